"""`serve --api-server-count N` (vLLM's): N API server processes in front of the engine cores, so that a busy server's
HTTP, JSON, tokenization, detokenization, stop strings and SSE encoding use N CPUs rather than one.

This process, the supervisor, binds the listening socket, starts the engine cores (one per data-parallel replica,
placed as a lone server places them) and N API server processes (entrypoints/api_server.py, each given a ServerRole).
They share the listening socket: the kernel hands each new connection to one of them. Each binds a pair of ZeroMQ
sockets per core, and every core connects to every pair: it takes requests from any server and sends each its own
requests' outputs, and every server the step's stats (engine/core_process.py). /metrics on any server shows the
request metrics of all of them (prometheus_client's multiprocess files, in a folder the supervisor gives them).

Life: SIGINT and SIGTERM reach the servers as SIGTERM from here (they ignore SIGINT, so a terminal's Ctrl-C, which
reaches the whole process group, counts once): the first drains in-flight requests, a second ends them, a third exits
at once. Once every server has exited the supervisor stops the cores (SHUTDOWN, then a kill after SHUTDOWN_TIMEOUT_S)
and exits 0. A core that dies is reported to every server as a FAILED message on its socket (their clients get the
error, and they exit 1); a server that exits on its own makes the supervisor stop the others; either way the exit
status is 1. If the supervisor itself dies, every child exits with it (each watches its parent).
"""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import zmq

from tinyvllm.config import ConfigError, EngineConfig, environment_for_children
from tinyvllm.engine.core_launcher import ProcessCore, ProcessLauncher, SharedCoreLauncher, SharedCores
from tinyvllm.engine.core_process import exit_with_parent
from tinyvllm.engine.core_setup import log, set_log_label
from tinyvllm.engine.dp_placement import replica_environments
from tinyvllm.engine.messages import OutputType, RequestType
from tinyvllm.engine.serialization import encode
from tinyvllm.entrypoints.api_server import ServerRole, ServerSettings, run_server

SHUTDOWN_TIMEOUT_S = 10.0   # how long the cores get to stop after SHUTDOWN before they are killed
LISTEN_BACKLOG = 2048       # connections the kernel queues for the servers (uvicorn's default)
POLL_S = 1.0


def listening_sockets(settings: ServerSettings, count: int) -> list[socket.socket]:
  """One listening socket per API server, bound and listening (ConfigError if that fails): on Linux each its own on the
  same port with SO_REUSEPORT, so that the kernel spreads new connections evenly over the servers (a burst of them too,
  which a shared socket hands to whichever server wakes first); elsewhere, and on a Unix socket, one they share."""
  if settings.uds: return [_listen(_unix_socket(settings.uds), settings.uds)] * count
  host, port = settings.host, settings.port
  sockets: list[socket.socket] = []
  try:
    for _ in range(count if sys.platform == "linux" else 1):
      sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
      sockets.append(sock)
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      if sys.platform == "linux": sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
      _listen(sock, f"{host}:{port}", (host, port))
      port = sock.getsockname()[1]   # port 0: the one the first got
  except BaseException:
    for sock in sockets: sock.close()
    raise
  return sockets if len(sockets) == count else sockets * count


def _unix_socket(path: str) -> socket.socket:
  with contextlib.suppress(FileNotFoundError):
    if stat.S_ISSOCK(os.stat(path).st_mode): os.unlink(path)   # a stale socket file, as uvicorn does
  return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)


def _listen(sock: socket.socket, where: str, address: str | tuple[str, int] | None = None) -> socket.socket:
  try:
    sock.bind(address if address is not None else where)
  except OSError as e:
    sock.close()
    raise ConfigError(f"cannot listen on {where}: {e.strerror or e}") from None
  if sock.family == socket.AF_UNIX: os.chmod(where, 0o666)
  sock.listen(LISTEN_BACKLOG)
  sock.set_inheritable(True)
  return sock


def run_api_server(config: EngineConfig, settings: ServerSettings, role: ServerRole) -> None:
  """An API server process's entry point."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  set_log_label(f"tinyvllm api server {role.index}")
  exit_with_parent("API server")
  sys.exit(run_server(config, settings, role))


@dataclass
class Core:
  """An engine core the supervisor started: its process and the socket that tells it to stop."""
  rank: int | None
  process: multiprocessing.process.BaseProcess
  control: zmq.Socket
  notices: list[zmq.Socket]   # one per API server, onto its output socket for this core: where a death is told
  reported: bool = False


def run_api_servers(config: EngineConfig, settings: ServerSettings) -> int:
  """Serve through settings.api_server_count API server processes until stopped; the exit status."""
  listeners = listening_sockets(settings, settings.api_server_count)
  folder = Path(tempfile.mkdtemp(prefix="tinyvllm-"))
  try:
    return Supervisor(config, settings, folder).run(listeners)
  finally:
    for listener in set(listeners): listener.close()
    shutil.rmtree(folder, ignore_errors=True)


def address_words(sock: socket.socket, settings: ServerSettings) -> str:
  if settings.uds: return f"unix socket {settings.uds}"
  host, port = sock.getsockname()[:2]
  return f"{'https' if settings.ssl_certfile else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"


class Supervisor:
  def __init__(self, config: EngineConfig, settings: ServerSettings, folder: Path):
    self.config, self.settings, self.folder = config, settings, folder
    self.count = settings.api_server_count
    self.context = zmq.Context()
    self.cores: list[Core] = []
    self.servers: list[multiprocessing.process.BaseProcess] = []
    self.signals = 0
    self.failed = False

  def _start(self, listeners: list[socket.socket]) -> None:
    where = address_words(listeners[0], self.settings)
    (self.folder / "metrics").mkdir()
    environments = replica_environments(self.config)
    ranked = len(environments) > 1
    for rank, env in enumerate(environments): self.cores.append(self._start_core(rank if ranked else None, rank, env))
    for index, listener in enumerate(listeners): self.servers.append(self._start_server(index, listener))
    for listener in set(listeners): listener.close()   # the servers have theirs: a server's socket dies with it
    log(f"{self.count} API server processes started (pids {', '.join(str(p.pid) for p in self.servers)}), serving on {where}")

  def _address(self, name: str) -> str: return f"ipc://{self.folder}/{name}"

  def _start_core(self, rank: int | None, index: int, env: dict[str, str]) -> Core:
    control = self.context.socket(zmq.PUSH)
    control.bind(self._address(f"control-{index}"))
    inputs = [self._address(f"input-{k}-{index}") for k in range(self.count)]
    outputs = [self._address(f"output-{k}-{index}") for k in range(self.count)]
    process = ProcessLauncher(rank, env).spawn(self.config, [*inputs, self._address(f"control-{index}")], outputs)
    notices = []
    for output in outputs:
      notice = self.context.socket(zmq.PUSH)
      notice.connect(output)
      notices.append(notice)
    return Core(rank, process, control, notices)

  def _start_server(self, index: int, listener: socket.socket) -> multiprocessing.process.BaseProcess:
    cores = [SharedCoreLauncher(self._address(f"input-{index}-{i}"), self._address(f"output-{index}-{i}"), core.process.pid or 0,
                                core.rank) for i, core in enumerate(self.cores)]
    role = ServerRole(index, listener, SharedCores(index, cores), str(self.folder / "metrics"))
    config = self.config if index == 0 else dataclasses.replace(self.config, disable_log_stats=True)   # one stats line
    process = multiprocessing.get_context("spawn").Process(target=run_api_server, args=(config, self.settings, role),
                                                           name=f"tinyvllm-api-server-{index}", daemon=False)
    with environment_for_children({"PROMETHEUS_MULTIPROC_DIR": role.metrics_dir}): process.start()
    return process

  # ---- the loop
  def run(self, listeners: list[socket.socket]) -> int:
    """Start the cores and the servers on `listeners` (one a server), watch them until every server has exited, stop
    the cores; the exit status. Never leaves a child running."""
    previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
      self._start(listeners)
      self._watch()
    finally:
      for sig, handler in previous.items(): signal.signal(sig, handler)
      for server in self.servers:   # only where starting failed half-way: the loop waits for every server
        if server.exitcode is None: server.kill()
      self._stop_cores()
      self.context.destroy(linger=0)
    return 1 if self.failed else 0

  def _watch(self) -> None:
    """Until every API server has exited: report dead cores to the servers, stop the others when one exits alone."""
    while any(server.exitcode is None for server in self.servers):
      live = [s.sentinel for s in self.servers if s.exitcode is None] + [c.process.sentinel for c in self.cores if not c.reported]
      multiprocessing.connection.wait(live, timeout=POLL_S)
      for core in self.cores:
        if not core.reported and core.process.exitcode is not None: self._core_died(core)
      for index, server in enumerate(self.servers):
        if server.exitcode is not None and (server.exitcode != 0 or not self.signals) and not self.failed:
          log(f"API server {index} (pid {server.pid}) exited with status {server.exitcode}: stopping the others")
          self.failed = True
          self._signal_servers()

  def _core_died(self, core: Core) -> None:
    core.reported = True
    death = ProcessCore(core.process, core.rank).death()
    log(death)
    self.failed = True
    for notice in core.notices:
      with contextlib.suppress(zmq.Again): notice.send_multipart(encode(OutputType.FAILED, death), flags=zmq.NOBLOCK)

  def _on_signal(self, sig: int, frame: FrameType | None) -> None:
    self.signals += 1
    log(f"signal {signal.Signals(sig).name}: passed on to the API servers as SIGTERM ({self.signals})")
    self._signal_servers()

  def _signal_servers(self) -> None:
    for server in self.servers:
      if server.exitcode is None and server.pid is not None: os.kill(server.pid, signal.SIGTERM)

  def _stop_cores(self) -> None:
    for core in self.cores:
      if core.process.exitcode is None:
        with contextlib.suppress(zmq.Again): core.control.send_multipart(encode(RequestType.SHUTDOWN, None), flags=zmq.NOBLOCK)
    for core in self.cores:
      core.process.join(SHUTDOWN_TIMEOUT_S)
      if core.process.exitcode is None:
        log(f"the engine core process (pid {core.process.pid}) did not stop in {SHUTDOWN_TIMEOUT_S:g} s: killed")
        core.process.kill()
        core.process.join()
