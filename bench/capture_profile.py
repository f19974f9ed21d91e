"""Where the time of a first-time step capture goes (compiling kernel sources, tinygrad scheduling, codegen, graph
building): cProfile around the first step of new decode layouts, after a warm one.

Usage (on the GPU machine): DEV=CUDA python bench/capture_profile.py [--model qwen3-0.6b]
Writes $OUT/capture_profile.txt when OUT is set.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_batch(engine, batch: int, prompt_len: int, tag: str) -> None:
  from tinyvllm import SamplingParams
  params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
  for i in range(batch): engine.add_request(f"{tag}{i}", [1 + i] * prompt_len, params)
  while engine.has_unfinished_requests(): engine.step()


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="qwen3-0.6b")
  p.add_argument("--batches", default="2,4")
  args = p.parse_args()
  from tinyvllm import LLM
  llm = LLM(args.model, load_format="dummy", dtype="bfloat16", num_gpu_blocks=2048, max_model_len=4096, max_num_seqs=256,
            cuda_graph_sizes=[])
  engine = llm.engine
  run_batch(engine, 1, 100, "warm")
  report = io.StringIO()
  for batch in map(int, args.batches.split(",")):
    before, seconds = engine.runner.num_captures, engine.runner.capture_seconds
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    run_batch(engine, batch, 100, f"b{batch}-")
    prof.disable()
    line = (f"batch {batch}: {engine.runner.num_captures - before} captures, "
            f"{engine.runner.capture_seconds - seconds:.2f} s capturing, {time.perf_counter() - t:.2f} s in all")
    print(line, flush=True)
    report.write(line + "\n")
    stats = pstats.Stats(prof, stream=report)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(12)
  if out_dir := os.environ.get("OUT"): Path(out_dir, "capture_profile.txt").write_text(report.getvalue())


if __name__ == "__main__":
  main()
