"""Draft-model speculation ({"model": DRAFT, "num_speculative_tokens": k}): a smaller model with the target's vocabulary
proposes each decoding sequence's next tokens, greedily, k forward passes of its own per verification.

The draft's KV cache has the target's blocks (same count and size) and is addressed through the target's block tables,
so it needs no allocator of its own: the draft writes K/V only into slots the block manager gave the sequence. That is
why proposals are made after the step is scheduled: `propose` reserves n placeholder proposals for each decoding
sequence (the scheduler allocates the slots of 1 + n tokens), and `complete` runs the draft over them and fills them in:
  1. catch-up: the draft computes the sequence's tokens it has not seen (its whole prompt at first, then the last
     accepted proposals and the target's token), in steps of at most max_num_batched_tokens, and samples proposal 1;
  2. then n - 1 one-token steps, each over the previous proposal.
After the verification, the draft's K/V is right for the positions the target kept: what it computed, up to the target's
computed tokens. A sequence whose leading blocks changed (a preemption, copy-on-write after a fork) is caught up from
its start. Proposals are the draft's argmax: deterministic given the sequence, so the rejection sampler keeps the
target's distribution exactly whatever the request's sampling settings.
"""
from __future__ import annotations

from dataclasses import replace

from tinyvllm.config import SpeculativeConfig
from tinyvllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from tinyvllm.core.sequence import Sequence
from tinyvllm.engine.speculator import proposal_limit
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0)
PLACEHOLDER = 0   # a proposal's token until `complete` fills it in


class DraftModelSpeculator:
  def __init__(self, config: SpeculativeConfig, max_model_len: int, runner: ModelRunner, max_num_batched_tokens: int):
    self.config, self.max_model_len, self.runner = config, max_model_len, runner
    self.max_num_batched_tokens = max_num_batched_tokens
    self.block_size = runner.kv_cache.block_size
    # seq id -> (positions whose draft K/V is written, the blocks holding them when written)
    self.done: dict[int, tuple[int, tuple[int, ...]]] = {}

  def propose(self, running: list[Sequence]) -> dict[Sequence, list[int]]:
    """n placeholder proposals for each decoding sequence (none while disable_by_batch_size or more run)."""
    live = {seq.seq_id for seq in running}
    self.done = {sid: state for sid, state in self.done.items() if sid in live}
    off = self.config.disable_by_batch_size
    if off is not None and len(running) >= off: return {}
    proposals = {}
    for seq in running:
      n = min(self.config.num_speculative_tokens, proposal_limit(seq, self.max_model_len)) if seq.decoding else 0
      if n > 0: proposals[seq] = [PLACEHOLDER] * n
    return proposals

  def complete(self, sched: SchedulerOutput) -> SchedulerOutput:
    """The scheduled step with the draft's proposals in place of the placeholders."""
    todo = [item for item in sched.scheduled if item.spec_token_ids]
    if not todo: return sched
    drafts = self._first_proposals(todo)
    for j in range(2, max(len(item.spec_token_ids) for item in todo) + 1):
      active = [i for i, item in enumerate(todo) if len(item.spec_token_ids) >= j]
      steps = [ScheduledSequence(_view(todo[i].seq, drafts[i]), _known(todo[i]) + j - 2, 1, todo[i].block_table, True)
               for i in active]
      for i, tokens in zip(active, self.runner.execute(SchedulerOutput(steps)).token_ids, strict=True): drafts[i] += tokens
    for item in todo:
      written = _known(item) + len(item.spec_token_ids) - 1
      self.done[item.seq.seq_id] = (written, tuple(item.block_table[:-(-written // self.block_size)]))
    filled = {id(item): tuple(d) for item, d in zip(todo, drafts, strict=True)}
    return replace(sched, scheduled=[replace(item, spec_token_ids=filled[id(item)]) if id(item) in filled else item
                                     for item in sched.scheduled])

  def _first_proposals(self, todo: list[ScheduledSequence]) -> list[list[int]]:
    """Catch each sequence's draft K/V up to its last token, in steps of at most max_num_batched_tokens tokens; the
    draft's next token after it, per sequence."""
    position = [self._valid(item) for item in todo]
    drafts: list[list[int]] = [[] for _ in todo]
    while any(not d for d in drafts):
      budget, steps, owners = self.max_num_batched_tokens, [], []
      for i, item in enumerate(todo):
        if drafts[i] or budget <= 0: continue
        num = min(_known(item) - position[i], budget)
        steps.append(ScheduledSequence(_view(item.seq, []), position[i], num, item.block_table, position[i] + num == _known(item)))
        owners.append(i)
        position[i], budget = position[i] + num, budget - num
      tokens = iter(self.runner.execute(SchedulerOutput(steps)).token_ids)
      for i, step in zip(owners, steps, strict=True):
        if step.samples: drafts[i] = next(tokens)
    return drafts

  def _valid(self, item: ScheduledSequence) -> int:
    """The sequence's leading positions whose draft K/V is right: those written, within the target's computed tokens,
    in blocks the sequence still holds."""
    state = self.done.get(item.seq.seq_id)
    if state is None: return 0
    written, blocks = state
    valid = min(written, item.start)
    held = -(-valid // self.block_size)
    return valid if tuple(item.block_table[:held]) == blocks[:held] else 0


def _known(item: ScheduledSequence) -> int:
  """The sequence's known tokens when the step was scheduled (its last one is computed by the step)."""
  return item.start + item.num_new_tokens - len(item.spec_token_ids)


def _view(seq: Sequence, drafts: list[int]) -> Sequence:
  """The sequence with `drafts` after its tokens, sampled greedily: what a draft step reads its tokens from."""
  return Sequence(seq.request_id, seq.prompt_token_ids, GREEDY, seed=0, output_token_ids=seq.output_token_ids + drafts)
