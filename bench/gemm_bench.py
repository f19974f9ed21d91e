"""The model's matrix products on the GPU, one kernel at a time: correctness of the tensor-core GEMM and the skinny
decode kernel against tinygrad's own ops on the device, then time per call, achieved GB/s and TFLOP/s of every variant
(planner's choice, other tiles, splits, shared-memory stage counts and K slice depths, cuBLAS through torch as the
ceiling) for Qwen3-0.6B's projections (and, named with --projections, Qwen3-30B-A3B's attention and router products,
Llama-3.2-1B's and Qwen3-8B's).

Usage (GPU machine): DEV=CUDA python bench/gemm_bench.py [--quick] [--rows 1,32,256] [--projections qkv,gate_up];
writes $OUT/gemm_bench.json when
OUT is set. Environment: GEMM_ONLY_PLANNED=1 times the planner's tiles alone (with the prologue in the loop and as its
own pass), GEMM_ONLY_WGMMA=1 the planner's and the wgmma tiles, GEMM_WGMMA=0 leaves the wgmma tiles out;
GEMM_QUANT=int8|int4|fp8 times the weights quantized by round-to-nearest (int4 in groups of 128) with the planner's
kernel (with GEMM_QUANT_TILES=1 every tile variant too); GEMM_NO_CHECK=1 skips the correctness checks.
Timing: each variant is captured with TinyJit as R calls on R different weight copies (so weights come from HBM, not
L2, as in a decode step), replayed; time per call = wall time / (replays * R). Products with float32 outputs are not
chained one after another, so small grids may overlap and flatter: bench/graph_kernels.py times them inside a step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, out_features, in_features, prologue/epilogue) of Qwen3-0.6B's projections
PROJECTIONS = (("qkv", 4096, 1024, {"norm": True}), ("o", 1024, 2048, {"residual": True}),
               ("gate_up", 6144, 1024, {"norm": True}), ("down", 1024, 3072, {"silu_mul": True, "residual": True}),
               ("lm_head", 151936, 1024, {"norm": True, "out_float32": True}),
               # Qwen3-30B-A3B's attention half and router (hidden 2,048, 32 heads and 4 KV heads of 128)
               ("moe_qkv", 5120, 2048, {"norm": True}), ("moe_o", 2048, 4096, {"residual": True}),
               ("moe_router", 128, 2048, {"out_float32": True}),
               # Llama-3.2-1B's and Qwen3-8B's
               ("llama_qkv", 3072, 2048, {"norm": True}), ("llama_o", 2048, 2048, {"residual": True}),
               ("llama_gate_up", 16384, 2048, {"norm": True}), ("llama_down", 2048, 8192, {"silu_mul": True, "residual": True}),
               ("q8b_qkv", 6144, 4096, {"norm": True}), ("q8b_o", 4096, 4096, {"residual": True}),
               ("q8b_gate_up", 24576, 4096, {"norm": True}), ("q8b_down", 4096, 12288, {"silu_mul": True, "residual": True}))
OTHER_MODELS = ("moe_", "llama_", "q8b_")   # timed only when --projections names them
RESULTS: dict = {"correctness": [], "timing": [], "errors": []}


def log(msg: str) -> None: print(msg, flush=True)


def inputs(m: int, o: int, k: int, opts: dict, device: str, copies: int = 1, seed: int = 0):
  from tinygrad import Tensor, dtypes
  rng = np.random.default_rng(seed)
  bf = dtypes.bfloat16
  x = Tensor(rng.standard_normal((m, 2 * k if opts.get("silu_mul") else k)).astype(np.float32), device=device).cast(bf)
  ws = [(Tensor.randn(o, k, device=device, dtype=bf) * 0.05).realize() for _ in range(copies)]
  if method := os.environ.get("GEMM_QUANT"):
    from tinyvllm.layers.quantized import quantize_rtn
    ws = [quantize_rtn(w, method, 128 if method == "int4" else k) for w in ws]
    for w in ws: Tensor.realize(*w.tensors())
  extra = {}
  if opts.get("norm"): extra["norm"] = Tensor((1 + 0.2 * rng.standard_normal(k)).astype(np.float32), device=device).cast(bf)
  if opts.get("residual"): extra["residual"] = Tensor(rng.standard_normal((m, o)).astype(np.float32), device=device).cast(bf)
  if opts.get("bias"): extra["bias"] = Tensor(rng.standard_normal(o).astype(np.float32), device=device).cast(bf)
  return x.realize(), ws, {n: t.realize() for n, t in extra.items()}


def target_of(device: str):
  from tinyvllm.kernels.tinygrad_program import device_target
  return device_target(device)


def mma_target(target):
  """The device as the planner sees a tensor-core GPU without wgmma (sm_80; the same gemm tuning table): for the
  planner's mma.sync choice on Hopper."""
  return dataclasses.replace(target, arch="sm_80")


def call(x, w, extra: dict, opts: dict, variant: dict, residual=None):
  from tinyvllm.kernels.linear import linear_shape, run_linear
  from tinyvllm.layers.linear import portable_linear
  residual = extra.get("residual") if residual is None else residual
  kw = {"norm": extra.get("norm"), "residual": residual, "silu_mul": bool(opts.get("silu_mul")),
        "out_float32": bool(opts.get("out_float32")), "eps": 1e-6}
  if variant["kind"] == "portable": return portable_linear(x, w, extra.get("bias"), **kw)
  shape = linear_shape(x, w, extra.get("bias"), kw["norm"], kw["eps"], kw["silu_mul"], residual, kw["out_float32"])
  if shape is None: raise RuntimeError(f"kernel {variant} refused the shape")
  return run_linear(target_of(x.device), shape, variant["kind"], x, w, extra.get("bias"), kw["norm"], residual,
                    tiles=variant.get("tiles"))


def check(device: str) -> None:
  from tinyvllm.kernels.gemm import GemmTiles
  cases = [(1, 4096, 1024, {"norm": True}), (17, 1024, 2048, {"residual": True, "bias": True}),
           (33, 1000, 3072, {"silu_mul": True, "residual": True}), (100, 6144, 1024, {"norm": True}),
           (256, 4096, 1024, {}), (1000, 1024, 3072, {"silu_mul": True, "residual": True}),
           (256, 1024, 2048, {"residual": True}), (200, 1024, 3072, {"silu_mul": True, "residual": True}),
           (77, 151936, 1024, {"norm": True, "out_float32": True}),
           # the planner's tall row blocks for wide long-K products (long_k_tiles): whole K, and K split in four
           (200, 5120, 2048, {"norm": True}), (128, 2048, 4096, {"residual": True}),
           (256, 128, 2048, {"out_float32": True})]   # a small weight with K split (the router)
  for m, o, k, opts in cases:
    x, ws, extra = inputs(m, o, k, opts, device, seed=m)
    ref = call(x, ws[0], extra, opts, {"kind": "portable"}).float().numpy()
    # the 128x128 tile with the planner's stages (82-93 KB of dynamic shared memory) and with 5 (103-154 KB), and
    # with 64-wide K slices: 2 stages (74 KB; not with SwiGLU's two halves in the loop) and 3 (111-166 KB)
    variants = [{"kind": "gemm"}, {"kind": "gemm", "tiles": GemmTiles(128, 128, 2, 4, 1)},
                {"kind": "gemm", "tiles": GemmTiles(128, 128, 2, 4, 1, ring=5)},
                {"kind": "gemm", "tiles": GemmTiles(16, 64, 1, 4, 2)},
                {"kind": "gemm", "tiles": GemmTiles(128, 128, 2, 4, 1, bk=64)},
                {"kind": "gemm", "tiles": GemmTiles(128, 128, 2, 4, 1, ring=3, bk=64)}]
    variants += [{"kind": "gemm", "tiles": GemmTiles.warpgroup(*t)} for t in WGMMA_CHECKS]
    variants += [{"kind": "skinny"}] if m <= 16 else []
    for v in (v for v in variants if plannable(m, o, k, opts, v)):
      got = call(x, ws[0], extra, opts, v).float().numpy()
      err = float(np.abs(got - ref).max() / np.abs(ref).max())
      jit_ok = v["kind"] != "gemm" or replays_match(x, ws[0], extra, opts, v, got)
      ok = bool(np.isfinite(got).all() and err < 2e-2 and jit_ok)
      RESULTS["correctness"].append({"m": m, "o": o, "k": k, "opts": opts, "variant": str(v), "rel_err": err, "jit_ok": jit_ok,
                                     "ok": ok})
      log(f"check m={m} o={o} k={k} {opts} {v}: rel err {err:.2e}{'' if jit_ok else ', JIT replay differs'} "
          f"{'ok' if ok else 'FAIL'}")


def plannable(m: int, o: int, k: int, opts: dict, variant: dict) -> bool:
  """The planner accepts the variant's tiles for this product (K in whole slices, at least two stages fit)."""
  from tinygrad import Device

  from tinyvllm.kernels.gemm import gemm_plan
  from tinyvllm.kernels.linear import LinearShape
  if variant.get("tiles") is None: return True
  method = os.environ.get("GEMM_QUANT") or "elem"
  shape = LinearShape("bfloat16", m, k, o, bool(opts.get("bias")), 1e-6 if opts.get("norm") else None,
                      bool(opts.get("silu_mul")), bool(opts.get("residual")), bool(opts.get("out_float32")), method,
                      0 if method == "elem" else 128 if method == "int4" else k)
  try: gemm_plan(shape, target_of(Device.DEFAULT), variant["tiles"])
  except ValueError: return False
  return True


def replays_match(x, w, extra: dict, opts: dict, variant: dict, want: np.ndarray) -> bool:
  """The product captured by TinyJit and replayed (a CUDA graph, whose nodes must carry the dynamic shared memory)
  gives what the eager call gave, bit for bit."""
  from tinygrad import TinyJit
  jit = TinyJit(lambda: call(x, w, extra, opts, variant).float().realize())
  return all(np.array_equal(jit().numpy(), want) for _ in range(4))


def chained_calls(x, ws, extra, opts, variant) -> list:
  """One call per weight copy, each taking the previous output as its residual, so that the captured graph runs them
  one after the other as a model does (independent calls would overlap and flatter small grids); the logits product
  (float32 out) is not chained: it has thousands of blocks anyway."""
  outs, prev = [], None
  for w in ws:
    outs.append(y := call(x, w, extra, opts, variant, residual=prev))
    if not opts.get("out_float32"): prev = y
  return outs


def time_variant(x, ws, extra, opts, variant, device: str, replays: int) -> float:
  from tinygrad import Device, TinyJit
  jit = TinyJit(lambda: chained_calls(x, ws, extra, opts, variant))
  for _ in range(3): jit()
  Device[device].synchronize()
  t = time.perf_counter()
  for _ in range(replays): jit()
  Device[device].synchronize()
  return (time.perf_counter() - t) / (replays * len(ws))


def time_torch(m: int, o: int, k: int, copies: int, replays: int) -> float | None:
  try:
    import torch
  except ImportError: return None
  x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
  ws = [torch.randn(o, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
  for w in ws: x @ w.T
  torch.cuda.synchronize()
  t = time.perf_counter()
  for _ in range(replays):
    for w in ws: x @ w.T
  torch.cuda.synchronize()
  return (time.perf_counter() - t) / (replays * copies)


TILE_CANDIDATES = ((16, 64, 1, 4), (32, 64, 2, 2), (64, 64, 2, 2), (64, 128, 2, 2), (128, 128, 2, 4), (128, 128, 2, 2))
# stage counts tried besides the planner's (2 is what 48 KB of static shared memory gave the 128x128 tile)
RINGS = {(64, 128, 2, 2): (3,), (128, 128, 2, 4): (2, 3, 5)}
# tiles also tried with 64-wide K slices (one barrier per 4 k16 steps instead of 2): the planner's stages (2 for the
# 128x128 tile in 99 KB) and these
BK64_RINGS = {(64, 64, 2, 2): (), (64, 128, 2, 2): (), (128, 128, 2, 4): (3,)}


# Hopper's wgmma tiles (bm, bn) tried with the planner's ring (as many stages as fit, up to 4), with these rings and
# with split K at decode rows
# (256 rows: one row block at a 256-row decode batch, so a packed weight's column block is dequantized once, not twice)
WGMMA_TILES = {(64, 64): (), (128, 64): (), (128, 128): (3, 5, 6), (128, 256): (3, 4), (256, 64): (), (256, 128): ()}
# tiles also timed in the grid's plain block order (raster=1)
RASTER_OFF = ((128, 128), (256, 128))
# (bm, bn, splits, ring) checked for correctness: every instruction width, split K, a ring of 2
WGMMA_CHECKS = ((128, 128, 1, 0), (128, 256, 1, 3), (64, 64, 2, 0), (64, 128, 1, 2), (128, 64, 2, 3), (256, 64, 1, 0), (256, 64, 2, 0))


def wgmma_variants(m: int, k: int) -> list[dict]:
  from tinyvllm.kernels.gemm import GemmTiles
  out = []
  for (bm, bn), rings in WGMMA_TILES.items():
    if bm >= 2 * max(m, 64): continue
    for splits in (1, 2, 4) if m <= 256 else (1,):
      if k % (64 * splits) == 0: out.append({"kind": "gemm", "tiles": GemmTiles.warpgroup(bm, bn, splits)})
    out += [{"kind": "gemm", "tiles": GemmTiles.warpgroup(bm, bn, 1, ring)} for ring in rings]
    if (bm, bn) in RASTER_OFF and m > bm:   # the grid's plain order beside the tuning table's column-walking runs
      out.append({"kind": "gemm", "tiles": dataclasses.replace(GemmTiles.warpgroup(bm, bn), raster=1)})
  return out


def variants_for(m: int, o: int, k: int, opts: dict) -> list[dict]:
  from tinygrad import Device

  from tinyvllm.kernels.gemm import GemmTiles, choose_tiles
  target, silu = target_of(Device.DEFAULT), bool(opts.get("silu_mul"))
  planned = choose_tiles(m, k, o, target, silu)
  mma = {"kind": "gemm", "planner": "mma.sync", "tiles": choose_tiles(m, k, o, mma_target(target), silu)}
  out = [{"kind": "gemm"}, mma] + (wgmma_variants(m, k) if os.environ.get("GEMM_WGMMA") != "0" else [])
  if m > planned.bm: out.append({"kind": "gemm", "tiles": dataclasses.replace(planned, raster=1)})
  # the planner's tiles with the prologue in the loop and as its own pass
  xprime = [{"kind": "gemm", "tiles": dataclasses.replace(planned, xprime=flag)} for flag in (False, True)] \
    if opts.get("norm") or silu else []
  if os.environ.get("GEMM_QUANT") and not os.environ.get("GEMM_QUANT_TILES"):
    return [{"kind": "gemm"}] + ([{"kind": "skinny"}] if m <= 16 else [])
  if os.environ.get("GEMM_ONLY_PLANNED"): return [v for v in [{"kind": "gemm"}, *xprime] if plannable(m, o, k, opts, v)]
  out += xprime
  if os.environ.get("GEMM_ONLY_WGMMA"): return [v for v in out if plannable(m, o, k, opts, v)]
  for bm, bn, wm, wn in TILE_CANDIDATES:
    if bm >= 2 * max(m, 16) or (m > 256 and bm < 64): continue
    for splits in (1, 2, 4) if m <= 256 else (1,):
      if k % (32 * splits) == 0: out.append({"kind": "gemm", "tiles": GemmTiles(bm, bn, wm, wn, splits)})
    out += [{"kind": "gemm", "tiles": GemmTiles(bm, bn, wm, wn, 1, ring)} for ring in RINGS.get((bm, bn, wm, wn), ())]
    for ring in (0, *BK64_RINGS[bm, bn, wm, wn]) if (bm, bn, wm, wn) in BK64_RINGS else ():
      out.append({"kind": "gemm", "tiles": GemmTiles(bm, bn, wm, wn, 1, ring, bk=64)})
  out = [v for v in out if plannable(m, o, k, opts, v)]
  if m <= 16: out.append({"kind": "skinny"})
  return out


def bench(device: str, rows: list[int], replays: int, projections: set[str] | None = None) -> None:
  for name, o, k, opts in PROJECTIONS:
    if (name not in projections) if projections else name.startswith(OTHER_MODELS): continue
    wbytes = o * k * {"int8": 1, "fp8": 1, "int4": 0.5}.get(os.environ.get("GEMM_QUANT", ""), 2)
    # weight copies filling 256 MB, five times the L2 (a small weight in 16 copies stayed in L2: the router's 3.3 µs
    # here against 25.7 inside a decode step's graph, bench/graph_kernels.py)
    copies = max(2, min(512, math.ceil(256e6 / wbytes)))
    for m in rows:
      if name == "lm_head" and (m > 256 or os.environ.get("GEMM_QUANT")): continue   # (the LM head stays unquantized)
      x, ws, extra = inputs(m, o, k, opts, device, copies)
      entries = []
      for v in variants_for(m, o, k, opts):
        try: s = time_variant(x, ws, extra, opts, v, device, replays)
        except Exception as e:
          RESULTS["errors"].append({"proj": name, "m": m, "variant": str(v), "error": repr(e)[:300]})
          continue
        entries.append((str(v), s))
      ts = time_torch(m, o, k, copies, replays)
      if ts is not None: entries.append(("torch cuBLAS (plain x @ w.T)", ts))
      for label, s in entries:
        rec = {"proj": name, "m": m, "o": o, "k": k, "variant": label, "us": round(s * 1e6, 2),
               "GBps": round((wbytes + m * k * 2 + m * o * 2) / s / 1e9, 1), "TFLOPs": round(2 * m * o * k / s / 1e12, 1)}
        RESULTS["timing"].append(rec)
        log(f"{name:8s} m={m:5d} {label:60s} {rec['us']:9.2f} us {rec['GBps']:7.1f} GB/s {rec['TFLOPs']:6.1f} TFLOP/s")
      del x, ws, extra


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--quick", action="store_true")
  p.add_argument("--rows", default="1,4,16,32,64,128,256,1024,4096")
  p.add_argument("--projections", default="", help="comma-separated names of PROJECTIONS to time (default: all)")
  args = p.parse_args()
  from tinygrad import Device
  device = Device.DEFAULT
  t0 = time.perf_counter()
  try:
    if not os.environ.get("GEMM_NO_CHECK"): check(device)
    rows = [1, 32, 256] if args.quick else [int(r) for r in args.rows.split(",")]
    bench(device, rows, 5 if args.quick else 20, set(filter(None, args.projections.split(","))))
  finally:
    RESULTS["seconds"] = round(time.perf_counter() - t0, 1)
    if os.environ.get("OUT"): (Path(os.environ["OUT"]) / "gemm_bench.json").write_text(json.dumps(RESULTS, indent=1))
  bad = [c for c in RESULTS["correctness"] if not c["ok"]]
  log(f"{len(RESULTS['correctness']) - len(bad)}/{len(RESULTS['correctness'])} checks ok, {len(RESULTS['errors'])} "
      f"timing errors, {RESULTS['seconds']} s")
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  main()
