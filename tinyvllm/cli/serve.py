"""`serve`: the OpenAI-compatible HTTP server (needs the serve extra: pip install -e '.[serve]')."""
from __future__ import annotations

import argparse
import os
import sys

from tinyvllm.cli.args import add_engine_args, engine_config
from tinyvllm.model.embedded import EMBEDDED_MODEL

SERVE_PACKAGES = {"fastapi", "uvicorn", "starlette", "prometheus_client", "pydantic"}


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("serve", help="serve the model over HTTP with OpenAI's API")
  add_engine_args(p)
  s = p.add_argument_group("server")
  s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
  s.add_argument("--port", type=int, default=8000)
  s.add_argument("--api-key", default=os.environ.get("TINYVLLM_API_KEY"),
                 help="require Authorization: Bearer KEY (default: $TINYVLLM_API_KEY; none: no key needed)")
  s.add_argument("--served-model-name", help=f"the name clients pass as `model` (default: --model, or {EMBEDDED_MODEL} for the "
                                              "shipped model)")
  s.add_argument("--shutdown-timeout", type=float, default=10.0,
                 help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted")
  s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
  s.add_argument("--access-log", action="store_true", help="log every HTTP request")
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  try:
    from tinyvllm.entrypoints.api_server import ServerSettings, run_server
  except ImportError as e:
    if (e.name or "").split(".")[0] not in SERVE_PACKAGES: raise
    print(f"error: `serve` needs the serve extra ({e.name} is not installed): pip install -e '.[serve]'", file=sys.stderr)
    return 2
  served_name = args.served_model_name or (EMBEDDED_MODEL if args.model is None else None)
  settings = ServerSettings(args.host, args.port, args.api_key, served_name, args.shutdown_timeout, args.log_level, args.access_log)
  return run_server(engine_config(args), settings)
