"""What runs an engine core for the server's CoreClient, and how the client watches it: a process on this host (mp, the
default) or a Ray actor (engine/ray_executor.py). A launcher says where the client binds its two ZeroMQ sockets (the
core connects to them) and starts the core; the handle it returns reports the core's exit on the event loop, kills it,
waits for it and says how it ended.
"""
from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from tinyvllm.config import EngineConfig, environment_for_children
from tinyvllm.engine import core_process
from tinyvllm.engine.core_setup import log


class CoreHandle(Protocol):
  """A running engine core, as its client sees it."""
  pid: int | None

  @property
  def exitcode(self) -> int | None: ...
  def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
    """Call on_exit on the loop once the core has exited (once)."""
  def unwatch(self, loop: asyncio.AbstractEventLoop) -> None: ...
  def is_alive(self) -> bool: ...
  def kill(self) -> None: ...
  def join(self, timeout: float | None = None) -> None: ...
  def death(self) -> str:
    """How it ended, for EngineDeadError: 'the engine core process (pid 12) was killed by signal 9'."""
  def close(self) -> None:
    """Free what it holds once it has exited."""


class CoreLauncher(Protocol):
  def endpoint(self, folder: Path, name: str) -> str:
    """Where the client binds a socket (a ZeroMQ endpoint; `folder` is the client's own, for ipc:// files)."""
  def start(self, config: EngineConfig, input_address: str, output_address: str) -> CoreHandle: ...


def rank_words(rank: int | None) -> str: return "" if rank is None else f" of data-parallel rank {rank}"


class ProcessCore:
  """The core in a spawned process (CUDA must not be initialised in a forked child)."""

  def __init__(self, process: multiprocessing.process.BaseProcess, rank: int | None):
    self.process, self.rank = process, rank
    self.pid = process.pid

  @property
  def exitcode(self) -> int | None: return self.process.exitcode

  def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
    loop.add_reader(self.process.sentinel, on_exit)

  def unwatch(self, loop: asyncio.AbstractEventLoop) -> None: loop.remove_reader(self.process.sentinel)
  def is_alive(self) -> bool: return self.process.is_alive()
  def kill(self) -> None: self.process.kill()
  def join(self, timeout: float | None = None) -> None: self.process.join(timeout)

  def death(self) -> str:
    code = self.process.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
    return f"the engine core process{rank_words(self.rank)} (pid {self.pid}) {how}"

  def close(self) -> None: pass


class ProcessLauncher:
  """mp: the core in a process on this host; `env`: variables it starts with (CUDA_VISIBLE_DEVICES: its GPUs)."""

  def __init__(self, rank: int | None = None, env: dict[str, str] | None = None):
    self.rank, self.env = rank, env or {}

  def endpoint(self, folder: Path, name: str) -> str: return f"ipc://{folder}/{name}"

  def start(self, config: EngineConfig, input_address: str, output_address: str) -> ProcessCore:
    spawn = multiprocessing.get_context("spawn")
    process = spawn.Process(target=core_process.run_engine_core, args=(config, input_address, output_address),
                            name="tinyvllm-engine-core", daemon=True)
    with environment_for_children(self.env): process.start()
    placed = "".join(f", {k}={v}" for k, v in self.env.items())
    log(f"engine core process started (pid {process.pid}){rank_words(self.rank)}{placed}")
    return ProcessCore(process, self.rank)
