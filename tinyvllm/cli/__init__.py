"""The command line: generate | chat | serve | bench (`python main.py` and the `tinyvllm` script are the same)."""
from __future__ import annotations

import argparse
import sys

from tinyvllm.cli import bench, chat, generate, serve
from tinyvllm.cli.args import Parser


def build_parser() -> argparse.ArgumentParser:
  parser = Parser(prog="tinyvllm", description="A small, fast LLM inference engine on tinygrad.")
  sub = parser.add_subparsers(dest="command", required=True)
  for module in (generate, chat, serve, bench): module.add_parser(sub)
  return parser


def main(argv: list[str] | None = None) -> int:
  """Run a subcommand; a user's error (a flag, a model, a file) is one line on stderr and status 2, never a traceback."""
  args = build_parser().parse_args(argv)
  try:
    return args.run(args)
  except KeyboardInterrupt:   # Ctrl-C while loading or running: stop quietly (chat handles its own)
    print(file=sys.stderr)
    return 130
  except Exception as e:
    if not isinstance(e, _user_errors()): raise
    print(f"error: {e}", file=sys.stderr)
    return 2


def _user_errors() -> tuple[type[Exception], ...]:
  # imported only when needed: `bench serve` is a pure HTTP client and must not pull in the engine (tinygrad)
  from tinyvllm.config import ConfigError
  from tinyvllm.engine.llm_engine import PromptError
  from tinyvllm.sampling_params import SamplingParamsError
  from tinyvllm.tokenizer import TokenizerError
  return ConfigError, PromptError, SamplingParamsError, TokenizerError, OSError   # OSError: a file missing or unreadable
