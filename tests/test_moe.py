"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against HF transformers on tiny random checkpoints it saved: logits,
greedy tokens, batched equal to alone; the two portable ways of computing the experts against a reference written
here (experts without tokens, a token routed to every expert); refused variants; the presets."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tinygrad import Tensor, TinyJit, dtypes

from tests.hf_models import assert_same_greedy, hf_greedy, hf_logits, make_model
from tinyvllm import LLM, SamplingParams
from tinyvllm.backend.weights import MoEWeights
from tinyvllm.config import ConfigError
from tinyvllm.layers.moe import experts_dense, experts_gathered, route
from tinyvllm.model.presets import PRESETS
from tinyvllm.model_config import ModelConfig

PROMPT = [int(x) for x in np.random.default_rng(1).integers(0, 320, 20)]
QWEN3_MOE = dict(head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=3)
CASES = {
  # a dense layer among sparse ones (mlp_only_layers), renormalised top-k
  "qwen3-moe": ("qwen3_moe", dict(QWEN3_MOE, mlp_only_layers=[1], norm_topk_prob=True)),
  # every second layer sparse, the top-k probabilities as they are
  "qwen3-moe-step2": ("qwen3_moe", dict(QWEN3_MOE, decoder_sparse_step=2, norm_topk_prob=False)),
  # every token routed to every expert
  "qwen3-moe-all-experts": ("qwen3_moe", dict(QWEN3_MOE, num_experts=4, num_experts_per_tok=4, norm_topk_prob=True)),
  "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
  kind, overrides = CASES[request.param]
  folder = tmp_path_factory.mktemp(request.param)
  hf = make_model(kind, folder, **overrides)
  return hf, LLM(str(folder), max_num_seqs=8)


def test_last_position_logits_match(pair):
  hf, llm = pair
  ref = hf_logits(hf, PROMPT)[-1]
  ours = llm.engine.compute_logits(PROMPT)
  assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


@pytest.mark.slow
def test_greedy_tokens_match(pair):
  hf, llm = pair
  ref, ref_logits = hf_greedy(hf, PROMPT, 32)
  out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
  assert_same_greedy(out.outputs[0].token_ids, ref, ref_logits)


@pytest.mark.slow
def test_batched_equals_alone(pair):
  """Prompts of different lengths together (prefill steps of many tokens: every expert computed; decode steps of a few:
  the chosen experts gathered) give what each gives alone."""
  _, llm = pair
  rng = np.random.default_rng(5)
  prompts = [[int(x) for x in rng.integers(0, 320, n)] for n in (3, 11, 20, 7, 16)]
  params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
  together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
  alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
  assert together == alone


def test_sharded_bfloat16_checkpoint(tmp_path):
  """Experts stacked from per-expert tensors spread over several bf16 shards: the logits HF gives on the same weights."""
  hf = make_model("qwen3_moe", tmp_path, dtype=torch.bfloat16, shard_size="40KB", **QWEN3_MOE)
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  ref = hf_logits(hf, PROMPT)[-1]
  ours = LLM(str(tmp_path), max_num_seqs=2).engine.compute_logits(PROMPT)
  assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


# ---- the portable layer against a reference written here
def reference_experts(x: np.ndarray, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray, k: int, renorm: bool) -> np.ndarray:
  """HF's loop: softmax over the router's logits, each token's top k, SwiGLU experts, weighted sum."""
  logits = x @ router.T
  probs = np.exp(logits - logits.max(1, keepdims=True))
  probs /= probs.sum(1, keepdims=True)
  inter = down.shape[2]
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    chosen = np.argsort(-probs[t])[:k]
    weights = probs[t, chosen] / (probs[t, chosen].sum() if renorm else 1)
    for e, w in zip(chosen, weights, strict=True):
      gu = gate_up[e] @ x[t]
      out[t] += w * (down[e] @ (gu[:inter] / (1 + np.exp(-gu[:inter])) * gu[inter:]))
  return out


@pytest.mark.parametrize("tokens,experts,k", [(3, 8, 2), (1, 16, 4), (6, 4, 4), (32, 8, 1)])
def test_both_ways_match_the_reference(tokens, experts, k):
  """(3, 8, 2): most experts get no token; (6, 4, 4): every token goes to every expert; (32, 8, 1): one each."""
  rng = np.random.default_rng(tokens * experts + k)
  hidden, inter = 16, 12
  x = rng.standard_normal((tokens, hidden)).astype(np.float32)
  router = rng.standard_normal((experts, hidden)).astype(np.float32)
  gate_up = (rng.standard_normal((experts, 2 * inter, hidden)) * 0.3).astype(np.float32)
  down = (rng.standard_normal((experts, hidden, inter)) * 0.3).astype(np.float32)
  for renorm in (True, False):
    moe = MoEWeights(Tensor(router), Tensor(gate_up), Tensor(down), k, renorm)
    weights, ids = route(Tensor(x), moe)
    ref = reference_experts(x, router, gate_up, down, k, renorm)
    for way in (experts_gathered, experts_dense):
      np.testing.assert_allclose(way(Tensor(x), moe, weights, ids).numpy(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_dense_form_runs_large_steps_in_chunks_of_bounded_memory():
  """Above its budget the dense form runs in chunks of tokens, one after another: the reference's result, and captured
  (as the engine runs steps) tinygrad's buffers peak at a small part of what one pass over every token keeps alive."""
  from tinyvllm.platform.tinygrad_compat import track_peak_memory
  tokens, experts, k, hidden, inter = 256, 16, 4, 32, 16
  rng = np.random.default_rng(5)
  router = rng.standard_normal((experts, hidden)).astype(np.float32)
  gate_up = (rng.standard_normal((experts, 2 * inter, hidden)) * 0.3).astype(np.float32)
  down = (rng.standard_normal((experts, hidden, inter)) * 0.3).astype(np.float32)
  moe = MoEWeights(*(Tensor(a).realize() for a in (router, gate_up, down)), k, True)
  per_token = experts * (3 * inter + hidden)
  peaks = {}
  for chunk in (tokens, 32):
    step = TinyJit(lambda x, chunk=chunk: experts_dense(x, moe, *route(x, moe), chunk_elements=per_token * chunk).realize())
    for call in range(2):   # eager, captured
      x = rng.standard_normal((tokens, hidden)).astype(np.float32)
      with track_peak_memory() as peak: got = step(Tensor(x).realize()).numpy()
      np.testing.assert_allclose(got, reference_experts(x, router, gate_up, down, k, True), rtol=1e-4, atol=1e-5)
      if call == 1: peaks[chunk] = peak.extra_bytes
  assert peaks[32] < peaks[tokens] / 3.5, peaks   # 8 chunks


def test_routing_is_a_float32_softmax_top_k():
  moe = MoEWeights(Tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), Tensor.zeros(3, 4, 2), Tensor.zeros(3, 2, 2), 2, False)
  weights, ids = route(Tensor([[2.0, 0.0]]), moe)
  probs = np.exp([2.0, 0.0, 2.0]) / np.exp([2.0, 0.0, 2.0]).sum()
  assert ids.dtype == dtypes.int32 and sorted(ids.numpy()[0].tolist()) == [0, 2]
  np.testing.assert_allclose(weights.numpy()[0], [probs[0], probs[2]], rtol=1e-6)


# ---- configs
def qwen3_moe_config(**changes) -> dict:
  return {**PRESETS["qwen3-moe-tiny"], **changes}


@pytest.mark.parametrize("field,value", [("shared_expert_intermediate_size", 512), ("n_shared_experts", 2), ("scoring_func", "sigmoid"),
                                         ("routed_scaling_factor", 2.5), ("topk_method", "group_limited_greedy")])
def test_other_moe_variants_are_refused_naming_the_field(field, value):
  with pytest.raises(ConfigError, match=field): ModelConfig.from_dict(qwen3_moe_config(**{field: value}))


@pytest.mark.parametrize("changes,words", [({"num_experts_per_tok": 32}, "more than num_experts"),
                                           ({"num_experts": 0}, "num_experts must be a positive integer"),
                                           ({"moe_intermediate_size": None}, "moe_intermediate_size"),
                                           ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
                                           ({"mlp_only_layers": "0"}, "mlp_only_layers")])
def test_bad_moe_fields_are_named(changes, words):
  with pytest.raises(ConfigError, match=words): ModelConfig.from_dict(qwen3_moe_config(**changes))


def test_sparse_layers_follow_hf():
  cfg = ModelConfig.from_dict(qwen3_moe_config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
  assert cfg.moe is not None and [cfg.moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
  mixtral = ModelConfig.from_dict({**PRESETS["qwen3-moe-tiny"], "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                   "intermediate_size": 64, "mlp_only_layers": [0]})
  assert mixtral.moe is not None and mixtral.moe.norm_topk_prob and mixtral.moe.intermediate_size == 64
  assert all(mixtral.moe.is_sparse(i) for i in range(4))   # Mixtral has no dense layers


@pytest.mark.slow
def test_the_tiny_preset_runs_with_random_weights():
  llm = LLM("qwen3-moe-tiny", load_format="dummy", num_gpu_blocks=32, max_model_len=256)
  params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
  outs = llm.generate([[1, 2, 3], [9, 8, 7, 6, 5]], params, use_tqdm=False)
  assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
  assert outs[0].outputs[0].token_ids == llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
