#!/usr/bin/env python3
"""One-command GPU check of the hand-written attention kernels (docs/kernels.md).

  DEV=CUDA python bench/check_kernels.py --model /path/to/stories260K-hf

1. compiles every kernel specialisation the checks use (NVRTC on CUDA, MetalCompiler on METAL);
2. compares the fused kernels with the portable path on random paged batches: contexts 1..4000, block tables with
   holes / out of order / shared between sequences, GQA 1, 2, 4, 8 (and 7), head_dim 64 and 128 (and 8), decode with
   and without split-K, prefill and mixed batches with a cached prefix; outputs are poisoned with NaN before each run
   and must be fully written; the KV write; a TinyJit (CUDA graph) run of write + attention over several steps;
3. greedy-decodes stories260K through the engine with the hand-written backend and checks reference_greedy.json;
   the FP8 KV cache (bench/check_fp8.py): attention cases over FP8 codes, the write's codes, greedy Qwen3-shape decoding;
   the sampling kernel (bench/check_sample.py); the packed-weight (quantized) products (bench/check_quant.py); the
   logits products (bench/check_logits.py); the mixture-of-experts kernels against portable_moe at Qwen3-30B-A3B's
   shape, 1, 4 and 16 tokens (bench/check_moe.py);
4. times the fused decode against the portable path for the Qwen3-0.6B attention shape (16 q heads, 8 KV heads,
   head_dim 128, bf16, block 16, contexts ~1024) at batch 1, 8, 32, 128, 256;
5. (unless --no-e2e) batch-1 decode tok/s of the whole Qwen3-0.6B shape (random weights), both backends.
Everything goes to $OUT/kernels.json when OUT is set. It keeps going after a failure and ends with PASS or FAIL.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from attention_bench import bench_batch, bench_prefill, dev_tensor, rel_err  # noqa: E402  (bench/ is on sys.path)
from check_fp8 import check_kv_write_fp8, step_engine_fp8  # noqa: E402
from check_logits import check_logits  # noqa: E402
from check_moe import check_moe  # noqa: E402
from check_quant import check_quant  # noqa: E402
from check_sample import check_sample  # noqa: E402
from kernel_cases import build, case_list, plan_for  # noqa: E402

T_START = time.perf_counter()
RESULTS: dict = {"env": {}, "compile": [], "correctness": [], "jit": [], "engine": {}, "bench": [], "e2e": [], "failures": []}


def log(msg: str) -> None: print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def fail(where: str, msg: str) -> None:
  RESULTS["failures"].append(f"{where}: {msg}")
  log(f"FAIL {where}: {msg}")


def guarded(where: str, fn, *args, **kwargs):
  try: return fn(*args, **kwargs)
  except Exception as e:
    fail(where, f"{type(e).__name__}: {e}")
    traceback.print_exc(limit=6)
    sys.stdout.flush()
    return None


def save() -> None:
  if os.environ.get("OUT"):
    Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
    (Path(os.environ["OUT"]) / "kernels.json").write_text(json.dumps(RESULTS, indent=1, default=str))


# ---------------------------------------------------------------- helpers on the device

def host(t, dtype: str) -> np.ndarray:
  from tinygrad import dtypes

  from tests.emulator.cases import from_bits
  if dtype == "float32": return t.numpy().astype(np.float32)
  return from_bits(t.bitcast(dtypes.uint16).numpy(), dtype)


def poisoned(numel: int, dtype: str, device: str):
  from tinygrad import Tensor, dtypes
  dt = {"float32": dtypes.float32, "float16": dtypes.float16, "bfloat16": dtypes.bfloat16}[dtype]
  return Tensor.full((numel,), float("nan"), dtype=dt, device=device).contiguous().realize()


TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2.5e-2}   # max |a - b| / max |b|


# ---------------------------------------------------------------- 1. compile

def kernel_sources(target, cases: list[dict]) -> dict[str, str]:
  """The source of every case's attention kernel and of three KV writes (pure Python: plans and text)."""
  from tinyvllm.kernels.plan import write_plan
  from tinyvllm.kernels.sources import kernel_source
  sources = {}
  for i, spec in enumerate(cases):
    algo, plan = plan_for(build(spec, i), target, spec.get("splits"))
    sources[spec["name"]] = kernel_source(target.dialect, algo, plan.defines)
  for name, (dt, row) in {"write_bf16_1024": ("bfloat16", 1024), "write_f32_32": ("float32", 32),
                          "write_f16_256": ("float16", 256)}.items():
    sources[name] = kernel_source(target.dialect, "kv_write", write_plan(dt, row, 64, 4096).defines)
  return sources


def step_compile(target, device: str, cases: list[dict]) -> None:
  from tinyvllm.kernels.tinygrad_program import compile_source
  sources = kernel_sources(target, cases)
  for name, src in sources.items():
    t = time.perf_counter()
    lib = guarded(f"compile {name}", compile_source, device, src)
    if lib is not None:
      RESULTS["compile"].append({"name": name, "seconds": round(time.perf_counter() - t, 3), "bytes": len(lib)})
  log(f"compiled {len(RESULTS['compile'])}/{len(sources)} kernel sources")


# ---------------------------------------------------------------- 2. correctness

def run_fused_direct(target, device: str, case, splits=None) -> tuple[np.ndarray, dict]:
  """Run the plan's launches directly on poisoned outputs (and poisoned split-K scratch)."""
  from tinygrad import Tensor, dtypes

  from tinyvllm.kernels.attention import launch_attention
  from tinyvllm.kernels.sources import kernel_source
  sh, a = case.shape, case.arrays
  algo, plan = plan_for(case, target, splits)
  src = kernel_source(target.dialect, algo, plan.defines)
  q = dev_tensor(case.q.reshape(sh.num_tokens, -1), sh.dtype, device)
  kc, vc = dev_tensor(case.k_cache, case.kv_dtype, device), dev_tensor(case.v_cache, case.kv_dtype, device)
  ints = [Tensor(np.ascontiguousarray(a[k]), device=device).realize()
          for k in ("block_tables", "context_lens", "query_start", "row_order")]
  out = poisoned(sh.num_tokens * sh.num_heads * sh.head_dim, sh.dtype, device)
  info = {"kernel": algo, "splits": getattr(plan, "splits", None), "grid": [list(x.grid) for x in plan.launches]}
  numel = {p.name: p.numel for p in plan.launches[0].params}
  scratch = None if "part_o" not in numel else tuple(
    Tensor.full((numel[name],), float("nan"), dtype=dtypes.float32, device=device).contiguous().realize() for name in ("part_o", "part_ml"))
  out = launch_attention(plan, src, out, q, kc, vc, ints, scratch)
  out.realize()
  return host(out, sh.dtype).reshape(sh.num_tokens, -1), info


def run_portable(device: str, case) -> np.ndarray:
  from tests.emulator.cases import metadata_tensors
  from tinyvllm.layers.attention import paged_attention
  sh = case.shape
  q = dev_tensor(case.q.reshape(sh.num_tokens, -1), sh.dtype, device).reshape(sh.num_tokens, sh.num_heads, sh.head_dim)
  kc, vc = dev_tensor(case.k_cache, case.kv_dtype, device), dev_tensor(case.v_cache, case.kv_dtype, device)
  return host(paged_attention(q, kc, vc, metadata_tensors(case, device)).realize(), sh.dtype).reshape(sh.num_tokens, -1)


def check_case(target, device: str, spec: dict, seed: int) -> None:
  from tests.emulator.cases import reference_attention
  case = build(spec, seed)
  sh, n = case.shape, case.total_tokens
  t = time.perf_counter()
  got, info = run_fused_direct(target, device, case, spec.get("splits"))
  want = run_portable(device, case)
  rec = {"name": spec["name"], **info, "S": sh.num_seqs, "N": sh.num_tokens, "Tq": sh.query_len, "L": sh.context_len}
  problems = []
  if np.isnan(got).any(): problems.append(f"{int(np.isnan(got).sum())} output elements unwritten (NaN poison)")
  if not np.all(got[n:] == 0): problems.append("padding rows not zero")
  rec["err_vs_portable"] = rel_err(got[:n], want[:n].astype(np.float64))
  if rec["err_vs_portable"] > TOL[sh.dtype]: problems.append(f"vs portable {rec['err_vs_portable']:.3g} > {TOL[sh.dtype]}")
  if sum(new * ctx for ctx, new in case.seqs) * sh.num_heads < 4e6:   # float64 reference where it is cheap
    ref = reference_attention(case)
    rec["err_fused_vs_f64"], rec["err_portable_vs_f64"] = rel_err(got[:n], ref), rel_err(want[:n], ref)
    if rec["err_fused_vs_f64"] > TOL[sh.dtype]: problems.append(f"vs float64 {rec['err_fused_vs_f64']:.3g}")
  rec["seconds"], rec["ok"] = round(time.perf_counter() - t, 2), not problems
  RESULTS["correctness"].append(rec)
  extra = f", vs float64 {rec['err_fused_vs_f64']:.2e} (portable {rec['err_portable_vs_f64']:.2e})" if "err_fused_vs_f64" in rec else ""
  log(f"{'ok  ' if not problems else 'FAIL'} {spec['name']}: {info['kernel']} splits={info['splits']} grid={info['grid']} "
      f"err vs portable {rec['err_vs_portable']:.2e}{extra}")
  if problems: fail(spec["name"], "; ".join(problems))


def check_kv_write(target, device: str) -> None:
  from tinygrad import Tensor

  from tests.emulator.cases import round_to
  from tinyvllm.kernels.fused import FusedBackend
  backend = FusedBackend(target)
  for dt, kvh, d in (("bfloat16", 8, 128), ("float32", 4, 8), ("float16", 2, 64)):
    rng = np.random.default_rng(11)
    row, slots, n = kvh * d, 4096, 64
    kc, vc = (round_to(rng.standard_normal((slots, row)), dt) for _ in range(2))
    k, v = (round_to(rng.standard_normal((n, row)), dt) for _ in range(2))
    slot_mapping = rng.permutation(slots)[:n].astype(np.int32)
    slot_mapping[::7] = -1
    kt, vt = dev_tensor(kc, dt, device), dev_tensor(vc, dt, device)
    k2, v2 = backend.write_kv(kt, vt, dev_tensor(k, dt, device).reshape(n, kvh, d), dev_tensor(v, dt, device).reshape(n, kvh, d),
                              Tensor(slot_mapping, device=device).realize())
    Tensor.realize(k2, v2)
    want_k, want_v = kc.copy(), vc.copy()
    ok = slot_mapping >= 0
    want_k[slot_mapping[ok]], want_v[slot_mapping[ok]] = k[ok], v[ok]
    good = np.array_equal(host(k2, dt), want_k) and np.array_equal(host(v2, dt), want_v) \
      and np.array_equal(host(kt, dt), want_k)   # written in place: the original tensor's buffer holds it too
    RESULTS["correctness"].append({"name": f"kv_write_{dt}_kvh{kvh}_d{d}", "ok": good, "calls": dict(backend.calls)})
    log(f"{'ok  ' if good else 'FAIL'} kv_write {dt} kv_heads={kvh} head_dim={d}")
    if not good: fail(f"kv_write {dt}", "cache contents differ from the expected scatter")


def check_jit(target, device: str, name: str, seqs_per_step: list[list[tuple[int, int]]], heads: int, kv_heads: int,
              head_dim: int, dtype: str) -> None:
  """write_kv + attention under TinyJit (captured into a CUDA graph), several steps with new data each: catches missing
  dependencies between the kernels (stale reads) and anything that differs between eager, capture and replay."""
  from tinygrad import Tensor, TinyJit

  from tests.emulator.cases import make_case, reference_attention, round_to
  from tinyvllm.backend.metadata import AttentionMetadata
  from tinyvllm.kernels.fused import FusedBackend
  backend = FusedBackend(target)
  rng = np.random.default_rng(21)
  cases = [make_case(rng, seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, extra_blocks=40) for seqs in seqs_per_step]
  slots = max(c.shape.num_slots for c in cases)
  kc_host = round_to(rng.standard_normal((slots, kv_heads * head_dim)), dtype)
  vc_host = round_to(rng.standard_normal((slots, kv_heads * head_dim)), dtype)
  kc, vc = dev_tensor(kc_host, dtype, device), dev_tensor(vc_host, dtype, device)
  meta_shape = cases[0].shape

  @TinyJit
  def step(q, k, v, slot_mapping, block_tables, query_index, context_lens, query_start, row_order):
    meta = AttentionMetadata(slot_mapping, block_tables, query_index, query_index, slot_mapping, context_lens, query_start,
                             query_start[1:] - query_start[:-1], row_order, meta_shape.block_size, meta_shape.context_len)
    k2, v2 = backend.write_kv(kc, vc, k, v, slot_mapping)
    out = backend.attention(q, k2, v2, meta)
    Tensor.realize(out, k2, v2)
    return out

  errs = []
  for case in cases:
    assert case.shape.num_tokens == meta_shape.num_tokens and case.shape.context_len == meta_shape.context_len
    a, n = case.arrays, case.total_tokens
    # the new tokens' K/V: written by the kernel inside the step, then read by attention
    k_new = round_to(rng.standard_normal((case.shape.num_tokens, kv_heads * head_dim)), dtype)
    v_new = round_to(rng.standard_normal((case.shape.num_tokens, kv_heads * head_dim)), dtype)
    ok = a["slot_mapping"] >= 0
    kc_host[a["slot_mapping"][ok]], vc_host[a["slot_mapping"][ok]] = k_new[ok], v_new[ok]
    case.k_cache, case.v_cache = kc_host[:case.shape.num_slots], vc_host[:case.shape.num_slots]
    nt = case.shape.num_tokens
    args = [dev_tensor(case.q, dtype, device), dev_tensor(k_new.reshape(nt, kv_heads, head_dim), dtype, device),
            dev_tensor(v_new.reshape(nt, kv_heads, head_dim), dtype, device)]
    args += [Tensor(np.ascontiguousarray(a[k_]), device=device).realize()
             for k_ in ("slot_mapping", "block_tables", "query_index", "context_lens", "query_start", "row_order")]
    out = host(step(*args), dtype).reshape(case.shape.num_tokens, -1)
    errs.append(rel_err(out[:n], reference_attention(case)))
  good = all(e <= TOL[dtype] for e in errs)
  RESULTS["jit"].append({"name": name, "errors": errs, "ok": good, "calls": dict(backend.calls)})
  log(f"{'ok  ' if good else 'FAIL'} jit {name}: errors per step {[f'{e:.1e}' for e in errs]} (paths {dict(backend.calls)})")
  if not good: fail(f"jit {name}", f"step errors {errs}")


def step_correctness(target, device: str, cases: list[dict]) -> None:
  for i, spec in enumerate(cases): guarded(spec["name"], check_case, target, device, spec, i)
  guarded("kv_write", check_kv_write, target, device)
  record = guarded("kv_write fp8", check_kv_write_fp8, target, device)
  RESULTS["correctness"].append(record or {"name": "kv_write_fp8", "ok": False})
  log(f"{'ok  ' if record else 'FAIL'} kv_write fp8 (bf16 -> E4M3 codes, fused and portable)")
  steps = [[(int(c), 1) for c in np.random.default_rng(s).integers(1, 1000, 6)] for s in range(4)]
  for st in steps: st[0] = (1000, 1)   # same context bucket in every step (one capture)
  guarded("jit decode", check_jit, target, device, "decode_bf16_qwen3", steps, 16, 8, 128, "bfloat16")
  # every step: S 4, N 32, Tq 32, L 1024 (one layout, one capture)
  steps = [[(1000, 1), (300, 30), (17, 1)], [(900, 20), (40, 10), (2, 1)], [(1000, 1), (64, 17), (5, 5)], [(700, 25), (10, 1), (33, 2)]]
  guarded("jit mixed", check_jit, target, device, "mixed_bf16_qwen3", steps, 16, 8, 128, "bfloat16")


# ---------------------------------------------------------------- 3. engine

def step_engine(model: str | None, device: str, backend_name: str, tp: int = 1) -> None:
  if not model:
    fail("engine", "no --model given (the stories260K-hf folder)")
    return
  folder = Path(model)
  if not (folder / "reference_greedy.json").is_file():
    fail("engine", f"{folder}/reference_greedy.json not found")
    return
  from tinyvllm import LLM, SamplingParams
  ref = json.loads((folder / "reference_greedy.json").read_text())
  t = time.perf_counter()
  llm = LLM(str(folder), device=device, max_num_seqs=8, num_gpu_blocks=256, attention_backend=backend_name,
            tensor_parallel_size=tp)
  backend = llm.engine.model.backend
  out = llm.generate([ref["prompt_ids"]], SamplingParams(temperature=0, max_tokens=len(ref["greedy_ids"])), use_tqdm=False)[0]
  same = out.outputs[0].token_ids == ref["greedy_ids"]
  zoo = llm.generate("Zoo", SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
  zoo_same = zoo.prompt_token_ids + zoo.outputs[0].token_ids == ref["zoo"]["greedy_ids_64"]
  calls = dict(getattr(backend, "calls", {}))
  fallbacks = {k: v for k, v in calls.items() if k.startswith("portable")}
  RESULTS["engine"] = {"backend": backend.describe(), "greedy_ok": same, "zoo_ok": zoo_same, "calls": calls,
                       "tensor_parallel_size": tp, "seconds": round(time.perf_counter() - t, 1)}
  note = f"; head_dim 8 fell back to the portable path: {fallbacks}" if fallbacks else "; no portable fallback"
  log(f"{'ok  ' if same and zoo_same else 'FAIL'} engine stories260K greedy ({len(ref['greedy_ids'])} tokens) with "
      f"{backend.describe()}: matches={same}, zoo={zoo_same}, kernel calls {calls}{note}")
  if not same:
    got = out.outputs[0].token_ids
    want = ref["greedy_ids"]
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    fail("engine greedy", f"differs from reference_greedy.json at token {first}")
  if not zoo_same: fail("engine zoo", "the 'Zoo' prompt's greedy ids differ from the reference")
  if backend.name not in ("cuda", "metal"): fail("engine", f"the engine did not select the hand-written backend ({backend.describe()})")


def step_fp8_engine(device: str, dialect: str) -> None:
  RESULTS["engine_fp8"] = step_engine_fp8(device, dialect)
  log(f"ok   engine with an FP8 KV cache, {dialect} kernels against the portable path: {RESULTS['engine_fp8']}")


# ---------------------------------------------------------------- 4. benchmark

def step_prefill_bench(target, device: str, iters: int) -> None:
  for name, seqs in (("chunk 512 after a 1536 prefix", [(2048, 512)]), ("4 prompts of 256", [(256, 256)] * 4),
                     ("mixed: 31 decodes ~1000 + chunk 256", [(1000, 1)] * 31 + [(768, 256)])):
    r = guarded(f"prefill bench {name}", bench_prefill, target, device, name, seqs, iters)
    if r is None: continue
    RESULTS.setdefault("bench_prefill", []).append(r)
    log(f"prefill bench {name}: fused {r['fused_us_per_layer']:.1f} us/layer ({r['fused_TFLOPs']:.1f} TFLOP/s), portable "
        f"{r['portable_us_per_layer']:.1f} us/layer, speedup {r['speedup']:.2f}x, max diff {r['err_fused_vs_portable']:.1e}")
    if r["err_fused_vs_portable"] > TOL["bfloat16"]:
      fail(f"prefill bench {name}", f"fused and portable differ by {r['err_fused_vs_portable']:.3g}")


def step_bench(target, device: str, batches: list[int], iters: int) -> None:
  for b in batches:
    r = guarded(f"bench batch {b}", bench_batch, target, device, b, iters)
    if r is None: continue
    RESULTS["bench"].append(r)
    log(f"bench batch {b:>3}: fused {r['fused_us_per_layer']:8.1f} us/layer ({r['fused_GBps']:6.0f} GB/s of KV), portable "
        f"{r['portable_us_per_layer']:8.1f} us/layer, speedup {r['speedup']:5.2f}x, max diff {r['err_fused_vs_portable']:.1e}")
    if r["err_fused_vs_portable"] > TOL["bfloat16"]:
      fail(f"bench batch {b}", f"fused and portable differ by {r['err_fused_vs_portable']:.3g}")


def step_e2e(device: str, dialect: str, tp: int = 1) -> None:
  from tinyvllm.bench.decode import run_decode_bench
  from tinyvllm.config import EngineConfig
  from tinyvllm.engine.llm_engine import LLMEngine
  for backend in (dialect, "portable"):
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model="qwen3-0.6b", load_format="dummy", device=device, max_model_len=1024,
                                    max_num_seqs=8, num_gpu_blocks=512, attention_backend=backend, tensor_parallel_size=tp))
    r = run_decode_bench(engine, batch=1, prompt_len=128, new_tokens=64, no_kv_cache=False)[0]
    RESULTS["e2e"].append({"backend": backend, "tensor_parallel_size": tp, "tok_s": r.decode_tok_s,
                           "ms_per_step": r.decode_s / (r.new_tokens - 1) * 1e3,
                           "seconds": round(time.perf_counter() - t, 1)})
    log(f"e2e qwen3-0.6b (random weights) batch 1, {backend}: {r.line()}")
    del engine


# ---------------------------------------------------------------- main

def main() -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", help="the stories260K-hf folder (holds reference_greedy.json)")
  p.add_argument("--device", default=os.environ.get("DEV", "CUDA"), help="tinygrad device (default $DEV, else CUDA)")
  p.add_argument("--quick", action="store_true", help="fewer correctness cases")
  p.add_argument("--batches", default="1,8,32,128,256", help="decode batch sizes to time")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--no-e2e", action="store_true", help="skip the whole-model decode timing")
  p.add_argument("--tensor-parallel-size", type=int, default=1,
                 help="run the engine checks (stories260K's reference, e2e) with the model split over this many GPUs")
  p.add_argument("--skip", default="",
                 help="comma list of steps to skip: compile,correctness,engine,engine-fp8,sample,quant,logits,moe,bench,prefill-bench,e2e")
  args = p.parse_args()
  skip = set(filter(None, args.skip.split(","))) | ({"e2e"} if args.no_e2e else set())

  from tinyvllm.kernels.tinygrad_program import device_target
  from tinyvllm.platform.device import select_device
  device = select_device(args.device)
  target = device_target(device)
  dialect = target.dialect
  RESULTS["env"] = {"device": device, "dialect": dialect, "arch": target.arch, "sms": target.multiprocessors, "argv": sys.argv}
  try:
    import subprocess
    RESULTS["env"]["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
  except Exception: pass
  log(f"device {device} ({RESULTS['env'].get('gpu', '?')}), kernel dialect {dialect}, arch {RESULTS['env']['arch']}")
  if dialect is None:
    fail("setup", f"no hand-written kernels for {device}: run with DEV=CUDA (or on METAL)")
  else:
    cases = case_list(args.quick)
    steps = [("compile", lambda: step_compile(target, device, cases)),
             ("correctness", lambda: step_correctness(target, device, cases)),
             ("engine", lambda: step_engine(args.model, device, dialect, args.tensor_parallel_size)),
             ("engine-fp8", lambda: step_fp8_engine(device, dialect)),
             ("sample", lambda: log(f"ok   sampling kernel: {RESULTS.setdefault('sample', check_sample(device))}")),
             ("quant", lambda: log(f"ok   packed-weight products: {RESULTS.setdefault('quant', check_quant(target, device))}")),
             ("logits", lambda: log(f"ok   wide products (logits): {RESULTS.setdefault('logits', check_logits(target, device))}")),
             ("moe", lambda: log(f"ok   mixture of experts: {RESULTS.setdefault('moe', check_moe(target, device))}")),
             ("bench", lambda: step_bench(target, device, [int(b) for b in args.batches.split(",") if b], args.iters)),
             ("prefill-bench", lambda: step_prefill_bench(target, device, args.iters)),
             ("e2e", lambda: step_e2e(device, dialect, args.tensor_parallel_size))]
    for name, fn in steps:
      if name in skip: continue
      log(f"==== {name}")
      guarded(name, fn)
      save()
  if RESULTS["bench"]:
    print("\n batch | fused us/layer | portable us/layer | speedup | fused KV GB/s", flush=True)
    for r in RESULTS["bench"]:
      print(f" {r['batch']:>5} | {r['fused_us_per_layer']:14.1f} | {r['portable_us_per_layer']:17.1f} | {r['speedup']:6.2f}x | "
            f"{r['fused_GBps']:8.0f}", flush=True)
  for r in RESULTS.get("bench_prefill", []):
    print(f" prefill {r['name']}: fused {r['fused_us_per_layer']:.1f} us/layer, portable {r['portable_us_per_layer']:.1f}, "
          f"{r['speedup']:.2f}x", flush=True)
  for r in RESULTS["e2e"]: print(f" e2e batch-1 decode, {r['backend']}: {r['tok_s']:.1f} tok/s ({r['ms_per_step']:.2f} ms/step)")
  n_ok = sum(r.get("ok", False) for r in RESULTS["correctness"] + RESULTS["jit"])
  n_all = len(RESULTS["correctness"]) + len(RESULTS["jit"])
  RESULTS["passed"] = not RESULTS["failures"]
  save()
  print(f"\ncorrectness {n_ok}/{n_all} ok; compiled {len(RESULTS['compile'])}; engine {RESULTS['engine'].get('greedy_ok')}; "
        f"{time.perf_counter() - T_START:.0f}s", flush=True)
  if RESULTS["failures"]:
    print(f"FAIL: {len(RESULTS['failures'])} failure(s):", flush=True)
    for f in RESULTS["failures"]: print(f"  - {f}", flush=True)
    return 1
  print("PASS", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
