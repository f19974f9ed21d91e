"""Mixture of experts on one GPU (docs/benchmarks.md section 12): the Qwen3-30B-A3B shape, bf16, dummy weights.

Parts, each in a process of its own (a 61 GB model and HF's copy of it do not fit together):
  decode      batch-1 decode (prompt 128, 256 new tokens): tok/s, the bytes a step reads (attention, router, the k chosen
              experts' weights, norms, LM head, KV cache) and the GB/s that makes
  throughput  workload 2 (nano-vllm's: 256 requests, prompts and outputs of 100-1,024 tokens)
  profile     where a decode step of 256 sequences (contexts of about 600 tokens) spends its time: the captured step's
              wall time, and each kernel of one eager step (tinygrad's DEBUG=2 timings, which inflate small kernels)
  hf          the peer: HF transformers' Qwen3MoeForCausalLM on the same shape (random bf16 weights), generate() at
              batch 1 with the same prompt and token counts
Usage (on the GPU machine, from the repo root): DEV=CUDA python bench/moe_bench.py decode throughput hf [--model M]
Writes $OUT/moe_<part>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PROMPT_LEN, NEW_TOKENS = 128, 256
QUANTIZATION: str | None = None   # --quantization: the weights quantized at load (int8, int4, fp8)


def save(part: str, result: dict) -> None:
  print(json.dumps(result)[:3000], flush=True)
  if out := os.environ.get("OUT"): Path(out, f"moe_{part}.json").write_text(json.dumps(result, indent=1))


def active_bytes(llm, context: int) -> int:
  from tinyvllm.backend.quantized import QuantizedWeight
  """What one batch-1 decode step reads: every weight but the experts, k experts a sparse layer, the LM head, and
  the KV cache of `context` tokens."""
  weights, cfg = llm.engine.model.weights, llm.engine.model_config
  total = weights.norm.nbytes() + weights.lm_head.nbytes()
  for layer in weights.layers:
    moe = layer.moe
    experts = [] if moe is None else [t for w in (moe.gate_up_proj, moe.down_proj)
                                      for t in (w.tensors() if isinstance(w, QuantizedWeight) else [w])]
    total += sum(t.nbytes() for t in layer.tensors() if not any(t is e for e in experts))
    if moe is not None: total += sum(t.nbytes() // moe.num_experts for t in experts) * moe.top_k
  return total + context * llm.engine.kv_cache.bytes_per_token(cfg, llm.engine.kv_dtype)


def calls(llm) -> dict:
  """Which path each traced op took (the hand-written backend counts them)."""
  return dict(getattr(llm.engine.model.backend, "calls", {}))


def engine(model: str, **kwargs):
  from tinyvllm import LLM
  t0 = time.perf_counter()
  llm = LLM(model, load_format="dummy", dtype=os.environ.get("MOE_DTYPE", "bfloat16"), enable_prefix_caching=False,
            quantization=QUANTIZATION, **kwargs)
  return llm, time.perf_counter() - t0


def part_decode(model: str) -> dict:
  from tinyvllm.bench.decode import run_decode_bench
  llm, load_s = engine(model, kv_cache_memory=4, max_model_len=4096, max_num_seqs=4, cuda_graph_sizes=[1])
  r = run_decode_bench(llm.engine, 1, PROMPT_LEN, NEW_TOKENS, no_kv_cache=False)[0]
  step_s = r.decode_s / (r.new_tokens - 1)
  step_bytes = active_bytes(llm, PROMPT_LEN + NEW_TOKENS // 2)
  print(r.line(), f"{step_bytes / 1e9:.2f} GB a step, {step_bytes / step_s / 1e9:,.0f} GB/s; median step {r.median_step_ms:.3f} ms",
        flush=True)
  return {"model": model, "quantization": QUANTIZATION, "load_s": load_s, "decode_tok_s": r.decode_tok_s, "step_ms": step_s * 1e3,
          "median_step_ms": r.median_step_ms,
          "active_bytes_per_step": step_bytes, "gb_s": step_bytes / step_s / 1e9, "calls": calls(llm),
          "attention_backend": llm.engine.model.backend.describe()}


def part_throughput(model: str) -> dict:
  from tinyvllm.bench.throughput import nano_vllm_workload, run_throughput
  llm, load_s = engine(model, kv_cache_memory=float(os.environ.get("MOE_KV_GIB", "40")), max_model_len=4096, max_num_seqs=256,
                       max_num_batched_tokens=8192)
  vocab = llm.engine.model_config.vocab_size
  r = run_throughput(llm, nano_vllm_workload(vocab), [nano_vllm_workload(vocab, 64, seed=1)])
  print(r.line(), flush=True)
  return {"model": model, "quantization": QUANTIZATION, "load_s": load_s, "requests": r.requests, "output_tokens": r.output_tokens,
          "seconds": r.seconds,
          "output_tok_s": r.output_tok_s, "cpu_seconds": r.cpu_seconds, "warmup_seconds": r.warmup_seconds,
          "captures": r.captures, "captures_in_timed_run": r.captures_in_timed_run, "calls": calls(llm)}


def part_profile(model: str, batch: int = 256, context: int = 600) -> dict:
  import contextlib
  import io

  from tinygrad.helpers import Context

  from tinyvllm import SamplingParams
  sys.path.insert(0, str(REPO / "bench"))
  from gpu_profile import kernel_times
  llm, load_s = engine(model, kv_cache_memory=float(os.environ.get("MOE_KV_GIB", "40")), max_model_len=4096, max_num_seqs=batch,
                       max_num_batched_tokens=8192, cuda_graph_sizes=[batch])
  eng, runner = llm.engine, llm.engine.runner
  params = SamplingParams(temperature=0.6, max_tokens=64, ignore_eos=True)
  for i in range(batch): eng.add_request(f"p{i}", [(7 * i + j) % 10000 for j in range(context)], params)
  while any(s.num_computed_tokens < context for s in eng.scheduler.running) or eng.scheduler.waiting: eng.step()
  for _ in range(4): eng.step()
  t = time.perf_counter()
  for _ in range(16): eng.step()
  step_ms = (time.perf_counter() - t) / 16 * 1e3
  mode, runner.cudagraph_mode = runner.cudagraph_mode, "NONE"
  try:
    eng.step()   # the eager kernels compiled outside the measurement
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), Context(DEBUG=2): eng.step()
  finally:
    runner.cudagraph_mode = mode
  times, counts = kernel_times(buf.getvalue())
  top = sorted(times.items(), key=lambda kv: -kv[1])[:30]
  eager_ms = sum(times.values())
  print(f"batch {batch}, contexts ~{context}: captured step {step_ms:.2f} ms; eager step {eager_ms:.2f} ms of kernels", flush=True)
  for name, ms in top: print(f"  {ms:8.3f} ms x{counts[name]:<4} {name}", flush=True)
  return {"model": model, "load_s": load_s, "batch": batch, "context": context, "step_ms": step_ms, "eager_kernel_ms": eager_ms,
          "top": [{"name": k, "ms": round(v, 4), "count": counts[k]} for k, v in top], "calls": calls(llm)}


def part_hf(model: str) -> dict:
  """HF transformers on the same shape: random bf16 weights built on the GPU, greedy generate() at batch 1."""
  import torch
  import transformers

  from tinyvllm.model.presets import PRESETS
  torch.set_default_dtype(torch.bfloat16)
  config = transformers.AutoConfig.for_model("qwen3_moe", **{k: v for k, v in PRESETS[model].items() if k != "architectures"})
  with torch.device("cuda"): hf = transformers.Qwen3MoeForCausalLM(config).eval()
  ids = torch.randint(0, 10000, (1, PROMPT_LEN), device="cuda")
  mask = torch.ones_like(ids)
  def generate(tokens: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad(): hf.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0
  generate(8)   # warm-up
  prefill_s, total_s = generate(1), generate(NEW_TOKENS)
  tok_s = (NEW_TOKENS - 1) / (total_s - prefill_s)
  print(f"HF transformers {transformers.__version__}: batch-1 decode {tok_s:,.1f} tok/s", flush=True)
  return {"model": model, "transformers": transformers.__version__, "torch": torch.__version__, "decode_tok_s": tok_s,
          "total_s": total_s, "prefill_s": prefill_s}


PARTS = {"decode": part_decode, "throughput": part_throughput, "profile": part_profile, "hf": part_hf}


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("parts", nargs="+", choices=list(PARTS))
  p.add_argument("--model", default="qwen3-30b-a3b")
  p.add_argument("--quantization", choices=["int8", "int4", "fp8"], help="quantize the weights at load (not the hf part)")
  p.add_argument("--in-process", action="store_true", help="run the one part here (what each part's process does)")
  args = p.parse_args()
  global QUANTIZATION
  QUANTIZATION = args.quantization
  if args.in_process:
    (part,) = args.parts
    save(part + (f"_{QUANTIZATION}" if QUANTIZATION else ""), PARTS[part](args.model))
    return 0
  failed = 0
  for part in args.parts:
    print(f"=== moe {part} {QUANTIZATION or ''} ===", flush=True)
    quant = ["--quantization", QUANTIZATION] if QUANTIZATION else []
    failed |= subprocess.run([sys.executable, __file__, part, "--model", args.model, *quant, "--in-process"], cwd=REPO).returncode != 0
  return int(failed)


if __name__ == "__main__":
  sys.exit(main())
