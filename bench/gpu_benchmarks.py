"""The GPU benchmark suite of docs/benchmarks.md, in one process: each part in its own engine, results appended to
$OUT/bench_<part>.json as soon as it finishes (a timeout keeps what was done).

Usage (on the GPU machine, from the repo root): DEV=CUDA python bench/gpu_benchmarks.py decode throughput prefill context peers
Parts: decode, decode_quant, throughput, coldstart, startup, prefill, context, peers, serve (see docs/benchmarks.md for what each measures).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# overridable for a smoke test on the CPU (a small config folder, float32)
MODEL = os.environ.get("BENCH_MODEL", "qwen3-0.6b")
DTYPE = os.environ.get("BENCH_DTYPE", "bfloat16")
KV_CACHE_DTYPE = os.environ.get("BENCH_KV_CACHE_DTYPE", "auto")   # fp8: the E4M3 KV cache (results saved as *_fp8.json)
COMMON = dict(load_format="dummy", dtype=DTYPE, enable_prefix_caching=False, kv_cache_dtype=KV_CACHE_DTYPE)
# the persistent decode-layer kernel's context bound for every row count (e.g. very large: it takes every context)
if bound := os.environ.get("BENCH_DECODE_LAYER_MAX_CONTEXT"): COMMON["decode_layer_max_context"] = int(bound)
QUANTIZATION = os.environ.get("BENCH_QUANTIZATION")   # int8, int4, fp8: the linears quantized at load (results *_int8.json)
if QUANTIZATION: COMMON["quantization"] = QUANTIZATION
SMALL = os.environ.get("BENCH_SMALL") == "1"   # a CPU smoke test: small caches and sweeps


def kv_gib(gib: float) -> float: return 0.05 if SMALL else gib


def save(part: str, result: dict) -> None:
  print(json.dumps(result)[:2000], flush=True)
  suffix = ("" if KV_CACHE_DTYPE == "auto" else f"_{KV_CACHE_DTYPE}") + (f"_{QUANTIZATION}" if QUANTIZATION else "")
  if out := os.environ.get("OUT"): Path(out, f"bench_{part}{suffix}.json").write_text(json.dumps(result, indent=1))


def engine(model: str = MODEL, **kwargs):
  from tinyvllm import LLM
  t0 = time.perf_counter()
  llm = LLM(model, **{**COMMON, **kwargs})
  return llm, time.perf_counter() - t0


def weight_bytes(llm) -> int:
  """Bytes of weights one decode step reads (a tied embedding table counts once: the lm_head reads it whole)."""
  weights, seen, total = llm.engine.model.weights, set(), 0
  for t in weights.tensors():
    if id(t) not in seen and t is not weights.rope_cos and t is not weights.rope_sin:
      seen.add(id(t))
      total += t.nbytes()
  return total


def part_decode() -> dict:
  from tinyvllm.bench.decode import run_decode_bench
  llm, load_s = engine(kv_cache_memory=kv_gib(8), max_model_len=4096, max_num_seqs=64)
  wbytes, kv_per_token = weight_bytes(llm), llm.engine.kv_cache.bytes_per_token(llm.engine.model_config, llm.engine.kv_dtype)
  rows = []
  for prompt_len in (128, 2048):
    t0 = time.perf_counter()
    r = run_decode_bench(llm.engine, 1, prompt_len, 256, no_kv_cache=False)[0]
    avg_context = prompt_len + 128
    step_s = r.decode_s / (r.new_tokens - 1)
    rows.append({"prompt_len": prompt_len, "new_tokens": 256, "decode_tok_s": r.decode_tok_s, "step_ms": step_s * 1e3,
                 "prefill_ms": r.prefill_s * 1e3, "gb_s": (wbytes + avg_context * kv_per_token) / step_s / 1e9,
                 "median_step_ms": r.median_step_ms, "slowest_step_ms": max(r.step_s) * 1e3, "slow_steps": r.slow_steps,
                 "bench_wall_s": time.perf_counter() - t0})
    print(r.line(), f"{rows[-1]['gb_s']:.0f} GB/s; median step {r.median_step_ms:.3f} ms, slowest {max(r.step_s) * 1e3:.2f} ms, "
          f"{r.slow_steps} over twice the median", flush=True)
  return {"load_s": load_s, "start_up_captures_s": llm.engine.warm_up_seconds, "weight_bytes": wbytes, "kv_bytes_per_token": kv_per_token,
          "attention_backend": llm.engine.model.backend.describe(), "rows": rows}


def part_decode_quant() -> dict:
  """Batch-1 decode (prompt 128, 256 new tokens) of Qwen3-0.6B and Llama-3.2-1B (BENCH_QUANT_MODELS) with the linears
  unquantized and quantized at load (int8, fp8, int4), each in its own engine capturing the batch-1 decode step only;
  where the persistent layer kernel took the quantized steps, again with the per-op kernels for comparison."""
  from tinyvllm.bench.decode import run_decode_bench
  rows = []
  for model in os.environ.get("BENCH_QUANT_MODELS", "qwen3-0.6b,llama-3.2-1b").split(","):
    for quantization in (None, "int8", "fp8", "int4"):
      for layer_kernel in (True, False):
        llm, load_s = engine(model, quantization=quantization, kv_cache_memory=kv_gib(4), max_model_len=4096, max_num_seqs=4,
                             cuda_graph_sizes=[1], decode_layer_kernel=layer_kernel)
        r = run_decode_bench(llm.engine, 1, 128, 256, no_kv_cache=False)[0]
        calls = dict(llm.engine.model.backend.calls)
        rows.append({"model": model, "quantization": quantization, "decode_layer_kernel": layer_kernel,
                     "layer_kernel_ran": calls.get("decode-layers", 0) > 0, "decode_tok_s": r.decode_tok_s,
                     "median_step_ms": r.median_step_ms, "weight_bytes": weight_bytes(llm), "load_s": load_s})
        print(f"{model} {quantization or 'bf16'} ({'layer kernel' if rows[-1]['layer_kernel_ran'] else 'per-op kernels'}): "
              f"{r.decode_tok_s:,.0f} tok/s, median step {r.median_step_ms:.3f} ms, {rows[-1]['weight_bytes'] / 1e6:,.0f} MB "
              "of weights a step", flush=True)
        del llm
        gc.collect()
        if not rows[-1]["layer_kernel_ran"] or quantization is None: break   # (no per-op run to compare with)
  return {"rows": rows}


def part_throughput() -> dict:
  from tinyvllm.bench.throughput import nano_vllm_workload, run_throughput
  # 8,192 tokens a step, as vLLM's offline default on this class of GPU (16,384) is also well above our 2,048
  llm, load_s = engine(kv_cache_memory=kv_gib(40), max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192)
  runner = llm.engine.runner
  vocab, warmup_requests = llm.engine.model_config.vocab_size, int(os.environ.get("BENCH_WARMUP_REQUESTS", "256"))
  r = run_throughput(llm, nano_vllm_workload(vocab), [nano_vllm_workload(vocab, warmup_requests, seed=1)])   # another seed
  print(r.line(), f"(whole run incl. warm-up: {runner.num_captures} step layouts captured in {runner.capture_seconds:.1f} s)",
        flush=True)
  return {"load_s": load_s, "start_up_captures_s": llm.engine.warm_up_seconds,
          "warmup_requests": warmup_requests,
          "requests": r.requests, "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens,
          "seconds": r.seconds, "output_tok_s": r.output_tok_s, "preemptions": llm.engine.scheduler.num_preemptions,
          "captures": runner.num_captures, "capture_s": runner.capture_seconds}


def part_coldstart() -> dict:
  """The issue's cold start: engine start-up, then the first LLM.generate of 256 requests (prompts 100-1024 tokens, 512
  output tokens each, greedy) and a second identical in shape; a user's defaults otherwise (no warm-up of our own)."""
  import numpy as np

  from tinyvllm import SamplingParams
  llm, load_s = engine(kv_cache_memory=kv_gib(40), max_model_len=4096, max_num_seqs=256)
  vocab = min(10000, llm.engine.model_config.vocab_size)

  def run(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, int(rng.integers(100, 1025))).tolist() for _ in range(256)]
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    captures, capture_s = llm.engine.runner.num_captures, llm.engine.runner.capture_seconds
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "new_captures": llm.engine.runner.num_captures - captures, "capture_s": llm.engine.runner.capture_seconds - capture_s}
  start_up_captures = llm.engine.runner.num_captures
  first, second = run(0), run(1)
  print(f"start-up {load_s:.1f} s; first generate {first['output_tok_s']:,.0f} output tok/s ({first['new_captures']} captures, "
        f"{first['capture_s']:.1f} s), second {second['output_tok_s']:,.0f} ({second['new_captures']} captures): "
        f"first / second = {first['output_tok_s'] / second['output_tok_s']:.3f}", flush=True)
  return {"load_s": load_s, "start_up_captures_s": llm.engine.warm_up_seconds, "start_up_captures": start_up_captures,
          "first": first, "second": second,
          "first_over_second": first["output_tok_s"] / second["output_tok_s"]}


def part_startup() -> dict:
  """Engine start-up alone, configured as coldstart's; run after it, in a process of its own, it is the second start
  (the kernels it compiled are in tinygrad's disk cache)."""
  llm, load_s = engine(kv_cache_memory=kv_gib(40), max_model_len=4096, max_num_seqs=256)
  runner = llm.engine.runner
  print(f"start-up {load_s:.1f} s ({runner.num_captures} step layouts captured in {llm.engine.warm_up_seconds:.1f} s)", flush=True)
  return {"load_s": load_s, "start_up_captures_s": llm.engine.warm_up_seconds, "captures": runner.num_captures}


def part_prefill() -> dict:
  """BENCH_PREFILL_BACKENDS (default "auto,portable") and BENCH_PREFILL_LENGTHS pick the sweep."""
  from tinyvllm.bench.prefill import run_prefill_sweep
  out = {}
  for backend in os.environ.get("BENCH_PREFILL_BACKENDS", "auto,portable").split(","):
    llm, _ = engine(kv_cache_memory=kv_gib(4), max_model_len=8192 + 16, max_num_batched_tokens=8192, max_num_seqs=8,
                    attention_backend=backend)
    lengths = [64, 256] if SMALL else [int(n) for n in os.environ.get("BENCH_PREFILL_LENGTHS", "256,512,1024,2048,4096,8192").split(",")]
    try: results = run_prefill_sweep(llm, lengths)
    except Exception as e:  # the naive path may run out of memory at the longest prompts: keep what ran
      print(f"prefill sweep ({backend}) stopped: {e!r}", flush=True)
      results = []
    out[backend] = [{"prompt_len": r.prompt_len, "ms": r.seconds * 1e3, "peak_extra_mib": r.peak_extra_bytes / 2**20}
                    for r in results]
    del llm
    gc.collect()
  return out


def part_context() -> dict:
  from tinyvllm.bench.context import run_context_sweep
  llm, _ = engine(kv_cache_memory=kv_gib(36), max_model_len=8192 + 64, max_num_seqs=64, enable_prefix_caching=True)
  contexts = [64, 256] if SMALL else [128, 256, 512, 1024, 2048, 4096, 8192]
  return {f"batch{b}": [{"context": r.context, "tok_s": r.tok_s, "step_ms": r.step_ms}
                        for r in run_context_sweep(llm, b, contexts)] for b in ((1, 4) if SMALL else (1, 32))}


def part_peers() -> dict:
  import peers  # bench/peers.py (this script's folder is on sys.path)
  out: dict = {}
  for name, fn in (("hf_batch1", lambda: peers.hf_generate(MODEL, 1)), ("hf_batch64", lambda: peers.hf_generate(MODEL, 64)),
                   ("hf_batch256", lambda: peers.hf_generate(MODEL, 256)), ("tinygrad_llm", lambda: peers.tinygrad_llm(MODEL))):
    try:
      r = fn()
      out[name] = {"batch": r.batch, "tok_s": r.tok_s, "seconds": r.seconds}
      print(r.line(), flush=True)
    except Exception as e:
      out[name] = {"error": repr(e)}
      print(f"{name} failed: {e!r}", flush=True)
    gc.collect()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available(): sys.modules["torch"].cuda.empty_cache()
  return out


def serve_workload3(rate: str, *flags: str, clients: int = 1) -> dict:
  """Workload 3: 500 prompts of 512 random tokens, 128 output tokens, streamed over HTTP, arriving at `rate` requests/s
  (inf: all at once); `flags` and BENCH_SERVE_ARGS add server flags. With `clients` > 1, that many client processes
  each send their own 500 (differently seeded) at once: one Python client tops out near 15,000 streamed tokens a
  second, which hides what a server beyond that can do; the result sums their tokens over the longest duration."""
  port = 8765
  server = subprocess.Popen([sys.executable, "main.py", "serve", MODEL, "--load-format", "dummy", "--dtype", DTYPE,
                             "--port", str(port), "--kv-cache-memory", "40", "--max-num-seqs", "256", "--max-model-len", "4096",
                             *flags, *os.environ.get("BENCH_SERVE_ARGS", "").split()], cwd=REPO)
  try:
    tag = f"{rate}{''.join(flags).replace('-', '_')}{f'_{clients}clients' if clients > 1 else ''}"
    files = [Path(os.environ.get("OUT", "/tmp"), f"bench_serve_raw_{tag}{f'_{i}' if i else ''}.json") for i in range(clients)]
    cmds = [[sys.executable, "main.py", "bench", "serve", "--url", f"http://127.0.0.1:{port}", "--num-prompts", "500",
             "--input-len", "512", "--output-len", "128", "--request-rate", rate, "--result-file", str(f), "--seed", str(i),
             "--disable-tqdm"] for i, f in enumerate(files)]
    for _ in range(600):
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
          if r.status == 200: break
      except OSError: pass
      if server.poll() is not None: raise RuntimeError(f"the server exited with {server.returncode}")
      time.sleep(1)
    running = [subprocess.Popen(cmd, cwd=REPO) for cmd in cmds]
    if any(p.wait() != 0 for p in running): raise RuntimeError("a benchmark client failed")
    results = [json.loads(f.read_text()) for f in files]
    if clients == 1: return results[0]
    duration = max(r["duration_s"] for r in results)
    return {"clients": clients, "completed": sum(r["completed"] for r in results), "failed": sum(r["failed"] for r in results),
            "duration_s": duration, "output_throughput": sum(r["total_output_tokens"] for r in results) / duration,
            "median_ttft_ms": [r["median_ttft_ms"] for r in results], "median_tpot_ms": [r["median_tpot_ms"] for r in results]}
  finally:
    server.terminate()
    server.wait(timeout=60)


def part_serve() -> dict: return serve_workload3("inf")
def part_serve16() -> dict: return serve_workload3("16")
def part_serve_dp2() -> dict: return serve_workload3("inf", "--data-parallel-size", "2")
def part_serve_2clients() -> dict: return serve_workload3("inf", clients=2)
def part_serve_dp2_2clients() -> dict: return serve_workload3("inf", "--data-parallel-size", "2", clients=2)
def part_serve_asc2() -> dict: return serve_workload3("inf", "--api-server-count", "2")
def part_serve_asc2_2clients() -> dict: return serve_workload3("inf", "--api-server-count", "2", clients=2)
def part_serve_dp2_asc4_4clients() -> dict:
  return serve_workload3("inf", "--data-parallel-size", "2", "--api-server-count", "4", clients=4)
def part_serve_asc4_2clients() -> dict: return serve_workload3("inf", "--api-server-count", "4", clients=2)
def part_serve_asc4_16k() -> dict:   # the serving target's configuration: 4 API servers, 16,384-token steps
  return serve_workload3("inf", "--api-server-count", "4", "--max-num-batched-tokens", "16384")
def part_serve_dp2_asc8_4clients() -> dict:   # each replica with what serve_asc4_2clients gives one: 4 servers, 2 clients
  return serve_workload3("inf", "--data-parallel-size", "2", "--api-server-count", "8", clients=4)


PARTS = {"decode": part_decode, "decode_quant": part_decode_quant, "throughput": part_throughput,
         "coldstart": part_coldstart, "startup": part_startup,
         "prefill": part_prefill, "context": part_context,
         "peers": part_peers, "serve": part_serve, "serve16": part_serve16,
         "serve_dp2": part_serve_dp2, "serve_2clients": part_serve_2clients, "serve_dp2_2clients": part_serve_dp2_2clients,
         "serve_asc2": part_serve_asc2, "serve_asc2_2clients": part_serve_asc2_2clients,
         "serve_dp2_asc4_4clients": part_serve_dp2_asc4_4clients, "serve_asc4_2clients": part_serve_asc4_2clients,
         "serve_dp2_asc8_4clients": part_serve_dp2_asc8_4clients, "serve_asc4_16k": part_serve_asc4_16k}


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("parts", nargs="+", choices=list(PARTS))
  args = p.parse_args()
  for part in args.parts:
    print(f"=== {part} ===", flush=True)
    t0 = time.perf_counter()
    try: result = PARTS[part]()
    except Exception:
      traceback.print_exc()
      result = {"error": traceback.format_exc()[-2000:]}
    result["wall_s"] = time.perf_counter() - t0
    save(part, result)
    gc.collect()


if __name__ == "__main__":
  main()
