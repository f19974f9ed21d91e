"""BPEEncoding (a tiktoken.Encoding plus the map from its ranks to token ids) and the parts a format loader returns."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tiktoken

WHOLE_TEXT_PATTERN = r"[\s\S]+"  # no pre-split: the whole text is one piece


class BPEEncoding:
  """Byte-level BPE over `ranks` (bytes -> rank; tiktoken merges the adjacent pair whose concatenation ranks lowest).

  `rank_to_id` is None when ranks are the token ids. Otherwise rank r gives token id rank_to_id[r], or, when that is
  negative, the ids in expansions[r] (SentencePiece byte fallback for a character that is not in the vocab).
  """

  def __init__(self, name: str, pattern: str, ranks: dict[bytes, int], rank_to_id: list[int] | None = None,
               expansions: dict[int, list[int]] | None = None):
    self.tiktoken = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    self.pattern = pattern
    self._rank_to_id = rank_to_id
    self._expansions = expansions or {}

  def encode(self, text: str) -> list[int]:
    ranks = self.tiktoken.encode_ordinary(text)
    if self._rank_to_id is None or not ranks:
      return ranks
    table = self._rank_to_id
    ids = [table[r] for r in ranks]
    if min(ids) >= 0:
      return ids
    out: list[int] = []
    for r, i in zip(ranks, ids, strict=True):
      if i >= 0:
        out.append(i)
      else:
        out.extend(self._expansions[r])
    return out


@dataclass
class ModelParts:
  """What a format loader hands to Tokenizer: the BPE and how text reaches it and comes back."""
  encoding: BPEEncoding
  token_bytes: dict[int, bytes]  # id -> the bytes it decodes to, for every id of the base vocab
  prepare: Callable[[str, bool], str]  # (plain-text run, whether it starts the input) -> the text the BPE sees
  strip_leading_space: bool = False  # decode drops one leading space (SentencePiece's prepended "▁")
  vocab: dict[str, int] | None = None  # the base vocab's token strings as the files write them (None: GPT-2 byte-level
                                       # strings of token_bytes, as HF's conversion of a tiktoken file writes them)
