"""Data parallelism's routing without a model: the router's choices (a shared prefix goes where it went before, unless
that replica is much busier; load spreads otherwise), the DP client's bookkeeping over stand-in replicas (each request,
its aborts and stops go to one replica; finished, aborted and refused requests stop counting), the stats summed over
replicas, the placement of replicas on this host's devices, and the offline engine's refusal."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.engine import dp_placement
from tinyvllm.engine.dp_client import DPCoreClient, sum_stats
from tinyvllm.engine.dp_router import BALANCE_ABS_THRESHOLD, PrefixRouter, block_hashes
from tinyvllm.engine.llm_engine import check_one_replica
from tinyvllm.engine.messages import (
  EngineCoreInfo,
  EngineCoreOutput,
  EngineCoreOutputs,
  EngineCoreRequest,
  SampleRef,
  SchedulerStats,
  SwapStats,
)
from tinyvllm.sampling_params import SamplingParams

BLOCK = 16
SYSTEM = list(range(100, 100 + 4 * BLOCK))   # a 64-token "system prompt" shared by the requests that start with it


def prompt(seed: int, length: int = 40) -> list[int]: return [(seed * 7919 + i * 31) % 500 for i in range(length)]


def test_block_hashes_chain_full_blocks_only():
  a, b = block_hashes([*SYSTEM, 1, 2, 3], BLOCK), block_hashes(SYSTEM + [9] * 20, BLOCK)
  assert len(a) == 4 and len(b) == 5 and a == b[:4]
  assert block_hashes([5] * 15, BLOCK) == []
  assert block_hashes([1] * BLOCK + [2] * BLOCK, BLOCK)[1] != block_hashes([3] * BLOCK + [2] * BLOCK, BLOCK)[1]   # chained


def test_a_shared_prefix_goes_where_it_went_before():
  router = PrefixRouter(4, BLOCK, [1000] * 4)
  first = router.route("a", SYSTEM + prompt(1))
  for i in range(3): router.route(f"other-{i}", prompt(10 + i))   # the three other replicas get one each
  assert sorted(router.load) == [1, 1, 1, 1]
  assert router.route("b", SYSTEM + prompt(2)) == first             # more loaded now, but holding the prefix
  assert router.route("c", SYSTEM[:2 * BLOCK] + prompt(3)) == first  # half the prefix still matches


def test_load_spreads_without_a_shared_prefix():
  router = PrefixRouter(3, BLOCK, [1000] * 3)
  assert [router.route(f"r{i}", prompt(i)) for i in range(6)] == [0, 1, 2, 0, 1, 2]
  router.release("r1")
  router.release("r4")
  assert router.route("short", [1, 2, 3]) == 1     # the least loaded (no full block: nothing to match)
  router.release("unknown")                        # ignored
  assert router.load == [2, 1, 2]


def test_a_much_busier_replica_loses_its_prefix_to_the_least_loaded():
  router = PrefixRouter(2, BLOCK, [1000] * 2)
  home = router.route("first", SYSTEM + prompt(0))
  for i in range(BALANCE_ABS_THRESHOLD): router.route(f"same-{i}", SYSTEM + prompt(i + 1))
  assert router.load[home] == BALANCE_ABS_THRESHOLD + 1 and router.load[1 - home] == 0
  assert router.route("overflow", SYSTEM + prompt(99)) == 1 - home   # beyond the slack: load wins
  assert router.route("next", SYSTEM + prompt(98)) == 1 - home       # both hold it now: the less loaded of the two


def test_the_memory_of_a_replica_is_its_cache_size():
  router = PrefixRouter(2, BLOCK, [4, 4])
  home = router.route("a", SYSTEM)                          # 4 blocks: all remembered
  router.release("a")
  router.route("b", prompt(5, 4 * BLOCK))                   # goes to the other replica (in turn)
  router.release("b")
  router.route("c", [7] * (4 * BLOCK))                      # back to `home`: its 4 new blocks push SYSTEM's out
  router.release("c")
  assert router.prefixes[home].match(block_hashes(SYSTEM, BLOCK)) == 0
  no_cache = PrefixRouter(2, BLOCK, [0, 0])                 # prefix caching off: load alone
  assert [no_cache.route(f"x{i}", SYSTEM) for i in range(4)] == [0, 1, 0, 1]


class FakeClient:
  """A stand-in replica: records what it is sent, answers wait_ready, yields the outputs it is given."""

  def __init__(self, blocks: int = 64):
    self.sent: list[tuple[str, object]] = []
    self.info = EngineCoreInfo(512, 512, [2], blocks, BLOCK, True, None)
    self.outputs: asyncio.Queue = asyncio.Queue()
    self.process, self.stopped = None, False

  def add_request(self, request): self.sent.append(("add", request.request_id))
  def abort_requests(self, ids): self.sent.append(("abort", list(ids)))
  def stop_samples(self, refs): self.sent.append(("stop", [(r.request_id, r.index) for r in refs]))
  async def wait_ready(self): return self.info
  async def get_output(self): return await self.outputs.get()
  async def shutdown(self): self.stopped = True


def request(rid: str, tokens: list[int], n: int = 1) -> EngineCoreRequest:
  return EngineCoreRequest(rid, tokens, SamplingParams(n=n, max_tokens=4), [2], 0.0)


def test_the_dp_client_sends_each_request_its_aborts_and_stops_to_one_replica():
  async def main() -> None:
    replicas = [FakeClient(64), FakeClient(48)]
    client = DPCoreClient(replicas, prefix_aware=True)   # type: ignore[arg-type]
    info = await client.wait_ready()
    assert info.num_kv_blocks == 48   # what one replica holds, the smaller
    client.add_request(request("a", SYSTEM + prompt(1), n=2))
    client.add_request(request("b", prompt(2)))
    client.add_request(request("c", SYSTEM + prompt(3)))
    assert replicas[0].sent == [("add", "a"), ("add", "c")] and replicas[1].sent == [("add", "b")]
    client.abort_requests(["b", "gone"])
    client.stop_samples([SampleRef("a", 1)])
    assert replicas[1].sent[-1] == ("abort", ["b"]) and replicas[0].sent[-1] == ("stop", [("a", 1)])
    assert client.router is not None and client.router.load == [2, 0]
    stats = SchedulerStats(num_running_reqs=2, kv_cache_blocks_used=5, kv_cache_blocks_total=64, step_generation_tokens=3)
    replicas[0].outputs.put_nowait(EngineCoreOutputs([EngineCoreOutput("a", 0, [7], finish_reason="length")], stats,
                                                     rejected=[("c", "too long")]))
    out = await client.get_output()
    assert [o.request_id for o in out.outputs] == ["a"] and client.router.load == [0, 0]   # a: both samples done; c: refused
    replicas[1].outputs.put_nowait(EngineCoreOutputs([], SchedulerStats(num_running_reqs=1, kv_cache_blocks_total=48,
                                                                        step_prompt_tokens=9)))
    merged = (await client.get_output()).scheduler_stats
    assert merged is not None and (merged.num_running_reqs, merged.kv_cache_blocks_used, merged.kv_cache_blocks_total) == (3, 5, 112)
    assert (merged.step_prompt_tokens, merged.step_generation_tokens) == (9, 0)   # that step's own
    assert [(r.engine, r.routed) for r in client.replica_stats()] == [(0, 2), (1, 1)]
    await client.shutdown()
    assert all(r.stopped for r in replicas)
  asyncio.run(main())


def test_sum_stats_adds_nested_stats_and_keeps_none():
  a = SchedulerStats(1, 2, 3, 10, True, 100, 50, 1, 7, 8, SwapStats(1, 2, 4, 5, 6, 0))
  b = SchedulerStats(2, 0, 1, 10, True, 20, 10, 0, 0, 1, None)
  total = sum_stats([a, b], b)
  assert (total.num_running_reqs, total.kv_cache_blocks_total, total.prefix_cache_hits, total.prefix_caching) == (3, 20, 60, True)
  assert total.swap == SwapStats(1, 2, 4, 5, 6, 0) and total.spec_decoding is None and total.step_prompt_tokens == 0
  assert total.prefix_cache_hit_rate == pytest.approx(60 / 120)


def test_replicas_take_consecutive_gpus(monkeypatch):
  monkeypatch.delenv("DEV", raising=False)   # tinygrad sets DEV once any test in this worker opened a device
  monkeypatch.setattr(dp_placement, "cuda_devices", lambda: ["4", "5", "6", "7"])
  config = EngineConfig(model="m", data_parallel_size=2, tensor_parallel_size=2)
  assert dp_placement.replica_environments(config) == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
  with pytest.raises(ConfigError, match=r"data_parallel_size 3 x tensor_parallel_size 2 needs 6 CUDA devices; .* has 4"):
    dp_placement.replica_environments(dataclasses.replace(config, data_parallel_size=3))
  assert dp_placement.replica_environments(dataclasses.replace(config, device="CPU")) == [{}, {}]
  monkeypatch.setattr(dp_placement, "cuda_devices", lambda: None)
  assert dp_placement.replica_environments(dataclasses.replace(config, tensor_parallel_size=1)) == [{}, {}]   # the CPU


def test_the_offline_engine_refuses_data_parallelism():
  with pytest.raises(ConfigError, match=r"data_parallel_size 2: the offline engine .* --data-parallel-size 2"):
    check_one_replica(EngineConfig(model="m", data_parallel_size=2))
  check_one_replica(EngineConfig(model="m"))
