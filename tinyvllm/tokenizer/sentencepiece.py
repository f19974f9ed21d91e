"""SentencePiece-style BPE tokenizer.json (Llama 2, TinyLlama, stories260K) mapped onto tiktoken byte-level ranks.

HF's BPE starts from characters (a character not in the vocab becomes its `<0xNN>` byte tokens) and repeatedly
merges the listed pair of lowest merge rank. tiktoken starts from bytes and merges the adjacent pair whose
concatenation has the lowest rank. To make the two agree, ranks are laid out as:
  1. the 256 single bytes (the one-character piece if there is one, else the `<0xNN>` token);
  2. the byte prefixes of every multi-byte character piece, then the characters themselves, so that every
     character of the vocab is whole before any real merge (a prefix left over at the end means the character
     was not in the vocab: it becomes its `<0xNN>` tokens, which is SentencePiece's byte fallback);
  3. every piece that merges can build, in the order of its first merge.
Ranks are then mapped to token ids. (Ranks cannot simply be the ids: SentencePiece puts single characters such as
"▁" at the end of the vocab, so their bytes would be joined last, after merges HF never makes.)
SentencePiece conversions list every split of a piece as a merge, grouped by piece, so "lowest merge rank" and
"lowest rank of the merged piece" pick the same merge. (A tie between overlapping splits, A+B = B+C, could still
differ in theory; it never showed up in tests against HF on stories260K and Llama 2.)
"""
from __future__ import annotations

import re
import warnings
from typing import Any

from tinyvllm.tokenizer.byte_level import check_bpe_options, parse_merges
from tinyvllm.tokenizer.encoding import WHOLE_TEXT_PATTERN, BPEEncoding, ModelParts
from tinyvllm.tokenizer.errors import TokenizerError
from tinyvllm.tokenizer.normalizer import Normalizer, build_normalizer

SPACE = "▁"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def step_types(spec: Any) -> set[str]:
  """The `type` of a normalizer / pre_tokenizer / decoder entry and of everything nested in it."""
  if isinstance(spec, list):
    return set().union(*map(step_types, spec))
  if not isinstance(spec, dict):
    return set()
  return {spec.get("type", "")}.union(*(step_types(v) for v in spec.values() if isinstance(v, (list, dict))))


def is_sentencepiece_style(data: dict[str, Any]) -> bool:
  """A BPE tokenizer.json that works on characters with "▁" for spaces and `<0xNN>` byte fallback."""
  types = step_types([data.get("normalizer"), data.get("pre_tokenizer"), data.get("decoder")])
  if "ByteLevel" in types:
    return False
  return bool(data["model"].get("byte_fallback")) or bool(types & {"Metaspace", "ByteFallback"})


def _byte_ids(vocab: dict[str, int]) -> dict[int, int]:
  found = {int(m.group(1), 16): i for p, i in vocab.items() if len(p) == 6 and (m := _BYTE_TOKEN.fullmatch(p))}
  if len(found) != 256:
    raise TokenizerError(f"SentencePiece-style vocab has {len(found)} of the 256 <0xNN> byte-fallback tokens; "
                         "only tokenizers with byte fallback are supported")
  return found


def reachable_pieces(vocab: dict[str, int], merges: list[tuple[str, str]]) -> set[str]:
  """The pieces HF's BPE can produce: one-character pieces, and merges of pieces it can produce."""
  reachable = {p for p in vocab if len(p) == 1}
  grown = True
  while grown:
    before = len(reachable)
    reachable.update(a + b for a, b in merges if a in reachable and b in reachable and a + b in vocab)
    grown = len(reachable) != before
  return reachable


def build_ranks(vocab: dict[str, int], merges: list[tuple[str, str]], reachable: set[str]):
  """(ranks, rank_to_id, expansions) as laid out in the module docstring."""
  byte_ids = _byte_ids(vocab)
  ranks: dict[bytes, int] = {}
  rank_to_id: list[int] = []
  expansions: dict[int, list[int]] = {}

  def add(raw: bytes, token_id: int) -> None:
    ranks[raw] = len(rank_to_id)
    rank_to_id.append(token_id)

  for b in range(256):
    add(bytes([b]), vocab.get(chr(b), byte_ids[b]) if b < 0x80 else byte_ids[b])
  wide = [p for p in vocab if len(p) == 1 and len(p.encode()) > 1]
  for raw in (p.encode() for p in wide):
    for k in range(2, len(raw)):
      if raw[:k] not in ranks:
        expansions[len(rank_to_id)] = [byte_ids[x] for x in raw[:k]]
        add(raw[:k], -1)
  for p in wide:
    add(p.encode(), vocab[p])
  for a, b in merges:
    raw = (a + b).encode()
    if a + b in reachable and raw not in ranks:
      add(raw, vocab[a + b])
  return ranks, rank_to_id, expansions


def split_pattern(reachable: set[str], space: str, split: bool) -> str:
  """The tiktoken pre-split regex. Cutting before a `space` that follows another character changes nothing
  when no piece holds such a pair (no merge can cross the cut); otherwise use the whole text as one piece."""
  s = re.escape(space)
  if split:
    return f"{s}[^{s}]*|[^{s}]+"  # HF's Metaspace split: every "▁" starts a new word
  crosses = any(piece[i] != space and piece[i + 1] == space for piece in reachable for i in range(len(piece) - 1))
  return WHOLE_TEXT_PATTERN if crosses else f"{s}*[^{s}]+|{s}+"


def _metaspace(data: dict[str, Any]) -> dict[str, Any] | None:
  pre = data.get("pre_tokenizer")
  if pre is None:
    return None
  steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
  if len(steps) != 1 or steps[0].get("type") != "Metaspace":
    raise TokenizerError(f"unsupported SentencePiece-style pre_tokenizer {str(pre)[:200]}")
  return steps[0]


def _prepare(normalize: Normalizer, meta: dict[str, Any] | None):
  if meta is None:
    return lambda text, at_start: normalize(text)
  space = meta.get("replacement", SPACE)
  scheme = meta.get("prepend_scheme", "always" if meta.get("add_prefix_space", True) else "never")

  def prepare(text: str, at_start: bool) -> str:
    text = normalize(text).replace(" ", space)
    wants = scheme == "always" or (scheme == "first" and at_start)
    return space + text if wants and text and not text.startswith(space) else text
  return prepare


def _strips_leading_space(decoder: dict[str, Any] | None) -> bool:
  """Whether the decoder drops the leading space (Strip(start=1), or a Metaspace decoder that prepends)."""
  if decoder is None:
    return False
  if decoder.get("type") == "Metaspace":
    return decoder.get("prepend_scheme", "always") != "never"
  if decoder.get("type") == "Strip":
    return decoder.get("content", " ") == " " and decoder.get("start", 0) > 0
  return decoder.get("type") == "Sequence" and any(map(_strips_leading_space, decoder["decoders"]))


def _check_grouped(merges: list[tuple[str, str]]) -> None:
  """tiktoken gives all merges into one piece the piece's rank; that equals HF's order only when those merges are
  listed together (as SentencePiece conversions list them)."""
  first: dict[str, int] = {}
  last_group = -1
  for i, (a, b) in enumerate(merges):
    group = first.setdefault(a + b, i)
    if group < last_group:
      warnings.warn(f"merges into {a + b!r} are not listed together: ids may differ from HF's BPE", stacklevel=3)
      return
    last_group = group


def from_tokenizer_json(name: str, data: dict[str, Any]) -> ModelParts:
  model = data["model"]
  check_bpe_options(model)
  vocab: dict[str, int] = model["vocab"]
  merges = parse_merges(model.get("merges", []))
  _check_grouped(merges)
  meta = _metaspace(data)
  space = meta.get("replacement", SPACE) if meta else SPACE
  reachable = reachable_pieces(vocab, merges)
  ranks, rank_to_id, expansions = build_ranks(vocab, merges, reachable)
  pattern = split_pattern(reachable, space, bool(meta and meta.get("split", True)))
  encoding = BPEEncoding(name, pattern, ranks, rank_to_id, expansions)
  token_bytes = {i: _piece_bytes(p, space) for p, i in vocab.items()}
  prepare = _prepare(build_normalizer(data.get("normalizer")), meta)
  return ModelParts(encoding, token_bytes, prepare, _strips_leading_space(data.get("decoder")), vocab=vocab)


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
  """The merges a SentencePiece BPE vocab implies (a GGUF file stores scores, not merges), as transformers recovers them
  (tokenization_utils_base.generate_merges): every split of a piece into two pieces of the vocab, a piece's splits by the
  ids of their halves, then every split by its piece's score, best first (then the longer left and right halves; ties
  keep the order before)."""
  ids = {t: i for i, t in enumerate(tokens)}
  best = dict(zip(tokens, scores, strict=True))
  merges: list[tuple[str, str, float]] = []
  for piece, score in best.items():
    splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
    merges += [(a, b, score) for a, b in sorted(splits, key=lambda ab: (ids[ab[0]], ids[ab[1]]))]
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(a, b) for a, b, _ in merges]


def scored_pieces_json(tokens: list[str], scores: list[float], unk: str | None,
                       merges: list[tuple[str, str]] | None = None) -> dict[str, Any]:
  """The tokenizer.json transformers builds for a SentencePiece BPE vocab given as pieces and scores, and its merges
  where given (else recovered from the scores) (LlamaTokenizer: byte fallback, "▁" for spaces prepended to the first
  run of text, the decoder dropping it again)."""
  pairs = merges if merges is not None else merges_from_scores(tokens, scores)
  return {"model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens)}, "byte_fallback": True, "fuse_unk": True,
                    "unk_token": unk, "merges": [[a, b] for a, b in pairs]},
          "pre_tokenizer": {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first", "split": False},
          "decoder": {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}, {"type": "Fuse"},
                                                       {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}}


def _piece_bytes(piece: str, space: str) -> bytes:
  m = _BYTE_TOKEN.fullmatch(piece) if len(piece) == 6 else None
  return bytes([int(m.group(1), 16)]) if m else piece.replace(space, " ").encode("utf-8")
