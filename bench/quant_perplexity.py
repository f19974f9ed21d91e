"""Perplexity of a model on a fixed text through prompt_logprobs, unquantized and with each on-the-fly weight
quantization (int8, fp8, int4): how much each format costs in accuracy. CPU, float32 compute.

  python bench/quant_perplexity.py --model ../shared/data/models/stories260K-hf --out docs/bench-data/perplexity_stories260k_cpu.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# A short children's story (written for this benchmark) in the style stories260K was trained on.
TEXT = ("Once upon a time, there was a little girl named Mia. She had a red ball that she loved very much. Every day she "
        "took the ball to the park and played with her friend Tom. One day, the ball rolled into the pond. Mia was sad and "
        "began to cry. Tom saw a long stick under a tree. He picked it up and pulled the ball out of the water. Mia smiled "
        "and hugged Tom. \"Thank you, Tom! You are a good friend,\" she said. They played with the ball until the sun went "
        "down, and then they went home happy.")


def perplexity(model: str, quantization: str | None) -> dict:
  from tinyvllm import LLM, SamplingParams
  llm = LLM(model, quantization=quantization, dtype="float32", num_gpu_blocks=64, max_num_seqs=1, seed=0)
  out = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
  scored = [next(iter(d.values())).logprob for d in out.prompt_logprobs if d]
  nll = -sum(scored) / len(scored)
  return {"quantization": quantization or "none (float32)", "tokens_scored": len(scored), "mean_nll": nll, "perplexity": math.exp(nll)}


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--model", required=True)
  p.add_argument("--out", help="JSON result")
  args = p.parse_args()
  rows = [perplexity(args.model, q) for q in (None, "int8", "fp8", "int4")]
  base = rows[0]["perplexity"]
  for r in rows:
    r["vs_float32"] = r["perplexity"] / base - 1
    print(f"{r['quantization']:>16}: perplexity {r['perplexity']:.4f} ({r['vs_float32']:+.2%}) over {r['tokens_scored']} tokens")
  if args.out: Path(args.out).write_text(json.dumps({"model": args.model, "text": TEXT, "rows": rows}, indent=1))


if __name__ == "__main__":
  main()
