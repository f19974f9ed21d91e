"""--distributed-executor-backend ray: the data-parallel replicas' engine cores as Ray actors on the cluster (needs the
ray extra: pip install 'tinyvllm[ray]').

This API server is the cluster's driver: ray.init() connects to the cluster RAY_ADDRESS names, else to one already
running on this machine, else starts a local one (as vLLM does); it disconnects (stopping a cluster it started) when
the server stops. Each replica is an actor with tensor_parallel_size GPUs (num_gpus; Ray makes them its only visible
ones, so the replica's devices are CUDA:0 ...) and a CPU, spread over the nodes; on a cluster without GPUs it asks for
the CPU alone. The actor runs the same engine-core loop as a core process (engine/core_process.py) over the same two
ZeroMQ sockets, which the server binds on its node's address (tcp) for the actor to connect to. The actor's log lines
reach the server's log through Ray.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.engine.core_launcher import rank_words
from tinyvllm.engine.core_setup import log

RAY_MISSING = "--distributed-executor-backend ray needs Ray: pip install 'tinyvllm[ray]'"


def import_ray() -> Any:
  try:
    import ray
  except ImportError:
    raise ConfigError(RAY_MISSING) from None
  return ray


class EngineCoreActor:
  """The engine core in a Ray actor (made a Ray actor class when first launched)."""

  def where(self) -> tuple[str, int]:
    """The actor's node and process."""
    import os

    import ray
    return ray.get_runtime_context().get_node_id(), os.getpid()

  def run(self, config: EngineConfig, input_address: str, output_address: str) -> int:
    """Load, say READY, serve until SHUTDOWN, as a core process does; the exit status."""
    from tinyvllm.engine.core_process import EngineCoreProc
    return EngineCoreProc(config, [input_address], [output_address]).run()


class RayExecutor:
  def __init__(self, config: EngineConfig):
    self.config = config
    self.ray = import_ray()
    self.connected = False
    self.num_gpus = 0   # per replica

  def connect(self) -> None:
    """Join (or start) the cluster and check that it can place every replica (ConfigError, disconnected, if not)."""
    ray = self.ray
    if not ray.is_initialized():
      ray.init(include_dashboard=False)
      self.connected = True
    try:
      self.num_gpus = self._check_resources(ray.nodes())
    except BaseException:
      self.close()
      raise
    resources = ray.cluster_resources()
    log(f"Ray cluster: {sum(n['Alive'] for n in ray.nodes())} nodes, {resources.get('CPU', 0):g} CPUs, "
        f"{resources.get('GPU', 0):g} GPUs; {self.config.data_parallel_size} engine replicas with "
        f"{self.num_gpus or 'no'} GPU(s) each")

  def _check_resources(self, nodes: list[dict[str, Any]]) -> int:
    """The GPUs a replica asks for (tensor_parallel_size, none without GPUs or with --device CPU), after checking that
    the alive nodes have room for every replica."""
    dp, tp = self.config.data_parallel_size, self.config.tensor_parallel_size
    alive = [n["Resources"] for n in nodes if n.get("Alive")]
    on_cpu = (self.config.device or "").partition(":")[0].upper() == "CPU"
    gpus = 0 if on_cpu or not any(r.get("GPU", 0) for r in alive) else tp
    need = {"CPU": 1.0, **({"GPU": float(gpus)} if gpus else {})}
    room = sum(min(int(r.get(k, 0) // v) for k, v in need.items()) for r in alive)
    if room < dp:
      have = ", ".join(f"{r.get('CPU', 0):g} CPUs/{r.get('GPU', 0):g} GPUs" for r in alive) or "none alive"
      raise ConfigError(f"data_parallel_size {dp}: the Ray cluster has room for {room} replicas of "
                        f"{' and '.join(f'{v:g} {k}' for k, v in need.items())} each (its nodes: {have})")
    return gpus

  def launchers(self) -> list[RayLauncher]:
    actor_class = self.ray.remote(EngineCoreActor)
    options = {"num_cpus": 1, "num_gpus": self.num_gpus, "scheduling_strategy": "SPREAD", "max_restarts": 0}
    host = self.ray.util.get_node_ip_address()
    return [RayLauncher(self.ray, actor_class, options, host, rank) for rank in range(self.config.data_parallel_size)]

  def close(self) -> None:
    """Disconnect from the cluster (a local one this server started stops with it)."""
    if self.connected: self.ray.shutdown()
    self.connected = False


class RayLauncher:
  def __init__(self, ray: Any, actor_class: Any, options: dict[str, Any], host: str, rank: int):
    self.ray, self.actor_class, self.options, self.host, self.rank = ray, actor_class, options, host, rank

  def endpoint(self, folder: Path, name: str) -> str: return f"tcp://{self.host}:*"

  def start(self, config: EngineConfig, input_address: str, output_address: str) -> RayCore:
    actor = self.actor_class.options(**self.options).remote()
    log(f"engine core Ray actor{rank_words(self.rank)} requested ({self.options['num_gpus'] or 'no'} GPU(s))")
    return RayCore(self.ray, actor, actor.where.remote(), actor.run.remote(config, input_address, output_address), self.rank)


class RayCore:
  """A core in a Ray actor, watched through its run() call: the call returns (SHUTDOWN, or a crash it reported) or
  raises (the actor died)."""
  owned = True

  def __init__(self, ray: Any, actor: Any, where: Any, run: Any, rank: int):
    self.ray, self.actor, self.run, self.rank = ray, actor, run, rank
    self.pid: int | None = None
    self.node: str | None = None
    self._where = where
    self._code: int | None = None
    self._error: BaseException | None = None
    self._done = False
    self._tasks: list[asyncio.Task] = []

  @property
  def exitcode(self) -> int | None: return self._code

  def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
    self._tasks = [loop.create_task(self._placed()), loop.create_task(self._wait(on_exit))]

  async def _placed(self) -> None:
    with contextlib.suppress(Exception):
      self.node, self.pid = await self._where
      log(f"engine core Ray actor{rank_words(self.rank)} running on node {self.node} (pid {self.pid})")

  async def _wait(self, on_exit: Callable[[], None]) -> None:
    try: self._code = await self.run
    except Exception as e: self._error = e
    self._done = True
    on_exit()

  def unwatch(self, loop: asyncio.AbstractEventLoop) -> None: pass
  def is_alive(self) -> bool: return not self._done and not self.ray.wait([self.run], timeout=0)[0]

  def kill(self) -> None:
    with contextlib.suppress(Exception): self.ray.kill(self.actor, no_restart=True)

  def join(self, timeout: float | None = None) -> None: self.ray.wait([self.run], timeout=timeout)

  def death(self) -> str:
    who = f"the engine core Ray actor{rank_words(self.rank)}" + (f" (pid {self.pid})" if self.pid is not None else "")
    if self._error is not None: return f"{who} died: {type(self._error).__name__}: {str(self._error).splitlines()[0]}"
    return f"{who} exited with status {self._code}"

  def close(self) -> None:
    """Kill the actor (after SHUTDOWN its run() has returned, but it holds its worker and GPUs until killed)."""
    self.kill()
    for task in self._tasks: task.cancel()
