"""Prompt-lookup (n-gram) proposals for speculative decoding: the tokens that followed the last earlier occurrence of the
sequence's final n tokens, in its own prompt and output (vLLM's `{"method": "ngram"}`; llama.cpp's lookup decoding).

Text that repeats (code edits, quotes, summaries of the prompt) continues as it did before, so those tokens are likely
the target's own next ones; verifying them costs one forward pass over all of them. The longest n from prompt_lookup_max
down to prompt_lookup_min that matches wins; among its matches the most recent, whose continuation is the freshest.

One pass over the sequence per call: the earlier positions holding its last token, then, for n = 2, 3, ..., those of
them preceded by the suffix's n - 1 tokens before it (a few candidates, checked with one gather each); every sequence
of a batch is looked up before each step, so the cost is the host's.
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

  def propose(self, tokens, limit: int | None = None) -> np.ndarray:
    """Up to min(k, limit) token ids (int32) to verify after `tokens` (the sequence so far); none without a match."""
    t = np.asarray(tokens)
    want = self.num_speculative_tokens if limit is None else min(self.num_speculative_tokens, limit)
    if want <= 0 or len(t) < 2: return np.zeros(0, np.int32)
    ends = np.flatnonzero(t[:-1] == t[-1])   # where an earlier match of the suffix's last token ends (never the suffix)
    best, n = -1, 1
    while len(ends):
      if n >= self.prompt_lookup_min: best = int(ends[-1])
      if n == self.prompt_lookup_max: break
      ends = ends[ends >= n]                 # the match grows one token to the left
      ends = ends[t[ends - n] == t[-1 - n]]
      n += 1
    return t[best + 1:best + 1 + want].astype(np.int32) if best >= 0 else np.zeros(0, np.int32)
