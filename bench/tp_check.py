"""Tensor parallelism on the GPU, checked: stories260K's greedy reference with the model split over N GPUs (the
hand-written kernels running per shard), and a bf16 Qwen3 shape's greedy tokens at TP=N against TP=1 (a split changes
the order of the all-reduced sums, so bf16 tokens may part where two logits nearly tie: the agreement is reported).
Prints one JSON line per check; exits 1 if stories260K's tokens differ from the reference.

  python3 bench/tp_check.py --tp 2 --stories .data/stories260K-hf
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


def qwen_tokens(tp: int, model: str) -> list[list[int]]:
  from tinyvllm import LLM, SamplingParams
  rng = np.random.default_rng(0)
  prompts = [{"prompt_token_ids": rng.integers(0, 150000, int(n)).tolist()} for n in rng.integers(16, 400, 16)]
  llm = LLM(model, load_format="dummy", tensor_parallel_size=tp, max_model_len=1024, gpu_memory_utilization=0.5)
  t = time.perf_counter()
  outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
  print(f"tp {tp}: 16 sequences x 64 tokens in {time.perf_counter() - t:.2f} s", file=sys.stderr)
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
  p.add_argument("--only", choices=("stories", "tokens"))
  args = p.parse_args()
  if args.only == "stories": print(json.dumps(stories(args.stories, args.tp)))
  elif args.only == "tokens": print(json.dumps(qwen_tokens(args.tp, args.model)))
  else:
    result = in_subprocess("--tp", str(args.tp), "--stories", args.stories, "--only", "stories")
    print(json.dumps(result), flush=True)
    one, split = (in_subprocess("--tp", str(tp), "--model", args.model, "--only", "tokens") for tp in (1, args.tp))
    print(json.dumps({"check": f"{args.model} bf16 greedy, tp {args.tp} vs 1", **agreement(split, one)}), flush=True)
    return 0 if result["equal"] else 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
