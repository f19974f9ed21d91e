"""A GGUF file's llama / qwen2 / qwen3 metadata as a ModelConfig (the fields HF's config.json would hold)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tinyvllm.config import ConfigError
from tinyvllm.model.gguf.reader import GGUFFile
from tinyvllm.model_config import ModelConfig

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# architectures whose attn_q / attn_k rows llama.cpp's converter permutes (its LlamaModel; the Qwen models keep HF's)
PERMUTED_ARCHITECTURES = ("llama",)
# the compute dtype "auto" picks on a GPU: the blocks' scales are fp16, the activations of llama-family models want
# bfloat16's range (on the CPU "auto" is float32 whatever this says)
GGUF_TORCH_DTYPE = "bfloat16"


def is_gguf_path(model: str | Path) -> bool:
  """A model argument that names a GGUF file (rather than a folder or a hub id)."""
  path = Path(model).expanduser()
  return path.suffix.lower() == ".gguf" and path.is_file()


def config_dict(f: GGUFFile) -> dict[str, Any]:
  """The HF config.json fields for the file's model; raises naming the metadata key tinyvllm cannot run."""
  arch = f.require("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ConfigError(f"{f.path}: GGUF general.architecture {arch!r} is not supported (tinyvllm reads "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUF files)")
  key = lambda name: f"{arch}.{name}"
  for scaling in (key("rope.scaling.type"), key("rope.scaling.factor")):
    value = f.get(scaling)
    if value not in (None, "none", 1.0, 0.0):
      raise ConfigError(f"{f.path}: GGUF metadata {scaling} = {value!r}: rope scaling in GGUF files is not supported")
  if key("expert_count") in f.metadata and int(f.metadata[key("expert_count")]) > 0:
    raise ConfigError(f"{f.path}: GGUF metadata {key('expert_count')} = {f.metadata[key('expert_count')]}: mixture-of-experts "
                      "models are not supported")
  hidden, heads = int(f.require(key("embedding_length"))), int(f.require(key("attention.head_count")))
  head_dim = int(f.get(key("attention.key_length"), hidden // heads))
  rot = f.get(key("rope.dimension_count"))
  if rot is not None and int(rot) != head_dim:
    raise ConfigError(f"{f.path}: GGUF metadata {key('rope.dimension_count')} = {rot}: partial rotary embeddings "
                      f"(head dim {head_dim}) are not supported")
  tokens = f.get("tokenizer.ggml.tokens")
  vocab = f.get(key("vocab_size"), len(tokens) if tokens else None)
  if vocab is None: raise ConfigError(f"{f.path}: GGUF metadata {key('vocab_size')} and tokenizer.ggml.tokens are both missing")
  eos = f.get("tokenizer.ggml.eos_token_id")
  return {
    "architectures": [SUPPORTED_ARCHITECTURES[arch]], "model_type": arch,
    "hidden_size": hidden, "intermediate_size": int(f.require(key("feed_forward_length"))),
    "num_hidden_layers": int(f.require(key("block_count"))), "num_attention_heads": heads,
    "num_key_value_heads": int(f.get(key("attention.head_count_kv"), heads)), "head_dim": head_dim, "vocab_size": int(vocab),
    "max_position_embeddings": int(f.get(key("context_length"), 2048)),
    "rms_norm_eps": float(f.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
    "rope_theta": float(f.get(key("rope.freq_base"), 10000.0)),
    "tie_word_embeddings": "output.weight" not in f, "torch_dtype": GGUF_TORCH_DTYPE,
    "bos_token_id": f.get("tokenizer.ggml.bos_token_id"), "eos_token_id": eos,
  }


def gguf_model_config(f: GGUFFile) -> ModelConfig:
  return ModelConfig.from_dict(config_dict(f), f"{f.path} (GGUF metadata)")
