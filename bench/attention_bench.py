#!/usr/bin/env python3
"""Attention timings on the GPU for the Qwen3-0.6B shape: fused decode and prefill against the portable path, and
decode variants (split counts) on uniform or mixed contexts. bench/check_kernels.py runs the first two as its
benchmark step; run alone, this explores the decode split policy:

  DEV=CUDA python bench/attention_bench.py [--batches 64,128,256] [--splits 1,2,4,8,16]  ->  $OUT/attention_explore.json
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


def dev_tensor(x: np.ndarray, dtype: str, device: str):
  from tinygrad import Tensor, dtypes

  from tests.emulator.cases import FP8, to_bits
  if dtype == "float32": return Tensor(np.ascontiguousarray(x, np.float32), device=device).realize()
  if dtype == FP8: return Tensor(to_bits(x, FP8), device=device).realize()   # uint8 E4M3 codes
  bits = Tensor(to_bits(x, dtype), device=device)
  return bits.bitcast(dtypes.bfloat16 if dtype == "bfloat16" else dtypes.float16).contiguous().realize()


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
  return float(np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def decode_variant(target, splits: int | None = None, stages: int | None = None, key_warps: int = 0):
  """Fused decode attention on a forced plan: `splits` split-K blocks, a K/V ring of `stages` shared-memory stages
  (0: registers); None: the planner's choice. `key_warps` > 0: the tensor-core kernel takes the decode step, its warps
  over that many groups of each tile's keys (1: over 64 rows, as for a prompt; 4: the engine's decode form)."""
  from tinyvllm.kernels.attention import attention_shape, run_attention
  from tinyvllm.kernels.plan import decode_plan, tc_prefill_plan
  from tinyvllm.kernels.sources import kernel_source

  def attention(q, k_cache, v_cache, meta):
    shape, reason = attention_shape(q, k_cache, v_cache, meta, target)
    if shape is None or reason is not None or shape.query_len != 1: raise ValueError(f"not a fused decode shape: {reason}")
    plan = tc_prefill_plan(shape, key_warps) if key_warps else decode_plan(shape, target, splits=splits, stages=stages)
    source = kernel_source(target.dialect, plan.algorithm, plan.defines)
    return run_attention(shape, target, q, k_cache, v_cache, meta, plan_source=(plan, source))
  return attention


def bench_batch(target, device: str, batch: int, iters: int, variants: dict | None = None, mixed: bool = False,
                kv_fp8: bool = False, heads: int = 16, kvh: int = 8) -> dict:
  """Per-layer decode attention time, fused vs portable, for the Qwen3-0.6B shape. Each JIT call runs `layers`
  attention layers with their own caches (so the KV reads come from HBM, not L2) to keep the GPU busier than Python.
  Contexts ~1,024 (bucket 1,024), or with `mixed` uniform in [100, 2048] (bucket 2,048) as in the throughput workload.
  `kv_fp8`: FP8 E4M3 caches (random finite codes). `variants`: name -> decode_variant's keyword arguments (splits,
  stages), timed instead of fused vs portable; `heads`, `kvh`: query and KV heads (Qwen3-0.6B's by default)."""
  from tinygrad import Tensor, dtypes

  from tinyvllm.backend.metadata import AttentionMetadata
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.layers.attention import paged_attention
  from tinyvllm.worker.input_batch import launch_order
  d, bs, L = 128, 16, 2048 if mixed else 1024
  layers = 64 if batch <= 8 else 32 if batch <= 32 else 16
  rng = np.random.default_rng(batch)
  blocks = batch * (L // bs)
  ctx = (rng.integers(100, L + 1, batch) if mixed else rng.integers(L - 64, L + 1, batch)).astype(np.int32)
  qs = np.arange(batch + 1, dtype=np.int32)
  Tensor.manual_seed(batch)
  per_layer = []
  for _ in range(layers):
    table = rng.permutation(blocks).astype(np.int32).reshape(batch, L // bs)
    kc, vc = (Tensor.randint(blocks * bs, kvh * d, low=0, high=0x7E, device=device).cast(dtypes.uint8).contiguous().realize()
              if kv_fp8 else Tensor.rand(blocks * bs, kvh * d, dtype=dtypes.bfloat16, device=device).contiguous().realize()
              for _ in range(2))
    q = Tensor.rand(batch, heads, d, dtype=dtypes.bfloat16, device=device).contiguous().realize()
    ints = {k: Tensor(v, device=device).realize() for k, v in
            {"bt": table, "ctx": ctx, "qs": qs, "qi": np.arange(batch, dtype=np.int32).reshape(batch, 1),
             "qp": (ctx - 1).reshape(batch, 1), "oi": np.arange(batch, dtype=np.int32), "sm": np.full(batch, -1, np.int32),
             "order": launch_order(ctx)}.items()}
    meta = AttentionMetadata(ints["sm"], ints["bt"], ints["qi"], ints["qp"], ints["oi"], ints["ctx"], ints["qs"],
                             ints["qs"][1:] - ints["qs"][:-1], ints["order"], bs, L)
    per_layer.append((q, kc, vc, meta))
  backend = FusedBackend(target)
  fns = {"fused": backend.attention, "portable": paged_attention} if variants is None else \
    {name: decode_variant(target, **kw) for name, kw in variants.items()}
  res: dict = {"batch": batch, "mixed": mixed, "kv_fp8": kv_fp8, "layers": layers, "heads": heads, "kv_heads": kvh,
               "kv_bytes_per_layer": int(2 * ctx.sum() * kvh * d * (1 if kv_fp8 else 2))}
  outs = time_layers(fns, per_layer, device, iters, layers, res)
  if variants is not None:
    first = next(iter(variants))
    for name in variants:
      res[f"{name}_GBps"] = res["kv_bytes_per_layer"] / res[f"{name}_us_per_layer"] / 1e3
      res[f"{name}_err_vs_{first}"] = rel_err(outs[name], outs[first].astype(np.float64))
    return res
  res["speedup"] = res["portable_us_per_layer"] / res["fused_us_per_layer"]
  res["fused_GBps"] = res["kv_bytes_per_layer"] / res["fused_us_per_layer"] / 1e3
  res["err_fused_vs_portable"] = rel_err(outs["fused"], outs["portable"].astype(np.float64))
  res["fused_calls"] = backend.calls.most_common()
  return res


def time_layers(fns: dict, per_layer: list, device: str, iters: int, layers: int, res: dict) -> dict:
  """Time each attention function over all layers under TinyJit (3 warm-up replays); us per layer go into res as
  `<name>_us_per_layer`; returns each function's output."""
  from tinygrad import Device, Tensor, TinyJit
  outs = {}
  for name, fn in fns.items():
    jit = TinyJit(lambda fn=fn: Tensor.stack(*[fn(*x) for x in per_layer]).realize())
    for _ in range(3): jit()
    Device[device].synchronize()
    t = time.perf_counter()
    for _ in range(iters): jit()
    Device[device].synchronize()
    res[f"{name}_us_per_layer"] = (time.perf_counter() - t) / iters / layers * 1e6
    outs[name] = jit().float().numpy()
  return outs


def bench_prefill(target, device: str, name: str, seqs: list[tuple[int, int]], iters: int, layers: int = 4) -> dict:
  """Prefill / chunked-prefill attention, fused vs portable, Qwen3-0.6B shape (random data, own caches per layer)."""
  from tests.emulator.cases import make_case, metadata_tensors
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.layers.attention import paged_attention
  per_layer = []
  for i in range(layers):
    case = make_case(np.random.default_rng(100 + i), seqs, heads=16, kv_heads=8, head_dim=128, dtype="bfloat16")
    per_layer.append((dev_tensor(case.q, "bfloat16", device), dev_tensor(case.k_cache, "bfloat16", device),
                      dev_tensor(case.v_cache, "bfloat16", device), metadata_tensors(case, device)))
  fns = {"fused": FusedBackend(target).attention, "portable": paged_attention}
  new = sum(n for _, n in seqs)
  res: dict = {"name": name, "seqs": seqs, "new_tokens": new, "layers": layers}
  outs = {key: out[:, :new] for key, out in time_layers(fns, per_layer, device, iters, layers, res).items()}
  flops = sum(4 * n * (c - n + (n + 1) / 2) * 16 * 128 for c, n in seqs)   # QK^T and PV over the visible keys
  res["fused_TFLOPs"] = flops / res["fused_us_per_layer"] / 1e6
  res["speedup"] = res["portable_us_per_layer"] / res["fused_us_per_layer"]
  res["err_fused_vs_portable"] = rel_err(outs["fused"], outs["portable"].astype(np.float64))
  return res


def explore(target, device: str, batches: list[int], splits: list[int], iters: int, fp8_only: bool = False) -> list[dict]:
  """The automatic split count against forced ones, on uniform and on mixed contexts; FP8 variants (`fp8_only`: those
  alone)."""
  results = []
  for mixed in () if fp8_only else (False, True):
    for b in batches:
      variants = {"auto": {}, **{f"splits {sp}": {"splits": sp} for sp in splits}}
      r = bench_batch(target, device, b, iters, variants, mixed=mixed)
      results.append(r)
      print(f"batch {b:>3} {'mixed' if mixed else 'uniform'}: " +
            ", ".join(f"{k} {r[k + '_us_per_layer']:.1f} us ({r[k + '_GBps']:.0f} GB/s)" for k in variants), flush=True)
  for b, kv_fp8 in ((b, kv_fp8) for kv_fp8 in (True, False) for b in batches):   # mixed contexts: load order, splits
    variants = {"auto": {}, "registers": {"stages": 0}, "2 stages": {"stages": 2}, "3 stages": {"stages": 3}}
    r = bench_batch(target, device, b, iters, variants, mixed=True, kv_fp8=kv_fp8)
    results.append(r)
    print(f"batch {b:>3} mixed {'fp8' if kv_fp8 else 'bf16'}: " +
          ", ".join(f"{k} {r[k + '_us_per_layer']:.1f} us ({r[k + '_GBps']:.0f} GB/s)" for k in variants), flush=True)
  for b in () if fp8_only else batches:   # the planner's choice, bf16 against FP8 caches, mixed contexts (workload 2)
    for kv_fp8 in (False, True):
      r = bench_batch(target, device, b, iters, {"auto": {}}, mixed=True, kv_fp8=kv_fp8)
      results.append(r)
      print(f"batch {b:>3} mixed, {'fp8' if kv_fp8 else 'bf16'} cache: {r['auto_us_per_layer']:.1f} us/layer "
            f"({r['auto_GBps']:.0f} GB/s of KV)", flush=True)
  return results


def explore_gqa(target, device: str, batches: list[int], iters: int) -> list[dict]:
  """The decode kernel against the tensor-core kernel taking the decode step (its warps over the rows, as for a prompt,
  and over each tile's keys), by GQA group (Qwen3-0.6B's 2, Qwen3-8B's 4, Qwen3-30B-A3B's 8), mixed contexts (workload
  2), bf16 and FP8 caches."""
  results = []
  for (heads, kvh), kv_fp8, b in ((hk, f, b) for hk in ((16, 8), (32, 8), (32, 4)) for f in (False, True) for b in batches):
    variants = {"decode": {"key_warps": 0}, "tensor cores": {"key_warps": 1}, "tensor cores, warps over keys": {"key_warps": 4}}
    r = bench_batch(target, device, b, iters, variants, mixed=True, kv_fp8=kv_fp8, heads=heads, kvh=kvh)
    results.append(r)
    timings = (f"{k} {r[k + '_us_per_layer']:.1f} us ({r[k + '_GBps']:.0f} GB/s, error {r[k + '_err_vs_decode']:.2g})"
               for k in variants)
    print(f"G {heads // kvh} batch {b:>3} {'fp8' if kv_fp8 else 'bf16'}: " + ", ".join(timings), flush=True)
  return results


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batches", default="64,128,256")
  p.add_argument("--splits", default="1,2,4,8,16")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--fp8-only", action="store_true", help="only the FP8 cache variants")
  p.add_argument("--gqa", action="store_true", help="the decode kernel against the tensor-core one by GQA group")
  args = p.parse_args()
  from tinyvllm.kernels.tinygrad_program import device_target
  from tinyvllm.platform.device import select_device
  device = select_device(os.environ.get("DEV", "CUDA"))
  t = time.perf_counter()
  batches = [int(b) for b in args.batches.split(",")]
  results = explore_gqa(device_target(device), device, batches, args.iters) if args.gqa else \
    explore(device_target(device), device, batches, [int(s) for s in args.splits.split(",")], args.iters, args.fp8_only)
  print(f"explored in {time.perf_counter() - t:.0f} s", flush=True)
  if out := os.environ.get("OUT"): Path(out, "attention_explore.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
