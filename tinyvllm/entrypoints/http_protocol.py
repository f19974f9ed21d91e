"""The HTTP/1.1 connection: uvicorn's h11 protocol with read deadlines, so that no client holds a connection open by
sending nothing, or a little at a time.

- A request's head (request line and headers) must arrive within `header_timeout` seconds: counted from the
  connection's start, or from the first byte of a later request on a kept-alive connection (an idle kept-alive
  connection is uvicorn's: closed after --timeout-keep-alive seconds).
- Its body must arrive within `body_timeout` seconds of the head.
- A body left unread because the answer went out first (a 413 for a declared length over the limit) is discarded as
  it arrives, within `body_timeout` too; the connection is then reused.
A request that misses its deadline gets a 408 in OpenAI's error shape and the connection is closed; an idle
connection is closed without one. A request h11 cannot parse gets a 400 in OpenAI's shape (uvicorn's is plain text).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tinyvllm.entrypoints.errors import APIError


@dataclass(frozen=True)
class ReadTimeouts:
  header_timeout: float = 10.0
  body_timeout: float = 60.0


def _closing_response(error: APIError, reason: str) -> bytes:
  """An error response written straight to the connection, which closes after it (h11's state is past helping)."""
  body = json.dumps(error.body(), separators=(",", ":"))
  return (f"HTTP/1.1 {error.status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
          f"connection: close\r\n\r\n{body}").encode()


class DeadlineH11Protocol(H11Protocol):
  """uvicorn's H11Protocol with one read deadline at a time: for a request's head, for its body, or for discarding an
  answered request's body (`ReadTimeouts`; `protocol_class` makes the class for a server's settings)."""
  timeouts = ReadTimeouts()

  def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
    self._deadline: asyncio.TimerHandle | None = None
    self._deadline_for: object = None   # the request cycle the deadline is for (None: the next request's head)
    self._what = ""
    super().connection_made(transport)
    self._arm(self.timeouts.header_timeout, "head")

  def connection_lost(self, exc: Exception | None) -> None:
    self._disarm()
    super().connection_lost(exc)

  def send_400_response(self, msg: str) -> None:
    self.transport.write(_closing_response(APIError(400, f"malformed HTTP request: {msg}"), "Bad Request"))
    self.transport.close()

  def data_received(self, data: bytes) -> None:
    super().data_received(data)
    self._follow()

  def on_response_complete(self) -> None:
    super().on_response_complete()
    self._follow()

  def _follow(self) -> None:
    """Set the deadline for what the connection waits for now."""
    if self.transport.is_closing(): return self._disarm()
    cycle = self.cycle
    if cycle is None or cycle.response_complete:
      if self.conn.their_state is h11.SEND_BODY: return self._arm_for(cycle, self.timeouts.body_timeout, "discard")
      if self.conn.trailing_data[0]: return self._arm_for(None, self.timeouts.header_timeout, "head")
      return self._idle()
    if cycle.more_body: return self._arm_for(cycle, self.timeouts.body_timeout, "body")
    self._disarm()   # the whole request is in: the answer may take as long as it takes

  def _idle(self) -> None:
    """Between requests: uvicorn's keep-alive timeout closes the connection (data on it may have stopped that timer)."""
    self._disarm()
    if self.timeout_keep_alive_task is None:
      self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

  def _arm_for(self, cycle: object, seconds: float, what: str) -> None:
    """Start a deadline unless one for the same thing is already running (a deadline is not reset by more data)."""
    if self._deadline is not None and self._deadline_for is cycle and self._what == what: return
    self._arm(seconds, what)
    self._deadline_for = cycle

  def _arm(self, seconds: float, what: str) -> None:
    self._disarm()
    self._what = what
    self._deadline = self.loop.call_later(seconds, self._expire, what, seconds)

  def _disarm(self) -> None:
    if self._deadline is not None: self._deadline.cancel()
    self._deadline, self._deadline_for = None, None

  def _expire(self, what: str, seconds: float) -> None:
    self._deadline = None
    if self.transport.is_closing(): return
    cycle = self.cycle
    unanswered = what == "body" and cycle is not None and not cycle.response_started
    if unanswered:   # the application waits for the body: it sees the client gone, and nothing it sends goes out
      cycle.disconnected = True
      cycle.message_event.set()
    if unanswered or (what == "head" and self.conn.trailing_data[0]):
      what = "body" if unanswered else "headers"
      error = APIError(408, f"the request's {what} did not arrive within {seconds:g} s", code="request_timeout")
      self.transport.write(_closing_response(error, "Request Timeout"))
    self.transport.close()


def protocol_class(timeouts: ReadTimeouts) -> type[DeadlineH11Protocol]:
  """The connection class for a server with these deadlines (uvicorn makes one instance per connection)."""
  return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"timeouts": timeouts})
