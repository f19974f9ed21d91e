"""Structured output's state of one sequence: an llguidance matcher over its output tokens.

The engine compiles a request's grammar once (engine/structured_outputs.py) and gives each of its n sequences a copy
(`StructuredOutputGrammar.copy`). The scheduler advances it as each token lands (`accept`) and ends the sequence
with "stop" when the grammar is complete (`terminated`: nothing may follow but EOS). Preemption changes nothing: the
matcher stands for the output tokens, which a preempted sequence keeps (recomputed or swapped). Rejected speculative
proposals never reach it (only landed tokens do); the masks of a verification's rows are computed with the proposals
consumed and rolled back (`fill_bitmasks`). The model runner asks for each step's bitmask rows (llguidance's layout:
bit t % 32 of int32 word t // 32 set when token t is allowed), computed in llguidance's threads with the GIL
released.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np


def reasoning_ended(token_ids: Sequence[int], start: int, end: int) -> bool:
  """Whether a prompt has closed its reasoning: its last end marker comes after its last start marker."""
  last = {start: -1, end: -1}
  for i, t in enumerate(token_ids):
    if t in last: last[t] = i
  return last[end] > last[start]


class StructuredOutputGrammar:
  """One sequence's matcher (an llguidance.LLMatcher). With `reasoning_end` (an engine with a reasoning parser, as
  vLLM's) the constraint starts after the model's reasoning: until that token lands the sequence samples freely and
  the matcher takes nothing."""

  def __init__(self, matcher: Any, reasoning_end: int | None = None):
    self.matcher, self.reasoning_end = matcher, reasoning_end

  @property
  def active(self) -> bool:
    """Whether the constraint applies to the next token (the reasoning, if any, has ended)."""
    return self.reasoning_end is None

  def copy(self) -> StructuredOutputGrammar:
    return StructuredOutputGrammar(self.matcher.deep_copy(), self.reasoning_end)

  def after_reasoning(self, end: int) -> StructuredOutputGrammar:
    """This grammar, applied once token `end` has landed."""
    self.reasoning_end = end
    return self

  def advance(self, token: int) -> bool:
    """Take a landed token; whether the output ends with it: the grammar is complete (nothing may follow but EOS), or
    it rejected the token. Only a row whose other controls leave the grammar no token can sample one it rejects (say
    allowed_token_ids without a token the grammar allows there); that sequence ends, said on stderr."""
    if self.reasoning_end is not None:
      if token == self.reasoning_end: self.reasoning_end = None
      return False
    if not self.matcher.consume_token(token):
      print(f"[tinyvllm] structured output: the grammar rejected token {token} ({self.matcher.get_error()}); "
            "the sequence ends here", file=sys.stderr, flush=True)
      return True
    return self.matcher.is_stopped()


class BitmaskFiller:
  """Computes bitmask rows for many matchers at once in llguidance's thread pool (one per engine)."""

  def __init__(self) -> None:
    import llguidance
    self.executor = llguidance.LLExecutor()

  def fill(self, rows: Sequence[tuple[StructuredOutputGrammar, int, list[int]]], bitmask: np.ndarray) -> None:
    """For each (grammar, row, proposals): the mask of its next token into bitmask[row], and with proposals (a
    verification) the mask after each of them into the rows that follow (up to the first the grammar rejects: later rows
    are never sampled from). bitmask is [R, W] int32, C-contiguous."""
    if bitmask.dtype != np.int32 or not bitmask.flags["C_CONTIGUOUS"]: raise ValueError("bitmask must be C-contiguous int32")
    batch, words = bitmask.shape
    plain = [(g.matcher, row) for g, row, proposals in rows if not proposals]
    drafted = [(g.matcher, row, list(proposals)) for g, row, proposals in rows if proposals]
    if plain: self.executor.unsafe_compute_mask_ptr(plain, bitmask.ctypes.data, words * 4, batch)
    if drafted: self.executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.ctypes.data, words * 4, batch)
