"""--load-format dummy: random weights from a folder's config or a built-in preset, so speed can be measured."""
from __future__ import annotations

import json

import pytest

from tests.hf_models import make_model
from tinyvllm import LLM, SamplingParams
from tinyvllm.model.presets import PRESETS
from tinyvllm.model_config import ModelConfig


def test_dummy_weights_from_a_config_folder(tmp_path):
  make_model("qwen3", tmp_path, head_dim=24)
  (tmp_path / "model.safetensors").unlink()  # no weights at all: dummy does not need them
  llm = LLM(str(tmp_path), load_format="dummy", num_gpu_blocks=16)
  a = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
  b = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
  assert len(a) == 8 and a == b


def parameters(cfg: ModelConfig) -> tuple[int, int]:
  """(all parameters, those a token uses): embeddings (and an untied LM head), attention, dense MLPs or experts."""
  h = cfg.hidden_size
  total = active = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
  for i in range(cfg.num_layers):
    attention = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    if cfg.moe is not None and cfg.moe.is_sparse(i):
      expert = 3 * h * cfg.moe.intermediate_size
      total += attention + cfg.moe.num_experts * (h + expert)
      active += attention + cfg.moe.num_experts * h + cfg.moe.num_experts_per_tok * expert
    else:
      total, active = total + attention + 3 * h * cfg.intermediate_size, active + attention + 3 * h * cfg.intermediate_size
  return total, active


# published sizes (all parameters, active per token)
PUBLISHED = {"qwen3-0.6b": (596e6, 596e6), "qwen2.5-0.5b": (494e6, 494e6), "llama-3.2-1b": (1236e6, 1236e6),
             "qwen3-8b": (8.19e9, 8.19e9), "qwen3-30b-a3b": (30.5e9, 3.3e9)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_describe_the_real_models(name):
  total, active = parameters(ModelConfig.from_dict(PRESETS[name], name))
  assert abs(total - PUBLISHED[name][0]) / PUBLISHED[name][0] < 0.01 and abs(active - PUBLISHED[name][1]) / PUBLISHED[name][1] < 0.02


def test_qwen3_preset_matches_the_benchmark_shape():
  cfg = ModelConfig.from_dict(PRESETS["qwen3-0.6b"])
  assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == \
         (1024, 28, 16, 8, 128, 3072)
  assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.rope_theta == 1e6
  assert 2 * cfg.num_layers * cfg.kv_size * 2 == 114688  # KV bytes per token in bf16 (benchmarks reference)


def test_unknown_preset_is_a_missing_folder():
  from tinyvllm.config import ConfigError
  with pytest.raises(ConfigError, match="does not exist"): LLM("qwen9-7b", load_format="dummy")


def test_dummy_preset_config_in_json_form(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama-3.2-1b"]))
  assert ModelConfig.from_folder(tmp_path).rope_scaling is not None
