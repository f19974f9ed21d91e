"""`bench`: speed measurements (decode; more kinds arrive with the engine's later parts)."""
from __future__ import annotations

import argparse

from tinyvllm.cli.args import add_engine_args, engine_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("bench", help="measure speed")
  kinds = p.add_subparsers(dest="bench", required=True)
  d = kinds.add_parser("decode", help="decode tok/s with the KV cache (and without it, with --no-kv-cache)")
  add_engine_args(d)
  d.add_argument("--batch-size", type=int, default=1)
  d.add_argument("--prompt-len", type=int, default=128)
  d.add_argument("--max-tokens", type=int, default=256, help="new tokens per sequence")
  d.add_argument("--no-kv-cache", action="store_true", help="also measure decoding that recomputes everything each step")
  d.set_defaults(run=run_decode)


def run_decode(args: argparse.Namespace) -> int:
  from tinyvllm import LLM
  from tinyvllm.bench.decode import run_decode_bench
  llm = LLM(args.model, **engine_kwargs(args))
  results = run_decode_bench(llm.engine, args.batch_size, args.prompt_len, args.max_tokens, args.no_kv_cache)
  for r in results: print(r.line())
  if len(results) == 2: print(f"the KV cache makes decoding {results[0].decode_tok_s / results[1].decode_tok_s:.1f}x faster")
  return 0
