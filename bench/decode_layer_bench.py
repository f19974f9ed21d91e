"""Where the persistent decode-layer kernel's time goes: Qwen3-0.6B's 28 layers (distinct random weights, batch 1, 300
tokens of context in the engine's smallest context bucket) in one launch under TinyJit, replayed and timed, with phases
left out (TV_PHASES) or the grid barriers removed (TV_GRID_SYNCS=0; results then wrong, timing only); and the same 28
layers op by op on the per-op kernels; and the TV_TIMING clock timeline of each entry of TIMELINES (the kernel as built,
or with timing experiments).

  DEV=CUDA python3 bench/decode_layer_bench.py      (bash bench/run_on_device.sh layer_bench)
Writes $OUT/decode_layer_bench.json and $OUT/decode_layer_timeline.json.
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
            "qkv + attention": (("TV_PHASES", 3),)}


def timed(fn, *args) -> float:
  from tinygrad import Device
  for _ in range(3): fn(*args)
  Device[args[0].device].synchronize()
  t = time.perf_counter()
  for _ in range(ITERS): fn(*args)
  Device[args[0].device].synchronize()
  return (time.perf_counter() - t) / ITERS


def device_layers(device: str, count: int):
  """`count` Qwen3-0.6B layers of random bf16 weights made on the device (distinct, so the weights stream from HBM
  as in the engine, not from L2) and a bf16 cache each."""
  from tinygrad import Tensor, dtypes

  from tinyvllm.model.llama import DecoderLayer
  d = QWEN3
  qkv, hd = (d["heads"] + 2 * d["kv_heads"]) * d["head_dim"], d["heads"] * d["head_dim"]
  w = lambda *shape: (Tensor.randn(*shape, device=device) * shape[-1] ** -0.5).cast(dtypes.bfloat16).contiguous().realize()
  norm = lambda n: (1 + 0.1 * Tensor.randn(n, device=device)).cast(dtypes.bfloat16).contiguous().realize()
  layers = [DecoderLayer(norm(d["hidden"]), w(qkv, d["hidden"]), None, norm(d["head_dim"]), norm(d["head_dim"]),
                         w(d["hidden"], hd), None, norm(d["hidden"]), w(2 * d["intermediate"], d["hidden"]), None,
                         w(d["hidden"], d["intermediate"]), None) for _ in range(count)]
  caches = [tuple(Tensor.randn(4096 * 16, d["kv_heads"] * d["head_dim"], device=device).cast(dtypes.bfloat16).contiguous().realize()
                  for _ in range(2)) for _ in range(count)]
  return layers, caches


def main() -> None:
  from dataclasses import replace

  from tinygrad import TinyJit

  from tinyvllm.device import select_device
  from tinyvllm.kernels.cases import layer_tensors, make_layer_case
  from tinyvllm.kernels.decode_layer import layer_arguments, run_decode_layer
  from tinyvllm.kernels.fused import FusedBackend
  device = select_device(os.environ.get("DEV", "CUDA"))
  backend = FusedBackend("cuda", device)
  # the engine's block-table width (its smallest context bucket), which sets the splits and attention items
  case = make_layer_case(np.random.default_rng(0), [300], **QWEN3, dtype="bfloat16", min_bucket=backend.min_context_bucket)
  model, _, (h, cos, sin, _, meta) = layer_tensors(case, device, "bfloat16")
  layers, caches = device_layers(device, LAYERS)
  base = backend._decode_layer_shape(layers, h, cos, *caches[0], meta, case.eps)
  results = {}

  def chain(shape):
    def step(h, cos, sin):
      out = run_decode_layer(shape, layer_arguments(layers, h, cos, sin, caches, meta, backend._sync_base))
      return out["h_out"].realize()
    return TinyJit(step)

  out = Path(os.environ.get("OUT", "/tmp/out"))
  out.mkdir(parents=True, exist_ok=True)

  def record(name: str, us: float) -> None:
    results[name] = us
    print(f"{name:>36}: {us:8.1f} us for {LAYERS} layers ({us / LAYERS:6.2f} us a layer)", flush=True)
    summary = {"us_for_28_layers": results, "context": 300, "context_bucket": backend.min_context_bucket, "batch": 1}
    (out / "decode_layer_bench.json").write_text(json.dumps(summary, indent=1))

  model.linear_fn, model.attention_fn, model.qkv_rope_write_fn = backend.linear, backend.attention, backend.qkv_rope_write

  @TinyJit
  def per_op(h, cos, sin):
    return model.decoder_layers(h, cos, sin, caches, meta, layers)[0].realize()
  record("per-op kernels", timed(per_op, h, cos, sin) * 1e6)
  timelines = {}
  for name, extra in TIMELINES.items():
    timelines[name] = timeline(replace(base, experiment=(("TV_TIMING", 1), *extra)), layers, caches, h, cos, sin, meta,
                               backend._sync_base, name)
    (out / "decode_layer_timeline.json").write_text(json.dumps(timelines, indent=1))
  # the full kernel again at the end: drift between the first and last rows says how far apart rows can be trusted
  for name, extra in [*VARIANTS.items(), ("full (again)", ())]:
    record(name, timed(chain(replace(base, experiment=extra)), h, cos, sin) * 1e6)


# clock timelines taken: the kernel as built, then with timing experiments
TIMELINES = {"as built": ()}
SEGMENTS = ["norm", "qkv wait", "qkv gemv", "sync 1", "attention", "sync 2", "merge", "o wait", "o gemv", "sync 3", "norm 2",
            "gu wait", "gu gemv", "sync 4", "swiglu", "down wait", "down gemv", "sync 5 + next"]
# inside block 0's attention item (kernels/decode_layer_attend.inc's TV_ATT_STAMP points)
ATTENTION_SEGMENTS = ["q, k, v, RoPE row read", "QK norm, RoPE, K/V write", "scores", "softmax", "P V", "warp sums",
                      "part_o write"]


def timeline(shape, layers, caches, h, cos, sin, meta, sync, name: str) -> dict:
  """The TV_TIMING experiment: each block's SM clock at 18 points of every layer (and 8 inside block 0's attention
  item); the mean cycles of each segment (layers 1 .. L-2, so no launch edges) for block 0 and over all blocks, and the
  segments' share of a layer."""
  from tinygrad import Device

  from tinyvllm.kernels.decode_layer import TIMING_STAMPS, layer_arguments, run_decode_layer
  for _ in range(3):
    stamps = run_decode_layer(shape, layer_arguments(layers, h, cos, sin, caches, meta, sync))["timing"].numpy()
  Device[h.device].synchronize()
  t = stamps.astype(np.int64).reshape(shape.blocks, shape.layers, TIMING_STAMPS)
  phases = t[:, :, :len(SEGMENTS)]
  nxt = np.concatenate([phases[:, 1:, :1], phases[:, -1:, -1:]], axis=1)   # each layer's end: the next layer's first stamp
  seg = np.diff(np.concatenate([phases, nxt], axis=2), axis=2) % (1 << 32)
  mid = seg[:, 1:-1]
  rows = {name: {"block0": float(mid[0, :, i].mean()), "all_blocks": float(mid[:, :, i].mean()),
                 "max_block": float(mid[:, :, i].mean(1).max())} for i, name in enumerate(SEGMENTS)}
  inside = np.diff(t[0, 1:-1, len(SEGMENTS):], axis=1) % (1 << 32)
  attention = {name: float(inside[:, i].mean()) for i, name in enumerate(ATTENTION_SEGMENTS)}
  layer = float(mid[0].sum(1).mean())
  print(f"timeline ({name}): {layer:.0f} cycles a layer (block 0)", flush=True)
  for seg_name, r in rows.items():
    print(f"  {seg_name:>14}: block 0 {r['block0']:7.0f} cycles ({100 * r['block0'] / layer:4.1f}%), mean over blocks "
          f"{r['all_blocks']:7.0f}, slowest block {r['max_block']:7.0f}", flush=True)
  print("  inside block 0's attention item: " + ", ".join(f"{k} {v:.0f}" for k, v in attention.items()), flush=True)
  return {"cycles_per_layer_block0": layer, "segments": rows, "attention_item_block0": attention}


if __name__ == "__main__":
  main()
