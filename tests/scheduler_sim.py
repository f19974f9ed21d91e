"""A fake engine loop for driving the schedulers in tests: plain Python, no tensors, no model.

`Sim` does what LLMEngine.step does around the model runner: schedule, run (here: swap blocks out to a fake swap space
and back, copy blocks, and write token ids into a fake KV store, then read every computed position back), and hand the
scheduler a fake sampled token per sampling row with a length verdict. It records each sequence's computed positions,
so that a test can prove no token was skipped or computed twice (except from scratch after a preemption by
recomputation, or a rejected proposal's position; a swapped-out sequence goes on where it was).

With `speculate` (a random.Random), every decoding sequence gets random proposals before each step, and a step keeps a
random number of them: the accepted ones become the sequence's next tokens, followed by one more.
"""
from __future__ import annotations

import random

from tests.test_block_manager import check_invariants, make_seq
from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.scheduler import Scheduler, SchedulerConfig
from tinyvllm.core.scheduler_output import SchedulerOutput
from tinyvllm.core.sequence import Sequence, SequenceStatus, StopVerdict
from tinyvllm.core.static_scheduler import StaticScheduler


def fake_token(seq: Sequence) -> int: return 1000 + (seq.seq_id * 31 + len(seq.output_token_ids) * 7) % 997


def length_verdict(seq: Sequence, token: int, row: int) -> StopVerdict | None:
  """The output processor's length rule, alone."""
  return StopVerdict(SequenceStatus.FINISHED_LENGTH) if len(seq.output_token_ids) >= seq.params.max_tokens else None


class Sim:
  def __init__(self, scheduler: Scheduler | StaticScheduler, speculate: random.Random | None = None, k: int = 3):
    self.sched, self.alloc, self.speculate, self.k = scheduler, scheduler.allocator, speculate, k
    self.kv: dict[int, list[int | None]] = {}
    self.host: dict[int, list[int | None]] = {}    # the swap space's blocks
    self.seqs: list[Sequence] = []
    self.positions: dict[int, list[int]] = {}   # seq id -> positions computed since its last (re)admission
    self.starts: dict[int, int] = {}            # seq id -> first position computed after its last (re)admission
    self.outputs: list[SchedulerOutput] = []
    self.sampled: list[list[int]] = []           # per step: the ids of the sequences that sampled a token

  def add(self, prompt: list[int], max_tokens: int = 4, n: int = 1, rid: str = "r", priority: int = 0,
          group: str | None = None) -> list[Sequence]:
    seqs = [make_seq(prompt, max_tokens, n, f"{rid}{len(self.seqs)}", i, priority, group) for i in range(n)]
    self.seqs += seqs
    self.sched.add(seqs)
    return seqs

  def step(self) -> SchedulerOutput:
    if self.speculate is not None: self._propose()
    out = self.sched.schedule()
    self.outputs.append(out)
    for seq in out.preempted:
      assert self.table(seq) == []
      if seq.status is SequenceStatus.SWAPPED: assert seq.num_computed_tokens > 0   # it goes on where it was
      else:
        assert seq.num_computed_tokens == 0 and seq.status is SequenceStatus.WAITING
        self.positions.pop(seq.seq_id, None)
    if not out:  # the engine runs nothing: no block moves, and only a preemption excuses an idle step
      assert out.block_copies == out.blocks_to_swap_out == out.blocks_to_swap_in == []
      assert out.preempted or not self.sched.has_unfinished()
      return out
    if isinstance(self.sched, Scheduler): assert out.num_tokens <= self.sched.config.max_num_batched_tokens
    assert not {id(seq) for seq in out.preempted} & {id(item.seq) for item in out.scheduled}   # not back in the same step
    self._run(out)
    self.sampled.append([item.seq.seq_id for item in out.scheduled if item.samples])
    tokens = self._tokens(out)
    landed = self.sched.update_from_output(out, tokens, length_verdict)
    assert landed == out.sampling_seqs
    for item in out.scheduled:   # rejected proposals' positions are computed again
      if item.spec_token_ids and item.seq.seq_id in self.positions:
        del self.positions[item.seq.seq_id][max(item.seq.num_computed_tokens - self.starts[item.seq.seq_id], 0):]
    self.check()
    return out

  def _propose(self) -> None:
    rng, proposals = self.speculate, {}
    for seq in self.sched.running:
      room = min(self.k, seq.params.max_tokens - len(seq.output_token_ids) - 1)
      if seq.decoding and room > 0: proposals[seq] = [rng.randrange(500) for _ in range(rng.randint(0, room))]
    self.sched.set_proposals(proposals)

  def _tokens(self, out: SchedulerOutput) -> list[list[int]]:
    """Each sampling row's new tokens: a random number of its proposals (if any), then a fake token."""
    proposed = {id(item.seq): item.spec_token_ids for item in out.scheduled}
    rows = []
    for seq in out.sampling_seqs:
      drafts = proposed.get(id(seq), ())
      kept = list(drafts[:self.speculate.randint(0, len(drafts))]) if drafts and self.speculate else []
      rows.append([*kept, fake_token(seq)])
    return rows

  def table(self, seq: Sequence) -> list[int]: return self.alloc.block_table(seq)

  def _run(self, out: SchedulerOutput) -> None:
    """The model runner's view: copies first, then each scheduled token's K/V is written, then every position read."""
    size = self.alloc.block_size
    for device, host in out.blocks_to_swap_out: self.host[host] = list(self.kv[device])
    for host, device in out.blocks_to_swap_in: self.kv[device] = list(self.host[host])
    for src, dst in out.block_copies: self.kv[dst] = list(self.kv[src])
    starts = {item.seq.seq_id: item.start for item in out.scheduled}
    forks = {child.seq_id for item in out.scheduled for child in item.forks}
    for seq in self.sched.running:  # what attention reads is intact (forks of this step share blocks it writes)
      if seq.seq_id not in forks: self._read(seq, starts.get(seq.seq_id, seq.num_computed_tokens))
    for item in out.scheduled:
      seq, start = item.seq, item.start
      assert seq.status is SequenceStatus.RUNNING and item.num_new_tokens > 0
      # moved on when scheduled (past its known tokens by the proposals it verifies)
      assert seq.num_computed_tokens == start + item.num_new_tokens <= seq.num_tokens + len(item.spec_token_ids)
      assert item.block_table is self.table(seq)
      if seq.seq_id not in self.positions:
        assert start % size == 0  # from scratch, or after a cached prefix of whole blocks
        self.positions[seq.seq_id], self.starts[seq.seq_id] = [], start
      done = self.positions[seq.seq_id]
      assert start == (done[-1] + 1 if done else self.starts[seq.seq_id])
      run = seq.token_ids[start:start + item.num_new_tokens - len(item.spec_token_ids)] + list(item.spec_token_ids)
      for p, token in enumerate(run, start):
        self.kv.setdefault(item.block_table[p // size], [None] * size)[p % size] = token
        done.append(p)
      for child in item.forks:
        assert child.status is SequenceStatus.RUNNING and child.num_computed_tokens == seq.num_computed_tokens
        self.positions[child.seq_id], self.starts[child.seq_id] = [], child.num_computed_tokens
    for item in out.scheduled:   # (forks: once their copies ran; proposals: what was written, as checked above)
      self._read(item.seq, item.start + item.num_new_tokens - len(item.spec_token_ids))

  def _read(self, seq: Sequence, upto: int) -> None:
    size = self.alloc.block_size
    got = [self.kv[self.table(seq)[p // size]][p % size] for p in range(upto)]
    assert got == seq.token_ids[:upto], f"seq {seq.seq_id} reads wrong K/V"

  def check(self) -> None:
    running, waiting = self.sched.running, list(self.sched.waiting)
    assert len(set(map(id, running + waiting))) == len(running) + len(waiting)
    assert all(s.status is SequenceStatus.RUNNING for s in running)
    assert all(s.status in (SequenceStatus.WAITING, SequenceStatus.SWAPPED) and self.table(s) == [] for s in waiting)
    swap = self.sched.swap_space
    if swap is not None:   # each swapped-out sequence holds one swap-space block per block it held, no block twice
      held = [b for s in waiting for b in swap.table(s.seq_id)]
      assert len(held) == len(set(held)) == swap.num_used_blocks and not set(held) & set(swap.free_blocks)
      assert all(len(swap.table(s.seq_id)) == self.alloc.blocks_for(s.num_computed_tokens) for s in waiting
                 if s.status is SequenceStatus.SWAPPED)
    assert all(self.table(s) == [] for s in self.seqs if s not in running)  # finished, waiting, or a pending fork
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
      assert self.table(seq) == []
      assert self.positions[seq.seq_id] == list(range(self.starts[seq.seq_id], seq.num_tokens - 1))
    assert self.sched.pending_swap_out == self.sched.pending_swap_in == []
    if self.sched.swap_space is not None:
      assert self.sched.swap_space.num_used_blocks == 0 and self.sched.swap_space.tables == {}
    if isinstance(self.alloc, BlockManager):
      assert self.alloc.num_free_blocks == self.alloc.num_blocks and self.alloc.num_used_blocks == 0
      assert all(b.ref_count == 0 for b in self.alloc.blocks)
    else:
      assert self.alloc.num_free_blocks == self.alloc.num_blocks and self.alloc.reserved == {}


def sim(num_blocks: int = 64, block_size: int = 4, prefix: bool = True, static: bool = False, swap_blocks: int | None = None,
        speculate: random.Random | None = None, **config) -> Sim:
  """A simulated scheduler; swap_blocks: preemption by swapping, with a swap space of that many blocks; speculate:
  random proposals, randomly accepted (Sim)."""
  cls = StaticScheduler if static else Scheduler
  if swap_blocks is not None: config.update(preemption_mode="swap", num_swap_blocks=swap_blocks)
  return Sim(cls(BlockManager(num_blocks, block_size, prefix), SchedulerConfig(**config)), speculate)


def plan(out: SchedulerOutput) -> list[tuple[int, int]]:
  """(seq id, tokens) of each scheduled item."""
  return [(item.seq.seq_id, item.num_new_tokens) for item in out.scheduled]


def random_requests(rng: random.Random, count: int, block_size: int, num_blocks: int, max_n: int = 3):
  bases = [[rng.randrange(500) for _ in range(24)] for _ in range(3)]
  for _ in range(count):
    prompt = rng.choice(bases)[:rng.randint(1, 24)] + [rng.randrange(500) for _ in range(rng.randint(0, 6))]
    max_tokens, n = rng.randint(1, 12), rng.randint(1, max_n)
    blocks = lambda t: -(-t // block_size)
    need = blocks(len(prompt)) + n * (blocks(len(prompt) + max_tokens) - blocks(len(prompt)) + 1)  # as the engine checks
    if need <= num_blocks: yield prompt, max_tokens, n
