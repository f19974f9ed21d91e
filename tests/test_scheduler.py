"""The continuous-batching scheduler driven by a fake engine loop (tests/scheduler_sim.py): admission, budgets,
chunked prefill, prefix hits, preemption, forks and random runs that check every position is computed once."""
from __future__ import annotations

import random

import pytest

from tests.scheduler_sim import fake_token, length_verdict, plan, random_requests, sim
from tinyvllm.core.sequence import SequenceStatus, StopVerdict


# ---- continuous batching ----
def test_single_request_prefill_then_decode():
  s = sim()
  (a,) = s.add(list(range(6)), max_tokens=3)
  out = s.step()
  assert plan(out) == [(a.seq_id, 6)] and s.sampled[-1] == [a.seq_id]
  assert s.alloc.block_table(a) == [0, 1] and a.num_computed_tokens == 6 and len(a.output_token_ids) == 1
  assert plan(s.step()) == [(a.seq_id, 1)] and a.num_computed_tokens == 7
  out = s.step()
  assert plan(out) == [(a.seq_id, 1)] and a.is_finished and s.alloc.block_table(a) == []
  assert s.alloc.num_free_blocks == 64  # a finished sequence's blocks are free in the same step
  assert s.alloc.num_cached_blocks == 2  # its full blocks stay in the prefix cache
  s.check_done()


def test_max_num_seqs_and_fcfs_admission():
  s = sim(max_num_seqs=2)
  seqs = [s.add([10 * i + j for j in range(3)], max_tokens=2)[0] for i in range(5)]
  a, b, c, d, e = seqs
  assert plan(s.step()) == [(a.seq_id, 3), (b.seq_id, 3)]
  assert list(s.sched.waiting) == [c, d, e]
  assert plan(s.step()) == [(a.seq_id, 1), (b.seq_id, 1)]  # both finish now
  assert plan(s.step()) == [(c.seq_id, 3), (d.seq_id, 3)]
  s.run()
  assert max(len(o.scheduled) for o in s.outputs) == 2
  s.check_done()


def test_decodes_first_then_admission_mid_flight():
  s = sim(max_num_batched_tokens=8)
  (a,) = s.add(list(range(5)), max_tokens=6)
  s.step()
  (b,) = s.add(list(range(20, 27)), max_tokens=2)
  out = s.step()
  assert plan(out) == [(a.seq_id, 1), (b.seq_id, 7)]  # a's decode first, b admitted into the same step
  assert out.num_tokens == 8 and s.sched.running == [a, b]
  s.run()
  s.check_done()


def test_token_budget_caps_a_step_and_chunks_a_long_prompt():
  s = sim(max_num_batched_tokens=8)
  (a,) = s.add(list(range(5)), max_tokens=8)
  s.step()
  (b,) = s.add(list(range(100, 120)), max_tokens=2)
  assert plan(s.step()) == [(a.seq_id, 1), (b.seq_id, 7)]
  out = s.step()
  assert plan(out) == [(a.seq_id, 1), (b.seq_id, 7)] and s.sampled[-1] == [a.seq_id]
  out = s.step()
  assert plan(out) == [(a.seq_id, 1), (b.seq_id, 6)] and s.sampled[-1] == [a.seq_id, b.seq_id]  # the last chunk samples
  assert b.num_computed_tokens == 20 and len(b.output_token_ids) == 1
  s.run()
  assert all(o.num_tokens <= 8 for o in s.outputs)
  s.check_done()


def test_long_prefill_token_threshold():
  s = sim(long_prefill_token_threshold=5)
  (a,) = s.add(list(range(12)), max_tokens=3)
  (b,) = s.add(list(range(50, 53)), max_tokens=3)
  assert plan(s.step()) == [(a.seq_id, 5), (b.seq_id, 3)]
  assert plan(s.step()) == [(a.seq_id, 5), (b.seq_id, 1)]
  assert plan(s.step()) == [(a.seq_id, 2), (b.seq_id, 1)]
  assert plan(s.step()) == [(a.seq_id, 1)]  # decodes are not capped
  s.run()
  s.check_done()


def test_without_chunked_prefill_a_prompt_is_admitted_whole():
  s = sim(max_num_batched_tokens=10, enable_chunked_prefill=False)
  (a,) = s.add(list(range(4)), max_tokens=5)
  s.step()
  (b,) = s.add(list(range(30, 40)), max_tokens=2)
  assert plan(s.step()) == [(a.seq_id, 1)]  # 9 tokens left in the budget: b waits rather than being split
  assert list(s.sched.waiting) == [b]
  s.run()
  b_items = [n for o in s.outputs for sid, n in plan(o) if sid == b.seq_id]
  assert b_items == [10, 1]
  s.check_done()


def test_without_chunked_prefill_threshold_does_not_block_admission():
  s = sim(max_num_batched_tokens=32, enable_chunked_prefill=False, long_prefill_token_threshold=4)
  (a,) = s.add(list(range(10)), max_tokens=2)
  assert plan(s.step()) == [(a.seq_id, 10)]
  s.run(10)
  s.check_done()


def test_prefix_cache_hit_on_admission():
  s = sim()
  s.add(list(range(10)), max_tokens=2)
  s.run()
  (b,) = s.add([*range(10), 77], max_tokens=2)
  out = s.step()
  assert plan(out) == [(b.seq_id, 3)] and s.alloc.block_table(b) == [0, 1, 3]  # 8 cached tokens, 3 computed
  assert s.alloc.prefix_hits == 8 and s.starts[b.seq_id] == 8
  s.run()
  s.check_done()


def test_the_scheduler_records_cached_tokens_and_times():
  """What RequestOutput reports: the prefix-cache hit of the first admission (not of a readmission), and the times."""
  s = sim(num_blocks=5, block_size=4)
  (a,) = s.add(list(range(12)), max_tokens=3)
  (b,) = s.add(list(range(40, 48)), max_tokens=3)
  assert (a.num_cached_tokens, a.first_scheduled_time, a.first_token_time) == (None, None, None)
  s.step()
  s.step()   # b is preempted here, and later readmitted with 4 tokens from the prefix cache
  s.run()
  assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0) and s.sched.num_preemptions == 1
  hits_before = s.alloc.prefix_hits
  (c,) = s.add([*range(12), 99], max_tokens=2)
  s.run()
  assert c.num_cached_tokens == s.alloc.prefix_hits - hits_before == 8   # a's first two blocks are still cached
  for seq in (a, b, c):
    assert seq.first_scheduled_time <= seq.first_token_time <= seq.last_token_time <= seq.finished_time
  s.check_done()


def test_preemption_frees_blocks_and_requeues_at_front():
  s = sim(num_blocks=4, block_size=4, prefix=False)
  (a,) = s.add(list(range(8)), max_tokens=8)
  (b,) = s.add(list(range(10, 16)), max_tokens=8)
  (c,) = s.add(list(range(20, 22)), max_tokens=1)
  out = s.step()
  assert plan(out) == [(a.seq_id, 8), (b.seq_id, 6)] and list(s.sched.waiting) == [c]
  assert s.alloc.block_table(a) == [0, 1] and s.alloc.block_table(b) == [2, 3] and s.alloc.num_free_blocks == 0
  out = s.step()  # a's 9th token needs a block: b, the newest, is preempted
  assert out.preempted == [b] and plan(out) == [(a.seq_id, 1)]
  assert s.alloc.block_table(b) == [] and b.num_computed_tokens == 0 and b.status is SequenceStatus.WAITING
  assert list(s.sched.waiting) == [b, c] and s.sched.num_preemptions == 1
  assert s.alloc.block_table(a) == [0, 1, 3] and s.alloc.num_free_blocks == 1  # b's blocks were freed tail first
  assert len(b.output_token_ids) == 1  # its sampled token survives: it is recomputed, not sampled again
  for _ in range(6):  # b needs 2 blocks for its 7 tokens, 1 is free: a runs alone until it finishes
    assert plan(s.step()) == [(a.seq_id, 1)]
  assert a.is_finished and list(s.sched.waiting) == [b, c]
  assert plan(s.step()) == [(b.seq_id, 7), (c.seq_id, 2)]  # b recomputes prompt + its token, then c (FCFS)
  s.run()
  assert s.sched.num_preemptions == 1
  assert [n for o in s.outputs for sid, n in plan(o) if sid == b.seq_id] == [6, 7, 1, 1, 1, 1, 1, 1]
  s.check_done()


def test_the_newest_sequence_preempts_itself():
  s = sim(num_blocks=3, block_size=4, prefix=False)
  (a,) = s.add(list(range(3)), max_tokens=3)
  (b,) = s.add(list(range(10, 18)), max_tokens=2)
  s.step()
  assert s.alloc.block_table(a) == [0] and s.alloc.block_table(b) == [1, 2] and s.alloc.num_free_blocks == 0
  out = s.step()  # a's token fits in its block; b, the newest, needs a block and none is free
  assert out.preempted == [b] and plan(out) == [(a.seq_id, 1)] and list(s.sched.waiting) == [b]
  assert s.alloc.num_free_blocks == 2
  s.run()
  assert s.sched.num_preemptions == 1
  s.check_done()


def test_preempted_sequence_readmitted_through_the_prefix_cache():
  s = sim(num_blocks=5, block_size=4)
  (a,) = s.add(list(range(12)), max_tokens=3)
  (b,) = s.add(list(range(40, 48)), max_tokens=3)
  s.step()
  assert s.alloc.block_table(a) == [0, 1, 2] and s.alloc.block_table(b) == [3, 4] and s.alloc.num_cached_blocks == 5
  out = s.step()
  assert out.preempted == [b] and list(s.alloc.free_queue) == [3]  # b's tail (block 4) was freed first, and taken
  assert s.alloc.block_table(a) == [0, 1, 2, 4] and a.is_finished is False
  assert s.alloc.num_cached_blocks == 4  # b's first block is still cached
  s.step()  # a finishes; b is readmitted: block 3 covers its first 4 tokens
  hits_before = s.alloc.prefix_hits
  out = s.step()
  assert plan(out) == [(b.seq_id, 5)] and s.alloc.block_table(b)[0] == 3 and s.starts[b.seq_id] == 4
  assert s.alloc.prefix_hits - hits_before == 4
  s.run()
  s.check_done()


def test_forks_share_the_parents_blocks():
  s = sim()
  parent, c1, c2 = s.add(list(range(6)), max_tokens=3, n=3)
  assert list(s.sched.waiting) == [parent] and s.sched.pending_forks[parent.seq_id] == [c1, c2]
  out = s.sched.schedule()   # the parent's first sample forks its pending samples at once
  (item,) = out.scheduled
  assert item.seq is parent and item.forks == (c1, c2) and item.samples and out.sampling_seqs == [parent, c1, c2]
  assert s.alloc.block_table(c1) == s.alloc.block_table(c2) == s.alloc.block_table(parent) == [0, 1]
  assert [s.alloc.blocks[i].ref_count for i in (0, 1)] == [3, 3]
  assert c1.num_computed_tokens == c2.num_computed_tokens == 6 and s.sched.running == [parent, c1, c2]
  assert s.sched.pending_forks == {}
  s.sched.update_from_output(out, [[fake_token(seq)] for seq in out.sampling_seqs], length_verdict)
  out = s.sched.schedule()  # each write lands in shared block 1: two copies, the last sharer writes in place
  assert plan(out) == [(parent.seq_id, 1), (c1.seq_id, 1), (c2.seq_id, 1)]
  assert out.block_copies == [(1, 2), (1, 3)]
  assert s.alloc.block_table(parent) == [0, 2] and s.alloc.block_table(c1) == [0, 3] and s.alloc.block_table(c2) == [0, 1]
  assert [s.alloc.blocks[i].ref_count for i in (0, 1, 2, 3)] == [3, 1, 1, 1]
  assert s.sched.pending_copies == []


def test_forks_only_on_the_sampling_chunk():
  s = sim(long_prefill_token_threshold=4)
  parent, child = s.add(list(range(10)), max_tokens=3, n=2)
  out = s.step()
  assert plan(out) == [(parent.seq_id, 4)] and out.scheduled[0].forks == ()
  assert s.step().scheduled[0].forks == ()
  out = s.step()
  assert plan(out) == [(parent.seq_id, 2)] and out.scheduled[0].forks == (child,)
  assert s.alloc.block_table(child) == s.alloc.block_table(parent) == [0, 1, 2] and child.status is SequenceStatus.RUNNING
  assert len(child.output_token_ids) == 1 and child.output_token_ids != parent.output_token_ids
  out = s.step()
  assert out.block_copies == [(2, 3)]  # parent copies shared block 2 before writing; the child then owns it
  s.run()
  s.check_done()


def test_fork_run_end_to_end_with_cow():
  s = sim(num_blocks=16)
  s.add(list(range(7)), max_tokens=6, n=4)
  s.run()
  copies = [c for o in s.outputs for c in o.block_copies]
  assert len(copies) == 3 and all(src == 1 for src, _ in copies)
  s.check_done()


def test_max_num_seqs_counts_forks():
  s = sim(max_num_seqs=3)
  a, _ = s.add(list(range(4)), max_tokens=2, n=2)
  (b,) = s.add(list(range(10, 14)), max_tokens=2)
  c, _ = s.add(list(range(20, 24)), max_tokens=2, n=2)
  assert plan(s.step()) == [(a.seq_id, 4), (b.seq_id, 4)]  # c's 2 samples would make 5 sequences
  assert len(s.sched.running) == 3 and list(s.sched.waiting) == [c]
  s.run()
  assert max(len(o.scheduled) for o in s.outputs) <= 3
  s.check_done()


def test_a_request_wider_than_max_num_seqs_runs_alone():
  s = sim(max_num_seqs=2)
  s.add(list(range(4)), max_tokens=2, n=3)
  s.run(20)
  s.check_done()


def test_abort_removes_waiting_sequence_and_its_forks():
  s = sim()
  parent, child = s.add(list(range(5)), n=2)
  s.sched.abort([parent, child])
  assert not s.sched.has_unfinished() and s.sched.pending_forks == {}
  assert parent.status is child.status is SequenceStatus.FINISHED_ABORTED


def test_abort_running_sequence_frees_blocks():
  s = sim()
  (a,) = s.add(list(range(9)), max_tokens=5)
  s.step()
  assert s.alloc.block_table(a) == [0, 1, 2]
  s.sched.abort([a])
  assert a.status is SequenceStatus.FINISHED_ABORTED
  assert s.alloc.block_table(a) == [] and s.alloc.num_used_blocks == 0 and not s.sched.has_unfinished()


def test_a_stop_verdict_ends_a_sequence_in_the_step_it_lands():
  s = sim()
  (a,) = s.add(list(range(5)), max_tokens=5)
  out = s.sched.schedule()
  stop = lambda seq, token, row: StopVerdict(SequenceStatus.FINISHED_STOPPED, token)
  assert s.sched.update_from_output(out, [[42]], stop) == [a]
  assert a.status is SequenceStatus.FINISHED_STOPPED and a.stop_reason == 42 and a.output_token_ids == [42]
  assert s.alloc.num_used_blocks == 0 and not s.sched.has_unfinished()


@pytest.mark.parametrize("seed, config", [
  (0, dict(max_num_seqs=6, max_num_batched_tokens=32)),
  (1, dict(max_num_seqs=4, max_num_batched_tokens=16, long_prefill_token_threshold=5)),
  (2, dict(max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=False)),
  (3, dict(max_num_seqs=3, max_num_batched_tokens=8)),
])
@pytest.mark.parametrize("block_size, num_blocks", [(4, 12), (2, 24), (8, 8)])
@pytest.mark.parametrize("prefix", [True, False])
def test_random_continuous_run(seed: int, config: dict, block_size: int, num_blocks: int, prefix: bool):
  """Requests arrive mid-flight into a cache small enough to force preemptions; everything ends free and in order."""
  rng = random.Random(seed)
  s = sim(num_blocks=num_blocks, block_size=block_size, prefix=prefix, **config)
  pending = list(random_requests(rng, 40, block_size, num_blocks))
  steps = 0
  while pending or s.sched.has_unfinished():
    for _ in range(rng.choice([0, 0, 1, 2])):
      if pending: s.add(*pending.pop())
    s.step()
    assert len(s.sched.running) <= config["max_num_seqs"]
    steps += 1
    assert steps < 2000
  s.check_done()
  assert len(s.seqs) > 40 and s.sched.num_preemptions > 0
  assert (s.alloc.prefix_hits > 0) == prefix
