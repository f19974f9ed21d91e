"""What the scheduler hands the model runner for one step."""
from __future__ import annotations

from dataclasses import dataclass, field

from tinyvllm.core.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSequence:
  """One sequence's part of a step, fixed when the step is scheduled (the sequence itself moves on at once)."""
  seq: Sequence
  start: int                   # the first position computed: the sequence's computed tokens before the step
  num_new_tokens: int          # tokens computed this step, positions start .. start + num_new_tokens - 1
  block_table: list[int]       # the block manager's table of the sequence (valid until the next schedule())
  samples: bool                # the step reaches the sequence's last token: a token is sampled for it (and its forks)
  forks: tuple[Sequence, ...] = ()   # samples forked off the sequence this step, each sampled from its logits
  token_source: int = -1       # >= 0: the last new token is still in flight, in this row of the previous step's samples
  sample_index: int = 0        # the index in seq's output of the token sampled for it (its forks sample their first)
  spec_token_ids: tuple[int, ...] = ()   # proposals verified: the last len() of the new tokens (speculative decoding)


@dataclass
class SchedulerOutput:
  """One step. Before it runs, the runner moves blocks in this order: swap-outs (a device block they free may be
  handed out again in this very step), swap-ins, then the block copies."""
  scheduled: list[ScheduledSequence] = field(default_factory=list)
  preempted: list[Sequence] = field(default_factory=list)
  block_copies: list[tuple[int, int]] = field(default_factory=list)   # (source, destination) blocks, before the step
  blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, swap-space block)
  blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (swap-space block, device block)

  @property
  def num_tokens(self) -> int: return sum(s.num_new_tokens for s in self.scheduled)

  @property
  def speculates(self) -> bool: return any(item.spec_token_ids for item in self.scheduled)

  @property
  def sampling_seqs(self) -> list[Sequence]:
    """The sequence each sampled row is for, in row order (a sequence, then the samples forked off it)."""
    return [target for item in self.scheduled if item.samples for target in (item.seq, *item.forks)]

  def __bool__(self) -> bool: return bool(self.scheduled)
