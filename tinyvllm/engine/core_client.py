"""The API process's handle on the engine-core process (vLLM v1's AsyncMPClient): it binds the two ZeroMQ sockets
(requests, aborts and stops out without ever blocking; each step's outputs in, read by asyncio), starts the core (a
spawned process, or a Ray actor: engine/core_launcher.py) and watches it: its exit is noticed at once (the process
sentinel, on the event loop), and from then on every read raises EngineDeadError with the reason (the FAILED message
it sent, or how it ended) and sends are dropped.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from tinyvllm.config import EngineConfig
from tinyvllm.engine.core_launcher import CoreLauncher, ProcessLauncher
from tinyvllm.engine.exceptions import EngineDeadError, EngineLoadError
from tinyvllm.engine.messages import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest, OutputType, RequestType, SampleRef
from tinyvllm.engine.serialization import decode_output, encode

LAST_WORDS_S = 0.2         # after the process exits, how long its last messages (FAILED) may still take to arrive
SHUTDOWN_TIMEOUT_S = 10.0  # how long a SHUTDOWN may take before the process is killed
UNSENT_RETRY_S = 0.01      # how often a message the input socket did not take (no core connected yet) is tried again


class CoreClient:
  def __init__(self, config: EngineConfig, launcher: CoreLauncher | None = None, client_index: int = 0):
    """Start the core (it starts loading the model at once; launcher: a process on this host unless given); call from
    the event loop that will read it. client_index: this API server's among several sharing the core."""
    launcher = launcher or ProcessLauncher()
    self.client_index = client_index
    self._loop = asyncio.get_running_loop()
    self._folder = Path(tempfile.mkdtemp(prefix="tinyvllm-"))
    self._context = zmq.Context()
    self._input = self._context.socket(zmq.PUSH)
    self._input.setsockopt(zmq.SNDHWM, 0)
    self._input.bind(launcher.endpoint(self._folder, "input"))
    self._output = zmq.asyncio.Context(self._context).socket(zmq.PULL)
    self._output.setsockopt(zmq.RCVHWM, 0)
    self._output.bind(launcher.endpoint(self._folder, "output"))
    addresses = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (self._input, self._output)]   # tcp://...:* gets its port
    self.process = launcher.start(config, *addresses)
    self._exited = self._loop.create_future()
    self.process.watch(self._loop, self._on_exit)
    self._receiving: asyncio.Future | None = None
    self._unsent: collections.deque[list[bytes]] = collections.deque()   # messages the socket has not taken yet
    self._retrying = False
    self.dead: EngineDeadError | None = None
    self.ready = self._closing = False

  def _on_exit(self) -> None:
    self.process.unwatch(self._loop)
    if not self._exited.done(): self._exited.set_result(None)

  # ---- to the core
  def add_request(self, request: EngineCoreRequest) -> None:
    request.client_index = self.client_index
    self._send(RequestType.ADD, request)
  def abort_requests(self, request_ids: list[str]) -> None: self._send(RequestType.ABORT, request_ids)
  def stop_samples(self, samples: list[SampleRef]) -> None: self._send(RequestType.STOP_SAMPLES, samples)

  def _send(self, kind: RequestType, payload: Any) -> None:
    if self.dead is not None or self._exited.done(): return   # nobody would read it
    self._unsent.append(encode(kind, payload))
    if not self._retrying: self._flush()   # (else the retry scheduled sends it, after those before it)

  def _flush(self) -> None:
    """Send what waits, in order, never blocking the event loop. The socket takes a message only once the core has
    connected to it: a core started by the supervisor of several API servers connects on its own schedule (it retries
    every 100 ms), and its READY may come before (on the other socket), so a request then waits here, not dropped."""
    self._retrying = False
    while self._unsent and self.dead is None and not self._exited.done():
      try: self._input.send_multipart(self._unsent[0], flags=zmq.NOBLOCK)
      except zmq.Again:   # no core connected yet (the high-water mark is off: nothing else refuses a message)
        self._retrying = True
        self._loop.call_later(UNSENT_RETRY_S, self._flush)
        return
      self._unsent.popleft()

  # ---- from the core
  async def wait_ready(self) -> EngineCoreInfo:
    """The core's facts once its model is loaded; EngineLoadError with the reason if loading failed."""
    try:
      kind, payload = await self._next()
    except EngineDeadError as e:
      raise EngineLoadError(str(e)) from None
    if kind is OutputType.FAILED: raise EngineLoadError(payload)
    assert kind is OutputType.READY, kind
    self.ready = True
    return payload

  async def get_output(self) -> EngineCoreOutputs:
    """The next step's outputs; EngineDeadError once the core has failed or exited (what it sent before comes first)."""
    kind, payload = await self._next()
    if kind is OutputType.FAILED:
      self.dead = EngineDeadError(f"the engine core failed: {payload}")
      raise self.dead
    return payload

  async def _next(self) -> tuple[OutputType, Any]:
    if self.dead is not None: raise self.dead
    if self._receiving is None: self._receiving = asyncio.ensure_future(self._output.recv_multipart())
    if not self._receiving.done(): await asyncio.wait((self._receiving, self._exited), return_when=asyncio.FIRST_COMPLETED)
    if self._receiving.done():
      frames, self._receiving = self._receiving.result(), None
      return decode_output(frames)
    return await self._last_words()

  async def _last_words(self) -> tuple[OutputType, Any]:
    """The process has exited: what it sent before (a FAILED message) if anything, else EngineDeadError."""
    assert self._receiving is not None
    with contextlib.suppress(asyncio.TimeoutError): await asyncio.wait_for(asyncio.shield(self._receiving), LAST_WORDS_S)
    if self._receiving.done() and not self._receiving.cancelled():
      frames, self._receiving = self._receiving.result(), None
      return decode_output(frames)
    self.dead = EngineDeadError(self.process.death())
    raise self.dead

  # ---- the end
  async def shutdown(self) -> None:
    """Stop the core (SHUTDOWN once it is serving, else at once), wait for it, close the sockets. Never leaves it running
    (a shared core is left to the supervisor that started it)."""
    if self._closing: return
    self._closing = True
    if self.process.owned: await self._stop_core()
    if self._receiving is not None: self._receiving.cancel()
    self.dead = self.dead or EngineDeadError("the engine core was shut down")
    self.process.close()
    self._input.close(linger=0)
    self._output.close(linger=0)
    self._context.term()
    shutil.rmtree(self._folder, ignore_errors=True)

  async def _stop_core(self) -> None:
    if self.process.is_alive() and self.ready and self.dead is None:
      self._send(RequestType.SHUTDOWN, None)
      with contextlib.suppress(asyncio.TimeoutError): await asyncio.wait_for(asyncio.shield(self._exited), SHUTDOWN_TIMEOUT_S)
    if self.process.is_alive():
      self.process.kill()
    await asyncio.to_thread(self.process.join)
    self._on_exit()
