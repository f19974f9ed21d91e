"""`serve`: the OpenAI-compatible HTTP server (needs the serve extra: pip install -e '.[serve]'), with `vllm serve`'s
form and flags: `serve MODEL [flags]`."""
from __future__ import annotations

import argparse
import os
import sys

from tinyvllm.cli.args import (
  add_engine_args,
  bounded,
  engine_config,
  json_value,
  non_negative_float,
  non_negative_int,
  positive_float,
  positive_int,
)
from tinyvllm.config import REASONING_MARKERS, EngineConfig
from tinyvllm.model.embedded import EMBEDDED_MODEL

# the names of the parsers in tinyvllm/entrypoints (which needs the serve extra, so they are not imported here)
TOOL_PARSER_NAMES = ("hermes", "llama3_json")
SERVE_PACKAGES = {"fastapi", "uvicorn", "starlette", "prometheus_client", "pydantic", "zmq", "msgspec"}
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("serve", help="serve the model over HTTP with OpenAI's API")
  p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model (as `vllm serve MODEL`); or --model")
  add_engine_args(p)
  s = p.add_argument_group("server")
  s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
  s.add_argument("--port", type=bounded(int, 0, 65535), default=8000, help="TCP port (0: any free one)")
  s.add_argument("--uds", help="serve on this Unix domain socket instead of host:port")
  s.add_argument("--api-key", default=os.environ.get("TINYVLLM_API_KEY"),
                 help="require Authorization: Bearer KEY (default: $TINYVLLM_API_KEY; none: no key needed)")
  s.add_argument("--served-model-name", nargs="+",
                 help=f"the names clients may pass as `model`; responses carry the first (default: the model, or {EMBEDDED_MODEL} "
                      "for the shipped one)")
  s.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0,
                 help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted")
  s.add_argument("--uvicorn-log-level", "--log-level", dest="uvicorn_log_level", default="info", choices=UVICORN_LOG_LEVELS)
  s.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True, help="log every HTTP request (default: on)")
  s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log (= --no-access-log)")
  s.add_argument("--root-path", help="the path prefix a proxy serves the app under (FastAPI's root_path)")
  s.add_argument("--ssl-keyfile")
  s.add_argument("--ssl-certfile")
  s.add_argument("--ssl-ca-certs", help="CA certificates file (to verify clients)")
  s.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=0, help="whether a client certificate is required (ssl.CERT_*)")
  s.add_argument("--allowed-origins", type=json_list, default=[],
                 help='CORS allowed origins, JSON, e.g. \'["https://example.org"]\' (default: none, CORS off)')
  s.add_argument("--allowed-methods", type=json_list, default=["*"], help='CORS allowed methods, JSON (default ["*"])')
  s.add_argument("--allowed-headers", type=json_list, default=["*"], help='CORS allowed headers, JSON (default ["*"])')
  s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
  s.add_argument("--allowed-hosts", type=json_list,
                 help='Host header names answered, JSON, e.g. \'["api.example.org"]\' ("*": any; default: localhost, 127.0.0.1 '
                      'and ::1 when bound to the loopback, else any)')
  s.add_argument("--header-timeout", type=positive_float, default=10.0, help="seconds a request's head may take to arrive (default 10)")
  s.add_argument("--body-timeout", type=positive_float, default=60.0, help="seconds its body may take after the head (default 60)")
  s.add_argument("--timeout-keep-alive", type=positive_float, default=5.0,
                 help="seconds an idle kept-alive connection stays open (default 5)")
  s.add_argument("--max-seqs-per-request", type=positive_int, default=4096,
                 help="the most sequences (prompts x n) one request may ask for (default 4096)")
  s.add_argument("--api-server-count", "-asc", type=positive_int, default=1,
                 help="API server processes sharing the port and the engine cores, so that HTTP, tokenization and streaming "
                      "of a busy server use that many CPUs (default 1)")
  s.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc, /openapi.json (always the case)")
  s.add_argument("--disable-frontend-multiprocessing", action="store_true",
                 help="the HTTP server and the frontend (tokenization, detokenization) share one process, the engine core "
                      "runs in its own (always the case)")
  c = p.add_argument_group("chat and request log")
  c.add_argument("--chat-template", help="a chat template file, or the template itself, used instead of the model's")
  c.add_argument("--response-role", default="assistant", help="the role of generated chat messages (assistant only)")
  c.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                 help="log each request's prompt, sampling parameters and prompt token ids")
  c.add_argument("--disable-log-requests", action="store_true", help="no request log (the default)")
  c.add_argument("--max-log-len", type=non_negative_int, help="the most prompt characters and token ids a request log line shows")
  c.add_argument("--trust-request-chat-template", action="store_true",
                 help="render a chat_template a request sends (default: such a request is refused)")
  t = p.add_argument_group("tool calling and reasoning")
  t.add_argument("--enable-auto-tool-choice", action="store_true",
                 help='tool_choice "auto" (the default with tools): the model decides, its calls are read by --tool-call-parser')
  t.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSER_NAMES),
                 help="the format the model writes its tool calls in: hermes (<tool_call>{...}</tool_call>, Hermes, Qwen2.5, "
                      "Qwen3) or llama3_json (Llama 3.1/3.2's JSON)")
  t.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                 help='tool_choice "none": the chat template gets no tools either (default: it gets them)')
  t.add_argument("--reasoning-parser", choices=sorted(REASONING_MARKERS),
                 help="split the model's reasoning (qwen3: <think>...</think>) from its answer, as message.reasoning_content; "
                      "structured output constrains the answer after it")
  p.set_defaults(run=run)


def json_list(text: str) -> list[str]:
  """A JSON list of strings (the CORS and Host flags)."""
  value = json_value(text)
  if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
    raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
  return value


def check_server_flags(args: argparse.Namespace) -> None:
  """Refuse, naming it, a server flag tinyvllm cannot honour."""
  from tinyvllm.config import ConfigError
  if args.enable_auto_tool_choice and args.tool_call_parser is None:
    raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(sorted(TOOL_PARSER_NAMES))})")
  if args.response_role != "assistant":
    raise ConfigError(f"--response-role {args.response_role!r}: only 'assistant' is supported yet")
  if args.enable_log_requests and args.disable_log_requests:
    raise ConfigError("--enable-log-requests and --disable-log-requests contradict each other")
  if bool(args.ssl_keyfile) != bool(args.ssl_certfile): raise ConfigError("--ssl-keyfile and --ssl-certfile go together")


def server_settings(args: argparse.Namespace):
  from tinyvllm.entrypoints.api_server import ServerSettings
  from tinyvllm.tokenizer.chat_template import load_chat_template
  shipped = args.model is None and getattr(args, "model_tag", None) is None
  names = tuple(args.served_model_name or ((EMBEDDED_MODEL,) if shipped else ()))
  return ServerSettings(
    host=args.host, port=args.port, api_key=args.api_key, served_model_name=names[0] if names else None,
    shutdown_timeout=args.shutdown_timeout, log_level=args.uvicorn_log_level,
    access_log=args.access_log and not args.disable_uvicorn_access_log, other_model_names=names[1:],
    chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
    trust_request_chat_template=args.trust_request_chat_template, enable_auto_tool_choice=args.enable_auto_tool_choice,
    tool_call_parser=args.tool_call_parser, exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
    reasoning_parser=args.reasoning_parser,
    log_requests=args.enable_log_requests, max_log_len=args.max_log_len, uds=args.uds, root_path=args.root_path or "",
    ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
    allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
    allow_credentials=args.allow_credentials, allowed_hosts=args.allowed_hosts, header_timeout=args.header_timeout,
    body_timeout=args.body_timeout, keep_alive_timeout=args.timeout_keep_alive, max_seqs_per_request=args.max_seqs_per_request,
    api_server_count=args.api_server_count)


def run(args: argparse.Namespace) -> int:
  try:
    from tinyvllm.entrypoints.api_server import run_server
  except ImportError as e:
    if (e.name or "").split(".")[0] not in SERVE_PACKAGES: raise
    print(f"error: `serve` needs the serve extra ({e.name} is not installed): pip install -e '.[serve]'", file=sys.stderr)
    return 2
  check_server_flags(args)
  config = engine_config(args)   # every engine flag is checked before the server starts
  settings = server_settings(args)
  if settings.api_server_count > 1: check_api_servers(config)
  check_executor(config)
  if settings.api_server_count == 1: return run_server(config, settings)
  from tinyvllm.entrypoints.api_servers import run_api_servers
  return run_api_servers(config, settings)


def check_api_servers(config: EngineConfig) -> None:
  from tinyvllm.config import ConfigError
  if config.distributed_executor_backend == "ray":
    raise ConfigError("--api-server-count > 1 with --distributed-executor-backend ray: several API servers front engine "
                      "cores on this host only (executor mp)")


def check_executor(config: EngineConfig) -> None:
  """Before the server starts: the devices data parallelism places its replicas on are there (executor mp), Ray is
  installed (executor ray; its cluster is checked once the server has joined it)."""
  from tinyvllm.engine.dp_client import check_data_parallel
  check_data_parallel(config)
  if config.distributed_executor_backend == "ray":
    from tinyvllm.engine.ray_executor import import_ray
    import_ray()
