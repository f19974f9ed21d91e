"""Where an offline decode step's wall time goes on the host: timers around scheduling, the runner's launch, the wait for
the sampled tokens, landing them and building outputs, at a given batch size (bench-only instrumentation; it also
runs on older checkouts, timing whichever of these functions exist).

Usage (GPU machine, repo root): DEV=CUDA python3 bench/step_host.py --batch 1 [--kv-cache-dtype fp8] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

SPENT: dict[str, float] = defaultdict(float)


def wrap(owner: object, attr: str, name: str) -> None:
  if owner is None or attr not in vars(owner): return
  original = getattr(owner, attr)

  def timed(*args, **kwargs):
    t = time.perf_counter()
    try: return original(*args, **kwargs)
    finally: SPENT[name] += time.perf_counter() - t
  setattr(owner, attr, timed)


def instrument() -> None:
  import importlib

  def find(module: str, name: str):
    try: return getattr(importlib.import_module(module), name, None)
    except ImportError: return None
  for cls in (find("tinyvllm.core.scheduler", "SchedulerBase"), find("tinyvllm.core.async_scheduling", "AsyncScheduling")):
    wrap(cls, "schedule", "schedule")
    wrap(cls, "update_from_output", "update_from_output")
  wrap(find("tinyvllm.worker.model_runner", "ModelRunner"), "prepare", "prepare")
  wrap(find("tinyvllm.worker.model_runner", "ModelRunner"), "launch", "launch")
  wrap(find("tinyvllm.worker.runner_steps", "LaunchedStep"), "result", "wait for tokens")
  processor = find("tinyvllm.engine.output_processor", "OutputProcessor")
  wrap(processor, "process_outputs", "frontend outputs")
  wrap(processor, "request_output", "request_output")


def speculation(k: int | None) -> dict:
  """An n-gram speculative config (synchronous scheduling) whose proposer bench/spec_bench.py's forced one replaces."""
  return {} if k is None else {"speculative_config": {"method": "ngram", "num_speculative_tokens": max(k, 1)}}


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--kv-cache-dtype", default="auto")
  p.add_argument("--model", default="qwen3-0.6b")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--max-model-len", type=int, default=4096)
  p.add_argument("--kv-cache-memory", type=float, default=16)
  p.add_argument("--forced-proposals", type=int,
                 help="an n-gram speculative engine (synchronous scheduling) with this many proposals forced on every "
                      "sequence every step (0: its plain decode steps)")
  p.add_argument("--out")
  args = p.parse_args()
  instrument()
  from tinyvllm import LLM, SamplingParams
  llm = LLM(args.model, load_format="dummy", dtype=args.dtype, enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory,
            max_model_len=args.max_model_len, max_num_seqs=max(64, args.batch), kv_cache_dtype=args.kv_cache_dtype,
            **speculation(args.forced_proposals))
  engine = llm.engine
  if args.forced_proposals is not None:
    from bench.spec_bench import ForcedProposals
    engine.core.speculator = ForcedProposals(args.forced_proposals)
  params = SamplingParams(temperature=0, max_tokens=(args.steps + 8) * (1 + (args.forced_proposals or 0)), ignore_eos=True)
  for i in range(args.batch): engine.add_request(f"r{i}", [(i * 7 + j) % 500 + 1 for j in range(128)], params)
  for _ in range(4): engine.step()   # the prompt and the first decode layouts
  SPENT.clear()
  steps = []
  for _ in range(args.steps):
    t = time.perf_counter()
    engine.step()
    steps.append(time.perf_counter() - t)
  while engine.has_unfinished_requests(): engine.step()
  result = {"batch": args.batch, "forced_proposals": args.forced_proposals, "kv_cache_dtype": args.kv_cache_dtype,
            "median_step_ms": 1e3 * statistics.median(steps),
            "mean_step_ms": 1e3 * statistics.mean(steps),
            "per_step_ms": {k: round(1e3 * v / args.steps, 4) for k, v in sorted(SPENT.items(), key=lambda kv: -kv[1])}}
  print(json.dumps(result), flush=True)
  if args.out: Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
