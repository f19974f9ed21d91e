"""The static-batching baseline scheduler (`--scheduler static`): the continuous scheduler's state and step, with whole
batches admitted at once."""
from __future__ import annotations

from tinyvllm.core.scheduler import SchedulerBase, StepPlan
from tinyvllm.core.sequence import Sequence


class StaticScheduler(SchedulerBase):
  """Static batching: admit up to max_num_seqs whole prompts, run them to completion, then admit the next batch.

  A batch is admitted only if every member's worst case (prompt + max_tokens, for each of its samples) fits in the
  cache at once, so a static batch never needs preemption.
  """

  def _plan(self) -> StepPlan:
    if not self.running: self._admit_batch()
    return StepPlan(0, [self._item(seq, seq.num_uncomputed_tokens) for seq in self.running if not self._done_in_flight(seq)])

  def _worst_case_blocks(self, seq: Sequence) -> int:
    max_tokens = seq.params.max_tokens or 0
    return self.allocator.blocks_for(seq.num_tokens + max_tokens) * self._width(seq)

  def _admit_batch(self) -> None:
    reserved = seats = 0
    while self.waiting:
      seq = self.waiting[0]
      need, width = self._worst_case_blocks(seq), self._width(seq)
      if seats + width > self.config.max_num_seqs and seats: return
      if reserved + need > self.allocator.num_blocks and reserved: return
      reserved, seats = reserved + need, seats + width
      self._admit(seq)
