"""The FastAPI app and its uvicorn server.

The HTTP server starts first and the engine core process starts loading the model beside it (AsyncLLM, engine/), so
/health answers 503 while the model loads and 200 once the core reports ready; a load error stops the server with
status 1 and the core's message. A guard in front of the routes checks the API key and caps the body size before any
JSON is parsed. SIGINT/SIGTERM stop new connections and requests, give in-flight requests --shutdown-timeout seconds
to finish, end the rest with an error (aborting them in the engine), stop the core process and exit 0. If the core
process fails or dies, every waiting client gets an error, new requests a 503, and the server exits with status 1.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import signal
import threading
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinyvllm.config import EngineConfig
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.engine.core_setup import log
from tinyvllm.engine.exceptions import EngineDeadError, EngineLoadError
from tinyvllm.entrypoints.common import ServerState
from tinyvllm.entrypoints.errors import APIError, install_error_handlers, parse_body
from tinyvllm.entrypoints.logger import RequestLogger
from tinyvllm.entrypoints.metrics import CONTENT_TYPE
from tinyvllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tinyvllm.entrypoints.serving_chat import create_chat_completion
from tinyvllm.entrypoints.serving_completion import create_completion
from tinyvllm.entrypoints.serving_tokenize import detokenize, list_models, tokenize

MAX_BODY_BYTES = 4 << 20      # a request body larger than this is a 413
DISCARD_LIMIT = 64 << 20       # past this, an oversized body is not even read to the end before the 413 goes out
OPEN_PATHS = ("/health", "/metrics")


def _authorized(headers: Headers, key: str) -> bool:
  scheme, _, token = headers.get("authorization", "").partition(" ")
  return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


async def _discard_body(receive: Receive, limit: int) -> None:
  """Read what the client still sends (up to `limit`), so it gets to read our answer instead of a broken pipe."""
  seen = 0
  while seen <= limit:
    message = await receive()
    if message["type"] != "http.request" or not message.get("more_body"): return
    seen += len(message.get("body", b""))


class GuardMiddleware:
  """API key (when set) on every path but /health and /metrics; then the body, buffered whole, at most max_body bytes."""

  def __init__(self, app: ASGIApp, state: ServerState, max_body: int = MAX_BODY_BYTES):
    self.app, self.state, self.max_body = app, state, max_body

  async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http": return await self.app(scope, receive, send)
    headers = Headers(scope=scope)
    if self.state.api_key and scope["path"] not in OPEN_PATHS and not _authorized(headers, self.state.api_key):
      err = APIError(401, "missing or incorrect API key (send Authorization: Bearer <key>)", code="invalid_api_key")
      return await err.response(headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
    declared = headers.get("content-length")
    if declared is not None and not declared.isdigit():
      return await APIError(400, "invalid Content-Length").response()(scope, receive, send)
    body = None if declared is not None and int(declared) > self.max_body else await self._read(receive)
    if body is None:
      await _discard_body(receive, DISCARD_LIMIT)
      err = APIError(413, f"the request body is larger than {self.max_body} bytes", code="request_too_large")
      return await err.response()(scope, receive, send)
    await self.app(scope, _replay(body, receive), send)

  async def _read(self, receive: Receive) -> bytes | None:
    chunks, size = [], 0
    while True:
      message = await receive()
      if message["type"] == "http.disconnect": return b"".join(chunks)
      chunks.append(message.get("body", b""))
      size += len(chunks[-1])
      if size > self.max_body: return None
      if not message.get("more_body"): return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
  sent = False

  async def replay() -> Message:
    nonlocal sent
    if sent: return await receive()   # afterwards: the server's own messages (http.disconnect)
    sent = True
    return {"type": "http.request", "body": body, "more_body": False}
  return replay


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
  """CORS (vLLM's defaults: any origin, method and header; no credentials)."""
  allowed_origins: list[str] = field(default_factory=lambda: ["*"])
  allowed_methods: list[str] = field(default_factory=lambda: ["*"])
  allowed_headers: list[str] = field(default_factory=lambda: ["*"])
  allow_credentials: bool = False


def create_app(state: ServerState, start: Callable[[], Awaitable[AsyncLLM]], on_load_failure: Callable[[], None] = lambda: None,
               max_body: int = MAX_BODY_BYTES, cors: CorsSettings | None = None, root_path: str = "") -> FastAPI:
  """`start` makes the engine (AsyncLLM.from_config(config), in the server): it runs once the app has started."""
  @contextlib.asynccontextmanager
  async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    loading = asyncio.create_task(_start_engine(state, start, on_load_failure))
    try:
      yield
    finally:
      loading.cancel()
      with contextlib.suppress(asyncio.CancelledError): await loading
      if state.engine is not None: await state.engine.shutdown()

  app = FastAPI(title="tinyvllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None, root_path=root_path)
  install_error_handlers(app)
  app.add_middleware(GuardMiddleware, state=state, max_body=max_body)
  cors = cors or CorsSettings()
  # outside the guard, so that a browser's preflight (which carries no API key) gets its CORS answer
  app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                     allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
  _add_routes(app, state)
  return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
  @app.post("/v1/completions")
  async def completions(request: Request) -> Response:
    return await create_completion(state, parse_body(CompletionRequest, await request.body()), request)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request) -> Response:
    return await create_chat_completion(state, parse_body(ChatCompletionRequest, await request.body()), request)

  @app.get("/v1/models")
  async def models() -> JSONResponse: return JSONResponse(list_models(state))

  @app.post("/tokenize")
  async def tokenize_route(request: Request) -> JSONResponse:
    return JSONResponse(tokenize(state, parse_body(TokenizeRequest, await request.body())))

  @app.post("/detokenize")
  async def detokenize_route(request: Request) -> JSONResponse:
    return JSONResponse(detokenize(state, parse_body(DetokenizeRequest, await request.body())))

  @app.get("/health")
  async def health() -> JSONResponse:
    engine = state.require_ready()
    if engine.is_dead: raise APIError(503, "the engine has stopped", code="service_unavailable")
    return JSONResponse({"status": "ok"})

  @app.get("/metrics")
  async def metrics() -> Response: return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def _drain(state: ServerState, grace: float) -> None:
  """Shutdown: refuse new requests, give in-flight ones `grace` seconds, then end the rest (which aborts them)."""
  state.draining = True
  await asyncio.sleep(grace)
  state.abort_in_flight()


class _Server(uvicorn.Server):
  def __init__(self, config: uvicorn.Config, state: ServerState, grace: float):
    super().__init__(config)
    self.state, self.grace = state, grace
    self._drain_task: asyncio.Task | None = None

  def handle_exit(self, sig: int, frame: Any) -> None:
    super().handle_exit(sig, frame)
    with contextlib.suppress(RuntimeError):   # no running loop: nothing is in flight
      loop = asyncio.get_running_loop()
      if self._drain_task is None: self._drain_task = loop.create_task(_drain(self.state, self.grace))

  @contextlib.contextmanager
  def capture_signals(self) -> Iterator[None]:
    # uvicorn's own version re-raises the signal once the server has stopped, which makes the exit status 130/143;
    # a requested shutdown that went well should exit 0
    if threading.current_thread() is not threading.main_thread():
      yield
      return
    previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
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
  log_requests: bool = False                  # --enable-log-requests
  max_log_len: int | None = None
  uds: str | None = None                      # a Unix domain socket instead of host:port
  root_path: str = ""
  ssl_keyfile: str | None = None
  ssl_certfile: str | None = None
  ssl_ca_certs: str | None = None
  ssl_cert_reqs: int = 0
  allowed_origins: list[str] = field(default_factory=lambda: ["*"])
  allowed_methods: list[str] = field(default_factory=lambda: ["*"])
  allowed_headers: list[str] = field(default_factory=lambda: ["*"])
  allow_credentials: bool = False

  def cors(self) -> CorsSettings:
    return CorsSettings(self.allowed_origins, self.allowed_methods, self.allowed_headers, self.allow_credentials)

  def uvicorn_options(self) -> dict[str, Any]:
    where = {"uds": self.uds} if self.uds else {"host": self.host, "port": self.port}
    ssl = {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile, "ssl_ca_certs": self.ssl_ca_certs,
           "ssl_cert_reqs": self.ssl_cert_reqs} if self.ssl_certfile else {}
    # uvicorn's own timeout (it cancels what is left) is only a backstop behind _drain's
    return {**where, **ssl, "log_level": self.log_level, "access_log": self.access_log, "lifespan": "on",
            "timeout_graceful_shutdown": self.shutdown_timeout + 5}


def server_state(config: EngineConfig, settings: ServerSettings) -> ServerState:
  return ServerState(settings.served_model_name or config.model, config.model, settings.api_key or None,
                     other_model_names=settings.other_model_names, chat_template=settings.chat_template,
                     request_logger=RequestLogger(log, settings.max_log_len) if settings.log_requests else None)


def run_server(config: EngineConfig, settings: ServerSettings) -> int:
  state = server_state(config, settings)
  server: _Server | None = None

  def stop() -> None:
    if server is not None: server.should_exit = True

  def on_engine_dead(error: EngineDeadError) -> None:
    state.engine_error = str(error)
    stop()

  start = lambda: AsyncLLM.from_config(config, on_dead=on_engine_dead)
  app = create_app(state, start, on_load_failure=stop, cors=settings.cors(), root_path=settings.root_path)
  server = _Server(uvicorn.Config(app, **settings.uvicorn_options()), state, settings.shutdown_timeout)
  try:
    server.run()
  except Exception:
    traceback.print_exc()
    return 1
  return 1 if state.load_error or state.engine_error or not server.started else 0
