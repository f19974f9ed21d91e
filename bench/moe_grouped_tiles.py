"""Other (gate_up, down) tile pairs for the grouped expert GEMM than the planner's (the tuning table's
`moe.grouped_row_tiles`): each pair's sparse layer timed at Qwen3-30B-A3B's shape over bench/check_moe.py's four layers
of their own weights, its result checked against the planner's (the same routing; the sums in another order).

Usage (on the GPU machine, from the repo root): DEV=CUDA python bench/moe_grouped_tiles.py --tokens 64,256 \
    --pairs 32x128x64r3/32x256x32r4,...   (tiles() below says how a tile is written)
  ->  $OUT/moe_grouped_tiles.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TILE = re.compile(r"(\d+)x(\d+)x(\d+)(?:r(\d+))?(?::(\d+)x(\d+))?(w?)$")


def tiles(spec: str):
  """BMxBNxBK[rN][:WMxWN][w]: mma.sync tiles (WMxWN warps, default 2x4), or wgmma's (w)."""
  from tinyvllm.kernels.gemm import GemmTiles
  bm, bn, bk, ring, wm, wn, wgmma = TILE.match(spec).groups()
  if wgmma: return GemmTiles.warpgroup(int(bm), int(bn), ring=int(ring or 0))
  return GemmTiles(int(bm), int(bn), int(wm or 2), int(wn or 4), 1, int(ring or 0), int(bk))


def main() -> None:
  from check_moe import LAYERS, _experts_read, _inputs, _layer, _tiles_name, _time
  from tinygrad import Device

  from tinyvllm.kernels.moe import moe_shape
  from tinyvllm.kernels.moe_grouped import grouped_plan, run_grouped
  from tinyvllm.kernels.tinygrad_program import device_target
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", default="64,256")
  p.add_argument("--pairs", required=True, help="comma list of GATE_UP/DOWN tile pairs")
  p.add_argument("--iters", type=int, default=20)
  args = p.parse_args()
  device = Device.DEFAULT
  target = device_target(device)
  layers = [_layer(device, seed) for seed in range(LAYERS)]
  result = {}
  for n in [int(t) for t in args.tokens.split(",")]:
    x, norm, residual = _inputs(n, device)
    shape = moe_shape(x, layers[0], 1e-6)[0]
    plan = grouped_plan(shape, target)
    weight_bytes = int(sum(_experts_read(x, norm, moe) for moe in layers) / len(layers))
    want = run_grouped(target, shape, x, layers[0], norm, residual).float().numpy()
    scale = np.abs(want - residual.float().numpy()).max()
    rows = {}
    for name, pair in [("planner", None), *[(s, tuple(tiles(t) for t in s.split("/"))) for s in args.pairs.split(",")]]:
      try:
        got = run_grouped(target, shape, x, layers[0], norm, residual, pair).float().numpy()
      except Exception as e:   # a pair the planner refuses (shared memory, tile rules): said, the rest still timed
        print(f"{n:>5} tokens, {name:<28} refused: {e}", flush=True)
        continue
      step = lambda moe, pair=pair, shape=shape, x=x, norm=norm, residual=residual: run_grouped(target, shape, x, moe, norm, residual, pair)
      us = _time(step, layers, device, args.iters)
      rows[name] = {"us_per_layer": us, "GBps": weight_bytes / us / 1e3, "rel_diff": float(np.abs(got - want).max() / scale),
                    "tiles": _tiles_name(pair or (plan.tiles, plan.down_tiles))}
      print(f"{n:>5} tokens, {name:<28} {us:8.1f} us/layer ({weight_bytes / us / 1e3:6.0f} GB/s), against the planner's "
            f"result {rows[name]['rel_diff']:.1e}", flush=True)
    result[n] = rows
  if out := os.environ.get("OUT"): Path(out, "moe_grouped_tiles.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
