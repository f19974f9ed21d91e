"""Packed (quantized) experts on the GPU, part of bench/check_moe.py: Qwen3-30B-A3B's sparse layer with its experts
quantized at load as the engine does it (int8 and FP8 per channel, int4 in groups of 128; and a GGUF Q4_K_M layer's
forms, int4 gate/up in groups of 32 beside int8 down in groups of 16; the experts' rows stacked),
FusedBackend.moe (the decode kernels up to 16 tokens, the grouped tensor-core GEMM above) against portable_moe in
float32 on the same packed weights, each token within TOL of the experts' part (a token may route otherwise only
where its k-th and (k+1)-th experts tie within the logits' rounding, as check_moe allows), then timed against the bf16
layer: us a layer and GB/s of the expert weights read. Returns records for $OUT/kernels.json."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
from check_moe import EPS, HIDDEN, INTER, TIE, TOL, _inputs, _reference, _time

# name -> gate_up's and down's (format, scale group): quantized at load, and a GGUF Q4_K_M layer's Q4_K / Q6_K forms
FORMATS = {"int8": (("int8", HIDDEN), ("int8", INTER)), "int4": (("int4", 128), ("int4", 128)),
           "fp8": (("fp8", HIDDEN), ("fp8", INTER)), "q4_k_m": (("int4", 32), ("int8", 16))}
TOKENS = (1, 4, 16, 64, 256)


def packed_layer(moe, name: str):
  """The layer's experts quantized at load (layers/quantized.py's round-to-nearest), their rows stacked."""
  from tinygrad import Tensor

  from tinyvllm.layers.quantized import quantize_rtn
  (up_format, up_group), (down_format, down_group) = FORMATS[name]
  up = quantize_rtn(moe.gate_up_proj.reshape(-1, HIDDEN), up_format, up_group)
  down = quantize_rtn(moe.down_proj.reshape(-1, INTER), down_format, down_group)
  Tensor.realize(*up.tensors(), *down.tensors())
  return replace(moe, gate_up_proj=up, down_proj=down)


def _float32(moe):
  from tinygrad import dtypes
  return replace(moe, router=moe.router.float().contiguous().realize(), gate_up_proj=replace(moe.gate_up_proj, dtype=dtypes.float32),
                 down_proj=replace(moe.down_proj, dtype=dtypes.float32))


def _bytes_read(x, norm, moe) -> int:
  """Expert weight bytes (codes, scales, shifts) a step reads: each used expert's share once, and the router."""
  from tinyvllm.layers.moe import route
  from tinyvllm.layers.norm import rms_norm
  used = len(np.unique(route(rms_norm(x.float(), norm.float(), EPS), _float32(moe))[1].numpy()))
  experts = moe.router.shape[0]
  per_expert = sum(t.nbytes() for w in (moe.gate_up_proj, moe.down_proj) for t in w.tensors()) // experts
  return used * per_expert + moe.router.nbytes()


def _check(target, device: str, fmt: str, n: int, layers: list, bf16_layers: list, iters: int) -> dict:
  from tinyvllm.kernels.fused import FusedBackend
  x, norm, residual = _inputs(n, device)
  backend = FusedBackend(target)
  got = backend.moe(x, layers[0], norm=norm, eps=EPS, residual=residual).float().numpy()
  path = "moe" if n <= 16 else "moe-grouped"
  assert dict(backend.calls) == {path: 1}, f"{fmt}, {n} tokens did not take the {path} path: {dict(backend.calls)}"
  want, gaps = _reference(x, norm, residual, _float32(layers[0]))
  token_err = np.abs(got - want).max(1) / np.abs(want - residual.float().numpy()).max()
  off = token_err >= TOL
  rec = {"name": f"moe_packed_{fmt}_qwen3_30b_a3b_n{n}", "format": fmt, "tokens": n, "path": path,
         "rel_err": float(token_err[~off].max(initial=0.0)), "tokens_off": int(off.sum()), "nan": bool(np.isnan(got).any())}
  rec["ok"] = not rec["nan"] and off.sum() <= max(1, n // 100) and bool((gaps[off] < TIE).all())
  step = lambda moe: backend.moe(x, moe, norm=norm, eps=EPS, residual=residual)
  rec["fused_us_per_layer"], rec["bf16_us_per_layer"] = _time(step, layers, device, iters), _time(step, bf16_layers, device, iters)
  rec["weight_bytes_per_layer"] = int(np.mean([_bytes_read(x, norm, moe) for moe in layers]))
  rec["fused_GBps"] = rec["weight_bytes_per_layer"] / rec["fused_us_per_layer"] / 1e3
  print(f"{'ok  ' if rec['ok'] else 'FAIL'} moe packed {fmt:<4} {n:>3} tokens ({path}): max rel err {rec['rel_err']:.2e} "
        f"({rec['tokens_off']} routed otherwise); {rec['fused_us_per_layer']:.1f} us/layer ({rec['fused_GBps']:.0f} GB/s of "
        f"expert weights) against bf16's {rec['bf16_us_per_layer']:.1f}", flush=True)
  return rec


def check_moe_packed(target, device: str, bf16_layers: list, iters: int = 20) -> list[dict]:
  records = []
  for fmt in FORMATS:
    layers = [packed_layer(moe, fmt) for moe in bf16_layers]
    records += [_check(target, device, fmt, n, layers, bf16_layers, iters) for n in TOKENS]
  return records


def main() -> int:
  """Alone (bash bench/run_on_device.sh check_moe_packed; the repository on PYTHONPATH): the checks on LAYERS random bf16
  layers, $OUT/check_moe_packed.json."""
  import json
  import os
  from pathlib import Path

  from check_moe import LAYERS, _layer

  from tinyvllm.kernels.tinygrad_program import device_target
  from tinyvllm.platform.device import select_device
  device = select_device(os.environ.get("DEV", "CUDA"))
  records = check_moe_packed(device_target(device), device, [_layer(device, seed) for seed in range(LAYERS)])
  if out := os.environ.get("OUT"): Path(out, "check_moe_packed.json").write_text(json.dumps(records, indent=1))
  failed = [r["name"] for r in records if not r["ok"]]
  print(f"check_moe_packed: {len(records) - len(failed)} of {len(records)} ok" + (f"; FAILED {failed}" if failed else ""), flush=True)
  return int(bool(failed))


if __name__ == "__main__":
  import sys
  sys.exit(main())
