"""Time the device sampler alone: each variant's TinyJit replay on [B, V] float logits, and with DEBUG=2 the kernels of
one eager run (names, launch sizes and times), for the vocabulary of Qwen3.

Usage (on the GPU machine): DEV=CUDA python bench/sampler_bench.py [--batches 1,32,256]  ->  $OUT/sampler_bench.json
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOGITS_DTYPE = "float32" if os.environ.get("DEV", "CPU").startswith("CPU") else "bfloat16"   # the model's (old clangs lack bf16)
VARIANTS = {"greedy": (False, False), "random": (True, False), "random+filters": (True, True)}


def time_variant(batch: int, vocab: int, random: bool, filters: bool, iters: int = 20) -> float:
  from tinygrad import Device, Tensor, TinyJit

  from tinyvllm.backend.sampling import SamplerVariant
  from tinyvllm.layers.sampler import sample
  variant = SamplerVariant(random, filters, False)
  logits = Tensor.randn(batch, vocab).cast(LOGITS_DTYPE).contiguous().realize()
  params = Tensor(np.tile(np.array([0.6, 50, 0.9, 0.0, 0, 0, 1], np.float32), (batch, 1))).realize()
  rng = Tensor(np.stack([np.arange(batch), np.full(batch, 7)], 1).astype(np.uint32)).realize()
  jit = TinyJit(lambda lg, p, r: sample(lg, p, r, variant).realize())
  for _ in range(3): jit(logits, params, rng)
  Device[logits.device].synchronize()
  t = time.perf_counter()
  for _ in range(iters): jit(logits, params, rng)
  Device[logits.device].synchronize()
  return (time.perf_counter() - t) / iters * 1e3


def kernels_of(batch: int, vocab: int, random: bool, filters: bool) -> str:
  """DEBUG=2's per-kernel lines for one eager run (after a warm-up run that compiles them)."""
  from tinygrad import Tensor
  from tinygrad.helpers import Context

  from tinyvllm.backend.sampling import SamplerVariant
  from tinyvllm.layers.sampler import sample
  variant = SamplerVariant(random, filters, False)
  make = lambda: (Tensor.randn(batch, vocab).cast(LOGITS_DTYPE).realize(),
                  Tensor(np.tile(np.array([0.6, 50, 0.9, 0.0, 0, 0, 1], np.float32), (batch, 1))).realize(),
                  Tensor(np.zeros((batch, 2), np.uint32)).realize())
  sample(*make(), variant).realize()
  args = make()
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf), Context(DEBUG=2): sample(*args, variant).realize()
  return re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--batches", default="1,32,256")
  p.add_argument("--vocab", type=int, default=151936)
  args = p.parse_args()
  results = []
  for b in (int(x) for x in args.batches.split(",")):
    for name, (random, filters) in VARIANTS.items():
      ms = time_variant(b, args.vocab, random, filters)
      results.append({"batch": b, "variant": name, "ms": ms})
      print(f"batch {b:>3} {name:>15}: {ms:.3f} ms", flush=True)
  print(kernels_of(256, args.vocab, True, False), flush=True)
  if out := os.environ.get("OUT"): Path(out, "sampler_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
