"""`generate`: stream one completion to stdout."""
from __future__ import annotations

import argparse
import sys

from tinyvllm.cli.args import (
  add_engine_args,
  add_sampling_args,
  engine_kwargs,
  model_of,
  sampling_kwargs,
  sampling_params_for,
  tokenizer_check,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("generate", help="complete one prompt, streaming the text to stdout")
  add_engine_args(p)
  p.add_argument("--prompt", required=True, help='the prompt text ("-" reads it from stdin)')
  add_sampling_args(p, max_tokens=256)
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  from tinyvllm.engine.llm import LLM
  from tinyvllm.sampling_params import SamplingParams
  prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
  SamplingParams(**sampling_kwargs(args))   # a bad flag fails before the model loads
  llm = LLM(model_of(args), check_frontend_files=tokenizer_check(args), **engine_kwargs(args))
  for delta in llm.stream(prompt, sampling_params_for(args, llm.engine.default_sampling_params)):
    sys.stdout.write(delta)
    sys.stdout.flush()
  sys.stdout.write("\n")
  return 0
