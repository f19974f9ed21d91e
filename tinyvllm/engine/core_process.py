"""The server's engine-core process (vLLM v1's EngineCoreProc): an EngineCore behind ZeroMQ sockets, requests and
aborts in, each step's outputs out, so that nothing the API process does (HTTP, JSON, tokenization, detokenization,
stop strings, SSE) shares a GIL with the step loop.

The API process spawns it (multiprocessing's spawn: CUDA must not be initialised in a forked child) and binds the
sockets; this process connects, loads the model and says READY with the facts the frontend validates requests with
(or FAILED with the reason, and exits 1). Then a busy loop: drain the input without blocking while there is work, run
a step, send its outputs; block on the input when idle. A crash in the loop is sent as FAILED before the process exits
1. Its life is bound to the API process: SIGINT (a terminal's Ctrl-C reaches the whole process group) is left to the
API process, which drains and then sends SHUTDOWN; if the API process dies, this one exits at once.

With several API server processes (--api-server-count, entrypoints/api_servers.py) it connects to each one's pair and
to the supervisor's (which started it and sends the SHUTDOWN): one input socket takes every sender's messages, and
each step's outputs are split by the server that sent the request (its client_index), every server getting the stats.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from tinyvllm.config import EngineConfig
from tinyvllm.engine.core import EngineCore
from tinyvllm.engine.core_setup import log
from tinyvllm.engine.messages import EngineCoreOutputs, OutputType, RequestType
from tinyvllm.engine.serialization import decode_input, encode

FAILED_MESSAGE_LINGER_MS = 5000   # how long closing waits for the last message (FAILED) to leave


def run_engine_core(config: EngineConfig, input_addresses: list[str], output_addresses: list[str]) -> None:
  """The process's entry point: input_addresses, where requests come from; output_addresses[i], API server i's."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  exit_with_parent()
  sys.exit(EngineCoreProc(config, input_addresses, output_addresses).run())


def exit_with_parent(who: str = "engine core") -> None:
  """Exit as soon as the parent process (the API server, or the supervisor of several) is gone (killed, crashed): a
  child never outlives it."""
  parent = multiprocessing.parent_process()
  if parent is None or parent.sentinel is None: return

  def watch() -> None:
    multiprocessing.connection.wait([parent.sentinel])
    log(f"the parent process is gone: the {who} exits")
    os._exit(1)
  threading.Thread(target=watch, name="tinyvllm-parent-watch", daemon=True).start()


class EngineCoreProc:
  def __init__(self, config: EngineConfig, input_addresses: list[str], output_addresses: list[str]):
    self.config = config
    self.context = zmq.Context()
    self.input = self.context.socket(zmq.PULL)   # fair-queued over every sender
    self.input.setsockopt(zmq.RCVHWM, 0)
    for address in input_addresses: self.input.connect(address)
    self.outputs: list[zmq.Socket] = []
    for address in output_addresses:
      output = self.context.socket(zmq.PUSH)
      output.setsockopt(zmq.SNDHWM, 0)
      output.connect(address)
      self.outputs.append(output)
    self.core: EngineCore | None = None
    self.shutdown_requested = False
    self.rejected: list[tuple[int, str, str]] = []   # refused requests: (the API server that sent it, its id, why)
    self.owners: dict[str, int] = {}   # request id -> the API server it came from (with several)

  def run(self) -> int:
    """Load, say READY, serve until SHUTDOWN; the exit status (1: loading failed or the loop crashed)."""
    try:
      try:
        self.core = EngineCore(self.config)
      except Exception as e:
        self._send(OutputType.FAILED, f"{type(e).__name__}: {e}")
        return 1
      self._send(OutputType.READY, self.core.info())
      try:
        self.busy_loop()
      except Exception as e:
        traceback.print_exc()
        self._send(OutputType.FAILED, f"{type(e).__name__}: {e}")
        return 1
      return 0
    finally:
      self.input.close(linger=0)
      for output in self.outputs: output.close(linger=FAILED_MESSAGE_LINGER_MS)
      self.context.term()

  def busy_loop(self) -> None:
    while not self.shutdown_requested:
      changed = self.process_input_queue()
      if self.shutdown_requested: return
      assert self.core is not None
      if self.core.has_unfinished_requests(): self.send_outputs(self.core.step())
      elif changed or self.rejected:   # an abort freed blocks, say, with no step to report it: the stats alone
        self.send_outputs(EngineCoreOutputs(scheduler_stats=self.core.stats(), timestamp=time.time()))

  def process_input_queue(self) -> bool:
    """Apply every message waiting; block for the first one when the core has nothing to do. Whether any came."""
    assert self.core is not None
    block, changed = not self.core.has_unfinished_requests(), False
    while True:
      try:
        frames = self.input.recv_multipart(flags=0 if block else zmq.NOBLOCK, copy=True)
      except zmq.Again:
        return changed
      self.handle(*decode_input(frames))
      block, changed = False, True

  def handle(self, kind: RequestType, payload: Any) -> None:
    assert self.core is not None
    if kind is RequestType.ADD:
      try:
        self.core.add_request(payload)
      except ValueError as e:
        self.rejected.append((payload.client_index, payload.request_id, str(e)))
      else:
        if len(self.outputs) > 1: self.owners[payload.request_id] = payload.client_index
    elif kind is RequestType.ABORT:
      self.core.abort_requests(payload)
      self._forget(payload)
    elif kind is RequestType.STOP_SAMPLES:
      self.core.stop_samples(payload)
      self._forget([ref.request_id for ref in payload])   # the last sample stopped retires its request
    elif kind is RequestType.SHUTDOWN: self.shutdown_requested = True

  def _forget(self, request_ids: list[str]) -> None:
    """The owners of requests the core no longer has."""
    assert self.core is not None
    for rid in request_ids:
      if rid not in self.core.requests: self.owners.pop(rid, None)

  def send_outputs(self, outputs: EngineCoreOutputs) -> None:
    refused, self.rejected = self.rejected, []
    if len(self.outputs) == 1:
      outputs.rejected = [(rid, reason) for _, rid, reason in refused]
      self.outputs[0].send_multipart(encode(OutputType.OUTPUTS, outputs))
      return
    for output, share in zip(self.outputs, self.split(outputs, refused), strict=True):
      output.send_multipart(encode(OutputType.OUTPUTS, share))

  def split(self, outputs: EngineCoreOutputs, refused: list[tuple[int, str, str]]) -> list[EngineCoreOutputs]:
    """Each API server's share of a step's outputs (its requests', and the refusals of what it sent), each with the
    step's stats; the owners of requests that finished in the step forgotten."""
    shares = [EngineCoreOutputs([], outputs.scheduler_stats, outputs.timestamp) for _ in self.outputs]
    for out in outputs.outputs: shares[self.owners.get(out.request_id, 0)].outputs.append(out)
    for owner, rid, reason in refused: shares[owner].rejected.append((rid, reason))
    self._forget([out.request_id for out in outputs.outputs if out.finished])
    return shares

  def _send(self, kind: OutputType, payload: Any) -> None:
    """READY and FAILED go to every API server."""
    frames = encode(kind, payload)
    for output in self.outputs: output.send_multipart(frames)
