"""The static-batching baseline, and the contiguous-cache baseline under both schedulers (tests/scheduler_sim.py)."""
from __future__ import annotations

import random

import pytest

from tests.scheduler_sim import Sim, plan, random_requests, sim
from tinyvllm.core.contiguous_allocator import ContiguousAllocator
from tinyvllm.core.scheduler import Scheduler, SchedulerConfig
from tinyvllm.core.static_scheduler import StaticScheduler


# ---- static batching ----
def test_static_no_admission_while_a_batch_runs():
  s = sim(static=True, max_num_seqs=2)
  (a,) = s.add(list(range(3)), max_tokens=2)
  (b,) = s.add(list(range(10, 14)), max_tokens=4)
  assert plan(s.step()) == [(a.seq_id, 3), (b.seq_id, 4)]
  (c,) = s.add(list(range(20, 22)), max_tokens=1)
  assert plan(s.step()) == [(a.seq_id, 1), (b.seq_id, 1)]  # a finishes; c still waits for b
  assert plan(s.step()) == [(b.seq_id, 1)]
  assert plan(s.step()) == [(b.seq_id, 1)] and b.is_finished
  assert plan(s.step()) == [(c.seq_id, 2)]
  s.run()
  s.check_done()


def test_static_admission_respects_worst_case_blocks():
  s = sim(num_blocks=8, block_size=4, static=True, max_num_seqs=8)
  (a,) = s.add(list(range(8)), max_tokens=8)   # 4 blocks at worst
  (b,) = s.add(list(range(10, 14)), max_tokens=12)  # 4 blocks at worst
  (c,) = s.add([30], max_tokens=1)             # 1 block: does not fit beside them
  assert plan(s.step()) == [(a.seq_id, 8), (b.seq_id, 4)] and list(s.sched.waiting) == [c]
  s.run()
  assert s.sched.num_preemptions == 0
  s.check_done()


def test_static_admission_counts_forks():
  s = sim(num_blocks=8, block_size=4, static=True, max_num_seqs=8)
  parent, *_ = s.add(list(range(4)), max_tokens=4, n=3)  # 2 blocks at worst, for each of 3 samples
  (b,) = s.add([50, 51], max_tokens=7)                  # 3 blocks: 6 + 3 > 8
  assert plan(s.step()) == [(parent.seq_id, 4)] and list(s.sched.waiting) == [b]
  assert len(s.sched.running) == 3
  s.run()
  s.check_done()


def test_static_admission_counts_seats():
  s = sim(static=True, max_num_seqs=3)
  s.add(list(range(4)), max_tokens=2, n=2)
  b, _ = s.add([50, 51], max_tokens=2, n=2)
  s.step()
  assert list(s.sched.waiting) == [b] and len(s.sched.running) == 2
  s.run()
  s.check_done()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_static_run(seed: int):
  rng = random.Random(seed)
  s = sim(num_blocks=20, block_size=4, static=True, max_num_seqs=4)
  for request in random_requests(rng, 30, 4, 20): s.add(*request)
  while s.sched.has_unfinished():
    idle, before = not s.sched.running, set(map(id, s.sched.running))
    out = s.step()
    if not idle:  # mid-batch: only the batch's own decodes (and its forks) run, nothing is admitted
      assert all(id(item.seq) in before and item.num_new_tokens == 1 for item in out.scheduled)
  assert s.sched.num_preemptions == 0 and len(s.outputs) < 500
  assert max(len(o.scheduled) for o in s.outputs) <= 4
  s.check_done()


# ---- the contiguous baseline under the schedulers ----
@pytest.mark.parametrize("static", [False, True])
def test_contiguous_allocator_run(static: bool):
  rng = random.Random(5)
  cls = StaticScheduler if static else Scheduler
  s = Sim(cls(ContiguousAllocator(4, 64), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16)))
  for prompt, max_tokens, n in random_requests(rng, 20, 64, 4):
    s.add(prompt, max_tokens, n)
  s.run()
  copies = [c for o in s.outputs for c in o.block_copies]
  assert len(copies) == sum(1 for q in s.seqs if q.index > 0) > 0  # one row copy per fork
  s.check_done()


def test_contiguous_fork_copy_reported_next_step():
  s = Sim(Scheduler(ContiguousAllocator(4, 32), SchedulerConfig()))
  parent, child = s.add(list(range(5)), max_tokens=3, n=2)
  s.step()
  assert s.alloc.block_table(parent) == [0] and s.alloc.block_table(child) == [1] and s.sched.pending_copies == [(0, 1)]
  out = s.step()
  assert out.block_copies == [(0, 1)] and plan(out) == [(parent.seq_id, 1), (child.seq_id, 1)]
  s.run()
  s.check_done()
