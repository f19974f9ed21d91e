"""Llama-3 `tokenizer.model` in tiktoken's file format: one "<base64 token bytes> <rank>" line per token."""
from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path

from tinyvllm.tokenizer.added_tokens import AddedToken
from tinyvllm.tokenizer.encoding import BPEEncoding, ModelParts
from tinyvllm.tokenizer.errors import TokenizerError

LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
NUM_SPECIAL = 256
# Names from meta-llama/llama-models models/llama3/tokenizer.py; the rest are <|reserved_special_token_{2+i}|>.
_NAMED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
          "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
          "<|eot_id|>", "<|python_tag|>", "<|image|>"]
BOS, EOS, EOM, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"
_LINE = re.compile(rb"[A-Za-z0-9+/=]+ \d+")


def is_tiktoken_file(path: Path) -> bool:
  """True when the file starts with a "<base64> <rank>" line (a SentencePiece model is binary protobuf)."""
  with open(path, "rb") as f:
    head = f.read(256)
  return _LINE.fullmatch(head.split(b"\n", 1)[0].rstrip(b"\r")) is not None


def read_ranks(path: Path) -> dict[bytes, int]:
  ranks: dict[bytes, int] = {}
  for line in path.read_bytes().splitlines():
    if not line:
      continue
    token, rank = line.split()
    try:
      ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (binascii.Error, ValueError):
      raise TokenizerError(f"bad line in {path}: {line[:80]!r}") from None
  return ranks


def special_tokens(first_id: int) -> list[AddedToken]:
  names = _NAMED + [f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_SPECIAL - len(_NAMED))]
  return [AddedToken(first_id + i, name, special=True) for i, name in enumerate(names)]


def load(path: Path) -> tuple[ModelParts, list[AddedToken]]:
  ranks = read_ranks(path)
  encoding = BPEEncoding(path.parent.name or "tiktoken", LLAMA3_PATTERN, ranks)
  token_bytes = {rank: token for token, rank in ranks.items()}
  return ModelParts(encoding, token_bytes, lambda text, at_start: text), special_tokens(len(ranks))
