"""Where the mixture of experts' decode kernels should hand steps to the grouped tensor-core GEMM (the tuning table's
`moe.decode_kernel_max_tokens`): at Qwen3-30B-A3B's shape, each token count run both ways through FusedBackend.moe,
each checked against the float32 portable path and timed over bench/check_moe.py's four layers of their own weights.

Usage (on the GPU machine, from the repo root): DEV=CUDA python bench/moe_decode_bound.py [--tokens 6,8,12,16]
  ->  $OUT/moe_decode_bound.json: for each token count, µs a layer on the decode kernels and on the grouped GEMM.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
  from check_moe import LAYERS, _check_large, _check_tokens, _compile_grouped, _float32, _layer
  from graph_kernels import patch_tuning
  from tinygrad import Device

  from tinyvllm.kernels.moe import MoEShape
  from tinyvllm.kernels.tinygrad_program import device_target
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", default="6,8,12,16")
  p.add_argument("--iters", type=int, default=20)
  args = p.parse_args()
  tokens = [int(n) for n in args.tokens.split(",")]
  device = Device.DEFAULT
  target = device_target(device)
  layers = [_layer(device, seed) for seed in range(LAYERS)]
  reference = _float32(layers[0])
  kernels = {n: _check_tokens(target, device, n, layers, reference, args.iters) for n in tokens}
  patch_tuning(["moe.decode_kernel_max_tokens=0"])   # from here every step the grouped GEMM can take goes there
  _compile_grouped(target, device, [(MoEShape("bfloat16", n, 2048, 768, 128, 8, True, 1e-6), None) for n in tokens], layers[0])
  grouped = {n: _check_large(target, device, n, layers, reference, args.iters)[0] for n in tokens}
  keep = ("rel_err", "tokens_off", "tokens_off_gaps", "nan", "ok")
  result = {n: {"decode_kernels_us": kernels[n]["fused_us_per_layer"], "grouped_gemm_us": grouped[n]["fused_us_per_layer"],
                "ok": bool(kernels[n]["ok"] and grouped[n]["ok"]),
                "decode_kernels_check": {k: kernels[n][k] for k in keep if k in kernels[n]},
                "grouped_gemm_check": {k: grouped[n][k] for k in keep if k in grouped[n]}} for n in tokens}
  for n, r in result.items():
    print(f"{n:>3} tokens: decode kernels {r['decode_kernels_us']:.1f} us/layer, grouped GEMM {r['grouped_gemm_us']:.1f}"
          f"{'' if r['ok'] else '  (a check FAILED)'}; checks {r['decode_kernels_check']} {r['grouped_gemm_check']}", flush=True)
  if out := os.environ.get("OUT"): Path(out, "moe_decode_bound.json").write_text(json.dumps(result, indent=1))
  sys.exit(0 if all(r["ok"] for r in result.values()) else 1)


if __name__ == "__main__":
  main()
