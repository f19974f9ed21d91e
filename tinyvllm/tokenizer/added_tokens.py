"""Added tokens (special or not): found in the text as whole tokens before the BPE sees it, as HF does."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AddedToken:
  id: int
  content: str
  special: bool = True
  lstrip: bool = False  # the token also takes the whitespace on its left
  rstrip: bool = False  # ... and on its right


def _token(token_id: int | str, entry: dict[str, Any]) -> AddedToken:
  flag = lambda name: bool(entry.get(name, False))
  return AddedToken(int(token_id), entry["content"], flag("special"), flag("lstrip"), flag("rstrip"))


def from_tokenizer_json(entries: list[dict[str, Any]]) -> list[AddedToken]:
  """tokenizer.json `added_tokens`: a list of {id, content, special, lstrip, rstrip, ...}."""
  return [_token(e["id"], e) for e in entries]


def from_added_tokens_decoder(decoder: dict[str, dict[str, Any]]) -> list[AddedToken]:
  """tokenizer_config.json `added_tokens_decoder`: {"<id>": {content, special, ...}}."""
  return [_token(int(i), e) for i, e in decoder.items()]


def merge(*groups: list[AddedToken]) -> list[AddedToken]:
  """All tokens of all groups; for an id given twice the first group wins."""
  seen: dict[int, AddedToken] = {}
  for group in groups:
    for t in group:
      seen.setdefault(t.id, t)
  return sorted(seen.values(), key=lambda t: t.id)


class AddedTokenSplitter:
  """Cuts text into runs of plain text and added tokens (leftmost, then longest match)."""

  def __init__(self, tokens: list[AddedToken]):
    self._ids = {t.content: t.id for t in tokens if t.content}
    ordered = sorted((t for t in tokens if t.content), key=lambda t: -len(t.content))
    alternatives = [(r"\s*" if t.lstrip else "") + re.escape(t.content) + (r"\s*" if t.rstrip else "") for t in ordered]
    self._regex = re.compile("|".join(alternatives)) if alternatives else None

  def split(self, text: str) -> list[tuple[str, int | None, int]]:
    """[(text, None, start) for plain text | ("", token id, start) for an added token], in order."""
    if self._regex is None:
      return [(text, None, 0)] if text else []
    out: list[tuple[str, int | None, int]] = []
    pos = 0
    for m in self._regex.finditer(text):
      if m.start() > pos:
        out.append((text[pos:m.start()], None, pos))
      out.append(("", self._lookup(m.group()), m.start()))
      pos = m.end()
    if pos < len(text):
      out.append((text[pos:], None, pos))
    return out

  def _lookup(self, matched: str) -> int:
    found = self._ids.get(matched)
    return found if found is not None else self._ids[matched.strip()]
