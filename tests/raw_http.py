"""A raw HTTP/1.1 client on one socket (h11), for the tests that must control the bytes sent (lying lengths, half-sent
heads, garbage) and know whether a connection was kept."""
from __future__ import annotations

import contextlib
import json
import socket
import time
from dataclasses import dataclass

import h11


@dataclass
class RawResponse:
  status: int
  headers: dict[str, str]
  body: bytes

  def json(self) -> dict: return json.loads(self.body)


class RawConnection:
  def __init__(self, port: int, timeout: float = 30.0):
    self.port, self.timeout = port, timeout
    self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    self.conn = h11.Connection(h11.CLIENT)

  def close(self) -> None:
    """Close the connection now, even under a thread blocked reading it (close alone would wait for that read)."""
    with contextlib.suppress(OSError): self.sock.shutdown(socket.SHUT_RDWR)
    self.sock.close()

  def send_raw(self, data: bytes) -> None: self.sock.sendall(data)

  def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> RawResponse:
    """One request with a correct Content-Length (headers may override Host and Content-Type)."""
    if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE: self.conn.start_next_cycle()
    base = {"host": f"127.0.0.1:{self.port}", "content-length": str(len(body))}
    sent = {**base, **{k.lower(): v for k, v in (headers or {}).items()}}
    self.send_raw(self.conn.send(h11.Request(method=method, target=path, headers=list(sent.items()))))
    if body: self.send_raw(self.conn.send(h11.Data(data=body)))
    self.send_raw(self.conn.send(h11.EndOfMessage()))
    return self.read_response()

  def read_response(self) -> RawResponse:
    status, headers, chunks = 0, {}, []
    while True:
      event = self.conn.next_event()
      if event is h11.NEED_DATA:
        data = self.sock.recv(65536)
        self.conn.receive_data(data)
        continue
      if isinstance(event, h11.Response):
        status, headers = event.status_code, {k.decode().lower(): v.decode() for k, v in event.headers}
      elif isinstance(event, h11.Data): chunks.append(bytes(event.data))
      elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)): break
    return RawResponse(status, headers, b"".join(chunks))

  @property
  def reusable(self) -> bool:
    """Whether the next request may go on this connection (both sides done, nobody said close)."""
    return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
  """Everything the server sends until it closes the connection, and how long its first byte took to come."""
  start, chunks, first = time.monotonic(), [], None
  sock.settimeout(timeout)
  while True:
    try: data = sock.recv(65536)
    except (ConnectionResetError, TimeoutError): break
    if not data: break
    first = first if first is not None else time.monotonic() - start
    chunks.append(data)
  return b"".join(chunks), first if first is not None else time.monotonic() - start


def status_and_json(raw: bytes) -> tuple[int, dict | None]:
  """A whole raw response's status and JSON body (None if its body is not JSON)."""
  head, _, body = raw.partition(b"\r\n\r\n")
  status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
  try: return status, json.loads(body)
  except ValueError: return status, None
