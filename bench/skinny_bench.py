"""The skinny product (csrc/neutral/linear.inc) at decode batch sizes, in every layout: time per call and GB/s of weights
for the per-op decode paths' shapes (Qwen3-30B-A3B's attention half, router and LM head; Llama-3.2-1B's layer in bf16,
int8, int4 and FP8 (gate_up and down; qkv and o in int8 and int4); Qwen3-0.6B's LM head; a fourth of Qwen3-8B, a
device's share at TP=4), each layout checked against a float32 product in tinygrad.

Usage (GPU machine): DEV=CUDA python bench/skinny_bench.py [--rows 1,4] [--only NAMES] [--planned | --layout R:S,...];
writes $OUT/skinny_bench.json when OUT is set. A --layout entry is RPW:KSPLIT, RPW:KSPLIT:tc (the sums on tensor cores,
RPW 16), "planned" (the FMA form's planned layout) or "gemm" (the tensor-core GEMM); each variant's largest difference
from the first one's output is reported beside its error.
--plain-graphs: tinygrad's CUDA graphs with plain edges (the kernels' wait stays, a no-op without a programmatic launch).
Timing: each layout is captured with TinyJit as R calls on R different weight copies (so weights come from HBM, not
L2, as in a decode step), replayed; time per call = wall time / (replays * R), launch gaps inside the graph included.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, out_features, in_features, prologue/epilogue, weight: "elem" or an on-the-fly quantization method)
# Every product but the logits' adds a residual: the chain's calls take the one before as theirs, so that the captured
# graph runs them one after the other as a model does (independent calls could overlap and flatter small grids).
SHAPES = (("30b_qkv", 5120, 2048, {"norm": True}, "elem"), ("30b_o", 2048, 4096, {"residual": True}, "elem"),
          ("30b_router", 128, 2048, {"norm": True}, "elem"),
          ("30b_lm_head", 151936, 2048, {"norm": True, "out_float32": True}, "elem"),
          ("06b_lm_head", 151936, 1024, {"norm": True, "out_float32": True}, "elem"),
          ("1b_qkv", 3072, 2048, {"norm": True}, "elem"), ("1b_o", 2048, 2048, {"residual": True}, "elem"),
          ("1b_gate_up", 16384, 2048, {"norm": True}, "elem"), ("1b_down", 2048, 8192, {"silu_mul": True, "residual": True}, "elem"),
          ("1b_gate_up_int4", 16384, 2048, {"norm": True}, "int4"),
          ("1b_qkv_int4", 3072, 2048, {"norm": True}, "int4"), ("1b_o_int4", 2048, 2048, {"residual": True}, "int4"),
          ("1b_qkv_int8", 3072, 2048, {"norm": True}, "int8"), ("1b_o_int8", 2048, 2048, {"residual": True}, "int8"),
          ("1b_down_int4", 2048, 8192, {"silu_mul": True, "residual": True}, "int4"),
          ("1b_down_int8", 2048, 8192, {"silu_mul": True, "residual": True}, "int8"),
          ("1b_gate_up_int8", 16384, 2048, {"norm": True}, "int8"), ("1b_gate_up_fp8", 16384, 2048, {"norm": True}, "fp8"),
          ("1b_down_fp8", 2048, 8192, {"silu_mul": True, "residual": True}, "fp8"),
          ("8b_tp4_qkv", 1536, 4096, {"norm": True}, "elem"), ("8b_tp4_o", 4096, 1024, {}, "elem"),
          ("8b_tp4_gate_up", 6144, 4096, {"norm": True}, "elem"), ("8b_tp4_down", 4096, 3072, {"silu_mul": True}, "elem"),
          ("8b_down", 4096, 12288, {"silu_mul": True, "residual": True}, "elem"),
          ("8b_tp2_down", 4096, 6144, {"silu_mul": True, "residual": True}, "elem"))
# The down products again with x' = silu(gate) * up given (computed once before them), named "<down>_xp": what the
# SwiGLU prologue's per-block recomputation (every block reads gate and up whole and takes K SiLUs) costs each
SHAPES += tuple((f"{name}_xp", o, k, {n: v for n, v in opts.items() if n != "silu_mul"}, method)
                for name, o, k, opts, method in SHAPES if opts.get("silu_mul"))
# and the packed gate_up products with x' = rmsnorm(x) * g given, "<gate_up>_xn": what the RMSNorm prologue costs them
SHAPES += tuple((f"{name}_xn", o, k, {}, method) for name, o, k, opts, method in SHAPES
                if opts.get("norm") and name.startswith("1b_gate_up_"))
RPW, KSPLIT = (2, 4, 8), (1, 2, 4, 8, 16)
WEIGHT_BYTES = 256 << 20   # weight copies of a layout's chain: past the 50 MB L2
MAX_COPIES = 256
DTYPE = "bfloat16"


def inputs(m: int, o: int, k: int, opts: dict, method: str, device: str, copies: int):
  from tinygrad import Tensor, dtypes

  from tinyvllm.layers.quantized import quantize_rtn
  rng = np.random.default_rng(o + k)
  bf = getattr(dtypes, DTYPE)
  x = Tensor(rng.standard_normal((m, 2 * k if opts.get("silu_mul") else k)).astype(np.float32), device=device).cast(bf)
  ws = [(Tensor.randn(o, k, device=device, dtype=bf) * 0.05).realize() for _ in range(copies)]
  if method != "elem":
    ws = [quantize_rtn(w, method, 128 if method == "int4" else k) for w in ws]
    for w in ws: Tensor.realize(*w.tensors())
  extra = {}
  if opts.get("norm"): extra["norm"] = Tensor((1 + 0.2 * rng.standard_normal(k)).astype(np.float32), device=device).cast(bf)
  if not opts.get("out_float32"): extra["residual"] = Tensor(rng.standard_normal((m, o)).astype(np.float32), device=device).cast(bf)
  return x.realize(), ws, {n: t.realize() for n, t in extra.items()}


def reference(x, w, extra: dict, opts: dict) -> np.ndarray:
  """The float32 product in tinygrad ops (a quantized weight dequantized in float32)."""
  from tinygrad import Tensor

  from tinyvllm.layers.linear import portable_linear
  f = lambda t: None if t is None else t.float()
  y = portable_linear(x.float(), w.float() if isinstance(w, Tensor) else w, None, norm=f(extra.get("norm")), eps=1e-6,
                      silu_mul=bool(opts.get("silu_mul")), residual=f(extra.get("residual")))
  return y.float().numpy()


def chained(call, ws: list, residual) -> list:
  """One call per weight copy, each taking the previous output as its residual (the logits product: none)."""
  outs, prev = [], residual
  for w in ws:
    outs.append(y := call(w, prev))
    if residual is not None: prev = y
  return outs


def bench_shape(target, device: str, rows: int, spec: tuple, replays: int, planned_only: bool, only=None) -> list[dict]:
  """Every layout (`planned_only`: the planner's; `only`: those SkinnyLayouts) of one shape, timed and checked."""
  from tinygrad import Device, TinyJit

  from tinyvllm.kernels.linear import SkinnyLayout, linear_shape, run_linear, skinny_layout, unsupported_reason
  name, o, k, opts, method = spec
  bytes_per = o * k * {"elem": 2, "int8": 1, "fp8": 1, "int4": 0.5}[method]   # (bf16)
  copies = int(min(MAX_COPIES, max(1, WEIGHT_BYTES // bytes_per)))
  x, ws, extra = inputs(rows, o, k, opts, method, device, copies)
  shape = linear_shape(x, ws[0], None, extra.get("norm"), 1e-6, bool(opts.get("silu_mul")), extra.get("residual"),
                       bool(opts.get("out_float32")))
  assert shape is not None and unsupported_reason(shape) is None, name
  planned = skinny_layout(shape)
  others = [SkinnyLayout(r, s) for r in RPW for s in KSPLIT if r * rows <= 64]   # (registers)
  want = reference(x, ws[0], extra, opts)
  records, first = [], None
  variants = [planned, *([] if planned_only else others)] if only is None else [planned if v == "planned" else v for v in only]
  for layout in dict.fromkeys(variants):
    kernel = "gemm" if layout == "gemm" else "skinny_tc" if layout.tensor_cores else "skinny"
    call = lambda w, residual, layout=layout, kernel=kernel: run_linear(
      target, shape, kernel, x, w, None, extra.get("norm"), residual, layout=None if kernel == "gemm" else layout)
    got = call(ws[0], extra.get("residual")).float().numpy()
    err = float(np.abs(got - want).max() / np.abs(want).max())
    first = got if first is None else first
    vs_first = float(np.abs(got - first).max() / np.abs(first).max())
    jit = TinyJit(lambda call=call: chained(call, ws, extra.get("residual")))
    for _ in range(3): jit()
    Device[device].synchronize()
    t = time.perf_counter()
    for _ in range(replays): jit()
    Device[device].synchronize()
    us = (time.perf_counter() - t) / replays / copies * 1e6
    rec = {"shape": name, "rows": rows, "kernel": kernel, "rpw": getattr(layout, "rpw", 0), "ksplit": getattr(layout, "ksplit", 0),
           "planned": layout == planned, "us": round(us, 2), "GBps": round(bytes_per / us / 1e3), "rel_err": err,
           "vs_first": vs_first, "ok": err < 2e-2}
    print(f"  {kernel:9} rpw {rec['rpw']:2} ksplit {rec['ksplit']}: {rec['us']:7.2f} us {rec['GBps']:5} GB/s, "
          f"error {err:.2e}, from the first {vs_first:.2e}", flush=True)
    records.append(rec)
  best = min(records, key=lambda r: r["us"])
  plan = next((r for r in records if r["planned"]), records[0])
  print(f"{name:16} rows {rows}: planned rpw {plan['rpw']} ksplit {plan['ksplit']:2} {plan['us']:7.2f} us {plan['GBps']:5} GB/s; "
        f"best rpw {best['rpw']} ksplit {best['ksplit']:2} {best['us']:7.2f} us {best['GBps']:5} GB/s"
        f"{'' if all(r['ok'] for r in records) else '  ERROR: ' + str([r for r in records if not r['ok']][:2])}", flush=True)
  return records


def main() -> None:
  from tinygrad import Device

  from tinyvllm.kernels.tinygrad_program import device_target
  p = argparse.ArgumentParser()
  p.add_argument("--rows", default="1")
  p.add_argument("--replays", type=int, default=10)
  p.add_argument("--only", help="comma-separated shape names")
  p.add_argument("--planned", action="store_true", help="time only the planner's layout")
  p.add_argument("--layout", help="time only these layouts, RPW:KSPLIT, comma-separated (e.g. 4:8,8:4)")
  p.add_argument("--vector-codes", action="store_true",
                 help="packed codes a 16-byte activation vector's worth a lane (linear.lane_columns' fallback) instead of spans")
  p.add_argument("--plain-graphs", action="store_true",
                 help="tinygrad's CUDA graphs without programmatic launch (platform/cuda_graph.py), for comparison")
  args = p.parse_args()
  from tinyvllm.platform import cuda_graph
  if args.plain_graphs: cuda_graph.use_programmatic_graphs = lambda device: False
  if args.vector_codes:
    from tinyvllm.kernels import linear
    from tinyvllm.kernels.plan import ELEM_BYTES, dtype_code
    linear.lane_columns = lambda shape: 16 // ELEM_BYTES[dtype_code(shape.dtype)]
  relink, edges = cuda_graph._relink, []
  cuda_graph._relink = lambda graph, e: (edges.append(len(e)), relink(graph, e))[1]
  device = Device.DEFAULT
  target = device_target(device)
  shapes = [s for s in SHAPES if args.only is None or s[0] in args.only.split(",")]
  only = None
  if args.layout:
    from tinyvllm.kernels.linear import SkinnyLayout
    parse = lambda f: SkinnyLayout(int(f[0]), int(f[1]), tensor_cores=f[2:] == ["tc"])
    only = [v if v in ("planned", "gemm") else parse(v.split(":")) for v in args.layout.split(",")]
  records = [r for rows in map(int, args.rows.split(",")) for spec in shapes
             for r in bench_shape(target, device, rows, spec, args.replays, args.planned, only)]
  print(f"programmatic edges: {sum(edges)} in {len(edges)} graphs")
  if out := os.environ.get("OUT"): Path(out, "skinny_bench.json").write_text(json.dumps(records, indent=1))
  assert all(r["ok"] for r in records), "a layout's product is off"


if __name__ == "__main__":
  main()
