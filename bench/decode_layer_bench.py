"""Where the persistent decode-layer kernel's time goes: 28 chained launches (Qwen3-0.6B's layer, batch 1, 300 tokens of
context) under TinyJit, replayed and timed, with phases left out (TV_PHASES) or the grid barriers removed
(TV_GRID_SYNCS=0; results then wrong, timing only); and the same 28 layers op by op on the per-op kernels.

  DEV=CUDA python3 bench/decode_layer_bench.py      (bash bench/run_on_device.sh layer_bench)
Writes $OUT/decode_layer_bench.json.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
LAYERS, ITERS = 28, 50
QWEN3 = dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, qk_norm=True, qkv_bias=False)
VARIANTS = {"full": (), "no grid barriers": (("TV_GRID_SYNCS", 0),), "weights + barriers only": (("TV_PHASES", 0),),
            "qkv": (("TV_PHASES", 1),), "qkv + attention": (("TV_PHASES", 3),), "qkv + attention + o": (("TV_PHASES", 7),),
            "all but down": (("TV_PHASES", 15),), "no barriers, weights only": (("TV_PHASES", 0), ("TV_GRID_SYNCS", 0))}


def timed(fn, *args) -> float:
  from tinygrad import Device
  for _ in range(3): fn(*args)
  Device[args[0].device].synchronize()
  t = time.perf_counter()
  for _ in range(ITERS): fn(*args)
  Device[args[0].device].synchronize()
  return (time.perf_counter() - t) / ITERS


def main() -> None:
  from dataclasses import replace

  from tinygrad import TinyJit

  from tinyvllm.device import select_device
  from tinyvllm.kernels.cases import layer_tensors, make_layer_case
  from tinyvllm.kernels.decode_layer import layer_arguments, run_decode_layer
  from tinyvllm.kernels.fused import FusedBackend
  device = select_device(os.environ.get("DEV", "CUDA"))
  case = make_layer_case(np.random.default_rng(0), [300], **QWEN3, dtype="bfloat16")
  backend = FusedBackend("cuda", device)
  backend.layer_rows = (1, backend.layer_rows[1])   # batch 1 (the engine's default starts at 2)
  model, layer, (h, cos, sin, kc, vc, meta) = layer_tensors(case, device, "bfloat16")
  base = backend._decode_layer_shape(layer, h, cos, kc, vc, meta, case.eps)
  results = {}

  def chain(shape):
    def step(h, cos, sin):
      sync, k, v = backend._sync_base, kc, vc
      for _ in range(LAYERS):
        out = run_decode_layer(shape, layer_arguments(layer, h, cos, sin, k, v, meta, sync))
        h, sync, k, v = out["h_out"].reshape(h.shape), out["sync"], out["k_cache"], out["v_cache"]
      return h.realize()
    return TinyJit(step)

  for name, extra in VARIANTS.items():
    us = timed(chain(replace(base, experiment=extra)), h, cos, sin) * 1e6
    results[name] = us
    print(f"{name:>28}: {us:8.1f} us for {LAYERS} layers ({us / LAYERS:6.2f} us a layer)", flush=True)
  model.linear_fn, model.attention_fn, model.qkv_rope_write_fn = backend.linear, backend.attention, backend.qkv_rope_write

  @TinyJit
  def per_op(h, cos, sin):
    k, v = kc, vc
    for _ in range(LAYERS): h, k, v = model.decoder_layer(layer, h, cos, sin, k, v, meta)
    return h.realize()
  us = timed(per_op, h, cos, sin) * 1e6
  results["per-op kernels"] = us
  print(f"{'per-op kernels':>28}: {us:8.1f} us for {LAYERS} layers ({us / LAYERS:6.2f} us a layer)", flush=True)
  out = Path(os.environ.get("OUT", "/tmp/out"))
  out.mkdir(parents=True, exist_ok=True)
  (out / "decode_layer_bench.json").write_text(json.dumps({"us_for_28_layers": results, "context": 300, "batch": 1}, indent=1))


if __name__ == "__main__":
  main()
