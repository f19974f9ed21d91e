"""Speculative decoding on the GPU (docs/benchmarks.md, section "Speculative decoding"):
1. verify: a step that verifies k proposals per sequence against a plain decode step, Qwen3-0.6B shape (dummy bf16
   weights), at batch 1 and 64: the engine's median step time with k proposals forced every step (the last token
   repeated: mostly rejected, so each step still emits about one token) and with none;
2. ngram: end-to-end decode tok/s on stories260K-hf with repeated prompts of 384 tokens (bench decode --prompts
   repeated), 128 new tokens, plain against n-gram speculation (k = 4), batch 1 and 64 (at 64 also with speculation off
   from 32 running requests); the greedy tokens must be equal.
3. draft: stories260K as its own draft model (k = 4, every proposal accepted) against plain decoding, random prompts.
4. replay: the GPU's part of a batch-1 decode step and of a verification step (--verify-ks), each captured graph
   replayed back to back, free of the host's pace.
Results to $OUT/spec_bench.json. Usage: DEV=CUDA python bench/spec_bench.py [--stories .data/stories260K-hf]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class ForcedProposals:
  """A bench-only proposer: k copies of each decoding sequence's last token, every step (k = 0: none)."""
  def __init__(self, k: int): self.k = k

  def propose(self, running):
    return {s: [s.token_ids[-1]] * self.k for s in running if s.decoding} if self.k else {}

  def complete(self, sched): return sched


def step_times(llm, batch: int, k: int, steps: int = 60) -> list[float]:
  from tinyvllm import SamplingParams
  engine = llm.engine
  engine.core.speculator = ForcedProposals(k)
  rng = np.random.default_rng(0)
  for i in range(batch):
    engine.add_request(f"v{k}-{i}", rng.integers(0, 10000, 128).tolist(), SamplingParams(temperature=0, max_tokens=10**4, ignore_eos=True))
  for _ in range(8): engine.step()   # the prompts, then warm decode steps
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - t)
  for i in range(batch): engine.abort_request(f"v{k}-{i}")
  return times


def verify_cost(model: str, ks: list[int], batches: list[int]) -> list[dict]:
  from tinyvllm import LLM
  out = []
  for k in ks:
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_num_seqs=64, kv_cache_memory=8, enable_prefix_caching=False,
              cuda_graph_sizes=[1, 64], speculative_config={"method": "ngram", "num_speculative_tokens": k})
    for batch in batches:
      plain = float(np.median(step_times(llm, batch, 0))) * 1e3
      verify = float(np.median(step_times(llm, batch, k))) * 1e3
      row = {"model": model, "k": k, "batch": batch, "decode_step_ms": plain, "verify_step_ms": verify, "ratio": verify / plain}
      print(json.dumps(row), flush=True)
      out.append(row)
    del llm
  return out


def ngram_end_to_end(stories: str, k: int, prompt_len: int, new_tokens: int) -> list[dict]:
  """Each batch size: plain decoding, n-gram speculation, and n-gram speculation off from 32 running requests."""
  from tinyvllm import LLM
  from tinyvllm.bench.decode import run_decode_bench
  spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
  out = []
  for batch in (1, 64):
    runs = {}
    for name, config in (("plain", None), ("ngram", spec), ("ngram_off_from_32", {**spec, "disable_by_batch_size": 32})):
      if batch == 1 and name == "ngram_off_from_32": continue
      llm = LLM(stories, max_num_seqs=64, cuda_graph_sizes=[1, 64], kv_cache_memory=1, speculative_config=config)
      (runs[name],) = run_decode_bench(llm.engine, batch, prompt_len, new_tokens, no_kv_cache=False, repeated=True)
      print(f"{name}: {runs[name].line()}", flush=True)
      del llm
    for name, run in runs.items():
      if name == "plain": continue
      s = run.spec
      row = {"batch": batch, "k": k, "mode": name, "plain_tok_s": runs["plain"].decode_tok_s, "tok_s": run.decode_tok_s,
             "speedup": run.decode_tok_s / runs["plain"].decode_tok_s, "same_tokens": run.token_ids == runs["plain"].token_ids,
             "proposed": s.num_draft_tokens, "accepted": s.num_accepted_tokens, "acceptance_rate": s.acceptance_rate,
             "tokens_per_verification": s.mean_acceptance_length}
      print(json.dumps(row), flush=True)
      out.append(row)
  return out


def draft_end_to_end(stories: str, k: int, prompt_len: int, new_tokens: int) -> list[dict]:
  """stories260K as its own draft (every proposal accepted: the cost of drafting and verifying k tokens) against plain
  decoding, random prompts, batch 1 and 64."""
  from tinyvllm import LLM
  from tinyvllm.bench.decode import run_decode_bench
  out = []
  for batch in (1, 64):
    runs = {}
    for name, config in (("plain", None), ("draft", {"model": stories, "num_speculative_tokens": k})):
      llm = LLM(stories, max_num_seqs=64, cuda_graph_sizes=[1, 64], kv_cache_memory=1, speculative_config=config)
      (runs[name],) = run_decode_bench(llm.engine, batch, prompt_len, new_tokens, no_kv_cache=False)
      print(f"{name}: {runs[name].line()}", flush=True)
      del llm
    s = runs["draft"].spec
    row = {"batch": batch, "k": k, "mode": "self-draft", "plain_tok_s": runs["plain"].decode_tok_s,
           "tok_s": runs["draft"].decode_tok_s, "speedup": runs["draft"].decode_tok_s / runs["plain"].decode_tok_s,
           "same_tokens": runs["draft"].token_ids == runs["plain"].token_ids, "proposed": s.num_draft_tokens,
           "accepted": s.num_accepted_tokens, "acceptance_rate": s.acceptance_rate, "tokens_per_verification": s.mean_acceptance_length}
    print(json.dumps(row), flush=True)
    out.append(row)
  return out


def eager_kernels(llm, batch: int, k: int) -> dict:
  """One eager step (k proposals forced, or a plain decode step for k = 0) under tinygrad's DEBUG=2: its kernels'
  time, the slowest of them."""
  import contextlib
  import io

  from tinygrad.helpers import Context

  from bench.gpu_profile import kernel_times
  from tinyvllm import SamplingParams
  engine, runner = llm.engine, llm.engine.runner
  engine.core.speculator = ForcedProposals(k)
  for i in range(batch): engine.add_request(f"e{k}-{i}", [1 + i] * 128, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
  for _ in range(3): engine.step()
  mode, runner.cudagraph_mode = runner.cudagraph_mode, "NONE"
  try:
    engine.step()   # compiles the eager kernels
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), Context(DEBUG=2): engine.step()
  finally: runner.cudagraph_mode = mode
  for i in range(batch): engine.abort_request(f"e{k}-{i}")
  times, counts = kernel_times(buf.getvalue())
  top = sorted(times.items(), key=lambda kv: -kv[1])[:40]
  row = {"k": k, "batch": batch, "kernels": sum(counts.values()), "kernel_ms": round(sum(times.values()), 3),
         "top": [(name, round(ms, 4), counts[name]) for name, ms in top]}
  print(json.dumps(row), flush=True)
  return row


def verify_profile(model: str) -> list[dict]:
  """Eager kernels of decode and verification steps: k = 4 at batch 1 and 64, k = 3 at batch 1."""
  from tinyvllm import LLM
  rows = []
  for k, batches in ((4, (1, 64)), (3, (1,))):
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_num_seqs=64, kv_cache_memory=4, enable_prefix_caching=False,
              cuda_graph_sizes=[1, 64], speculative_config={"method": "ngram", "num_speculative_tokens": k})
    rows += [eager_kernels(llm, batch, forced) for batch in batches for forced in (0, k)]
    del llm
  return rows


def graph_replays(model: str, ks: list[int], rounds: int = 5, steps: int = 50, dtype: str = "bfloat16") -> list[dict]:
  """The GPU's part of a decode step and of a verification step (batch 1), free of the host's pace: each step's
  captured graph replayed back to back with its last input, `rounds` rounds of `steps`, the median round (ms)."""
  from bench.gpu_profile import recorded_steps, replay_ms
  from tinyvllm import LLM
  out = []
  for k in ks:
    llm = LLM(model, load_format="dummy", dtype=dtype, max_num_seqs=64, kv_cache_memory=4, enable_prefix_caching=False,
              cuda_graph_sizes=[1], speculative_config={"method": "ngram", "num_speculative_tokens": k})
    with recorded_steps(llm.engine.runner) as seen:
      for forced in (0, k): step_times(llm, 1, forced, steps=10)
    row: dict = {"model": model, "k": k, "batch": 1}
    for verifies, name in ((False, "decode_replay_ms"), (True, "verify_replay_ms")):
      layout = next(lay for lay in reversed(list(seen)) if not lay.multi_token and lay.verifies == verifies)   # (not prompts)
      row[name] = round(replay_ms(llm.engine, *seen[layout], steps, rounds)[0], 4)
      contexts = layout.unpack(seen[layout][1])["context_lens"].numpy().tolist()   # (the replayed input's)
      row[name.replace("_replay_ms", "_contexts")] = {"bucket": layout.context_len, "rows": contexts}
    row["ratio"] = round(row["verify_replay_ms"] / row["decode_replay_ms"], 3)
    print(json.dumps(row), flush=True)
    out.append(row)
    del llm
  return out


def skinny_rows_experiment(model: str) -> list[dict]:
  """The verification step (k = 4, batch 1: 8 token rows) and plain decode steps of 5-8 sequences with the products'
  skinny kernel up to 4 rows (the tuning table's) and up to 8 (the table overridden here, bench-only)."""
  import dataclasses

  from tinyvllm.kernels import linear
  original = linear.tuning_for
  out = []
  for rows in (4, 8):
    linear.tuning_for = lambda kind, rows=rows: dataclasses.replace(original(kind), linear=dataclasses.replace(
      original(kind).linear, skinny_max_rows=rows))
    from tinyvllm import LLM
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_num_seqs=64, kv_cache_memory=4, enable_prefix_caching=False,
              cuda_graph_sizes=[1, 8], speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    for batch, k in ((1, 0), (1, 4), (6, 0), (8, 0)):
      row = {"skinny_max_rows": rows, "batch": batch, "k": k, "step_ms": float(np.median(step_times(llm, batch, k))) * 1e3}
      print(json.dumps(row), flush=True)
      out.append(row)
    del llm
  linear.tuning_for = original
  return out


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--stories", default=".data/stories260K-hf")
  p.add_argument("--model", default="qwen3-0.6b")
  p.add_argument("--parts", default="verify,ngram,draft")
  p.add_argument("--verify-ks", default="4,3", help="proposals per verification the verify part times")
  p.add_argument("--verify-batches", default="1,64", help="batch sizes the verify part times")
  args = p.parse_args()
  result: dict = {}
  parts = args.parts.split(",")
  if "ngram" in parts: result["ngram"] = ngram_end_to_end(args.stories, 4, 384, 128)
  if "draft" in parts: result["draft"] = draft_end_to_end(args.stories, 4, 128, 128)
  if "skinny" in parts: result["skinny"] = skinny_rows_experiment(args.model)
  if "profile" in parts: result["profile"] = verify_profile(args.model)
  if "replay" in parts: result["replay"] = graph_replays(args.model, [int(k) for k in args.verify_ks.split(",")])
  if "verify" in parts: result["verify"] = verify_cost(args.model, [int(k) for k in args.verify_ks.split(",")],
                                                        [int(b) for b in args.verify_batches.split(",")])
  if out := os.environ.get("OUT"): Path(out, "spec_bench.json").write_text(json.dumps(result, indent=1))
  ok = all(r["same_tokens"] for r in result.get("ngram", []) + result.get("draft", []))
  print("greedy tokens equal with and without speculation" if ok else "GREEDY TOKENS DIFFER")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
