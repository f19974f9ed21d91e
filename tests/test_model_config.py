"""Mistral and Gemma configs as HF writes them, and RoPE scaling's fields: what is taken from them, and what is refused
with a reason."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.hf_models import BASE, hf_logits, make_model
from tinyvllm import LLM
from tinyvllm.config import ConfigError
from tinyvllm.model_config import ModelConfig

SHAPE = {k: v for k, v in BASE.items() if k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                                "num_key_value_heads", "vocab_size", "max_position_embeddings")}


def config(arch: str, **fields) -> ModelConfig:
  return ModelConfig.from_dict({"architectures": [arch], **SHAPE, **fields})


def test_mistral_is_llama_shaped_with_its_window():
  mc = config("MistralForCausalLM", sliding_window=4096, hidden_act="silu")
  assert (mc.architecture, mc.sliding_window, mc.hidden_act, mc.embed_scale, mc.norm_weight_offset) == (
    "MistralForCausalLM", 4096, "silu", 1.0, 0.0)
  assert config("MistralForCausalLM", sliding_window=None).sliding_window is None
  assert config("LlamaForCausalLM", sliding_window=16).sliding_window is None   # only Mistral's field means a window


def test_an_activation_other_than_silu_is_refused_by_name():
  with pytest.raises(ConfigError, match="hidden_act 'gelu' is not supported for MistralForCausalLM"):
    config("MistralForCausalLM", hidden_act="gelu")


def test_gemma_fields():
  """HF's GemmaConfig: legacy hidden_act "gelu" means the tanh form, embeddings tied unless said otherwise."""
  mc = config("GemmaForCausalLM", head_dim=256, hidden_act="gelu")
  assert mc.hidden_act == "gelu_pytorch_tanh" and mc.head_dim == 256 and mc.tie_word_embeddings
  assert mc.norm_weight_offset == 1.0 and mc.embed_scale == pytest.approx(8.0)   # sqrt(64)
  assert config("GemmaForCausalLM", hidden_act="gelu", hidden_activation="gelu_pytorch_tanh").hidden_act == "gelu_pytorch_tanh"
  assert not config("GemmaForCausalLM", tie_word_embeddings=False).tie_word_embeddings
  assert not config("LlamaForCausalLM").tie_word_embeddings


@pytest.mark.parametrize("fields, message", [
  ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported for GemmaForCausalLM"),   # the exact GELU
  ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
  ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_gemma_variants_refused(fields, message):
  with pytest.raises(ConfigError, match=message): config("GemmaForCausalLM", **fields)


@pytest.mark.parametrize("arch, reason", [("Gemma2ForCausalLM", "soft-capping"), ("Gemma3ForCausalLM", "sliding-window"),
                                          ("Gemma3ForConditionalGeneration", "vision")])
def test_later_gemmas_refused_with_the_reason(arch, reason, tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], **SHAPE}))
  with pytest.raises(ConfigError, match=f"{arch} is not supported: .*{reason}.*GemmaForCausalLM"): LLM(str(tmp_path))


def test_mistral_window_shorter_than_the_context(tmp_path):
  """Refused where the window could apply, naming it and the --max-model-len that makes it inert; taken there, and then
  the logits are HF's (whose window never reaches back past the prompt either)."""
  hf = make_model("mistral", tmp_path, sliding_window=32)
  with pytest.raises(ConfigError, match=r"sliding_window \(32 tokens\) is shorter than max_model_len \(256\).*--max-model-len 32"):
    LLM(str(tmp_path))
  with pytest.raises(ConfigError, match="sliding_window"): LLM(str(tmp_path), max_model_len=33)
  prompt = [int(x) for x in np.random.default_rng(2).integers(0, 320, 24)]
  ours = LLM(str(tmp_path), max_model_len=32, max_num_seqs=2).engine.compute_logits(prompt)
  ref = hf_logits(hf, prompt)[-1]
  assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5


def test_rope_scaling_sets_the_context_as_vllm_derives_it():
  """Linear scaling multiplies max_position_embeddings by its factor, YaRN makes it factor x the original context (the
  point of either); Llama-3.1's config counts its own. Qwen3's published YaRN recipe: 40,960 -> 131,072."""
  assert config("LlamaForCausalLM", rope_scaling={"rope_type": "linear", "factor": 4.0}).max_position_embeddings == 4 * 256
  qwen = {**SHAPE, "max_position_embeddings": 40960}
  yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
  cfg = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], **qwen, "rope_scaling": yarn})
  assert cfg.max_position_embeddings == 131072 and abs(cfg.rope_scaling.attention_factor - (0.1 * np.log(4.0) + 1)) < 1e-9
  llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
  assert config("LlamaForCausalLM", rope_scaling=llama3).max_position_embeddings == 256


@pytest.mark.parametrize("rope,message", [({"rope_type": "dynamic", "factor": 2.0}, "rope scaling type 'dynamic'"),
                                          ({"rope_type": "linear"}, "linear rope scaling needs a positive factor"),
                                          ({"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.5},
                                           "partial rotary embeddings")])
def test_rope_scaling_it_cannot_run_is_named(rope, message):
  with pytest.raises(ConfigError, match=message): config("LlamaForCausalLM", rope_scaling=rope)
