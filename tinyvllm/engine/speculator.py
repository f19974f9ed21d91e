"""Speculative decoding's proposals (vLLM's proposers): before each step, the tokens each decoding sequence's step
verifies after its last one. The scheduler schedules them, the runner verifies them in the step's one forward pass
(layers/rejection_sampler.py), and the scheduler lands what was accepted.

`NgramSpeculator` ({"method": "ngram"}): prompt lookup in the sequence's own tokens (core/ngram_proposer.py), on the host.
`DraftModelSpeculator` (engine/draft_model.py) runs a smaller model. Both: `propose(running)` before the step is
scheduled, `complete(scheduled step)` after it (the draft model fills in its proposals there).
A sequence gets no more proposals than its limits leave room for: the step emits at most one token past them, which
must stay within max_tokens, and their positions within the context.
"""
from __future__ import annotations

from tinyvllm.config import SpeculativeConfig
from tinyvllm.core.ngram_proposer import NgramProposer
from tinyvllm.core.scheduler_output import SchedulerOutput
from tinyvllm.core.sequence import Sequence


def proposal_limit(seq: Sequence, max_model_len: int) -> int:
  """The most proposals seq's next step may verify: its tokens emitted stay within max_tokens, its positions within the
  context."""
  limit = max_model_len - seq.num_tokens
  if seq.params.max_tokens is not None: limit = min(limit, seq.params.max_tokens - seq.num_output_tokens - 1)
  return max(limit, 0)


class NgramSpeculator:
  def __init__(self, config: SpeculativeConfig, max_model_len: int):
    self.config, self.max_model_len = config, max_model_len
    self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

  def propose(self, running: list[Sequence]) -> dict[Sequence, list[int]]:
    """Proposals for the running sequences that decode next (none while disable_by_batch_size or more run)."""
    off = self.config.disable_by_batch_size
    if off is not None and len(running) >= off: return {}
    proposals = {}
    for seq in running:
      if not seq.decoding or (limit := proposal_limit(seq, self.max_model_len)) == 0: continue
      tokens = self.proposer.propose(seq.token_ids, limit)
      if len(tokens): proposals[seq] = tokens.tolist()
    return proposals

  def complete(self, sched: SchedulerOutput) -> SchedulerOutput:
    """The proposals are the lookup's, made before scheduling: nothing to fill in."""
    return sched
