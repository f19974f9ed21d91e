"""Bench-only: the decode plans' layouts for packed experts, the grouped skinny plan's at decode batches and the direct
plan's at a few tokens (tinyvllm/kernels/moe.py's pass_rows, warp_columns / DIRECT_COLUMNS and batch_steps: rows a pass,
columns a warp, steps a batch), timed at Qwen3-30B-A3B's shape
with each format of bench/check_moe_packed.py, every layout checked against the portable path as check_moe_packed
checks the planner's. Prints us a layer by layout; writes $OUT/moe_packed_sweep.json.

  DEV=CUDA python3 bench/moe_packed_sweep.py [--tokens 1,8,16] [--formats int4,int8,fp8,q4_k_m]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
from check_moe import EPS, LAYERS, TIE, TOL, _inputs, _layer, _reference, _time
from check_moe_packed import FORMATS, _float32, packed_layer


def layouts(tokens: int) -> list[tuple[int, int, int]]:
  """(rows a pass, columns a warp, steps a batch) to time; (0, 0, 0) is the planner's, 0 a field it keeps. The direct
  plan (DIRECT_MAX_TOKENS tokens and fewer) has one row a pass: its columns a warp (gate_up's and down's alike) and
  steps a batch."""
  if tokens <= 4: return [(0, 0, 0), *[(0, c, b) for c in (0, 2, 4, 8) for b in (0, 1, 2, 4) if (c, b) != (0, 0)]]
  return [(0, 0, 0), *itertools.product((1, 2, 4), (2, 4), (1, 2))]


def with_layout(layout: tuple[int, int, int]):
  """The planner's functions replaced for one layout (the plan cache emptied around it)."""
  import contextlib

  import tinyvllm.kernels.moe as moe
  rows, rpw, sb = layout

  @contextlib.contextmanager
  def patched():
    saved = moe.pass_rows, moe.warp_columns, moe.batch_steps, moe.DIRECT_COLUMNS
    if rows: moe.pass_rows = lambda shape: min(shape.tokens, rows)
    if rpw: moe.warp_columns, moe.DIRECT_COLUMNS = (lambda k, packed=False: rpw), (rpw, rpw)   # (the direct plan's too)
    if sb: moe.batch_steps = lambda shape, product, rpw, grouped=False: sb
    moe.moe_sources.cache_clear()
    try: yield
    finally:
      moe.pass_rows, moe.warp_columns, moe.batch_steps, moe.DIRECT_COLUMNS = saved
      moe.moe_sources.cache_clear()
  return patched()


def sweep(target, device: str, fmt: str, n: int, bf16_layers: list, iters: int) -> list[dict]:
  from tinyvllm.kernels.fused import FusedBackend
  layers = [packed_layer(moe, fmt) for moe in bf16_layers]
  x, norm, residual = _inputs(n, device)
  want, gaps = _reference(x, norm, residual, _float32(layers[0]))
  scale = np.abs(want - residual.float().numpy()).max()
  records = []
  for layout in layouts(n):
    with with_layout(layout):
      backend = FusedBackend(target)
      try:
        got = backend.moe(x, layers[0], norm=norm, eps=EPS, residual=residual).float().numpy()
      except Exception as e:   # a layout the kernel's shared memory or registers do not take
        print(f"{fmt} n{n} {layout}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        continue
      err = np.abs(got - want).max(1) / scale
      off = err >= TOL
      ok = off.sum() <= max(1, n // 100) and bool((gaps[off] < TIE).all())
      us = _time(lambda moe, b=backend: b.moe(x, moe, norm=norm, eps=EPS, residual=residual), layers, device, iters)
    records.append({"format": fmt, "tokens": n, "layout": layout, "us_per_layer": us, "ok": ok,
                    "rel_err": float(err[~off].max(initial=0.0))})
    print(f"{fmt} n{n} rows/pass, cols/warp, steps/batch {layout}: {us:.1f} us/layer {'ok' if ok else 'FAIL'}", flush=True)
  return records


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", default="8,16")
  p.add_argument("--formats", default=",".join(FORMATS))
  p.add_argument("--iters", type=int, default=20)
  args = p.parse_args()
  from tinyvllm.kernels.tinygrad_program import device_target
  from tinyvllm.platform.device import select_device
  device = select_device(os.environ.get("DEV", "CUDA"))
  target = device_target(device)
  bf16_layers = [_layer(device, seed) for seed in range(LAYERS)]
  records = [r for fmt in args.formats.split(",") for n in map(int, args.tokens.split(","))
             for r in sweep(target, device, fmt, n, bf16_layers, args.iters)]
  if out := os.environ.get("OUT"): Path(out, "moe_packed_sweep.json").write_text(json.dumps(records, indent=1))
  return int(not all(r["ok"] for r in records))


if __name__ == "__main__":
  sys.exit(main())
