"""tinygrad.llm at batch 1 on this device (section 6 of docs/benchmarks.md), one configuration per process: its env
(JIT, JITBEAM) must be set before tinygrad is imported. Usage: DEV=CUDA [JIT=2] [JITBEAM=2] python bench/tinygrad_llm_peer.py
Appends {"env": ..., "tok_s" | "error": ...} to $OUT/bench_tinygrad_llm.jsonl when OUT is set."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
  from peers import tinygrad_llm  # bench/peers.py (this script's folder is on sys.path)
  env = {k: os.environ[k] for k in ("JIT", "JITBEAM", "DEV") if k in os.environ}
  t = time.perf_counter()
  try:
    r = tinygrad_llm(os.environ.get("BENCH_MODEL", "qwen3-0.6b"))
    row = {"env": env, "tok_s": r.tok_s, "decode_s": r.seconds, "wall_s": time.perf_counter() - t}
    print(r.line(), flush=True)
  except Exception as e:
    row = {"env": env, "error": repr(e)[:500], "wall_s": time.perf_counter() - t}
  print(json.dumps(row), flush=True)
  if out := os.environ.get("OUT"):
    with open(Path(out, "bench_tinygrad_llm.jsonl"), "a") as f: f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
