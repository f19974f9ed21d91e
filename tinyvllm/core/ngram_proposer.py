"""Prompt-lookup (n-gram) proposals for speculative decoding: the tokens that followed the last earlier occurrence of the
sequence's final n tokens, in its own prompt and output (vLLM's `{"method": "ngram"}`; llama.cpp's lookup decoding).

Text that repeats (code edits, quotes, summaries of the prompt) continues as it did before, so those tokens are likely
the target's own next ones; verifying them costs one forward pass over all of them. The longest n from prompt_lookup_max
down to prompt_lookup_min that matches wins; among its matches the most recent, whose continuation is the freshest.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramProposer:
  num_speculative_tokens: int   # k: proposals at most a step
  prompt_lookup_min: int = 1    # the shortest suffix that may match
  prompt_lookup_max: int = 4    # the longest

  def __post_init__(self):
    if self.num_speculative_tokens < 1:
      raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
    if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
      raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max ({self.prompt_lookup_max}) "
                       "must satisfy 1 <= min <= max")

  def propose(self, tokens: np.ndarray, limit: int | None = None) -> np.ndarray:
    """Up to min(k, limit) token ids (int32) to verify after `tokens` (the sequence so far); none without a match."""
    t = np.asarray(tokens)
    want = self.num_speculative_tokens if limit is None else min(self.num_speculative_tokens, limit)
    for n in range(min(self.prompt_lookup_max, len(t) - 1), self.prompt_lookup_min - 1, -1):
      if want <= 0: break
      # windows of n tokens that end before the last token: every earlier occurrence, never the suffix itself
      windows = np.lib.stride_tricks.sliding_window_view(t[:-1], n)
      starts = np.flatnonzero((windows == t[-n:]).all(axis=1))
      if len(starts): return t[starts[-1] + n:starts[-1] + n + want].astype(np.int32)
    return np.zeros(0, np.int32)
