"""The fastest workload 2 can run on a device for a mixture-of-experts shape (docs/benchmarks.md section 12), whatever the
kernels: the bytes its decode steps must read from HBM at the device's measured read rate, and its matrix FLOPs at the
tensor cores' peak.

The workload (nano_vllm_workload, seed 0) needs at least (its longest output - 1) decode steps, and a decode step reads,
whatever the engine does:
  - in each sparse layer, the weights of every expert one of its tokens chose (each once: the least any kernel reads);
  - every other weight once (attention, router, norms; the LM head);
  - the KV cache of each stepped request's context.
A step reads fewer experts the fewer sequences it takes, but concavely: so over the run the fewest expert bytes come
from the schedule that steps the most sequences together, every request from the first step on (the engine's: the
sequences a step takes are then the conjugate of the outputs' lengths, which majorizes any other schedule's, Gale-Ryser).
The experts a step's tokens choose come from --routing (measured on the model: `--measure-routing` on the GPU), else
uniform routing: E (1 - (1 - k / E)^n) of E experts for n tokens choosing k each (linear between measured points,
which undercounts a concave curve: still a bound). Prompts add their FLOPs (at the peak; their weight reads are
counted nowhere, as if they rode along the decode steps). The bound on the run's time is the larger of the bytes at the
read rate and the FLOPs at the peak; `engine_schedule` adds the engine's own schedule (prompts first, in chunks that
each read every weight) for comparison.

Usage:
  python bench/moe_ceiling.py [--read-gbps 4273] [--tflops 989] [--routing moe_routing.json] [--kv-bytes 2]
  DEV=CUDA python bench/moe_ceiling.py --measure-routing   (GPU: the device's read and copy rates, torch's kernels; the
      model's routing: distinct experts a layer in decode steps of 8-256 sequences, the engine eager, the workload's
      prompts)  ->  $OUT/moe_routing.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROUTING_COUNTS = (8, 16, 32, 64, 128, 256)
CHUNK_TOKENS = 8192   # the run's tokens a step (bench/moe_bench.py's throughput part)


def shape(model: str) -> dict:
  """Bytes and FLOPs of the preset's parts (bf16 weights)."""
  from tinyvllm.model.presets import PRESETS
  c = PRESETS[model]
  h, layers, e, k = c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"]
  q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
  # a layer's parameters outside the experts: qkv, o, the router, its two norms and Qwen3's q / k norms (a head each)
  attention = h * (q + 2 * kv) + q * h + e * h + 2 * h + 2 * c["head_dim"]
  expert = 3 * h * c["moe_intermediate_size"]
  head = c["vocab_size"] * h + h   # the LM head and the final norm
  return {"layers": layers, "experts": e, "top_k": k, "expert_bytes": 2 * expert, "dense_bytes": 2 * (layers * attention + head),
          "kv_elems_per_token": layers * 2 * kv, "flops_per_token": 2 * layers * (attention + k * expert)}


def expert_counts(routing: dict[int, float] | None, experts: int, top_k: int, n_max: int) -> np.ndarray:
  """Distinct experts a layer reads at n = 0 .. n_max tokens."""
  n = np.arange(n_max + 1)
  if not routing: return experts * (1 - (1 - top_k / experts) ** n)
  points = sorted({0: 0.0, 1: float(top_k), **routing}.items())
  return np.interp(n, [p for p, _ in points], [v for _, v in points])


def ceiling(model: str, read_gbps: float, tflops: float, routing: dict[int, float] | None, kv_bytes: float,
            chunk_tokens: int = CHUNK_TOKENS) -> dict:
  from tinyvllm.bench.throughput import nano_vllm_workload
  from tinyvllm.model.presets import PRESETS
  s = shape(model)
  prompts, params = nano_vllm_workload(PRESETS[model]["vocab_size"]).requests()
  prompt = np.array([len(p) for p in prompts])
  output = np.array([p.max_tokens for p in params])
  counts = expert_counts(routing, s["experts"], s["top_k"], len(prompts))
  steps = np.arange(1, output.max())
  stepped = (output[None, :] > steps[:, None])   # [step, request]: decode step t steps requests with more than t outputs
  n = stepped.sum(1)
  contexts = (stepped * (prompt[None, :] + steps[:, None])).sum(1)
  bytes_ = {"experts": float(s["layers"] * s["expert_bytes"] * counts[n].sum()),
            "dense": float(len(steps) * s["dense_bytes"]),
            "kv": float(contexts.sum() * s["kv_elems_per_token"] * kv_bytes)}
  flops = float((prompt.sum() + n.sum()) * s["flops_per_token"])
  rate = read_gbps * 1e9
  seconds = {part: b / rate for part, b in bytes_.items()}
  bound = max(sum(seconds.values()), flops / (tflops * 1e12))
  all_weights = s["dense_bytes"] + s["layers"] * s["experts"] * s["expert_bytes"]
  chunks = -(-int(prompt.sum()) // chunk_tokens)
  prompt_steps = chunks * max(all_weights / rate, prompt.sum() / chunks * s["flops_per_token"] / (tflops * 1e12))
  tokens, engine = int(output.sum()), sum(seconds.values()) + prompt_steps
  return {"model": model, "read_gbps": read_gbps, "tflops": tflops, "routing": "measured" if routing else "uniform",
          "kv_bytes_per_element": kv_bytes, "requests": len(prompts), "prompt_tokens": int(prompt.sum()), "output_tokens": tokens,
          "decode_steps": len(steps), "bytes": bytes_, "seconds": seconds, "flops_seconds": flops / (tflops * 1e12),
          "bound_seconds": bound, "bound_tok_s": tokens / bound,
          "engine_schedule_seconds": engine, "engine_schedule_tok_s": tokens / engine}


def device_rates(gib: float = 4.0, iters: int = 20) -> dict:
  """GB/s of a bf16 tensor's sum (bytes read) and copy (bytes read + written): torch's kernels, CUDA events."""
  import torch
  x = torch.empty(int(gib * 2 ** 30) // 2, dtype=torch.bfloat16, device="cuda").normal_()
  y = torch.empty_like(x)
  rates = {}
  for name, fn, moved in (("sum_read", lambda: x.sum(dtype=torch.float32), x.nbytes),
                          ("copy_read_write", lambda: y.copy_(x), 2 * x.nbytes)):
    for _ in range(3): fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters): fn()
    end.record()
    torch.cuda.synchronize()
    rates[f"{name}_GBps"] = moved * iters / (start.elapsed_time(end) / 1e3) / 1e9
  return rates


def save(result: dict) -> None:
  if out := os.environ.get("OUT"): Path(out, "moe_routing.json").write_text(json.dumps(result, indent=1))


def measure_routing(model: str, result: dict, decode_steps: int = 6) -> None:
  """Distinct experts each sparse layer's tokens chose, by the step's token count: the engine eager on dummy weights, the
  workload's first n prompts for n in ROUTING_COUNTS, the router's choice recomputed (the portable route on the step's
  x') at every call of the MoE op. A step of exactly n tokens is a decode step of all n: each request generates as many
  tokens as the prompts take chunks, plus `decode_steps`, so that every request is still decoding once the last prompt
  is done (the steps before mix decodes with a prompt's chunk). Into result["distinct_experts"], saved after each n."""
  from tinyvllm import LLM, SamplingParams
  from tinyvllm.bench.throughput import nano_vllm_workload
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.layers.moe import route
  from tinyvllm.layers.norm import rms_norm
  seen: dict[int, list[int]] = {}
  original = FusedBackend.moe
  def counting(self, x, moe, *, norm, eps, residual):
    seen.setdefault(int(x.shape[0]), []).append(len(np.unique(route(rms_norm(x, norm, eps), moe)[1].numpy())))
    return original(self, x, moe, norm=norm, eps=eps, residual=residual)
  FusedBackend.moe = counting
  llm = LLM(model, load_format="dummy", dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False, kv_cache_memory=40,
            max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=CHUNK_TOKENS)
  prompts, _ = nano_vllm_workload(llm.engine.model_config.vocab_size).requests()
  for n in ROUTING_COUNTS:
    chunks = -(-sum(len(p) for p in prompts[:n]) // CHUNK_TOKENS)
    llm.generate(prompts[:n], SamplingParams(temperature=0.6, max_tokens=chunks + decode_steps + 1, ignore_eos=True), use_tqdm=False)
    result["distinct_experts"] = {str(c): {"mean": float(np.mean(seen[c])), "min": int(min(seen[c])), "samples": len(seen[c])}
                                  for c in ROUTING_COUNTS if c in seen}
    save(result)
    print(f"{n:>4} sequences: {result['distinct_experts'].get(str(n), 'no step of exactly these tokens')}", flush=True)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="qwen3-30b-a3b")
  p.add_argument("--read-gbps", type=float, default=4273.0, help="the device's read rate (nvidia-h200: torch's sum, 4,273)")
  p.add_argument("--tflops", type=float, default=989.0, help="dense bf16 tensor-core peak (H200: 989)")
  p.add_argument("--routing", help="moe_routing.json of --measure-routing (else uniform routing)")
  p.add_argument("--kv-bytes", type=float, default=2.0, help="bytes a KV cache element (2: bf16, 1: FP8)")
  p.add_argument("--target", type=float, default=8000.0, help="output tok/s to compare with the bound")
  p.add_argument("--measure-routing", action="store_true")
  args = p.parse_args()
  if args.measure_routing:
    result = {"rates": device_rates()}
    print(f"device rates: {result['rates']}", flush=True)
    import torch
    torch.cuda.empty_cache()
    measure_routing(args.model, result)
    return
  routing = None
  if args.routing:
    routing = {int(n): r["mean"] for n, r in json.loads(Path(args.routing).read_text())["distinct_experts"].items()}
  r = ceiling(args.model, args.read_gbps, args.tflops, routing, args.kv_bytes)
  print(json.dumps(r, indent=1))
  print(f"bound {r['bound_seconds']:.2f} s = {r['bound_tok_s']:,.0f} output tok/s; {args.target:,.0f} tok/s is "
        f"{args.target / r['bound_tok_s']:.1%} of it (the engine's schedule: {r['engine_schedule_tok_s']:,.0f} tok/s, "
        f"{args.target / r['engine_schedule_tok_s']:.1%})")


if __name__ == "__main__":
  main()
