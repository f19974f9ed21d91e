"""What runs an engine core for the server's CoreClient, and how the client watches it: a process on this host (mp, the
default) or a Ray actor (engine/ray_executor.py), both owned by the client; or, with several API server processes, a
core the supervisor started and shares between them (SharedCoreLauncher). A launcher says where the client binds its
two ZeroMQ sockets (the core connects to them) and starts the core; the handle it returns reports the core's exit on
the event loop, kills it, waits for it and says how it ended.
"""
from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tinyvllm.config import EngineConfig, environment_for_children
from tinyvllm.engine import core_process
from tinyvllm.engine.core_setup import log


class CoreHandle(Protocol):
  """A running engine core, as its client sees it."""
  pid: int | None
  owned: bool   # the client stops it when it shuts down (a shared core is the supervisor's to stop)

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
  def start(self, config: EngineConfig, input_address: str, output_address: str) -> CoreHandle:
    """Start the core connected to the client's two sockets (a shared core is already running)."""


def rank_words(rank: int | None) -> str: return "" if rank is None else f" of data-parallel rank {rank}"


class ProcessCore:
  """The core in a spawned process (CUDA must not be initialised in a forked child)."""
  owned = True

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
    return ProcessCore(self.spawn(config, [input_address], [output_address]), self.rank)

  def spawn(self, config: EngineConfig, input_addresses: list[str], output_addresses: list[str]) -> multiprocessing.process.BaseProcess:
    """The core process, connected to every address given (several API servers: one pair each)."""
    spawn = multiprocessing.get_context("spawn")
    process = spawn.Process(target=core_process.run_engine_core, args=(config, input_addresses, output_addresses),
                            name="tinyvllm-engine-core", daemon=True)
    with environment_for_children(self.env): process.start()
    placed = "".join(f", {k}={v}" for k, v in self.env.items())
    log(f"engine core process started (pid {process.pid}){rank_words(self.rank)}{placed}")
    return process


class SharedCore:
  """A core the supervisor of several API servers started (entrypoints/api_servers.py): it watches the process and
  tells every client of its death with a FAILED message on the client's output socket, and stops it at the end."""
  owned = False

  def __init__(self, pid: int, rank: int | None):
    self.pid, self.rank = pid, rank

  @property
  def exitcode(self) -> int | None: return None
  def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None: pass
  def unwatch(self, loop: asyncio.AbstractEventLoop) -> None: pass
  def is_alive(self) -> bool: return True   # as far as this client can tell: its death comes as a message
  def kill(self) -> None: pass
  def join(self, timeout: float | None = None) -> None: pass
  def death(self) -> str: return f"the engine core process{rank_words(self.rank)} (pid {self.pid}) is gone"
  def close(self) -> None: pass


@dataclass(frozen=True)
class SharedCoreLauncher:
  """A running core's place for one API server: the addresses this server binds (the core connects to them)."""
  input_address: str
  output_address: str
  pid: int
  rank: int | None = None

  def endpoint(self, folder: Path, name: str) -> str: return self.input_address if name == "input" else self.output_address
  def start(self, config: EngineConfig, input_address: str, output_address: str) -> SharedCore: return SharedCore(self.pid, self.rank)


@dataclass(frozen=True)
class SharedCores:
  """What one of several API servers talks to: the running cores (one a data-parallel replica), as client_index."""
  client_index: int
  cores: list[SharedCoreLauncher]
