"""Prompt-lookup proposals (tinyvllm/core/ngram_proposer.py): the continuation of the last earlier occurrence of the
longest matching suffix, capped at k and at a caller's limit; nothing without a match; bad settings refused."""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.core.ngram_proposer import NgramProposer


def propose(tokens: list[int], k: int = 3, lo: int = 1, hi: int = 4, limit: int | None = None) -> list[int]:
  return NgramProposer(k, lo, hi).propose(np.array(tokens), limit).tolist()


def test_repeated_text_continues_as_before():
  assert propose([5, 6, 7, 8, 9, 1, 5, 6, 7]) == [8, 9, 1]          # "5 6 7" seen before: its continuation
  assert propose([5, 6, 7, 8, 5, 6, 7], k=5) == [8, 5, 6, 7]        # fewer than k tokens follow the match


def test_the_longest_suffix_wins_then_the_most_recent_match():
  # "2 3" occurs twice, "1 2 3" once: the 3-gram's continuation (4), not the most recent 2-gram's (9)
  assert propose([1, 2, 3, 4, 0, 2, 3, 9, 1, 2, 3], k=1) == [4]
  assert propose([7, 1, 2, 3, 2, 1, 8, 1], k=2, hi=1) == [8, 1]     # 1-grams: the latest earlier "1" is followed by 8
  assert propose([7, 1, 2, 3, 2, 1, 8, 1], k=2, lo=2, hi=2) == []   # "8 1" never occurred before


def test_limits_and_short_sequences():
  assert propose([1, 2, 1, 2, 1], k=3, limit=1) == [2]              # e.g. room left before max_tokens
  assert propose([1, 2, 1, 2, 1], limit=0) == []
  assert propose([4]) == [] and propose([]) == []
  assert propose([3, 3, 3], k=2) == [3]                             # the match may overlap the suffix


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="num_speculative_tokens"): NgramProposer(0)
  with pytest.raises(ValueError, match="prompt_lookup_min"): NgramProposer(2, 3, 2)
  with pytest.raises(ValueError, match="prompt_lookup_min"): NgramProposer(2, 0, 2)


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
  """The definition: the longest n in [lo, hi] whose suffix occurred earlier (ending before the last token), its most
  recent occurrence's continuation."""
  for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
    ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1:e + 1] == tokens[-n:]]
    if ends: return tokens[ends[-1] + 1:ends[-1] + 1 + k]
  return []


@pytest.mark.parametrize("seed", range(5))
def test_random_sequences_match_the_definition(seed):
  rng = np.random.default_rng(seed)
  for _ in range(300):
    tokens = rng.integers(0, 4, rng.integers(0, 40)).tolist()
    k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    hi = lo + int(rng.integers(0, 4))
    assert propose(tokens, k, lo, hi) == brute_force(tokens, k, lo, hi), (tokens, k, lo, hi)
