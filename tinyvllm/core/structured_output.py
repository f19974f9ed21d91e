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


class StructuredOutputGrammar:
  """One sequence's matcher (an llguidance.LLMatcher)."""

  def __init__(self, matcher: Any):
    self.matcher = matcher

  def copy(self) -> StructuredOutputGrammar:
    return StructuredOutputGrammar(self.matcher.deep_copy())

  def advance(self, token: int) -> bool:
    """Take a landed token; whether the output ends with it: the grammar is complete (nothing may follow but EOS), or
    it rejected the token. Only a row whose other controls leave the grammar no token can sample one it rejects (say
    allowed_token_ids without a token the grammar allows there); that sequence ends, said on stderr."""
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
