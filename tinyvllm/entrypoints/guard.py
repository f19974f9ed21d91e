"""What every request passes before a route sees it: the Host check, the API key, the body's size, and the answer to
an error the route did not expect.

- Host: a server bound to the loopback answers only requests addressed to the loopback (`localhost`, `127.0.0.1`,
  `[::1]`, any port) unless --allowed-hosts says otherwise, so that a web page cannot reach it through DNS rebinding.
- API key (when set) on every path but /health and /metrics.
- Body: buffered whole, at most max_body bytes. A declared Content-Length over the limit is answered with a 413 at
  once, without reading the body (the connection discards it as it arrives: http_protocol.py); a chunked body is
  read up to the limit. A client that goes away while sending its body gets nothing.
- An unexpected error in a route is a 500 in OpenAI's shape, logged once, and the connection stays usable.
"""
from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinyvllm.entrypoints.errors import APIError

logger = logging.getLogger("tinyvllm.server")
MAX_BODY_BYTES = 4 << 20      # a request body larger than this is a 413
OPEN_PATHS = ("/health", "/metrics")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(bind_host: str | None) -> tuple[str, ...] | None:
  """The Host names a server bound to `bind_host` answers: the loopback's when it is bound to the loopback (None: any,
  for a server bound to other addresses or to a Unix socket)."""
  if bind_host is None: return None
  return LOOPBACK_HOSTS if bind_host.strip("[]") in LOOPBACK_HOSTS else None


def host_name(header: str) -> str:
  """A Host header's name without its port: "localhost:8000" -> "localhost", "[::1]:8000" -> "::1"."""
  header = header.strip().lower()
  if header.startswith("["): return header[1:header.find("]")] if "]" in header else header
  return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _authorized(headers: Headers, key: str) -> bool:
  scheme, _, token = headers.get("authorization", "").partition(" ")
  return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class GuardMiddleware:
  def __init__(self, app: ASGIApp, api_key: str | None = None, allowed_hosts: Iterable[str] | None = None,
               max_body: int = MAX_BODY_BYTES):
    self.app, self.api_key, self.max_body = app, api_key, max_body
    self.allowed_hosts = None if allowed_hosts is None or "*" in allowed_hosts else frozenset(h.lower() for h in allowed_hosts)

  async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http": return await self.app(scope, receive, send)
    if (refusal := self._refusal(Headers(scope=scope), scope["path"])) is not None:
      return await refusal.response(headers=refusal.headers)(scope, receive, send)
    body = await self._read(receive)
    if body is None: return   # the client went away
    if isinstance(body, APIError): return await body.response()(scope, receive, send)
    await self._run(scope, _replay(body, receive), send)

  def _refusal(self, headers: Headers, path: str) -> APIError | None:
    """What refuses the request before its body is read: the Host, the API key, the declared length."""
    host = headers.get("host")
    if self.allowed_hosts is not None and host is not None and host_name(host) not in self.allowed_hosts:
      return APIError(400, f"the Host header {host!r} is not one this server answers (start it with --allowed-hosts to "
                           "add names)", code="invalid_host")
    if self.api_key and path not in OPEN_PATHS and not _authorized(headers, self.api_key):
      err = APIError(401, "missing or incorrect API key (send Authorization: Bearer <key>)", code="invalid_api_key")
      err.headers = {"WWW-Authenticate": "Bearer"}
      return err
    declared = headers.get("content-length")
    if declared is not None and not declared.isdigit(): return APIError(400, "invalid Content-Length")
    if declared is not None and int(declared) > self.max_body: return self._too_large()
    return None

  def _too_large(self) -> APIError:
    return APIError(413, f"the request body is larger than {self.max_body} bytes", code="request_too_large")

  async def _read(self, receive: Receive) -> bytes | APIError | None:
    """The whole body; a 413 past max_body; None if the client went away."""
    chunks, size = [], 0
    while True:
      message = await receive()
      if message["type"] == "http.disconnect": return None
      chunks.append(message.get("body", b""))
      size += len(chunks[-1])
      if size > self.max_body: return self._too_large()
      if not message.get("more_body"): return b"".join(chunks)

  async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
    """The route; an error it raises before answering becomes a 500, after which the connection is still usable."""
    started = False

    async def watched_send(message: Message) -> None:
      nonlocal started
      started = True
      await send(message)
    try:
      await self.app(scope, receive, watched_send)
    except Exception as e:
      logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
      if started: return
      await APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error").response()(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
  sent = False

  async def replay() -> Message:
    nonlocal sent
    if sent: return await receive()   # afterwards: the server's own messages (http.disconnect)
    sent = True
    return {"type": "http.request", "body": body, "more_body": False}
  return replay
