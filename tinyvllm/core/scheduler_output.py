"""What the scheduler hands the model runner for one step."""
from __future__ import annotations

from dataclasses import dataclass, field

from tinyvllm.core.sequence import Sequence


@dataclass
class ScheduledSequence:
  seq: Sequence
  num_new_tokens: int          # tokens computed this step, starting at seq.num_computed_tokens
  forks: list[Sequence] = field(default_factory=list)  # samples to fork off this sequence, sampled from its logits

  @property
  def samples(self) -> bool:
    """Whether this step reaches the sequence's last token, so that a new token is sampled for it."""
    return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
  scheduled: list[ScheduledSequence] = field(default_factory=list)
  preempted: list[Sequence] = field(default_factory=list)
  block_copies: list[tuple[int, int]] = field(default_factory=list)   # (source, destination) blocks, before the step

  @property
  def num_tokens(self) -> int: return sum(s.num_new_tokens for s in self.scheduled)

  def __bool__(self) -> bool: return bool(self.scheduled)
