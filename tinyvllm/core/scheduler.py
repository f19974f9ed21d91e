"""Schedulers: which sequences run in the next step, and how many of their tokens.

Both policies keep queues of waiting and running sequences and release a finished sequence's blocks at once.
- `Scheduler` (continuous batching, the default): every step serves the running sequences at their current positions
  (decodes and unfinished prompt chunks) and then admits waiting sequences mid-flight while the token budget
  (--max-num-batched-tokens), --max-num-seqs and free blocks allow. Long prompts are split into chunks (chunked
  prefill) that share a step with decodes. When a running sequence needs a block and none is free, the newest running
  sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later.
- `StaticScheduler` (the baseline): admit a batch, run it until all of it is done, then admit the next.

A request with n > 1 samples queues only its first sequence; the others are forked from it (sharing its prompt blocks)
when it samples its first token, each sampling its own token from the same logits.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tinyvllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from tinyvllm.core.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
  max_num_seqs: int = 64
  max_num_batched_tokens: int = 2048
  enable_chunked_prefill: bool = True
  long_prefill_token_threshold: int = 0   # most prompt tokens of one sequence per step (0: up to the budget)


class SchedulerBase:
  def __init__(self, allocator, config: SchedulerConfig):
    self.allocator, self.config = allocator, config
    self.waiting: deque[Sequence] = deque()
    self.running: list[Sequence] = []
    self.pending_forks: dict[int, list[Sequence]] = {}   # first sequence's id -> the samples forked from it
    self.pending_copies: list[tuple[int, int]] = []       # block copies (copy-on-write) the next step must do first
    self.num_preemptions = 0

  def add(self, seqs: list[Sequence]) -> None:
    """Queue a request's sequences: the first runs, the rest wait to be forked from it."""
    first, *forks = seqs
    if forks: self.pending_forks[first.seq_id] = forks
    self.waiting.append(first)

  def has_unfinished(self) -> bool: return bool(self.waiting or self.running)

  def finish(self, seq: Sequence) -> None:
    """Release a finished or aborted sequence wherever it is (its blocks are free for this very step)."""
    if seq in self.running: self.running.remove(seq)
    if seq in self.waiting: self.waiting.remove(seq)
    self.pending_forks.pop(seq.seq_id, None)
    if seq.block_table: self.allocator.free(seq)

  def fork(self, parent: Sequence) -> list[Sequence]:
    """After the parent sampled its first token: its pending samples share its blocks and start running."""
    children = self.pending_forks.pop(parent.seq_id, [])
    copies = []
    for child in children:
      copies += self.allocator.fork(parent, child)
      child.num_computed_tokens, child.status = parent.num_computed_tokens, SequenceStatus.RUNNING
      self.running.append(child)
    self.pending_copies.extend(copies)
    return children

  def _schedule_item(self, seq: Sequence, num_new: int) -> ScheduledSequence:
    self.pending_copies.extend(self.allocator.append_slots(seq, num_new))
    item = ScheduledSequence(seq, num_new)
    if item.samples and not seq.output_token_ids: item.forks = self.pending_forks.get(seq.seq_id, [])
    return item

  def _admit(self, seq: Sequence) -> None:
    self.waiting.remove(seq)
    seq.num_computed_tokens = self.allocator.allocate(seq, 1 + len(self.pending_forks.get(seq.seq_id, [])))
    seq.status = SequenceStatus.RUNNING
    self.running.append(seq)

  def _can_admit(self, seq: Sequence, num_new: int) -> bool:
    return self.allocator.can_allocate(seq, num_new, 1 + len(self.pending_forks.get(seq.seq_id, [])))

  def _output(self, items: list[ScheduledSequence], preempted: list[Sequence]) -> SchedulerOutput:
    out = SchedulerOutput(items, preempted, self.pending_copies)
    self.pending_copies = []
    return out


class Scheduler(SchedulerBase):
  """Continuous batching with chunked prefill and preemption by recomputation (FCFS)."""

  def _chunk(self, seq: Sequence, budget: int) -> int:
    num_new = min(seq.num_uncomputed_tokens, budget)
    if seq.in_prefill and self.config.long_prefill_token_threshold and self.config.enable_chunked_prefill:
      num_new = min(num_new, self.config.long_prefill_token_threshold)
    return num_new

  def schedule(self) -> SchedulerOutput:
    budget, items, preempted = self.config.max_num_batched_tokens, [], []
    index = 0
    while index < len(self.running) and budget > 0:
      seq = self.running[index]
      if seq.reaches_max_tokens:   # its last token is in flight (asynchronous scheduling): nothing left to compute
        index += 1
        continue
      num_new = self._chunk(seq, budget)
      if not self._make_room(seq, num_new, preempted): break
      items.append(self._schedule_item(seq, num_new))
      budget -= num_new
      index += 1
    if not preempted: self._admit_waiting(budget, items)
    return self._output(items, preempted)

  def _make_room(self, seq: Sequence, num_new: int, preempted: list[Sequence]) -> bool:
    """Preempt the newest running sequences until seq can take num_new more tokens; False if seq itself went."""
    while not self.allocator.can_append(seq, num_new):
      victim = self.running[-1]
      preempted.append(self._preempt(victim))
      if victim is seq: return False
    return True

  def _admit_waiting(self, budget: int, items: list[ScheduledSequence]) -> None:
    while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
      seq = self.waiting[0]
      if seq.num_pending: return   # preempted while its token was in flight: it is recomputed once the token is known
      # its pending forks will run too, and so will those of running sequences (a lone wide request still runs)
      seats = len(self.running) + sum(len(self.pending_forks.get(s.seq_id, [])) for s in self.running)
      if seats and seats + 1 + len(self.pending_forks.get(seq.seq_id, [])) > self.config.max_num_seqs: return
      num_new = self._chunk(seq, budget)
      if num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill: return
      if not self._can_admit(seq, num_new): return
      self._admit(seq)
      num_new = self._chunk(seq, budget)  # the prefix cache may have covered part of it
      items.append(self._schedule_item(seq, num_new))
      budget -= num_new

  def _preempt(self, seq: Sequence) -> Sequence:
    """Free the newest running sequence's blocks; it restarts from scratch (recomputation) when readmitted."""
    self.running.remove(seq)
    self.allocator.free(seq)
    seq.num_computed_tokens, seq.status = 0, SequenceStatus.WAITING
    self.waiting.appendleft(seq)
    self.num_preemptions += 1
    return seq


class StaticScheduler(SchedulerBase):
  """Static batching: admit up to max_num_seqs whole prompts, run them to completion, then admit the next batch.

  A batch is admitted only if every member's worst case (prompt + max_tokens, for each of its samples) fits in the
  cache at once, so a static batch never needs preemption.
  """

  def schedule(self) -> SchedulerOutput:
    if not self.running: self._admit_batch()
    items = [self._schedule_item(seq, seq.num_uncomputed_tokens) for seq in self.running if not seq.reaches_max_tokens]
    return self._output(items, [])

  def _worst_case_blocks(self, seq: Sequence) -> int:
    max_tokens = seq.params.max_tokens or 0
    return self.allocator.blocks_for(seq.num_tokens + max_tokens) * (1 + len(self.pending_forks.get(seq.seq_id, [])))

  def _admit_batch(self) -> None:
    reserved = seats = 0
    while self.waiting:
      seq = self.waiting[0]
      need, width = self._worst_case_blocks(seq), 1 + len(self.pending_forks.get(seq.seq_id, []))
      if seats + width > self.config.max_num_seqs and seats: return
      if reserved + need > self.allocator.num_blocks and reserved: return
      reserved, seats = reserved + need, seats + width
      self._admit(seq)
