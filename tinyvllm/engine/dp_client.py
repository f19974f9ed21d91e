"""Data parallelism behind one server (vLLM v1's DPLBAsyncMPClient): data_parallel_size engine cores, each a CoreClient
of its own (a process on this host, or a Ray actor: --distributed-executor-backend), one frontend in front of them.

Each request goes to the replica the router (engine/dp_router.py) picks, and its aborts and stop-string stops follow
it there; the replicas' outputs merge into one stream for AsyncLLM, each step's stats summed over the replicas' latest
(the step's own token counts as they are). The first replica to fail or die ends the whole engine: its EngineDeadError
reaches every waiting stream, as a lone core's does, and shutting down stops every replica.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tinyvllm.config import EngineConfig
from tinyvllm.engine.core_client import CoreClient
from tinyvllm.engine.core_launcher import CoreLauncher, ProcessLauncher, SharedCores
from tinyvllm.engine.core_setup import log
from tinyvllm.engine.dp_placement import replica_environments
from tinyvllm.engine.dp_router import PrefixRouter
from tinyvllm.engine.exceptions import EngineDeadError, EngineLoadError
from tinyvllm.engine.messages import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest, SampleRef, SchedulerStats


@dataclass(frozen=True)
class ReplicaStats:
  """One replica as /metrics shows it: requests routed to it since start, its stats after its latest step."""
  engine: int
  routed: int
  stats: SchedulerStats | None


class DPCoreClient:
  def __init__(self, clients: list[CoreClient], prefix_aware: bool, on_close: Callable[[], None] = lambda: None):
    """clients: one a replica, started; prefix_aware: route by cached prefixes (the replicas have a prefix cache);
    on_close: called once every replica has stopped (the Ray executor disconnects)."""
    self.clients, self.prefix_aware, self._on_close = clients, prefix_aware, on_close
    self.router: PrefixRouter | None = None                 # made when the replicas report their caches
    self.routed = [0] * len(clients)
    self._latest: list[SchedulerStats | None] = [None] * len(clients)
    self._reading: list[asyncio.Future | None] = [None] * len(clients)
    self._turn = 0
    self._samples: dict[str, tuple[int, set[int]]] = {}    # request id -> (its n, the samples that have finished)
    self.dead: EngineDeadError | None = None
    self.ready = self._closing = False

  # ---- to the replicas
  def add_request(self, request: EngineCoreRequest) -> None:
    assert self.router is not None, "add_request before wait_ready"
    replica = self.router.route(request.request_id, request.prompt_token_ids)
    self.routed[replica] += 1
    self._samples[request.request_id] = (request.sampling_params.n, set())
    self.clients[replica].add_request(request)

  def abort_requests(self, request_ids: list[str]) -> None:
    for replica, ids in self._by_owner(request_ids).items():
      self.clients[replica].abort_requests(ids)
      for rid in ids: self._release(rid)

  def stop_samples(self, samples: list[SampleRef]) -> None:
    for replica, refs in self._by_owner(samples).items():
      self.clients[replica].stop_samples(refs)
      for ref in refs: self._sample_done(ref.request_id, ref.index)

  def _by_owner(self, items: list[Any]) -> dict[int, list[Any]]:
    """Request ids or SampleRefs by the replica their request went to (a request already finished has none)."""
    owners: dict[int, list[Any]] = {}
    owner = {} if self.router is None else self.router.owner
    for item in items:
      replica = owner.get(item if isinstance(item, str) else item.request_id)
      if replica is not None: owners.setdefault(replica, []).append(item)
    return owners

  def _sample_done(self, request_id: str, index: int) -> None:
    entry = self._samples.get(request_id)
    if entry is None: return
    entry[1].add(index)
    if len(entry[1]) >= entry[0]: self._release(request_id)

  def _release(self, request_id: str) -> None:
    self._samples.pop(request_id, None)
    if self.router is not None: self.router.release(request_id)

  # ---- from the replicas
  async def wait_ready(self) -> EngineCoreInfo:
    """Every replica's facts once loaded (they must agree); EngineLoadError naming the replica that failed."""
    async def ready(rank: int, client: CoreClient) -> EngineCoreInfo:
      try: return await client.wait_ready()
      except EngineLoadError as e: raise EngineLoadError(f"data-parallel rank {rank}: {e}") from None
    infos = await asyncio.gather(*(ready(i, c) for i, c in enumerate(self.clients)))
    first = infos[0]
    for rank, info in enumerate(infos[1:], 1):
      if dataclasses.replace(info, num_kv_blocks=first.num_kv_blocks) != first:
        raise EngineLoadError(f"data-parallel rank {rank} loaded a different model or cache than rank 0 ({info} != {first})")
    capacities = [info.num_kv_blocks if self.prefix_aware else 0 for info in infos]
    self.router = PrefixRouter(len(self.clients), first.block_size, capacities)
    self.ready = True
    log(f"{len(self.clients)} data-parallel replicas ready ({'prefix-aware' if self.prefix_aware else 'least-loaded'} routing)")
    return dataclasses.replace(first, num_kv_blocks=min(info.num_kv_blocks for info in infos))   # what one replica holds

  async def get_output(self) -> EngineCoreOutputs:
    """The next step's outputs of any replica (in turn when several are waiting), its stats summed over the replicas;
    EngineDeadError once any replica has failed or exited."""
    if self.dead is not None: raise self.dead
    for i, client in enumerate(self.clients):
      if self._reading[i] is None: self._reading[i] = asyncio.ensure_future(client.get_output())
    reading = [f for f in self._reading if f is not None]
    if not any(f.done() for f in reading): await asyncio.wait(reading, return_when=asyncio.FIRST_COMPLETED)
    n = len(self.clients)
    replica = next(i for i in ((self._turn + k) % n for k in range(n)) if (f := self._reading[i]) is not None and f.done())
    self._turn = (replica + 1) % n
    done, self._reading[replica] = self._reading[replica], None
    assert done is not None
    try:
      outputs = done.result()
    except EngineDeadError as e:
      self.dead = e
      raise
    return self._account(replica, outputs)

  def _account(self, replica: int, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
    """What the router learns from a replica's step (finished and refused requests), and the summed stats."""
    for request_id, _ in outputs.rejected: self._release(request_id)
    for out in outputs.outputs:
      if out.finished: self._sample_done(out.request_id, out.index)
    if outputs.scheduler_stats is not None:
      self._latest[replica] = outputs.scheduler_stats
      outputs.scheduler_stats = sum_stats([s for s in self._latest if s is not None], outputs.scheduler_stats)
    return outputs

  def replica_stats(self) -> list[ReplicaStats]:
    return [ReplicaStats(i, self.routed[i], self._latest[i]) for i in range(len(self.clients))]

  # ---- the end
  async def shutdown(self) -> None:
    """Stop every replica (each as CoreClient.shutdown does), then what placed them."""
    if self._closing: return
    self._closing = True
    for f in self._reading:
      if f is not None: f.cancel()
    await asyncio.gather(*(f for f in self._reading if f is not None), return_exceptions=True)
    await asyncio.gather(*(c.shutdown() for c in self.clients), return_exceptions=True)
    self.dead = self.dead or EngineDeadError("the engine core was shut down")
    await asyncio.to_thread(self._on_close)


def sum_stats(latest: list[SchedulerStats], step: SchedulerStats) -> SchedulerStats:
  """The replicas' latest stats added up (counts, blocks, totals since start), with `step`'s own step counts."""
  total = _sum(latest)
  total.step_prompt_tokens, total.step_generation_tokens = step.step_prompt_tokens, step.step_generation_tokens
  return total


def _sum(items: list[Any]) -> Any:
  """Dataclasses of one type added up field by field: numbers summed, flags or-ed, nested dataclasses alike (None
  where every one is None)."""
  merged: dict[str, Any] = {}
  for f in dataclasses.fields(items[0]):
    values = [getattr(item, f.name) for item in items]
    present = [v for v in values if v is not None]
    if not present: merged[f.name] = None
    elif isinstance(present[0], bool): merged[f.name] = any(present)
    elif dataclasses.is_dataclass(present[0]): merged[f.name] = _sum(present)
    else: merged[f.name] = sum(present)
  return type(items[0])(**merged)


async def start_core_client(config: EngineConfig, shared: SharedCores | None = None) -> CoreClient | DPCoreClient:
  """The engine cores the server's frontend talks to: one process (data_parallel_size 1, executor mp), else a
  DPCoreClient over data_parallel_size replicas placed by the executor (mp: processes on this host; ray: actors).
  shared: one of several API servers, the cores the supervisor started."""
  prefix_aware = config.enable_prefix_caching and config.kv_cache == "paged"
  if shared is not None:
    shared_clients = [CoreClient(config, core, shared.client_index) for core in shared.cores]
    return shared_clients[0] if len(shared_clients) == 1 else DPCoreClient(shared_clients, prefix_aware)
  dp = config.data_parallel_size
  if config.distributed_executor_backend != "ray" and dp == 1: return CoreClient(config)
  on_close: Callable[[], None] = lambda: None
  if config.distributed_executor_backend == "ray":
    from tinyvllm.engine.ray_executor import RayExecutor
    executor = RayExecutor(config)
    await asyncio.to_thread(executor.connect)
    launchers: list[CoreLauncher] = list(executor.launchers())
    on_close = executor.close
  else:
    launchers = [ProcessLauncher(rank, env) for rank, env in enumerate(replica_environments(config))]
  clients: list[CoreClient] = []
  try:
    for launcher in launchers: clients.append(CoreClient(config, launcher))
  except BaseException:
    for client in clients: await client.shutdown()
    await asyncio.to_thread(on_close)
    raise
  return DPCoreClient(clients, prefix_aware, on_close=on_close)


def check_data_parallel(config: EngineConfig) -> None:
  """At start-up: the devices the replicas need are there (mp; Ray's are counted when it connects)."""
  if config.data_parallel_size > 1 and config.distributed_executor_backend in (None, "mp"): replica_environments(config)

