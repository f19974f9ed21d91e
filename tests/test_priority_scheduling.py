"""Priority scheduling (`scheduling_policy="priority"`, vLLM's meaning: lower values first, ties by arrival), driven by
the fake engine loop (tests/scheduler_sim.py): the order of admission, which running sequences a higher-priority
waiting one preempts and when it does not, the victim when blocks run out, and random runs that end with every
position computed once and nothing held. Then the engine: greedy outputs under priority scheduling with forced
preemption equal to each request run alone, and the priority argument refused where it cannot be honoured."""
from __future__ import annotations

import random

import pytest

from tests.conftest import assert_all_free
from tests.scheduler_sim import plan, random_requests, sim
from tests.test_invariance import PROMPTS, assert_matches_alone, run_alone
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.core.scheduling_policy import check_priority
from tinyvllm.core.sequence import SequenceStatus


def priority_sim(**kwargs):
  return sim(scheduling_policy="priority", **kwargs)


def first_scheduled(s) -> list[int]:
  """Sequence ids in the order of their first step."""
  order: list[int] = []
  for out in s.outputs:
    order += [sid for sid, _ in plan(out) if sid not in order]
  return order


# ---- admission order ----
def test_waiting_requests_are_admitted_by_priority_then_arrival():
  s = priority_sim(max_num_seqs=1)
  (a,) = s.add([1, 2, 3], max_tokens=2, priority=2)
  (b,) = s.add([4, 5, 6], max_tokens=2, priority=0)
  (c,) = s.add([7, 8, 9], max_tokens=2, priority=1)
  (d,) = s.add([10, 11, 12], max_tokens=2, priority=0)
  assert list(s.sched.waiting) == [b, d, c, a]
  s.run()
  assert first_scheduled(s) == [b.seq_id, d.seq_id, c.seq_id, a.seq_id]
  assert s.sched.num_preemptions == 0   # equal priorities never preempt each other
  s.check_done()


def test_fcfs_admits_in_arrival_order():
  s = sim(max_num_seqs=1)
  seqs = [s.add([i, i + 1], max_tokens=2)[0] for i in range(0, 8, 2)]
  s.run()
  assert first_scheduled(s) == [seq.seq_id for seq in seqs]
  s.check_done()


def test_a_higher_priority_arrival_takes_a_seat_from_a_running_one():
  s = priority_sim(max_num_seqs=1, prefix=False)
  (a,) = s.add(list(range(5)), max_tokens=6, priority=1)
  s.step()
  (b,) = s.add(list(range(10, 13)), max_tokens=3, priority=0)
  out = s.step()
  assert out.preempted == [a] and plan(out) == [(b.seq_id, 3)] and list(s.sched.waiting) == [a]
  assert a.status is SequenceStatus.WAITING and a.num_computed_tokens == 0   # recomputed later (preemption_mode recompute)
  s.run()
  assert first_scheduled(s) == [a.seq_id, b.seq_id] and s.sched.num_preemptions == 1
  s.check_done()


# ---- preemption for a waiting request ----
def test_the_lowest_priority_running_sequence_makes_room_and_the_newcomer_goes_first():
  s = priority_sim(num_blocks=4, block_size=4, prefix=False)
  (a,) = s.add(list(range(8)), max_tokens=8, priority=1)
  (b,) = s.add(list(range(20, 28)), max_tokens=8, priority=2)
  assert plan(s.step()) == [(a.seq_id, 8), (b.seq_id, 8)] and s.alloc.num_free_blocks == 0
  (c,) = s.add(list(range(40, 43)), max_tokens=2, priority=0)
  out = s.step()
  # b (priority 2) goes, not a; c's prompt is scheduled ahead of a's decode
  assert out.preempted == [b] and plan(out) == [(c.seq_id, 3), (a.seq_id, 1)]
  assert s.sched.running == [c, a] and list(s.sched.waiting) == [b]
  s.run()
  s.check_done()


def test_victims_go_lowest_priority_first_then_latest_arrival_first():
  s = priority_sim(num_blocks=3, block_size=4, prefix=False)
  (a,) = s.add([1, 2], max_tokens=4, priority=1)
  (b,) = s.add([3, 4], max_tokens=4, priority=2)
  (c,) = s.add([5, 6], max_tokens=4, priority=1)
  s.step()
  assert s.sched.running == [a, c, b] and s.alloc.num_free_blocks == 0   # the batch is kept in priority order
  (w1,) = s.add([7, 8], max_tokens=3, priority=0)
  out = s.step()
  assert out.preempted == [b] and plan(out) == [(w1.seq_id, 2), (a.seq_id, 1), (c.seq_id, 1)]  # b: lowest priority
  (w2,) = s.add([9, 10], max_tokens=3, priority=0)
  out = s.step()
  assert out.preempted == [c] and s.sched.running == [w1, w2, a]   # c: the later of the two priority-1 sequences
  assert list(s.sched.waiting) == [c, b]
  s.run()
  s.check_done()


def test_equal_or_lower_priority_never_preempts():
  s = priority_sim(num_blocks=2, block_size=4, prefix=False)
  (a,) = s.add(list(range(5)), max_tokens=3, priority=0)
  s.step()
  assert s.alloc.num_free_blocks == 0
  (b,) = s.add([10, 11], max_tokens=2, priority=0)
  (c,) = s.add([12, 13], max_tokens=2, priority=5)
  for _ in range(2):
    out = s.step()
    assert out.preempted == [] and plan(out) == [(a.seq_id, 1)]
  assert a.is_finished and list(s.sched.waiting) == [b, c]
  s.run()
  assert s.sched.num_preemptions == 0
  s.check_done()


def test_no_preemption_when_the_lower_priority_ones_cannot_make_enough_room():
  s = priority_sim(num_blocks=4, block_size=4, prefix=False)
  (a,) = s.add(list(range(11)), max_tokens=2, priority=0)   # 3 blocks
  (b,) = s.add([50, 51, 52], max_tokens=2, priority=1)      # 1 block
  s.step()
  (w,) = s.add(list(range(100, 112)), max_tokens=2, priority=0)   # 3 blocks: b's one would not be enough
  out = s.step()
  assert out.preempted == [] and plan(out) == [(a.seq_id, 1), (b.seq_id, 1)] and list(s.sched.waiting) == [w]
  s.run()
  s.check_done()


def test_a_running_sequence_short_of_a_block_preempts_the_lowest_priority_one_not_the_newest():
  s = priority_sim(num_blocks=4, block_size=4, prefix=False)
  (a,) = s.add(list(range(8)), max_tokens=4, priority=2)
  (b,) = s.add(list(range(20, 28)), max_tokens=4, priority=0)
  s.step()
  out = s.step()   # both need a third block and none is free: a, the older but lower-priority one, goes
  assert out.preempted == [a] and plan(out) == [(b.seq_id, 1)]
  s.run()
  s.check_done()


def test_prefix_cache_hits_count_when_choosing_how_many_to_preempt():
  s = priority_sim(num_blocks=5, block_size=4)
  system = list(range(100, 108))
  (a,) = s.add([*system, 1], max_tokens=6, priority=1)   # 3 blocks, the first 2 cached once computed
  (b,) = s.add([60, 61, 62, 63, 64], max_tokens=3, priority=2)   # 2 blocks
  s.step()
  assert s.alloc.num_free_blocks == 0
  (w,) = s.add([*system, 2, 3], max_tokens=2, priority=0)   # shares a's 2 cached blocks: needs 1 more
  out = s.step()
  assert out.preempted == [b] and plan(out)[0] == (w.seq_id, 2) and s.alloc.block_table(w)[:2] == s.alloc.block_table(a)[:2]
  s.run()
  s.check_done()


def test_forks_of_a_high_priority_request_take_the_seats_they_need():
  s = priority_sim(max_num_seqs=3, num_blocks=32)
  s.add(list(range(6)), max_tokens=8, priority=1)
  (b,) = s.add(list(range(10, 16)), max_tokens=8, priority=1)
  s.step()
  w = s.add(list(range(20, 26)), max_tokens=3, n=2, priority=0)   # two samples: two seats
  out = s.step()
  assert out.preempted == [b] and plan(out)[0] == (w[0].seq_id, 6) and out.scheduled[0].forks == (w[1],)
  assert len(s.sched.running) == 3
  s.run()
  s.check_done()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("swap_blocks", [None, 3, 64])
@pytest.mark.parametrize("prefix", [True, False])
def test_random_priority_runs(seed: int, swap_blocks: int | None, prefix: bool):
  """Requests of random priorities arrive mid-flight into a cache small enough to preempt (by recomputation, or by
  swapping with a swap space that is sometimes too small); everything ends free, each position computed once."""
  rng = random.Random(seed)
  config = [dict(max_num_seqs=6, max_num_batched_tokens=32), dict(max_num_seqs=4, max_num_batched_tokens=16,
            long_prefill_token_threshold=5), dict(max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=False),
            dict(max_num_seqs=3, max_num_batched_tokens=8)][seed]
  s = priority_sim(num_blocks=12, block_size=4, prefix=prefix, swap_blocks=swap_blocks, **config)
  pending = list(random_requests(rng, 40, 4, 12))
  steps = 0
  while pending or s.sched.has_unfinished():
    for _ in range(rng.choice([0, 0, 1, 2])):
      if pending: s.add(*pending.pop(), priority=rng.randrange(3))
    s.step()
    assert len(s.sched.running) <= config["max_num_seqs"]
    assert [seq.priority for seq in s.sched.running] == sorted(seq.priority for seq in s.sched.running)
    steps += 1
    assert steps < 2000
  s.check_done()
  assert s.sched.num_preemptions > 0
  if swap_blocks is not None: assert s.sched.num_swapped_out_blocks > 0
  if swap_blocks == 3: assert s.sched.num_swap_fallbacks > 0


# ---- where priorities are refused ----
def test_a_priority_under_fcfs_is_refused_naming_it():
  check_priority(0, "fcfs")
  check_priority(-3, "priority")
  with pytest.raises(ValueError, match=r"priority=2 needs scheduling_policy='priority'"): check_priority(2, "fcfs")
  with pytest.raises(ValueError, match="priority must be an integer"): check_priority(1.5, "priority")


@pytest.mark.parametrize(("fields", "words"), [
  ({"scheduling_policy": "lottery"}, "scheduling_policy must be one of fcfs, priority"),
  ({"scheduling_policy": "priority", "scheduler": "static"}, "scheduling_policy=priority needs the continuous scheduler"),
])
def test_bad_policy_settings_are_config_errors(fields, words):
  with pytest.raises(ConfigError, match=words): EngineConfig(model="m", **fields)


# ---- the engine ----
@pytest.fixture(scope="module")
def lone(stories_dir):
  return LLM(str(stories_dir), max_num_seqs=1, num_gpu_blocks=64)


def greedy(max_tokens: int):
  return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_outputs_under_priority_preemption_equal_lone_runs(stories_dir, lone, reference, preemption_mode):
  prompts = [reference["prompt_ids"], *PROMPTS[4:12]]
  max_tokens = [120, 40, 60, 30, 90, 20, 70, 50, 80]
  refs = run_alone(lone, prompts, max_tokens)
  llm = LLM(str(stories_dir), scheduling_policy="priority", num_gpu_blocks=20, max_num_seqs=4, preemption_mode=preemption_mode,
            swap_space=0.01)
  engine = llm.engine
  for i, (prompt, m) in enumerate(zip(prompts[:5], max_tokens[:5], strict=True)):
    engine.add_request(f"low{i}", prompt, greedy(m), priority=5)
  finals = {}
  for _ in range(8):
    for out in engine.step(): finals[out.request_id] = out
  assert {s.request_id for s in engine.scheduler.running} == {f"low{i}" for i in range(4)}
  for i, (prompt, m) in enumerate(zip(prompts[5:], max_tokens[5:], strict=True)):   # arrive mid-flight
    engine.add_request(f"high{i}", prompt, greedy(m), priority=-1)
  for out in engine.step(): finals[out.request_id] = out
  # they take every seat at once: the four running low-priority requests are preempted, and wait behind them
  assert {s.request_id for s in engine.scheduler.running} == {f"high{i}" for i in range(4)}
  assert engine.scheduler.num_preemptions == 4
  assert len(engine.scheduler.swapped) == (4 if preemption_mode == "swap" else 0)
  while engine.has_unfinished_requests():
    for out in engine.step(): finals[out.request_id] = out
  outputs = [finals[f"low{i}"] for i in range(5)] + [finals[f"high{i}"] for i in range(4)]
  assert_matches_alone(outputs, refs)
  assert outputs[0].outputs[0].token_ids == reference["greedy_ids"][:120]
  assert_all_free(llm)


def test_llm_generate_takes_priorities_in_order(stories_dir):
  llm = LLM(str(stories_dir), scheduling_policy="priority", max_num_seqs=1, num_gpu_blocks=64)
  prompts = [[1, 400 + i, 300 + i] for i in range(4)]
  outs = llm.generate(prompts, greedy(3), priority=[3, 0, 2, 1], use_tqdm=False)
  assert [o.prompt_token_ids for o in outs] == prompts   # outputs in the prompts' order
  started = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
  assert started == [1, 3, 2, 0]
  assert_all_free(llm)


def test_priorities_refused_where_they_cannot_be_honoured(stories_dir, lone):
  with pytest.raises(ValueError, match=r"priority=1 needs scheduling_policy='priority'"):
    lone.generate([[1, 2, 3], [1, 4]], greedy(2), priority=[0, 1], use_tqdm=False)
  with pytest.raises(ValueError, match=r"priority=-2 needs scheduling_policy='priority'"):
    lone.engine.add_request("x", [1, 2, 3], greedy(2), priority=-2)
  with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
    lone.generate([[1, 2, 3]], greedy(2), priority=[0, 0], use_tqdm=False)
  assert_all_free(lone)   # nothing was queued
  with pytest.raises(ConfigError, match="scheduling_policy=priority needs the continuous scheduler"):
    LLM(str(stories_dir), scheduling_policy="priority", scheduler="static")
