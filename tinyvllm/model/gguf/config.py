"""A GGUF file's llama / qwen2 / qwen3 / qwen3moe metadata (a llama file with experts: Mixtral) as a ModelConfig (the
fields HF's config.json would hold)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tinyvllm.config import ConfigError
from tinyvllm.model.gguf.reader import MAGIC, GGUFFile
from tinyvllm.model_config import ModelConfig

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "qwen3moe": "Qwen3MoeForCausalLM"}
# llama files with experts are Mixtral's (llama.cpp converts Mixtral to its llama architecture)
EXPERT_ARCHITECTURES = {"llama": "MixtralForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# architectures whose attn_q / attn_k rows llama.cpp's converter permutes (its LlamaModel; the Qwen models keep HF's)
PERMUTED_ARCHITECTURES = ("llama",)
# tensors the config takes rather than the model: llama.cpp's rope_freqs, Llama-3.1/3.2's frequency scaling as a factor
# per frequency (its converter writes no rope.scaling metadata for them)
CONFIG_TENSORS = ("rope_freqs.weight",)
# the compute dtype "auto" picks on a GPU: the blocks' scales are fp16, the activations of llama-family models want
# bfloat16's range (on the CPU "auto" is float32 whatever this says)
GGUF_TORCH_DTYPE = "bfloat16"


def is_gguf_path(model: str | Path) -> bool:
  """A model argument that names a GGUF file (rather than a folder or a hub id): a .gguf file, or any file that starts
  with GGUF's magic, as ollama's blobs (models/blobs/sha256-...) do without the suffix."""
  path = Path(model).expanduser()
  if not path.is_file(): return False
  if path.suffix.lower() == ".gguf": return True
  try:
    with path.open("rb") as f: return f.read(4) == MAGIC
  except OSError: return False


def config_dict(f: GGUFFile) -> dict[str, Any]:
  """The HF config.json fields for the file's model; raises naming the metadata key tinyvllm cannot run."""
  arch = f.require("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ConfigError(f"{f.path}: GGUF general.architecture {arch!r} is not supported (tinyvllm reads "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUF files)")
  key = lambda name: f"{arch}.{name}"
  rope_scaling = _rope_scaling(f, key)
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
  experts = _experts(f, arch)
  return {
    "architectures": [EXPERT_ARCHITECTURES[arch] if experts else SUPPORTED_ARCHITECTURES[arch]], "model_type": arch,
    "hidden_size": hidden, "intermediate_size": _dense_size(f, key("feed_forward_length"), experts),
    "num_hidden_layers": int(f.require(key("block_count"))), "num_attention_heads": heads,
    "num_key_value_heads": int(f.get(key("attention.head_count_kv"), heads)), "head_dim": head_dim, "vocab_size": int(vocab),
    "max_position_embeddings": int(f.get(key("context_length"), 2048)),
    "rms_norm_eps": float(f.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
    "rope_theta": float(f.get(key("rope.freq_base"), 10000.0)),
    "tie_word_embeddings": "output.weight" not in f, "torch_dtype": GGUF_TORCH_DTYPE,
    "bos_token_id": f.get("tokenizer.ggml.bos_token_id"), "eos_token_id": eos, **experts,
    **({"rope_scaling": rope_scaling} if rope_scaling else {}),
  }


def _rope_scaling(f: GGUFFile, key) -> dict[str, Any] | None:
  """rope.scaling.* as HF's rope_scaling: linear (positions divided by the factor), YaRN (the factor over
  original_context_length, as llama.cpp's converter writes Qwen's; its other yarn_* tuning refused by name), or none."""
  kind, factor = f.get(key("rope.scaling.type")), f.get(key("rope.scaling.factor"))
  if kind == "linear": return {"rope_type": "linear", "factor": factor}
  if kind == "yarn":
    tuned = sorted(k for k in f.metadata if k.startswith(key("rope.scaling.yarn_")))
    if tuned: raise ConfigError(f"{f.path}: GGUF metadata {', '.join(tuned)}: YaRN's own tuning is not supported")
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": f.get(key("rope.scaling.original_context_length"))}
  if kind not in (None, "none"):
    raise ConfigError(f"{f.path}: GGUF metadata {key('rope.scaling.type')} = {kind!r}: rope scaling other than linear and "
                      "yarn is not supported")
  if factor not in (None, 1.0, 0.0):
    raise ConfigError(f"{f.path}: GGUF metadata {key('rope.scaling.factor')} = {factor!r} without a rope.scaling.type")
  return None


def _dense_size(f: GGUFFile, key: str, experts: dict[str, Any]) -> int:
  """A dense MLP's intermediate size: required, but in a qwen3moe file, whose layers are all sparse (its experts' size
  then stands in)."""
  size = f.get(key)
  if size is None and "moe_intermediate_size" in experts: return experts["moe_intermediate_size"]
  return int(size if size is not None else f.require(key))


def _experts(f: GGUFFile, arch: str) -> dict[str, Any]:
  """A mixture of experts' config fields (none for a dense file): every layer sparse, the chosen experts' probabilities
  renormalised, as llama.cpp runs qwen3moe and llama files with experts (Mixtral)."""
  key = lambda name: f"{arch}.{name}"
  count = int(f.get(key("expert_count"), 0))
  if count == 0:
    if arch == "qwen3moe": raise ConfigError(f"{f.path}: GGUF metadata {key('expert_count')} is missing")
    return {}
  if arch not in EXPERT_ARCHITECTURES:
    raise ConfigError(f"{f.path}: GGUF metadata {key('expert_count')} = {count}: experts in a {arch} file are not supported")
  fields = {"num_experts_per_tok": int(f.require(key("expert_used_count"))), "norm_topk_prob": True}
  if arch == "qwen3moe":
    return {**fields, "num_experts": count, "moe_intermediate_size": int(f.require(key("expert_feed_forward_length")))}
  # (Mixtral's experts' size is its intermediate_size: feed_forward_length, or expert_feed_forward_length where written)
  size = f.get(key("expert_feed_forward_length"))
  return {**fields, "num_local_experts": count, **({"intermediate_size": int(size)} if size is not None else {})}


def gguf_model_config(f: GGUFFile) -> ModelConfig:
  cfg = ModelConfig.from_dict(config_dict(f), f"{f.path} (GGUF metadata)")
  factors = _rope_freq_factors(f, cfg.head_dim)
  if factors is None: return cfg
  # (llama.cpp applies both: a linear factor times each frequency's own)
  linear = cfg.rope_freq_factors or (1.0,) * len(factors)
  return replace(cfg, rope_freq_factors=tuple(a * b for a, b in zip(factors, linear, strict=True)))


def _rope_freq_factors(f: GGUFFile, head_dim: int) -> tuple[float, ...] | None:
  """rope_freqs.weight: one factor for each of the head's head_dim / 2 frequencies, which llama.cpp divides them by."""
  name = CONFIG_TENSORS[0]
  if name not in f: return None
  info = f.tensors[name]
  if info.type_name != "F32" or info.shape != (head_dim // 2,):
    raise ConfigError(f"{f.path}: tensor {name} is {info.type_name} {info.shape}; llama.cpp's frequency factors are F32 "
                      f"({head_dim // 2},) for heads of {head_dim}")
  factors = f.raw(name).view(np.float32)
  if not np.all(np.isfinite(factors) & (factors > 0)):
    raise ConfigError(f"{f.path}: tensor {name} holds factors that are not positive finite numbers")
  return tuple(float(x) for x in factors)
