"""HF `tokenizers` normalizers (the subset LLM tokenizers use) as plain str -> str functions."""
from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from typing import Any

from tinyvllm.tokenizer.errors import TokenizerError

Normalizer = Callable[[str], str]


def identity(text: str) -> str:
  return text


def _unicode(form: str) -> Normalizer:
  return lambda text: unicodedata.normalize(form, text)  # type: ignore[arg-type]


def _prepend(prefix: str) -> Normalizer:
  return lambda text: prefix + text if text else text


def _replace(spec: dict[str, Any]) -> Normalizer:
  pattern, content = spec["pattern"], spec["content"]
  if "String" in pattern:
    old = pattern["String"]
    return lambda text: text.replace(old, content)
  regex = re.compile(pattern["Regex"])
  return lambda text: regex.sub(lambda _: content, text)


def _sequence(parts: list[Normalizer]) -> Normalizer:
  def run(text: str) -> str:
    for part in parts:
      text = part(text)
    return text
  return run


def build_normalizer(spec: dict[str, Any] | None) -> Normalizer:
  """The normalizer described by a tokenizer.json `normalizer` entry (None: leave text as it is)."""
  if spec is None:
    return identity
  kind = spec.get("type")
  if kind in ("NFC", "NFD", "NFKC", "NFKD"):
    return _unicode(kind)
  if kind == "Lowercase":
    return str.lower
  if kind == "Prepend":
    return _prepend(spec["prepend"])
  if kind == "Replace":
    return _replace(spec)
  if kind == "Sequence":
    return _sequence([build_normalizer(s) for s in spec["normalizers"]])
  raise TokenizerError(f"unsupported tokenizer.json normalizer {kind!r}")
