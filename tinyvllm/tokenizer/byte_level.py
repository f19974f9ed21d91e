"""Byte-level BPE (GPT-2, Qwen2/2.5/3, Llama-3 in HF form) from tokenizer.json or vocab.json + merges.txt."""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from tinyvllm.tokenizer.encoding import WHOLE_TEXT_PATTERN, BPEEncoding, ModelParts
from tinyvllm.tokenizer.errors import TokenizerError
from tinyvllm.tokenizer.normalizer import Normalizer, build_normalizer, identity

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


@cache
def unicode_to_byte() -> dict[int, int]:
  """GPT-2's byte <-> printable-character table, as {ord(character): byte} for str.translate."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  others = [b for b in range(256) if b not in printable]
  table = {b: b for b in printable}
  table.update({256 + n: b for n, b in enumerate(others)})
  return table


@cache
def byte_to_unicode() -> list[str]:
  """The printable character GPT-2's table writes each byte as (index: the byte)."""
  table = ["" for _ in range(256)]
  for char, byte in unicode_to_byte().items(): table[byte] = chr(char)
  return table


def bytes_to_token(raw: bytes) -> str:
  """A byte-level vocab's string for these bytes ("Ġworld" for b" world")."""
  chars = byte_to_unicode()
  return "".join(chars[b] for b in raw)


def token_to_bytes(token: str) -> bytes:
  try:
    return token.translate(unicode_to_byte()).encode("latin-1")
  except UnicodeEncodeError:
    return token.encode("utf-8")  # not a byte-level string (an added token)


def parse_merges(merges: list[Any]) -> list[tuple[str, str]]:
  """tokenizer.json merges come as "a b" strings (older files) or [a, b] pairs."""
  if merges and isinstance(merges[0], str):
    return [tuple(m.split(" ", 1)) for m in merges]  # type: ignore[misc]
  return [(a, b) for a, b in merges]


def read_merges_txt(path: Path) -> list[tuple[str, str]]:
  lines = path.read_text(encoding="utf-8").splitlines()
  return [tuple(line.split(" ", 1)) for line in lines if line and not line.startswith("#version")]  # type: ignore[misc]


def _ids_follow_merges(vocab: dict[str, int], merged: list[int], byte_ids: dict[bytes, int]) -> bool:
  """True when tiktoken can use the ids as ranks: the merge results are all the multi-byte tokens, and their ids
  grow with merge order (several merges into one token, as converted tiktoken files list them, must be adjacent)."""
  if any(b > a for a, b in zip(merged[1:], merged[:-1], strict=True)):
    return False
  return len(set(merged)) + len(byte_ids) == len(vocab)


def build_ranks(vocab: dict[str, int], merges: list[tuple[str, str]],
                drop_missing_bytes: bool = False) -> tuple[dict[bytes, int], list[int] | None]:
  """tiktoken ranks for a byte-level vocab, and the rank -> id table when the ids do not follow merge order.
  `drop_missing_bytes`: a vocab without some single bytes (SmolLM2's lacks 21 that its training text never held)
  encodes them to nothing, as HF's BPE does with no unk token (they get id -1 here; BPEEncoding drops them)."""
  as_bytes = {token: token_to_bytes(token) for token in vocab}
  byte_ids = {b: vocab[t] for t, b in as_bytes.items() if len(b) == 1}
  if len(byte_ids) != 256 and not drop_missing_bytes:
    raise TokenizerError(f"byte-level vocab has {len(byte_ids)} single-byte tokens, not 256")
  try:
    merged = [vocab[a + b] for a, b in merges]
  except KeyError as e:
    raise TokenizerError(f"merge result {e.args[0]!r} is not in the vocab") from None
  if len(byte_ids) == 256 and _ids_follow_merges(vocab, merged, byte_ids):
    return {as_bytes[t]: i for t, i in vocab.items()}, None
  ranks = {bytes([b]): b for b in range(256)}
  rank_to_id = [byte_ids.get(bytes([b]), -1) for b in range(256)]
  for (a, b), token_id in zip(merges, merged, strict=True):
    piece = as_bytes[a + b]
    if piece not in ranks:
      ranks[piece] = len(rank_to_id)
      rank_to_id.append(token_id)
  return ranks, rank_to_id


def pre_tokenizer_settings(spec: dict[str, Any] | None) -> tuple[str, bool]:
  """(split pattern, add_prefix_space) from a tokenizer.json pre_tokenizer: [Split(regex, Isolated)] + ByteLevel."""
  steps = spec.get("pretokenizers", []) if spec and spec.get("type") == "Sequence" else [spec] if spec else []
  pattern: str | None = None
  add_prefix_space = False
  for step in steps:
    kind = step.get("type")
    if kind == "Split" and pattern is None and step.get("behavior") == "Isolated" and not step.get("invert"):
      p = step["pattern"]
      pattern = p["Regex"] if "Regex" in p else _escape(p["String"])
    elif kind == "ByteLevel":
      add_prefix_space = bool(step.get("add_prefix_space", False))
      if step.get("use_regex", True):
        if pattern is not None:
          raise TokenizerError("unsupported pre_tokenizer: Split followed by ByteLevel regex")
        pattern = GPT2_PATTERN
    else:
      raise TokenizerError(f"unsupported byte-level pre_tokenizer step {json.dumps(step)[:200]}")
  return pattern or WHOLE_TEXT_PATTERN, add_prefix_space


def _escape(literal: str) -> str:
  return "".join("\\" + c if c in r"\.^$|?*+()[]{}" else c for c in literal)


def _prepare(normalize: Normalizer, add_prefix_space: bool):
  def prepare(text: str, at_start: bool) -> str:
    text = normalize(text)
    return " " + text if add_prefix_space and not text.startswith(" ") else text
  return prepare


def check_bpe_options(model: dict[str, Any]) -> None:
  if model.get("type", "BPE") != "BPE":
    raise TokenizerError(f"tokenizer model {model.get('type')!r} is not supported (only BPE)")
  if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
    raise TokenizerError("BPE with continuing_subword_prefix / end_of_word_suffix is not supported")


def build_model(name: str, vocab: dict[str, int], merges: list[tuple[str, str]], pattern: str,
                normalize: Normalizer = identity, add_prefix_space: bool = False, drop_missing_bytes: bool = False) -> ModelParts:
  ranks, rank_to_id = build_ranks(vocab, merges, drop_missing_bytes)
  dropped = {r: [] for r, i in enumerate(rank_to_id or []) if i < 0}   # missing bytes expand to no ids
  encoding = BPEEncoding(name, pattern, ranks, rank_to_id, dropped)
  token_bytes = {i: token_to_bytes(t) for t, i in vocab.items()}
  return ModelParts(encoding, token_bytes, _prepare(normalize, add_prefix_space), vocab=vocab)


def from_tokenizer_json(name: str, data: dict[str, Any]) -> ModelParts:
  model = data["model"]
  check_bpe_options(model)
  pattern, add_prefix_space = pre_tokenizer_settings(data.get("pre_tokenizer"))
  normalize = build_normalizer(data.get("normalizer"))
  return build_model(name, model["vocab"], parse_merges(model.get("merges", [])), pattern, normalize, add_prefix_space)


def from_vocab_merges(name: str, folder: Path, tokenizer_class: str | None) -> ModelParts:
  """vocab.json + merges.txt: Qwen2's regex and NFC when tokenizer_config names a Qwen2 tokenizer, else GPT-2's."""
  vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
  merges = read_merges_txt(folder / "merges.txt")
  qwen = (tokenizer_class or "").startswith("Qwen2")
  normalize = build_normalizer({"type": "NFC"}) if qwen else identity
  return build_model(name, vocab, merges, QWEN2_PATTERN if qwen else GPT2_PATTERN, normalize)
