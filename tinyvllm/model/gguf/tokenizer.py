"""The tokenizer a GGUF file's metadata describes (tokenizer.ggml.*), built as HF transformers builds it from the same
file (integrations/gguf): byte-level BPE ("gpt2") from the tokens and merges, or SentencePiece BPE ("llama": Llama 2,
Mistral, TinyLlama) from the tokens and their scores; the tokens typed CONTROL as special added tokens and USER_DEFINED as
plain ones, BOS/EOS/PAD/UNK from their ids, tokenizer.chat_template for chat."""
from __future__ import annotations

from typing import Any

from tinyvllm.config import ConfigError
from tinyvllm.model.gguf.reader import GGUFFile
from tinyvllm.tokenizer import sentencepiece
from tinyvllm.tokenizer.added_tokens import AddedToken
from tinyvllm.tokenizer.byte_level import GPT2_PATTERN, QWEN2_PATTERN, build_model, byte_to_unicode
from tinyvllm.tokenizer.chat_template import ChatTemplate
from tinyvllm.tokenizer.config import Specials
from tinyvllm.tokenizer.encoding import ModelParts
from tinyvllm.tokenizer.errors import TokenizerError
from tinyvllm.tokenizer.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4   # llama.cpp's token types
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's tekken (Mistral Nemo): words cut where a lowercase run ends and an uppercase one starts
TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                  r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                  r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex, as transformers maps the names (integrations/gguf). "smollm" and "gpt2" keep
# GPT-2's, as transformers does (llama.cpp itself splits SmolLM's digits one by one; tinyvllm follows transformers,
# which the tests compare against); other names are refused rather than guessed (transformers falls back to GPT-2's).
PRE_TOKENIZER_PATTERNS = {
  **dict.fromkeys(("default", "gpt2", "gpt-2", "smollm"), GPT2_PATTERN),
  **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), QWEN2_PATTERN),
  **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                   "jina-v5-nano", "dbrx", "smaug-bpe"), LLAMA3_PATTERN),
  "tekken": TEKKEN_PATTERN,
  **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), GPT4O_PATTERN)}
SPECIAL_IDS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
               ("pad_token", "padding_token_id"))


def _byte_level_spelling(token: str, alphabet: set[str]) -> str:
  """A token as a byte-level vocab spells it: as stored when every character is in GPT-2's byte alphabet, else its UTF-8
  bytes spelled in that alphabet (as transformers does)."""
  if set(token) <= alphabet: return token
  chars = byte_to_unicode()
  return "".join(chars[b] for b in token.encode("utf-8"))


def gguf_tokenizer(f: GGUFFile) -> Tokenizer:
  """The file's tokenizer; raises naming the tokenizer.ggml key that tinyvllm cannot build."""
  kind = f.require("tokenizer.ggml.model")
  if kind not in ("gpt2", "llama"):
    raise ConfigError(f"{f.path}: GGUF tokenizer.ggml.model {kind!r} is not supported (tinyvllm builds byte-level BPE, "
                      "\"gpt2\", and SentencePiece BPE, \"llama\", tokenizers from GGUF files); pass --tokenizer with the "
                      "model's HF tokenizer folder")
  tokens: list[str] = f.require("tokenizer.ggml.tokens")
  types: list[int] = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  ids = {name: f.get(f"tokenizer.ggml.{key}") for name, key in SPECIAL_IDS}
  parts, added = _byte_level(f, tokens, types) if kind == "gpt2" else _sentencepiece(f, tokens, types, ids["unk_token"])
  added += [AddedToken(i, t, special=False) for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == USER_DEFINED]
  bos, eos, pad = ids["bos_token"], ids["eos_token"], ids["pad_token"]
  # (llama.cpp and transformers add BOS to a SentencePiece vocab whose file does not say)
  prefix = (bos,) if f.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None else ()
  suffix = (eos,) if f.get("tokenizer.ggml.add_eos_token", False) and eos is not None else ()
  specials = Specials(bos=bos, eos=eos, pad=pad, eos_ids=frozenset([eos] if eos is not None else []), prefix=prefix, suffix=suffix)
  template_tokens: dict[str, Any] = {name: tokens[i] for name, i in ids.items() if i is not None and 0 <= i < len(tokens)}
  template_tokens["additional_special_tokens"] = [t.content for t in added if t.special]
  source = f.get("tokenizer.chat_template")
  return Tokenizer(f.path.stem, parts, added, specials, ChatTemplate(source) if source else None, template_tokens)


def _byte_level(f: GGUFFile, tokens: list[str], types: list[int]) -> tuple[ModelParts, list[AddedToken]]:
  pre = f.get("tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZER_PATTERNS:
    raise ConfigError(f"{f.path}: GGUF tokenizer.ggml.pre {pre!r} is not supported (known: {', '.join(PRE_TOKENIZER_PATTERNS)})")
  merges = [tuple(m.split(" ", 1)) for m in f.require("tokenizer.ggml.merges")]
  alphabet = set(byte_to_unicode())
  vocab: dict[str, int] = {}
  for i, token in enumerate(tokens): vocab.setdefault(_byte_level_spelling(token, alphabet), i)
  parts = build_model(f.path.stem, vocab, merges, PRE_TOKENIZER_PATTERNS[pre],   # type: ignore[arg-type]
                      drop_missing_bytes=True)
  # a CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel that transformers skips too
  return parts, [AddedToken(i, t, special=True) for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
                 if ty == CONTROL and set(t) <= alphabet]


def _sentencepiece(f: GGUFFile, tokens: list[str], types: list[int], unk: int | None) -> tuple[ModelParts, list[AddedToken]]:
  scores: list[float] = f.require("tokenizer.ggml.scores")
  if len(scores) != len(tokens):
    raise ConfigError(f"{f.path}: GGUF tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
  # (files converted from an HF tokenizer.json carry its merges, which transformers then takes as they are)
  merges = f.get("tokenizer.ggml.merges")
  data = sentencepiece.scored_pieces_json(tokens, scores, tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
                                          [tuple(m.split(" ", 1)) for m in merges] if merges else None)
  try: parts = sentencepiece.from_tokenizer_json(f.path.stem, data)
  except TokenizerError as e: raise ConfigError(f"{f.path}: GGUF SentencePiece tokenizer: {e}") from None
  # the unknown token is special too: transformers adds it as the tokenizer's unk_token
  return parts, [AddedToken(i, t, special=True) for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
                 if ty == CONTROL or i == unk]
