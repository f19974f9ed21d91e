"""Preemption by swapping (`preemption_mode="swap"`, `swap_space` GiB of host memory, as vLLM V0's): a preempted
sequence's KV blocks are copied to the swap space and back into free device blocks when it is readmitted, and it goes
on where it was. The fake engine loop (tests/scheduler_sim.py) moves fake K/V through a fake swap space and reads every
position back, so these prove what was copied where; then the engine on stories260K: forced swaps (the counters say
so) keep greedy outputs equal to each request run alone, with the float32 and the FP8 KV cache, prefix caching, n > 1
and asynchronous scheduling, and a full swap space falls back to recomputation. Nothing stays allocated in either pool."""
from __future__ import annotations

import types

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tests.conftest import assert_all_free
from tests.scheduler_sim import fake_token, length_verdict, plan, sim
from tests.test_block_manager import make_seq
from tests.test_invariance import PROMPTS, SHARED_PROMPTS, assert_matches_alone, run_alone
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.core.async_scheduling import AsyncScheduler
from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.scheduler import SchedulerConfig
from tinyvllm.core.sequence import SequenceStatus
from tinyvllm.core.swap_space import SwapSpace
from tinyvllm.engine.stats_logger import EngineSnapshot, StatsLogger
from tinyvllm.model_config import ModelConfig
from tinyvllm.platform.device import check_dtype
from tinyvllm.worker.kv_cache import KVCache


# ---- the scheduler ----
def test_a_swapped_out_sequence_goes_on_where_it_was():
  s = sim(num_blocks=4, block_size=4, prefix=False, swap_blocks=8)
  (a,) = s.add(list(range(8)), max_tokens=8)
  (b,) = s.add(list(range(10, 16)), max_tokens=8)
  s.step()
  out = s.step()   # a's 9th token needs a block: b, the newest, is swapped out
  assert out.preempted == [b] and plan(out) == [(a.seq_id, 1)]
  assert b.status is SequenceStatus.SWAPPED and b.num_computed_tokens == 6 and s.alloc.block_table(b) == []
  assert out.blocks_to_swap_out == [(2, 0), (3, 1)] and s.sched.swap_space.table(b.seq_id) == [0, 1]
  assert s.sched.swapped == [b] and s.sched.num_swapped_requests == 1
  while b.status is not SequenceStatus.RUNNING: out = s.step()
  # back in two fresh blocks, its two blocks copied in; it decodes its next token instead of recomputing 7
  assert len(out.blocks_to_swap_in) == 2 and [d for _, d in out.blocks_to_swap_in] == s.alloc.block_table(b)[:2]
  assert (b.seq_id, 1) in plan(out)
  s.run()
  assert [n for o in s.outputs for sid, n in plan(o) if sid == b.seq_id] == [6] + [1] * 7
  assert (s.sched.num_swapped_out_blocks, s.sched.num_swapped_in_blocks, s.sched.num_swap_fallbacks) == (2, 2, 0)
  s.check_done()


def test_a_full_swap_space_falls_back_to_recomputation():
  s = sim(num_blocks=4, block_size=4, prefix=False, swap_blocks=1)
  s.add(list(range(8)), max_tokens=8)
  (b,) = s.add(list(range(10, 16)), max_tokens=8)
  s.step()
  out = s.step()   # b holds 2 blocks, the swap space 1
  assert out.preempted == [b] and out.blocks_to_swap_out == []
  assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and s.sched.num_swap_fallbacks == 1
  s.run()
  assert [n for o in s.outputs for sid, n in plan(o) if sid == b.seq_id] == [6, 7] + [1] * 6   # recomputed
  assert s.sched.num_swapped_out_blocks == 0
  s.check_done()


def test_blocks_shared_with_others_stay_on_the_device_and_come_back_from_the_prefix_cache():
  s = sim(num_blocks=7, block_size=4, swap_blocks=8)
  system = list(range(100, 108))   # two full blocks, cached once computed
  (a,) = s.add([*system, 1, 2, 3], max_tokens=12)
  s.step()
  s.add(list(range(50, 57)), max_tokens=8)
  (b,) = s.add([*system, 5, 6, 7], max_tokens=8)   # the newest; shares a's two cached blocks
  shared = s.alloc.block_table(a)[:2]
  while not s.sched.swapped: out = s.step()
  assert out.preempted == [b] and s.sched.swapped == [b]
  # b's copy of each of its three blocks goes out; the two it shared stay on the device for a
  assert [d for d, _ in out.blocks_to_swap_out][:2] == shared and len(out.blocks_to_swap_out) == 3
  assert [s.alloc.blocks[i].ref_count for i in shared] == [1, 1]
  while b.status is not SequenceStatus.RUNNING: out = s.step()
  # the shared blocks are still in the prefix cache: b takes them again, and only its own third block is copied back
  table = s.alloc.block_table(b)
  assert table[:2] == shared and [d for _, d in out.blocks_to_swap_in if d in table] == [table[2]]
  s.run()
  s.check_done()


def test_forks_swap_separately_and_keep_their_shared_blocks_right():
  s = sim(num_blocks=6, block_size=4, swap_blocks=16, max_num_seqs=4)
  s.add(list(range(6)), max_tokens=9, n=3)
  s.run()
  assert s.sched.num_swapped_out_blocks > 0 and s.sched.num_swapped_in_blocks > 0
  s.check_done()


def test_the_swap_outs_of_a_step_that_runs_nothing_go_first_in_the_next():
  """Asynchronous scheduling: a's last token is in flight, and b, short of a block, preempts itself; the step runs
  nothing, so b's swap-out waits for the next step, where b comes back into a block its swap-out reads from."""
  sched = AsyncScheduler(BlockManager(3, 4, False), SchedulerConfig(preemption_mode="swap", num_swap_blocks=8))
  a, b = make_seq([1, 2, 3], max_tokens=1), make_seq(list(range(10, 18)), max_tokens=3)
  sched.add([a])
  sched.add([b])
  first = sched.schedule()
  kv = {block: b.token_ids[4 * i:4 * i + 4] for i, block in enumerate(sched.allocator.block_table(b))}
  idle = sched.schedule()
  assert not idle and idle.preempted == [b] and b.status is SequenceStatus.SWAPPED and b.num_pending == 1
  assert idle.blocks_to_swap_out == [] and len(sched.pending_swap_out) == 2
  carried = list(sched.pending_swap_out)
  sched.update_from_output(first, [[fake_token(seq)] for seq in first.sampling_seqs], length_verdict)
  assert a.is_finished and b.num_pending == 0
  out = sched.schedule()
  assert plan(out) == [(b.seq_id, 1)] and out.blocks_to_swap_out == carried
  assert {d for d, _ in out.blocks_to_swap_out} & {d for _, d in out.blocks_to_swap_in}   # why the swap-outs go first
  host = {h: kv[d] for d, h in out.blocks_to_swap_out}
  kv.update({d: host[h] for h, d in out.blocks_to_swap_in})
  assert [t for block in sched.allocator.block_table(b)[:2] for t in kv[block]] == b.token_ids[:8]


def test_swap_space_blocks_freed_by_a_swap_in_wait_for_the_next_step():
  swap = SwapSpace(4)
  assert swap.take(7, 3) == [0, 1, 2] and swap.num_free_blocks == 1
  assert swap.swap_in(7) == [0, 1, 2]
  assert not swap.can_hold(2) and swap.num_used_blocks == 3   # this step's copies still read them
  swap.end_step()
  assert swap.can_hold(4) and swap.num_used_blocks == 0
  swap.take(8, 2)
  swap.free(8)   # a sequence that ended while swapped out
  assert swap.num_free_blocks == 4 and swap.tables == {}


def test_the_stats_line_tells_swapped_requests():
  lines: list[str] = []
  stats = StatsLogger(lines.append, interval=0.0)
  stats.maybe_log(lambda: EngineSnapshot(running=2, waiting=1, kv_cache_usage=0.5, prefix_cache_hit_rate=None, swapped=3))
  assert "Running: 2 reqs, Swapped: 3 reqs, Waiting: 1 reqs" in lines[0]
  stats.maybe_log(lambda: EngineSnapshot(running=2, waiting=1, kv_cache_usage=0.5, prefix_cache_hit_rate=None))
  assert "Swapped" not in lines[1]   # recompute mode: vLLM V1's line


# ---- settings ----
@pytest.mark.parametrize(("fields", "words"), [
  ({"preemption_mode": "offload"}, "preemption_mode must be one of recompute, swap"),
  ({"preemption_mode": "swap", "swap_space": 0}, "preemption_mode=swap needs swap_space > 0"),
  ({"swap_space": -1}, "swap_space must be a number of GiB >= 0"),
  ({"preemption_mode": "swap", "scheduler": "static"}, "preemption_mode=swap needs the continuous scheduler"),
  ({"preemption_mode": "swap", "kv_cache": "contiguous"}, "the paged KV cache"),
])
def test_bad_swap_settings_are_config_errors(fields, words):
  with pytest.raises(ConfigError, match=words): EngineConfig(model="m", **fields)


def test_preemption_mode_none_is_vllms_default():
  assert EngineConfig(model="m", preemption_mode=None).preemption_mode == "recompute"


# ---- the KV cache's copies ----
BITS = {1: (dtypes.uint8, np.uint8), 2: (dtypes.uint16, np.uint16), 4: (dtypes.uint32, np.uint32)}


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16, dtypes.uint8], ids=["float32", "bfloat16", "fp8"])
def test_kv_cache_swaps_blocks_out_and_back_bit_for_bit(dtype):
  """The FP8 cache stores uint8 codes; bfloat16 runs where the backend computes it (not with an old clang on the CPU)."""
  try: check_dtype("CPU", dtype)
  except ConfigError as e: pytest.skip(str(e))
  config = ModelConfig("LlamaForCausalLM", 64, 128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=32,
                       max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=False)
  cache = KVCache(config, num_blocks=6, block_size=4, dtype=dtype, device="CPU", num_swap_blocks=3)
  raw_dtype, np_bits = BITS[dtype.itemsize]
  rng = np.random.default_rng(0)
  # random bit patterns (finite floats, so that no NaN is canonicalised on the way)
  raw = [(rng.integers(0, 2 ** (8 * dtype.itemsize), (24, 32), dtype=np.uint64) & 0x3F3F3F3F).astype(np_bits) for _ in range(4)]
  cache.layers = [tuple(Tensor(raw[2 * i + j]).bitcast(dtype).contiguous().realize() for j in range(2)) for i in range(2)]
  cache.swap_out([(1, 2), (4, 0), (0, 1)])   # device blocks 1, 4, 0 to swap blocks 2, 0, 1 (padded to 4 blocks)
  cache.swap_in([(2, 5), (0, 3), (1, 2)])    # and back into device blocks 5, 3, 2
  now = [t.bitcast(raw_dtype).numpy() for pair in cache.layers for t in pair]
  for got, was in zip(now, raw, strict=True):
    np.testing.assert_array_equal(got[20:24], was[4:8])     # block 1 -> 5
    np.testing.assert_array_equal(got[12:16], was[16:20])   # block 4 -> 3
    np.testing.assert_array_equal(got[8:12], was[0:4])      # block 0 -> 2
    np.testing.assert_array_equal(got[:8], was[:8])         # the rest untouched (the padding wrote nowhere)
    np.testing.assert_array_equal(got[16:20], was[16:20])
  np.testing.assert_array_equal(cache.swap[:, 4:8], np.stack(raw)[:, 0:4])   # device block 0 sits in swap block 1


# ---- the engine ----
def greedy(max_tokens: int, n: int = 1):
  return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


@pytest.fixture(scope="module")
def lone(stories_dir):
  return {kind: LLM(str(stories_dir), max_num_seqs=1, num_gpu_blocks=64, kv_cache_dtype=kind) for kind in ("auto", "fp8")}


def swap_engine(stories_dir, **kwargs):
  return LLM(str(stories_dir), **{"preemption_mode": "swap", "swap_space": 0.01, "num_gpu_blocks": 24, "max_num_seqs": 6, **kwargs})


def assert_swapped(llm) -> None:
  sched = llm.engine.scheduler
  assert sched.num_preemptions > 0 and sched.num_swapped_out_blocks > 0 and sched.num_swapped_in_blocks > 0
  assert sched.num_swap_fallbacks == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["auto", "fp8"])
def test_greedy_outputs_with_forced_swaps_equal_lone_runs(stories_dir, lone, reference, kind):
  prompts, max_tokens = [reference["prompt_ids"], *PROMPTS[6:14]], [100, 60, 40, 80, 30, 70, 50, 90, 45]
  refs = run_alone(lone[kind], prompts, max_tokens)
  llm = swap_engine(stories_dir, kv_cache_dtype=kind)
  outputs = llm.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)
  assert_swapped(llm)
  assert_matches_alone(outputs, refs)
  if kind == "auto": assert outputs[0].outputs[0].token_ids == reference["greedy_ids"][:100]
  assert_all_free(llm)
  pytest.importorskip("prometheus_client")
  from tinyvllm.entrypoints.metrics import EngineCollector
  metrics = {m.name: m.samples[0].value for m in EngineCollector(lambda: llm.engine.core.stats()).collect()}
  sched = llm.engine.scheduler
  assert metrics["tinyvllm:swapped_out_blocks"] == sched.num_swapped_out_blocks > 0
  assert metrics["tinyvllm:swapped_in_blocks"] == sched.num_swapped_in_blocks > 0
  assert metrics["tinyvllm:num_requests_swapped"] == metrics["tinyvllm:cpu_cache_usage_perc"] == 0


@pytest.mark.slow
def test_swaps_with_prefix_caching_forks_and_asynchronous_scheduling(stories_dir, lone, reference):
  prompts, max_tokens = SHARED_PROMPTS[:6], [60, 35, 50, 25, 45, 40]
  refs = run_alone(lone["auto"], prompts, max_tokens)
  for asynchronous in (False, True):
    llm = swap_engine(stories_dir, num_gpu_blocks=40, async_scheduling=asynchronous)
    params = [greedy(m, n=2 if i % 2 else 1) for i, m in enumerate(max_tokens)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_swapped(llm)
    assert llm.engine.allocator.prefix_hits > 0
    for sample in range(2):   # every greedy sample of an n=2 request is the lone greedy output
      assert_matches_alone([types.SimpleNamespace(outputs=o.outputs[sample % len(o.outputs):]) for o in outputs], refs)
    assert_all_free(llm)


@pytest.mark.slow
def test_a_swap_space_too_small_falls_back_to_recomputation(stories_dir, lone, reference):
  prompts, max_tokens = [reference["prompt_ids"], *PROMPTS[6:14]], [100, 60, 40, 80, 30, 70, 50, 90, 45]
  refs = run_alone(lone["auto"], prompts, max_tokens)
  block_bytes = KVCache.bytes_per_token(ModelConfig.from_folder(stories_dir), dtypes.float32) * 16   # float32 on the CPU
  llm = swap_engine(stories_dir, swap_space=5.5 * block_bytes / 2**30)   # five blocks of swap space
  assert llm.engine.scheduler.swap_space.num_blocks == 5
  outputs = llm.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)
  sched = llm.engine.scheduler
  assert sched.num_swap_fallbacks > 0 and sched.num_swapped_out_blocks > 0   # some swapped, some recomputed
  assert_matches_alone(outputs, refs)
  assert_all_free(llm)


def test_a_swap_space_smaller_than_a_block_is_refused(stories_dir):
  with pytest.raises(ConfigError, match=r"swap_space \(1e-09 GiB\) is smaller than one KV block"):
    LLM(str(stories_dir), preemption_mode="swap", swap_space=1e-9, num_gpu_blocks=8)
