"""Whether the grouped expert GEMM's weight reads are bound by their access pattern: each K slice of a block reads
TV_BN rows x 128 bytes, rows K * 2 bytes apart, so the DRAM sees short bursts scattered over the expert's rows. This
times the grouped layer (Qwen3-30B-A3B's shape, bench/check_moe.py's four layers) as the engine runs it and with the
weight copies addressed as if the experts were stored tile by tile ([E, NOUT / BN, K / BK, BN, BK]: each slice's w one
contiguous run), the same bytes and instructions otherwise (the results are wrong there: timing only). Beside them, the
device's own rates: a bf16 tensor summed (reads) and copied (torch; bench/moe_ceiling.py).

Usage (on the GPU machine, from the repo root): DEV=CUDA python bench/moe_weight_layout.py [--tokens 64,256,2048]
  ->  $OUT/moe_weight_layout.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROW_MAJOR = "w + (TV_I64)tv_gemm_wrow(tv_imin(n0 + r, TV_NOUT - 1)) * TV_K + k0 + (c % TV_KCH) * 8"
TILED = "w + ((TV_I64)(n0 / TV_BN) * (TV_K / TV_BK) + k0 / TV_BK) * (TV_BN * TV_BK) + r * TV_BK + (c % TV_KCH) * 8"


def main() -> None:
  from check_moe import LAYERS, _experts_read, _inputs, _layer, _time
  from tinygrad import Device

  import tinyvllm.kernels.moe_grouped as grouped
  from tinyvllm.kernels.moe import moe_shape
  from tinyvllm.kernels.tinygrad_program import device_target
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", default="64,256,2048")
  p.add_argument("--iters", type=int, default=20)
  args = p.parse_args()
  from moe_ceiling import device_rates
  result: dict = {"ceilings": device_rates()}
  import torch
  torch.cuda.empty_cache()
  print(f"device ceilings: {result['ceilings']}", flush=True)
  device = Device.DEFAULT
  target = device_target(device)
  layers = [_layer(device, seed) for seed in range(LAYERS)]
  original = grouped.kernel_source

  def tiled_source(dialect: str, algorithm: str, defines: dict, body: str | None = None) -> str:
    src = original(dialect, algorithm, defines, body)
    if algorithm != "gemm_tc" or "TV_MOE" not in defines: return src
    assert ROW_MAJOR in src, "the w copy's address is not where this bench expects it"
    return src.replace(ROW_MAJOR, TILED)

  for n in [int(t) for t in args.tokens.split(",")]:
    x, norm, residual = _inputs(n, device)
    shape = moe_shape(x, layers[0], 1e-6)[0]
    weight_bytes = int(sum(_experts_read(x, norm, moe) for moe in layers) / len(layers))
    rec = {"weight_bytes_per_layer": weight_bytes}
    for name, source in (("row_major", original), ("tiled", tiled_source), ("row_major_again", original)):
      grouped.kernel_source = source
      grouped.grouped_sources.cache_clear()
      step = lambda moe, shape=shape, x=x, norm=norm, residual=residual: grouped.run_grouped(target, shape, x, moe, norm, residual)
      us = _time(step, layers, device, args.iters)
      rec[name] = {"us_per_layer": us, "GBps": weight_bytes / us / 1e3}
      print(f"{n:>5} tokens, {name:<16} {us:8.1f} us/layer ({weight_bytes / us / 1e3:6.0f} GB/s of expert weights)", flush=True)
    grouped.kernel_source = original
    result[n] = rec
  if out := os.environ.get("OUT"): Path(out, "moe_weight_layout.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
