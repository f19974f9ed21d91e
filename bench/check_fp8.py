"""The FP8 E4M3 KV cache on the GPU, as part of bench/check_kernels.py (which runs these and records the results).

- (bench/kernel_cases.py's FP8_CASES: attention cases over FP8 caches, checked with the others);
- check_kv_write_fp8: the KV write kernel's codes (the hardware cvt.rn.satfinite on sm_89+) against the portable
  encoder's, value for value, over magnitudes from E4M3's subnormals to beyond its largest finite value;
- step_engine_fp8: greedy decoding of the Qwen3-0.6B shape (random weights) with an FP8 cache, hand-written kernels
  against the portable path: the same tokens, except where the two paths swap their top two tokens by no more than
  they disagree elsewhere (see `_swap_bound`).
Each function returns a record for $OUT/kernels.json and raises AssertionError on a failure.
"""
from __future__ import annotations

import numpy as np

NEAR_TIE = 0.02   # a swap of the top two tokens this small is always accepted (accumulation order differs)


def _top2(logprobs: dict) -> tuple[int, int, float]:
  """A position's two most likely tokens and the logprob gap between them."""
  (a, la), (b, lb) = sorted(((t, e.logprob) for t, e in logprobs.items()), key=lambda x: -x[1])[:2]
  return a, b, la - lb


SWAP_SLACK = 2.0   # a swap may need up to this many times the largest disagreement measured elsewhere (its tail)


def _swap_bound(fused: list, portable: list) -> float:
  """How far the two paths' gaps between the same top two tokens differ at the positions where both chose the same
  token (the same prefix, so the same state): the measured disagreement of their numerics. A swap of the top two
  tokens needs the gaps to differ by the two gaps' sum; one within SWAP_SLACK times the largest such difference of the
  run (or NEAR_TIE) is explained by it: ~190 positions show the spread, not its tail, and a real fault moves logprobs
  by far more."""
  worst = 0.0
  for f, p in zip(fused, portable, strict=True):
    for tf, tp, lf, lp in zip(f.token_ids, p.token_ids, f.logprobs, p.logprobs, strict=True):
      if tf != tp: break
      fa, fb, fgap = _top2(lf)
      pa, pb, pgap = _top2(lp)
      if (fa, fb) == (pa, pb): worst = max(worst, abs(fgap - pgap))
  return max(NEAR_TIE, SWAP_SLACK * worst)


def check_kv_write_fp8(target, device: str) -> dict:
  from tinygrad import Tensor, dtypes

  from tests.emulator.cases import FP8, round_to, to_bits
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.layers.attention import write_kv
  rng = np.random.default_rng(12)
  kvh, d, slots, n = 8, 128, 4096, 64
  row = kvh * d
  old = [to_bits(round_to(rng.standard_normal((slots, row)), FP8), FP8) for _ in range(2)]
  new = [round_to(rng.standard_normal((n, row)) * np.exp(rng.uniform(-11, 7, (n, row))), "bfloat16") for _ in range(2)]
  slot_mapping = rng.permutation(slots)[:n].astype(np.int32)
  slot_mapping[::5] = -1
  results = {}
  for name, write in (("fused", FusedBackend(target).write_kv), ("portable", write_kv)):
    caches = [Tensor(c, device=device).realize() for c in old]
    kv = [Tensor(x.astype(np.float32), device=device).cast(dtypes.bfloat16).reshape(n, kvh, d) for x in new]
    written = write(*caches, *kv, Tensor(slot_mapping, device=device).realize())
    Tensor.realize(*written)
    results[name] = [t.numpy() for t in written]
  want = [c.copy() for c in old]
  ok = slot_mapping >= 0
  for w, x in zip(want, new, strict=True): w[slot_mapping[ok]] = to_bits(x[ok], FP8)
  same = [np.array_equal(results["fused"][i], want[i]) and np.array_equal(results["portable"][i], want[i]) for i in range(2)]
  record = {"name": "kv_write_fp8_bf16_kvh8_d128", "ok": all(same),
            "codes_differing_fused": int(sum((results["fused"][i] != want[i]).sum() for i in range(2))),
            "codes_differing_portable": int(sum((results["portable"][i] != want[i]).sum() for i in range(2)))}
  assert record["ok"], f"FP8 codes differ from the expected encoding: {record}"
  return record


def _greedy(engine_kwargs: dict, prompts: list[list[int]], tokens: int, logprobs: int | None):
  from tinyvllm import LLM, SamplingParams
  llm = LLM(**engine_kwargs)
  outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=logprobs),
                      use_tqdm=False)
  calls = dict(getattr(llm.engine.model.backend, "calls", {}))
  return [o.outputs[0] for o in outs], calls


def step_engine_fp8(device: str, dialect: str) -> dict:
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 10000, n).tolist() for n in (5, 60, 200, 700)]
  base = dict(model="qwen3-0.6b", load_format="dummy", device=device, dtype="bfloat16", max_model_len=1024, max_num_seqs=8,
              num_gpu_blocks=512, kv_cache_dtype="fp8", cuda_graph_sizes=[])
  fused, calls = _greedy({**base, "attention_backend": dialect}, prompts, 48, 2)
  portable, _ = _greedy({**base, "attention_backend": "portable"}, prompts, 48, 2)
  bound, matched, problems = _swap_bound(fused, portable), [], []
  for i, (f, p) in enumerate(zip(fused, portable, strict=True)):
    first = next((j for j, (a, b) in enumerate(zip(f.token_ids, p.token_ids, strict=True)) if a != b), None)
    matched.append(len(f.token_ids) if first is None else first)
    if first is None: continue
    fa, fb, fgap = _top2(f.logprobs[first])
    pa, pb, pgap = _top2(p.logprobs[first])
    if (fa, fb) != (pb, pa) or fgap + pgap > bound:
      problems.append(f"prompt {i} differs at token {first}: fused top two {fa}, {fb} (gap {fgap:.3f}), portable {pa}, "
                      f"{pb} (gap {pgap:.3f}); beyond {bound:.3f}, {SWAP_SLACK:g}x the paths' largest disagreement elsewhere")
  record = {"name": "engine_fp8_qwen3_dummy", "ok": not problems, "tokens_matched": matched, "swap_bound": bound,
            "calls": calls, "problems": problems}
  assert not problems, "; ".join(problems)
  decodes = sum(calls.get(k, 0) for k in ("decode", "decode-layers"))   # per-op or layer kernels
  assert calls.get("qkv-rope", 0) > 0 and decodes > 0, calls
  return record
