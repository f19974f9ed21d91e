"""Acceptance 1: our forward pass against HF transformers on tiny random models saved by transformers itself."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.hf_models import assert_same_greedy, hf_greedy, hf_logits, make_model
from tinyvllm import LLM, SamplingParams

PROMPT = [int(x) for x in np.random.default_rng(1).integers(0, 320, 20)]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CASES = {
  # GQA with 2 query heads per kv head everywhere; Qwen3 with head_dim != hidden / heads
  "qwen3-tied": ("qwen3", dict(head_dim=24, tie_word_embeddings=True)),
  "qwen3-untied": ("qwen3", dict(head_dim=24, tie_word_embeddings=False, num_hidden_layers=3)),
  "llama-untied": ("llama", dict(tie_word_embeddings=False)),
  "llama-tied": ("llama", dict(tie_word_embeddings=True)),
  "llama3-rope-scaling": ("llama", dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
  "llama-linear-rope-scaling": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
  # Qwen's long-context recipe: YaRN over an original context of 32 positions, its attention factor on cos / sin
  "qwen3-yarn": ("qwen3", dict(head_dim=24, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32})),
  "llama-attention-bias": ("llama", dict(attention_bias=True)),
  "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
  # Mistral v0.1's 4096-token window is longer than this model's context, so it never applies (as in the engine's check)
  "mistral-window": ("mistral", dict(sliding_window=4096)),
  "mistral-no-window": ("mistral", dict(sliding_window=None, head_dim=24)),
  # Gemma: (1 + weight) RMSNorm, GeGLU with tanh GELU, embeddings times sqrt(hidden), explicit head_dim, tied
  "gemma": ("gemma", dict(head_dim=24, hidden_act="gelu_pytorch_tanh")),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
  kind, overrides = CASES[request.param]
  folder = tmp_path_factory.mktemp(request.param)
  hf = make_model(kind, folder, **overrides)
  return hf, LLM(str(folder), max_num_seqs=4)


@pytest.mark.slow
def test_last_position_logits_match(pair):
  hf, llm = pair
  ref = hf_logits(hf, PROMPT)[-1]
  ours = llm.engine.compute_logits(PROMPT)
  assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.slow
def test_greedy_tokens_match(pair):
  hf, llm = pair
  ref, ref_logits = hf_greedy(hf, PROMPT, 32)
  out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
  assert_same_greedy(out.outputs[0].token_ids, ref, ref_logits)
  assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_loads_exactly(tmp_path, dtype):
  """bf16/fp16 weights are upcast to float32 on the CPU, so logits match HF run on the same (rounded) weights."""
  hf = make_model("qwen3", tmp_path, dtype=dtype, head_dim=24, tie_word_embeddings=False)
  ref = hf_logits(hf, PROMPT)[-1]
  ours = LLM(str(tmp_path), max_num_seqs=2).engine.compute_logits(PROMPT)
  assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


def test_sharded_checkpoint(tmp_path):
  hf = make_model("llama", tmp_path, shard_size="60KB", tie_word_embeddings=False)
  assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 1
  ref = hf_logits(hf, PROMPT)[-1]
  ours = LLM(str(tmp_path), max_num_seqs=2).engine.compute_logits(PROMPT)
  assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4
