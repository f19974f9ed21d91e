"""Tensor parallelism on the GPU, checked: the peer all-reduce kernel (and the inputs' broadcast and the logits' gather
through it) against the portable copies and adds (the same bits, over many launches, eager and inside a captured
TinyJit, shapes from one row to a whole decode batch), stories260K's greedy reference with the model split over N
GPUs (the hand-written kernels running per shard), and a bf16 Qwen3 shape's greedy tokens at TP=N against TP=1 (a
split changes the order of the all-reduced sums, so bf16 tokens may part where two logits nearly tie: the agreement
is reported). Prints one JSON line per check; exits 1 if the kernel's sums or stories260K's tokens differ.

  python3 bench/tp_check.py --tp 2 --stories .data/stories260K-hf
  python3 bench/tp_check.py --tp 2 --quantization int8     (the tokens check alone, weights quantized at load)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np


def stories(folder: str, tp: int) -> dict:
  from tinyvllm import LLM, SamplingParams
  with open(f"{folder}/reference_greedy.json") as f: ref = json.load(f)
  llm = LLM(folder, tensor_parallel_size=tp, num_gpu_blocks=256)
  out = llm.generate({"prompt_token_ids": ref["prompt_ids"]}, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
  tokens = out.outputs[0].token_ids
  calls = dict(getattr(llm.engine.model.backend, "calls", {}))
  return {"check": "stories260K", "tp": tp, "equal": tokens == ref["greedy_ids"][:64], "backend": llm.engine.model.backend.name,
          "kernel_calls": calls}


def peer_all_reduce(tp: int) -> dict:
  """The kernel's sums against the group's copies and adds on random bf16 partials: 40 launches of each shape eagerly,
  then 40 replays of a captured step of three chained all-reduces, and 40 of a step's start (two inputs in one
  broadcast, then an all-reduce of values computed from them); the row-parallel products that all-reduce their own
  outputs against the product followed by the kernel; every launch's result compared bit for bit."""
  from tinygrad import Tensor, TinyJit, dtypes

  from tinyvllm.kernels.all_reduce import PeerAllReduce
  from tinyvllm.kernels.linear import fused_linear, linear_all_reduce
  from tinyvllm.kernels.tinygrad_program import device_target
  from tinyvllm.layers.tensor_parallel import TensorParallelGroup, broadcast_together, group_devices
  group = TensorParallelGroup(group_devices("CUDA", tp))
  kernel, rng, mismatches, launches = PeerAllReduce(group), np.random.default_rng(0), 0, 0

  def partial(rows: int, cols: int) -> Tensor:
    return group.local([Tensor(rng.standard_normal((rows, cols)).astype(np.float32), device=group.first).cast(dtypes.bfloat16)
                        for _ in range(tp)])

  def same(a: Tensor, b: Tensor) -> bool:
    return all(np.array_equal(Tensor(a.uop.mselect(i)).bitcast(dtypes.uint16).numpy(),
                              Tensor(b.uop.mselect(i)).bitcast(dtypes.uint16).numpy()) for i in range(tp))
  for rows, cols in ((1, 4096), (4, 4096), (256, 4096), (7, 1024), (1, 5120)):
    for i in range(40):   # every other launch adds a residual (replicated, as the hidden states are)
      x = partial(rows, cols).realize()
      r = None if i % 2 else group.replicate(Tensor(rng.standard_normal((rows, cols)).astype(np.float32)).cast(dtypes.bfloat16))
      mismatches += not same(kernel.all_reduce(x, r).realize(), group.all_reduce(x, r).realize())
      launches += 1

  @TinyJit
  def step(x: Tensor) -> Tensor: return kernel.all_reduce(kernel.all_reduce(kernel.all_reduce(x) * 0.5) * 0.5).realize()
  for _ in range(40):
    x = partial(8, 4096).realize()
    want = group.all_reduce(group.all_reduce(group.all_reduce(x) * 0.5) * 0.5)
    mismatches += not same(step(x), want.realize())
    launches += 3
  @TinyJit
  def inputs(a: Tensor, b: Tensor, x: Tensor) -> tuple[Tensor, ...]:
    # a step's start: its inputs in one broadcast, then an all-reduce of values computed from them (the collectives of
    # a step follow one another by their data: layers/tensor_parallel.py's broadcast_together)
    moved_a, moved_b = broadcast_together(kernel, [a, b])
    return tuple(t.realize() for t in (moved_a, moved_b, kernel.all_reduce(x + moved_b[:1].cast(dtypes.bfloat16))))
  for _ in range(40):
    a, b = rng.integers(-2**31, 2**31, 300, dtype=np.int64).astype(np.int32), rng.integers(-64, 64, 7).astype(np.int32)
    x = partial(1, 4096).realize()
    got_a, got_b, got_x = inputs(Tensor(a, device=group.first).realize(), Tensor(b, device=group.first).realize(), x)
    mismatches += not all(np.array_equal(Tensor(t.uop.mselect(i)).numpy(), w) for t, w in ((got_a, a), (got_b, b)) for i in range(tp))
    mismatches += not same(got_x, group.all_reduce(x + group.replicate(Tensor(b[:1]).cast(dtypes.bfloat16))).realize())
    launches += 2
  products = 0
  for rows, k, out, silu in ((1, 2048, 4096, False), (4, 2048, 4096, False), (1, 6144, 4096, True), (3, 1024, 5120, True)):
    # the row-parallel products that all-reduce their own outputs against the product, then the all-reduce kernel
    target = device_target(group.first)
    x, w = partial(rows, 2 * k if silu else k).realize(), partial(out, k).realize()
    r = group.replicate(Tensor(rng.standard_normal((rows, out)).astype(np.float32)).cast(dtypes.bfloat16))
    got = linear_all_reduce(target, x, w, kernel.table, tp, r, silu_mul=silu)
    want = kernel.all_reduce(fused_linear(target, x, w, silu_mul=silu), r)
    mismatches += got is None or not same(got.realize(), want.realize())
    products += 1
  gathers = 0
  for rows in (1, 4, 8, 13):   # float32 logits of the Qwen3 vocabulary: 13 rows fill an exchange slot, 14 are copied
    logits = group.local([Tensor(rng.standard_normal((rows, 151936 // tp)).astype(np.float32), device=group.first)
                          for _ in range(tp)]).realize()
    got, want = kernel.gather_columns(logits).realize(), group.gather_columns(logits).realize()
    mismatches += not np.array_equal(got.numpy(), want.numpy())
    gathers += 1
  broadcasts = 0
  for numel in (1, 7, 300, 5000, 5000):   # a step's int32 inputs (any bits), each device's copy against the source
    words = rng.integers(-2**31, 2**31, numel, dtype=np.int64).astype(np.int32)
    got = kernel.broadcast(Tensor(words, device=group.first)).realize()
    mismatches += not all(np.array_equal(Tensor(got.uop.mselect(i)).numpy(), words) for i in range(tp))
    broadcasts += 1
  return {"check": "peer all-reduce, broadcast and gather vs copies and adds", "tp": tp, "launches": launches,
          "products": products, "gathers": gathers, "broadcasts": broadcasts, "mismatches": mismatches, "equal": mismatches == 0}


def qwen_tokens(tp: int, model: str, quantization: str | None = None) -> list[list[int]]:
  from tinyvllm import LLM, SamplingParams
  rng = np.random.default_rng(0)
  prompts = [{"prompt_token_ids": rng.integers(0, 150000, int(n)).tolist()} for n in rng.integers(16, 400, 16)]
  llm = LLM(model, load_format="dummy", tensor_parallel_size=tp, max_model_len=1024, gpu_memory_utilization=0.5,
            quantization=quantization)
  t = time.perf_counter()
  outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
  calls = dict(getattr(llm.engine.model.backend, "calls", {}))
  print(f"tp {tp}: 16 sequences x 64 tokens in {time.perf_counter() - t:.2f} s; kernel calls {calls}", file=sys.stderr)
  return [o.outputs[0].token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
  """Tokens equal up to the first difference, per sequence."""
  prefix = [next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), len(p)) for p, q in zip(a, b, strict=True)]
  return {"sequences_equal": sum(n == len(p) for n, p in zip(prefix, a, strict=True)), "sequences": len(a),
          "mean_equal_prefix": float(np.mean(prefix)), "tokens_per_sequence": len(a[0])}


def in_subprocess(*args: str) -> dict:
  """One engine per process: each gets all of its GPUs' memory."""
  out = subprocess.run([sys.executable, __file__, *args], check=True, stdout=subprocess.PIPE, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--tp", type=int, required=True)
  p.add_argument("--stories")
  p.add_argument("--model", default="qwen3-0.6b")
  p.add_argument("--only", choices=("all_reduce", "stories", "tokens"))
  p.add_argument("--quantization", help="the tokens check with the weights quantized at load (int8, int4, fp8)")
  args = p.parse_args()
  quant = ["--quantization", args.quantization] if args.quantization else []
  if args.only == "all_reduce": print(json.dumps(peer_all_reduce(args.tp)))
  elif args.only == "stories": print(json.dumps(stories(args.stories, args.tp)))
  elif args.only == "tokens": print(json.dumps(qwen_tokens(args.tp, args.model, args.quantization)))
  elif args.quantization:   # the tokens check alone, quantized: tp N against tp 1
    one, split = (in_subprocess("--tp", str(tp), "--model", args.model, "--only", "tokens", *quant) for tp in (1, args.tp))
    print(json.dumps({"check": f"{args.model} {args.quantization} greedy, tp {args.tp} vs 1", **agreement(split, one)}), flush=True)
  else:
    kernel = in_subprocess("--tp", str(args.tp), "--only", "all_reduce")
    print(json.dumps(kernel), flush=True)
    result = in_subprocess("--tp", str(args.tp), "--stories", args.stories, "--only", "stories")
    print(json.dumps(result), flush=True)
    one, split = (in_subprocess("--tp", str(tp), "--model", args.model, "--only", "tokens") for tp in (1, args.tp))
    print(json.dumps({"check": f"{args.model} bf16 greedy, tp {args.tp} vs 1", **agreement(split, one)}), flush=True)
    return 0 if result["equal"] and kernel["equal"] else 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
