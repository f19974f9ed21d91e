"""Static batching, the baseline: admit a batch, run it until every sequence in it is done, then admit the next.

Sequences that finish early leave the batch at once (their rows are freed), but nobody joins mid-flight.
"""
from __future__ import annotations

from collections import deque

from tinyvllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from tinyvllm.core.sequence import Sequence, SequenceStatus


class StaticScheduler:
  def __init__(self, allocator, max_num_seqs: int):
    self.allocator, self.max_num_seqs = allocator, max_num_seqs
    self.waiting: deque[Sequence] = deque()
    self.running: list[Sequence] = []

  def add(self, seq: Sequence) -> None: self.waiting.append(seq)

  def has_unfinished(self) -> bool: return bool(self.waiting or self.running)

  def schedule(self) -> SchedulerOutput:
    if not self.running: self._admit()
    for seq in self.running: self.allocator.append_slots(seq, seq.num_uncomputed_tokens)
    return SchedulerOutput([ScheduledSequence(seq, seq.num_uncomputed_tokens) for seq in self.running])

  def _admit(self) -> None:
    while self.waiting and len(self.running) < self.max_num_seqs and self.allocator.can_allocate(self.waiting[0]):
      seq = self.waiting.popleft()
      self.allocator.allocate(seq)
      seq.status = SequenceStatus.RUNNING
      self.running.append(seq)

  def finish(self, seq: Sequence) -> None:
    """Release a finished (or aborted) sequence wherever it is."""
    if seq in self.running: self.running.remove(seq)
    if seq in self.waiting: self.waiting.remove(seq)
    if seq.block_table: self.allocator.free(seq)
