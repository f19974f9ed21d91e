"""The FastAPI app and its uvicorn server.

The HTTP server starts first and the engine core process starts loading the model beside it (AsyncLLM, engine/), so
/health answers 503 while the model loads and 200 once the core reports ready; a load error stops the server with
status 1 and the core's message. A guard in front of the routes checks the API key and caps the body size before any
JSON is parsed. SIGINT/SIGTERM stop new connections and requests, give in-flight requests --shutdown-timeout seconds
to finish, end the rest with an error (aborting them in the engine), stop the core process and exit 0. If the core
process fails or dies, every waiting client gets an error, new requests a 503, and the server exits with status 1.

As one of several API server processes (--api-server-count, entrypoints/api_servers.py) it serves on the listening
socket they share and talks to the engine cores they share; it starts taking connections only once the cores are ready
(so that no server says 503 while another serves), and only SIGTERM (which the supervisor passes on) stops it.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from tinyvllm.config import EngineConfig
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.engine.core_launcher import SharedCores
from tinyvllm.engine.core_setup import log
from tinyvllm.engine.exceptions import EngineDeadError, EngineLoadError
from tinyvllm.entrypoints.chat_settings import ChatSettings
from tinyvllm.entrypoints.common import ServerState
from tinyvllm.entrypoints.errors import APIError, install_error_handlers, parse_request
from tinyvllm.entrypoints.guard import MAX_BODY_BYTES, GuardMiddleware, default_allowed_hosts
from tinyvllm.entrypoints.http_protocol import ReadTimeouts, protocol_class
from tinyvllm.entrypoints.logger import RequestLogger
from tinyvllm.entrypoints.metrics import CONTENT_TYPE
from tinyvllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tinyvllm.entrypoints.serving_chat import create_chat_completion
from tinyvllm.entrypoints.serving_completion import create_completion
from tinyvllm.entrypoints.serving_tokenize import detokenize, list_models, tokenize


async def _start_engine(state: ServerState, start: Callable[[], Awaitable[AsyncLLM]], on_failure: Callable[[], None]) -> None:
  """Start the engine (its core process loads the model), then serve with it; a load error stops the server."""
  try:
    engine = await start()
  except Exception as e:
    state.load_error = str(e) if isinstance(e, EngineLoadError) else f"{type(e).__name__}: {e}"   # the core's names its type
    log(f"loading the model failed: {state.load_error}")
    on_failure()
    return
  state.engine = engine
  log(f"model ready, serving it as {state.served_model_name!r}")


@dataclass(frozen=True)
class CorsSettings:
  """CORS, off unless origins are given (then any method and header by default, no credentials, as vLLM's)."""
  allowed_origins: list[str] = field(default_factory=list)
  allowed_methods: list[str] = field(default_factory=lambda: ["*"])
  allowed_headers: list[str] = field(default_factory=lambda: ["*"])
  allow_credentials: bool = False


def create_app(state: ServerState, start: Callable[[], Awaitable[AsyncLLM]], on_load_failure: Callable[[], None] = lambda: None,
               max_body: int = MAX_BODY_BYTES, cors: CorsSettings | None = None, root_path: str = "",
               allowed_hosts: list[str] | tuple[str, ...] | None = None, load_before_serving: bool = False) -> FastAPI:
  """`start` makes the engine (AsyncLLM.from_config(config), in the server): it runs once the app has started
  (load_before_serving: connections are taken only after it has finished)."""
  @contextlib.asynccontextmanager
  async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    loading = state.loading = asyncio.create_task(_start_engine(state, start, on_load_failure))
    if load_before_serving: await asyncio.wait([loading])   # a signal cancels it (_Server)
    try:
      yield
    finally:
      loading.cancel()
      with contextlib.suppress(asyncio.CancelledError): await loading
      if state.engine is not None: await state.engine.shutdown()

  app = FastAPI(title="tinyvllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None, root_path=root_path)
  install_error_handlers(app)
  app.add_middleware(GuardMiddleware, api_key=state.api_key, allowed_hosts=allowed_hosts, max_body=max_body)
  if cors is not None and cors.allowed_origins:
    # outside the guard, so that a browser's preflight (which carries no API key) gets its CORS answer
    app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                       allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
  _add_routes(app, state)
  return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
  get = lambda path: app.api_route(path, methods=["GET", "HEAD"])   # HEAD wherever GET is allowed

  @app.post("/v1/completions")
  async def completions(request: Request) -> Response:
    return await create_completion(state, await parse_request(CompletionRequest, request), request)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request) -> Response:
    return await create_chat_completion(state, await parse_request(ChatCompletionRequest, request), request)

  @get("/v1/models")
  async def models() -> JSONResponse: return JSONResponse(list_models(state))

  @app.post("/tokenize")
  async def tokenize_route(request: Request) -> JSONResponse:
    return JSONResponse(tokenize(state, await parse_request(TokenizeRequest, request)))

  @app.post("/detokenize")
  async def detokenize_route(request: Request) -> JSONResponse:
    return JSONResponse(detokenize(state, await parse_request(DetokenizeRequest, request)))

  @get("/health")
  async def health() -> JSONResponse:
    engine = state.require_ready()
    if engine.is_dead: raise APIError(503, "the engine has stopped", code="service_unavailable")
    return JSONResponse({"status": "ok"})

  @get("/metrics")
  async def metrics() -> Response: return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def _drain(state: ServerState, grace: float) -> None:
  """Shutdown: refuse new requests, give in-flight ones `grace` seconds, then end the rest (which aborts them)."""
  state.draining = True
  await asyncio.sleep(grace)
  state.abort_in_flight()


class _Server(uvicorn.Server):
  def __init__(self, config: uvicorn.Config, state: ServerState, grace: float,
               signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)):
    super().__init__(config)
    self.state, self.grace, self.signals = state, grace, signals
    self._drain_task: asyncio.Task | None = None
    self._signals = 0

  def handle_exit(self, sig: int, frame: Any) -> None:
    """The first signal shuts down with the grace period, a second one ends what is in flight at once, a third one
    exits without waiting for anything (uvicorn's forced exit)."""
    self._signals += 1
    if self._signals == 2: log("second signal: ending the requests in flight now")
    if self._signals == 3: log("third signal: exiting at once")
    if self._signals != 2: super().handle_exit(sig, frame)
    with contextlib.suppress(RuntimeError):   # no running loop: nothing is in flight
      loop = asyncio.get_running_loop()
      if self._signals == 1: loop.call_soon_threadsafe(self._start_draining, loop)
      if self._signals == 2: loop.call_soon_threadsafe(self.state.abort_in_flight)

  def _start_draining(self, loop: asyncio.AbstractEventLoop) -> None:
    if self.state.engine is None and self.state.loading is not None: self.state.loading.cancel()   # still loading: stop
    self._drain_task = loop.create_task(_drain(self.state, self.grace))

  @contextlib.contextmanager
  def capture_signals(self) -> Iterator[None]:
    # uvicorn's own version re-raises the signal once the server has stopped, which makes the exit status 130/143;
    # a requested shutdown that went well should exit 0
    if threading.current_thread() is not threading.main_thread():
      yield
      return
    previous = {sig: signal.signal(sig, self.handle_exit) for sig in self.signals}
    try:
      yield
    finally:
      for sig, handler in previous.items(): signal.signal(sig, handler)


@dataclass(frozen=True)
class ServerSettings:
  host: str = "127.0.0.1"
  port: int = 8000
  api_key: str | None = None
  served_model_name: str | None = None
  shutdown_timeout: float = 10.0
  log_level: str = "info"                     # uvicorn's (--uvicorn-log-level)
  access_log: bool = True
  other_model_names: tuple[str, ...] = ()     # further --served-model-name names requests may use
  chat_template: str | None = None            # the --chat-template source, used instead of the model's
  trust_request_chat_template: bool = False
  enable_auto_tool_choice: bool = False
  tool_call_parser: str | None = None
  exclude_tools_when_tool_choice_none: bool = False
  reasoning_parser: str | None = None
  log_requests: bool = False                  # --enable-log-requests
  max_log_len: int | None = None
  uds: str | None = None                      # a Unix domain socket instead of host:port
  root_path: str = ""
  ssl_keyfile: str | None = None
  ssl_certfile: str | None = None
  ssl_ca_certs: str | None = None
  ssl_cert_reqs: int = 0
  allowed_origins: list[str] = field(default_factory=list)   # CORS: off unless origins are given
  allowed_methods: list[str] = field(default_factory=lambda: ["*"])
  allowed_headers: list[str] = field(default_factory=lambda: ["*"])
  allow_credentials: bool = False
  allowed_hosts: list[str] | None = None      # Host names answered (None: the loopback's when bound to it, else any)
  header_timeout: float = 10.0                # seconds for a request's head to arrive
  body_timeout: float = 60.0                  # seconds for its body to arrive after the head
  keep_alive_timeout: float = 5.0             # seconds an idle connection stays open (uvicorn's)
  max_seqs_per_request: int = 4096            # prompts x n one request may ask for
  api_server_count: int = 1                   # API server processes in front of the engine cores

  def chat(self) -> ChatSettings:
    return ChatSettings(self.chat_template, self.trust_request_chat_template, self.enable_auto_tool_choice, self.tool_call_parser,
                        self.exclude_tools_when_tool_choice_none, self.reasoning_parser)

  def cors(self) -> CorsSettings:
    return CorsSettings(self.allowed_origins, self.allowed_methods, self.allowed_headers, self.allow_credentials)

  def hosts(self) -> list[str] | tuple[str, ...] | None:
    if self.allowed_hosts is not None: return self.allowed_hosts
    return None if self.uds else default_allowed_hosts(self.host)

  def uvicorn_options(self) -> dict[str, Any]:
    where = {"uds": self.uds} if self.uds else {"host": self.host, "port": self.port}
    ssl = {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile, "ssl_ca_certs": self.ssl_ca_certs,
           "ssl_cert_reqs": self.ssl_cert_reqs} if self.ssl_certfile else {}
    # uvicorn's own timeout (it cancels what is left) is only a backstop behind _drain's
    return {**where, **ssl, "log_level": self.log_level, "access_log": self.access_log, "lifespan": "on",
            "timeout_graceful_shutdown": self.shutdown_timeout + 5, "timeout_keep_alive": self.keep_alive_timeout,
            "http": protocol_class(ReadTimeouts(self.header_timeout, self.body_timeout))}


@dataclass
class ServerRole:
  """One of several API server processes, as the supervisor (entrypoints/api_servers.py) starts it: its index, the
  listening socket they share, the engine cores they share, the folder their request metrics add up in."""
  index: int
  listener: socket.socket
  cores: SharedCores
  metrics_dir: str


def server_state(config: EngineConfig, settings: ServerSettings, metrics_dir: str | None = None) -> ServerState:
  return ServerState(settings.served_model_name or config.model, config.model, settings.api_key or None,
                     other_model_names=settings.other_model_names, chat=settings.chat(),
                     request_logger=RequestLogger(log, settings.max_log_len) if settings.log_requests else None,
                     max_seqs_per_request=settings.max_seqs_per_request, metrics_dir=metrics_dir)


def run_server(config: EngineConfig, settings: ServerSettings, role: ServerRole | None = None) -> int:
  """Serve until stopped; the exit status. role: one of several API server processes (else the only one, which
  starts the engine cores itself)."""
  state = server_state(config, settings, role.metrics_dir if role else None)
  server: _Server | None = None

  def stop() -> None:
    if server is not None: server.should_exit = True

  def on_engine_dead(error: EngineDeadError) -> None:
    state.engine_error = str(error)
    stop()

  start = lambda: AsyncLLM.from_config(config, on_dead=on_engine_dead, shared=role.cores if role else None)
  app = create_app(state, start, on_load_failure=stop, cors=settings.cors(), root_path=settings.root_path,
                   allowed_hosts=settings.hosts(), load_before_serving=role is not None)
  signals = (signal.SIGTERM,) if role else (signal.SIGINT, signal.SIGTERM)   # the supervisor turns SIGINT into SIGTERM
  server = _Server(uvicorn.Config(app, **settings.uvicorn_options()), state, settings.shutdown_timeout, signals)
  try:
    server.run(sockets=[role.listener] if role else None)
  except Exception:
    traceback.print_exc()
    return 1
  return 1 if state.load_error or state.engine_error or not server.started else 0
