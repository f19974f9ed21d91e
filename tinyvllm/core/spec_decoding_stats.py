"""Speculative decoding's counters, as vLLM names them: what the scheduler counts as verifications land, and what
/metrics, RequestOutput and `bench decode` report."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodingStats:
  """Speculative decoding's totals since start (vLLM's names): verifications (a sequence's proposals checked in a step),
  proposals, accepted proposals. Each verification emits its accepted proposals and one token of the target's."""
  num_drafts: int = 0
  num_draft_tokens: int = 0
  num_accepted_tokens: int = 0

  def count(self, proposed: int, accepted: int) -> None:
    self.num_drafts, self.num_draft_tokens = self.num_drafts + 1, self.num_draft_tokens + proposed
    self.num_accepted_tokens += accepted

  def since(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
    """The counts between an earlier snapshot and this one."""
    return SpecDecodingStats(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                             self.num_accepted_tokens - earlier.num_accepted_tokens)

  @property
  def acceptance_rate(self) -> float: return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

  @property
  def mean_acceptance_length(self) -> float:
    """Tokens emitted per verification (1 + accepted proposals)."""
    return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
