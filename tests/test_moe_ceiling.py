"""bench/moe_ceiling.py's bound on workload 2: its experts a step against simulated routing, its schedule's steps and
bytes against a request-by-request count."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from moe_ceiling import ceiling, expert_counts, shape

from tinyvllm.bench.throughput import nano_vllm_workload
from tinyvllm.model.presets import PRESETS


def test_shape_counts_the_parameters_hf_builds():
  """The bytes a step reads outside the experts (every parameter but the experts' and the embedding table's) and one
  expert's, against HF's Qwen3MoeForCausalLM of the tiny preset."""
  import transformers
  config = transformers.AutoConfig.for_model("qwen3_moe", **{k: v for k, v in PRESETS["qwen3-moe-tiny"].items() if k != "architectures"})
  hf = transformers.Qwen3MoeForCausalLM(config)
  params = dict(hf.named_parameters())
  experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
  dense = sum(p.numel() for n, p in params.items() if ".experts." not in n and "embed_tokens" not in n)
  s = shape("qwen3-moe-tiny")
  assert s["dense_bytes"] == 2 * dense and s["expert_bytes"] * s["experts"] * s["layers"] == 2 * experts


def test_uniform_expert_counts_match_simulated_routing():
  rng = np.random.default_rng(0)
  counts = expert_counts(None, 128, 8, 64)
  for n in (1, 4, 16, 64):
    distinct = [len(np.unique([rng.choice(128, 8, replace=False) for _ in range(n)])) for _ in range(400)]
    assert abs(np.mean(distinct) - counts[n]) < 0.02 * counts[n], (n, np.mean(distinct), counts[n])


def test_measured_expert_counts_interpolate_below_the_curve():
  counts = expert_counts({8: 50.0, 32: 100.0}, 128, 8, 64)
  assert counts[0] == 0 and counts[1] == 8 and counts[8] == 50 and counts[32] == 100
  assert counts[20] == 75 and counts[64] == 100   # linear between points, flat past the last


def test_bound_counts_every_request_step_by_step():
  model = "qwen3-30b-a3b"
  s = shape(model)
  prompts, params = nano_vllm_workload(PRESETS[model]["vocab_size"]).requests()
  outputs = [p.max_tokens for p in params]
  r = ceiling(model, 1000.0, 1000.0, None, 2.0)
  assert r["decode_steps"] == max(outputs) - 1 and r["output_tokens"] == sum(outputs)
  # request i is stepped at decode steps 1 .. outputs[i] - 1, reading its prompt + t tokens of cache at step t
  kv_tokens = sum(sum(len(p) + t for t in range(1, n)) for p, n in zip(prompts, outputs, strict=True))
  assert r["bytes"]["kv"] == kv_tokens * s["kv_elems_per_token"] * 2
  # every step reads the dense weights once; the experts between one step's k and all of them a layer
  assert r["bytes"]["dense"] == r["decode_steps"] * s["dense_bytes"]
  per_step = s["layers"] * s["expert_bytes"]
  assert r["decode_steps"] * 8 * per_step < r["bytes"]["experts"] < r["decode_steps"] * 128 * per_step
  assert r["bound_seconds"] >= sum(r["seconds"].values()) and r["bound_tok_s"] == r["output_tokens"] / r["bound_seconds"]
