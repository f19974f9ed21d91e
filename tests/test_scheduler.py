"""Schedulers driven by a fake engine loop: plain Python, no tensors, no model.

`Sim` does what LLMEngine.step does around the model runner: schedule, run (here: copy blocks and write token ids into
a fake KV store, then read every computed position back), advance num_computed_tokens, register computed blocks,
fork, append a fake sampled token, finish. It records each sequence's computed positions, so that a test can prove
no token was skipped or computed twice (except from scratch after a preemption).
"""
from __future__ import annotations

import random

import pytest

from tests.test_block_manager import check_invariants, make_seq
from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.contiguous_allocator import ContiguousAllocator
from tinyvllm.core.scheduler import Scheduler, SchedulerConfig, StaticScheduler
from tinyvllm.core.scheduler_output import SchedulerOutput
from tinyvllm.core.sequence import Sequence, SequenceStatus


def fake_token(seq: Sequence) -> int: return 1000 + (seq.seq_id * 31 + len(seq.output_token_ids) * 7) % 997


class Sim:
  def __init__(self, scheduler: Scheduler | StaticScheduler):
    self.sched, self.alloc = scheduler, scheduler.allocator
    self.kv: dict[int, list[int | None]] = {}
    self.seqs: list[Sequence] = []
    self.positions: dict[int, list[int]] = {}   # seq id -> positions computed since its last (re)admission
    self.starts: dict[int, int] = {}            # seq id -> first position computed after its last (re)admission
    self.outputs: list[SchedulerOutput] = []
    self.sampled: list[list[int]] = []           # per step: the ids of the sequences that sampled a token

  def add(self, prompt: list[int], max_tokens: int = 4, n: int = 1, rid: str = "r") -> list[Sequence]:
    seqs = [make_seq(prompt, max_tokens, n, f"{rid}{len(self.seqs)}", i) for i in range(n)]
    self.seqs += seqs
    self.sched.add(seqs)
    return seqs

  def step(self) -> SchedulerOutput:
    out = self.sched.schedule()
    self.outputs.append(out)
    for seq in out.preempted:
      assert seq.block_table == [] and seq.num_computed_tokens == 0 and seq.status is SequenceStatus.WAITING
      self.positions.pop(seq.seq_id, None)
    if not out:  # the engine runs nothing: no copy may be pending, and only a preemption excuses an idle step
      assert out.block_copies == [] and (out.preempted or not self.sched.has_unfinished())
      return out
    if isinstance(self.sched, Scheduler): assert out.num_tokens <= self.sched.config.max_num_batched_tokens
    self._run(out)
    samplers = [item for item in out.scheduled if item.samples]  # (a property: read it before the counters move)
    self.sampled.append([item.seq.seq_id for item in samplers])
    for item in out.scheduled:
      item.seq.num_computed_tokens += item.num_new_tokens
      self.alloc.register_computed(item.seq)
    for item in out.scheduled:
      if not item.forks: continue
      assert self.sched.fork(item.seq) == item.forks
      for child in item.forks: self.positions[child.seq_id], self.starts[child.seq_id] = [], child.num_computed_tokens
    finished = []
    for seq in [s for item in samplers for s in [item.seq, *item.forks]]:
      seq.output_token_ids.append(fake_token(seq))
      if len(seq.output_token_ids) >= seq.params.max_tokens:
        seq.status = SequenceStatus.FINISHED_LENGTH
        finished.append(seq)
    for seq in finished: self.sched.finish(seq)
    self.check()
    return out

  def _run(self, out: SchedulerOutput) -> None:
    """The model runner's view: copies first, then each scheduled token's K/V is written, then every position read."""
    size = self.alloc.block_size
    for src, dst in out.block_copies: self.kv[dst] = list(self.kv[src])
    for seq in self.sched.running: self._read(seq, seq.num_computed_tokens)  # what attention reads is intact
    for item in out.scheduled:
      seq, start = item.seq, item.seq.num_computed_tokens
      assert seq.status is SequenceStatus.RUNNING and item.num_new_tokens > 0
      assert start + item.num_new_tokens <= seq.num_tokens
      if seq.seq_id not in self.positions:
        assert start % size == 0  # from scratch, or after a cached prefix of whole blocks
        self.positions[seq.seq_id], self.starts[seq.seq_id] = [], start
      done = self.positions[seq.seq_id]
      assert start == (done[-1] + 1 if done else self.starts[seq.seq_id])
      for p in range(start, start + item.num_new_tokens):
        self.kv.setdefault(seq.block_table[p // size], [None] * size)[p % size] = seq.token_ids[p]
        done.append(p)
    for item in out.scheduled: self._read(item.seq, item.seq.num_computed_tokens + item.num_new_tokens)

  def _read(self, seq: Sequence, upto: int) -> None:
    size = self.alloc.block_size
    got = [self.kv[seq.block_table[p // size]][p % size] for p in range(upto)]
    assert got == seq.token_ids[:upto], f"seq {seq.seq_id} reads wrong K/V"

  def check(self) -> None:
    running, waiting = self.sched.running, list(self.sched.waiting)
    assert len(set(map(id, running + waiting))) == len(running) + len(waiting)
    assert all(s.status is SequenceStatus.RUNNING for s in running)
    assert all(s.status is SequenceStatus.WAITING and s.block_table == [] for s in waiting)
    assert all(s.block_table == [] for s in self.seqs if s not in running)  # finished, waiting, or a pending fork
    if isinstance(self.alloc, BlockManager): check_invariants(self.alloc, self.seqs)

  def run(self, max_steps: int = 1000) -> int:
    steps = 0
    while self.sched.has_unfinished():
      self.step()
      steps += 1
      assert steps <= max_steps, "the scheduler made no progress"
    return steps

  def check_done(self) -> None:
    """Every sequence finished, computed each of its tokens once after its last admission, and holds nothing."""
    assert not self.sched.waiting and not self.sched.running and not self.sched.pending_forks
    assert self.sched.pending_copies == []
    for seq in self.seqs:
      assert seq.status is SequenceStatus.FINISHED_LENGTH and len(seq.output_token_ids) == seq.params.max_tokens
      assert seq.block_table == []
      assert self.positions[seq.seq_id] == list(range(self.starts[seq.seq_id], seq.num_tokens - 1))
    if isinstance(self.alloc, BlockManager):
      assert self.alloc.num_free_blocks == self.alloc.num_blocks and self.alloc.num_used_blocks == 0
      assert all(b.ref_count == 0 for b in self.alloc.blocks)
    else:
      assert self.alloc.num_free_blocks == self.alloc.num_blocks and self.alloc.reserved == {}


def sim(num_blocks: int = 64, block_size: int = 4, prefix: bool = True, static: bool = False, **config) -> Sim:
  cls = StaticScheduler if static else Scheduler
  return Sim(cls(BlockManager(num_blocks, block_size, prefix), SchedulerConfig(**config)))


def plan(out: SchedulerOutput) -> list[tuple[int, int]]:
  """(seq id, tokens) of each scheduled item."""
  return [(item.seq.seq_id, item.num_new_tokens) for item in out.scheduled]


# ---- continuous batching ----
def test_single_request_prefill_then_decode():
  s = sim()
  (a,) = s.add(list(range(6)), max_tokens=3)
  out = s.step()
  assert plan(out) == [(a.seq_id, 6)] and s.sampled[-1] == [a.seq_id]
  assert a.block_table == [0, 1] and a.num_computed_tokens == 6 and len(a.output_token_ids) == 1
  assert plan(s.step()) == [(a.seq_id, 1)] and a.num_computed_tokens == 7
  out = s.step()
  assert plan(out) == [(a.seq_id, 1)] and a.is_finished and a.block_table == []
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
  assert plan(out) == [(b.seq_id, 3)] and b.block_table == [0, 1, 3]  # 8 cached tokens, 3 computed
  assert s.alloc.prefix_hits == 8 and s.starts[b.seq_id] == 8
  s.run()
  s.check_done()


def test_preemption_frees_blocks_and_requeues_at_front():
  s = sim(num_blocks=4, block_size=4, prefix=False)
  (a,) = s.add(list(range(8)), max_tokens=8)
  (b,) = s.add(list(range(10, 16)), max_tokens=8)
  (c,) = s.add(list(range(20, 22)), max_tokens=1)
  out = s.step()
  assert plan(out) == [(a.seq_id, 8), (b.seq_id, 6)] and list(s.sched.waiting) == [c]
  assert a.block_table == [0, 1] and b.block_table == [2, 3] and s.alloc.num_free_blocks == 0
  out = s.step()  # a's 9th token needs a block: b, the newest, is preempted
  assert out.preempted == [b] and plan(out) == [(a.seq_id, 1)]
  assert b.block_table == [] and b.num_computed_tokens == 0 and b.status is SequenceStatus.WAITING
  assert list(s.sched.waiting) == [b, c] and s.sched.num_preemptions == 1
  assert a.block_table == [0, 1, 3] and s.alloc.num_free_blocks == 1  # b's blocks were freed tail first
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
  assert a.block_table == [0] and b.block_table == [1, 2] and s.alloc.num_free_blocks == 0
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
  assert a.block_table == [0, 1, 2] and b.block_table == [3, 4] and s.alloc.num_cached_blocks == 5
  out = s.step()
  assert out.preempted == [b] and list(s.alloc.free_queue) == [3]  # b's tail (block 4) was freed first, and taken
  assert a.block_table == [0, 1, 2, 4] and a.is_finished is False
  assert s.alloc.num_cached_blocks == 4  # b's first block is still cached
  s.step()  # a finishes; b is readmitted: block 3 covers its first 4 tokens
  hits_before = s.alloc.prefix_hits
  out = s.step()
  assert plan(out) == [(b.seq_id, 5)] and b.block_table[0] == 3 and s.starts[b.seq_id] == 4
  assert s.alloc.prefix_hits - hits_before == 4
  s.run()
  s.check_done()


def test_forks_share_the_parents_blocks():
  s = sim()
  parent, c1, c2 = s.add(list(range(6)), max_tokens=3, n=3)
  assert list(s.sched.waiting) == [parent] and s.sched.pending_forks[parent.seq_id] == [c1, c2]
  out = s.sched.schedule()
  (item,) = out.scheduled
  assert item.seq is parent and item.forks == [c1, c2] and item.samples
  parent.num_computed_tokens = 6
  s.alloc.register_computed(parent)
  assert s.sched.fork(parent) == [c1, c2]
  assert c1.block_table == c2.block_table == parent.block_table == [0, 1]
  assert [s.alloc.blocks[i].ref_count for i in (0, 1)] == [3, 3]
  assert c1.num_computed_tokens == c2.num_computed_tokens == 6 and s.sched.running == [parent, c1, c2]
  assert s.sched.pending_forks == {}
  for seq in (parent, c1, c2): seq.output_token_ids.append(fake_token(seq))
  out = s.sched.schedule()  # each write lands in shared block 1: two copies, the last sharer writes in place
  assert plan(out) == [(parent.seq_id, 1), (c1.seq_id, 1), (c2.seq_id, 1)]
  assert out.block_copies == [(1, 2), (1, 3)]
  assert parent.block_table == [0, 2] and c1.block_table == [0, 3] and c2.block_table == [0, 1]
  assert [s.alloc.blocks[i].ref_count for i in (0, 1, 2, 3)] == [3, 1, 1, 1]
  assert s.sched.pending_copies == []


def test_forks_only_on_the_sampling_chunk():
  s = sim(long_prefill_token_threshold=4)
  parent, child = s.add(list(range(10)), max_tokens=3, n=2)
  out = s.step()
  assert plan(out) == [(parent.seq_id, 4)] and out.scheduled[0].forks == []
  assert s.step().scheduled[0].forks == []
  out = s.step()
  assert plan(out) == [(parent.seq_id, 2)] and out.scheduled[0].forks == [child]
  assert child.block_table == parent.block_table == [0, 1, 2] and child.status is SequenceStatus.RUNNING
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


def test_finish_removes_waiting_sequence_and_its_forks():
  s = sim()
  parent, _child = s.add(list(range(5)), n=2)
  s.sched.finish(parent)
  assert not s.sched.has_unfinished() and s.sched.pending_forks == {}


def test_abort_running_sequence_frees_blocks():
  s = sim()
  (a,) = s.add(list(range(9)), max_tokens=5)
  s.step()
  assert a.block_table == [0, 1, 2]
  a.status = SequenceStatus.FINISHED_ABORTED
  s.sched.finish(a)
  assert a.block_table == [] and s.alloc.num_used_blocks == 0 and not s.sched.has_unfinished()


def random_requests(rng: random.Random, count: int, block_size: int, num_blocks: int, max_n: int = 3):
  bases = [[rng.randrange(500) for _ in range(24)] for _ in range(3)]
  for _ in range(count):
    prompt = rng.choice(bases)[:rng.randint(1, 24)] + [rng.randrange(500) for _ in range(rng.randint(0, 6))]
    max_tokens, n = rng.randint(1, 12), rng.randint(1, max_n)
    blocks = lambda t: -(-t // block_size)
    need = blocks(len(prompt)) + n * (blocks(len(prompt) + max_tokens) - blocks(len(prompt)) + 1)  # as the engine checks
    if need <= num_blocks: yield prompt, max_tokens, n


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
  assert parent.block_table == [0] and child.block_table == [1] and s.sched.pending_copies == [(0, 1)]
  out = s.step()
  assert out.block_copies == [(0, 1)] and plan(out) == [(parent.seq_id, 1), (child.seq_id, 1)]
  s.run()
  s.check_done()
