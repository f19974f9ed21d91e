"""The persistent decode-layer kernel's block size against its rows (bench-only): the GPU's step (captured graphs
replayed back to back, bench/spec_bench.py's graph_replays and bench/gpu_profile.py's step_breakdown) of batch-1
verifications (k = 3 and 4: 4 and 5 rows) and of decode steps at 1, 2, 4 and 8 sequences, with the kernel's blocks of
each --threads size (the plan's rows patched in here, never in the package).

  DEV=CUDA python3 bench/layer_threads.py [--threads 512,384,256]      Writes $OUT/layer_threads.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


PLANNED: dict = {}   # the package's step_shape, kept before the first patch


def with_threads(threads: int, from_rows: int = 1) -> None:
  """Every decode-layer launch of `from_rows` rows or more planned with blocks of `threads` (the package's own
  step_shape, patched over)."""
  from tinyvllm.kernels import decode_layer
  original = PLANNED.setdefault("step_shape", decode_layer.step_shape)
  def step_shape(*args, **kwargs):
    shape, reason = original(*args, **kwargs)
    if shape is None or shape.rows < from_rows: return shape, reason
    return replace(shape, threads=threads), reason
  decode_layer.step_shape = step_shape



def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--threads", default="512,384")
  p.add_argument("--batches", default="1,2,4,8")
  args = p.parse_args()
  from bench.gpu_profile import step_breakdown
  from bench.spec_bench import graph_replays
  from tinyvllm import LLM
  rows = []
  for threads in (int(t) for t in args.threads.split(",")):
    with_threads(threads)
    for row in graph_replays("qwen3-0.6b", [3, 4]): rows.append({"threads": threads, **row})
    for batch in (int(b) for b in args.batches.split(",")):
      llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", max_num_seqs=8, kv_cache_memory=4,
                enable_prefix_caching=False, cuda_graph_sizes=[batch])
      row = {"threads": threads, "batch": batch, **step_breakdown(llm.engine, batch, rounds=5)}
      print(json.dumps(row), flush=True)
      rows.append(row)
      del llm
  if out := os.environ.get("OUT"): Path(out, "layer_threads.json").write_text(json.dumps(rows, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
