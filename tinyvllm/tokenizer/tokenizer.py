"""Tokenizer: text <-> token ids over a tiktoken BPE, with added/special tokens, BOS/EOS and a chat template."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tinyvllm.tokenizer.added_tokens import AddedToken, AddedTokenSplitter
from tinyvllm.tokenizer.byte_level import bytes_to_token
from tinyvllm.tokenizer.chat_template import ChatTemplate
from tinyvllm.tokenizer.config import Specials
from tinyvllm.tokenizer.encoding import ModelParts
from tinyvllm.tokenizer.errors import TokenizerError

OTHER_TEMPLATES = 64   # compiled chat templates kept beside the model's


class Tokenizer:
  """Made by load_tokenizer(); encode/decode follow HF `tokenizers` for the same files."""

  def __init__(self, name: str, parts: ModelParts, added: list[AddedToken], specials: Specials,
               chat_template: ChatTemplate | None = None, template_tokens: dict[str, Any] | None = None):
    self.name = name
    self._parts = parts
    self._splitter = AddedTokenSplitter(added)
    self._text_splitter = AddedTokenSplitter([t for t in added if not t.special])   # special tokens' text as text
    self._specials = specials
    self._chat_template = chat_template
    # templates given per call (--chat-template, a request's own), compiled once; the least recently used go first
    self._other_templates: dict[str, ChatTemplate] = {}
    self._template_tokens = template_tokens or {}
    self.added_tokens = {t.content: t.id for t in added}
    self.special_token_ids: frozenset[int] = frozenset(t.id for t in added if t.special)
    self.strip_leading_space = parts.strip_leading_space
    self._build_tables(parts.token_bytes, added)

  def _build_tables(self, token_bytes: dict[int, bytes], added: list[AddedToken]) -> None:
    self.vocab_size = max([*token_bytes, *(t.id for t in added)], default=-1) + 1
    table = [b""] * self.vocab_size
    for i, b in token_bytes.items():
      table[i] = b
    for t in added:
      table[t.id] = t.content.encode("utf-8")
    self._bytes = table
    self._bytes_skipping = [b"" if i in self.special_token_ids else b for i, b in enumerate(table)]

  @property
  def bos_token_id(self) -> int | None:
    return self._specials.bos

  @property
  def eos_token_id(self) -> int | None:
    return self._specials.eos

  @property
  def eos_token_ids(self) -> frozenset[int]:
    """Every id generation stops on: eos_token, generation_config's and config.json's eos_token_id."""
    return self._specials.eos_ids

  @property
  def pad_token_id(self) -> int | None:
    return self._specials.pad

  @property
  def has_chat_template(self) -> bool:
    return self._chat_template is not None

  @property
  def chat_template(self) -> str | None:
    """The model's chat template source (None: it has none)."""
    return self._chat_template.source if self._chat_template is not None else None

  @property
  def special_tokens_map(self) -> dict[str, Any]:
    """HF's special_tokens_map: the bos/eos/unk/sep/pad/cls/mask tokens the config names, additional_special_tokens."""
    return dict(self._template_tokens)

  def base_vocab(self) -> dict[str, int]:
    """The vocab without added tokens: token string -> id, the strings as the tokenizer files write them."""
    if self._parts.vocab is not None:
      return dict(self._parts.vocab)
    return {bytes_to_token(raw): i for i, raw in self._parts.token_bytes.items()}

  def __repr__(self) -> str:
    return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; added tokens written in it become their ids; BOS/EOS as the tokenizer's config says."""
    if not isinstance(text, str):
      raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")
    ids = list(self._specials.prefix) if add_special_tokens else []
    prepare, encoding = self._parts.prepare, self._parts.encoding
    for run, token_id, start in self._splitter.split(text):
      if token_id is None:
        ids.extend(encoding.encode(prepare(run, start == 0)))
      else:
        ids.append(token_id)
    if add_special_tokens:
      ids.extend(self._specials.suffix)
    return ids

  def encode_continuation(self, text: str) -> list[int]:
    """Token ids of `text` as it continues earlier text (what a model writing it as text generates): no BOS/EOS, no
    prefix space where encode() gives one (SentencePiece's "▁", add_prefix_space), and a special token's text stays
    text (non-special added tokens become their ids). The text is prepared behind an "a", whose piece is then cut, so
    a normaliser's prefix lands before it."""
    ids: list[int] = []
    prepare, encoding = self._parts.prepare, self._parts.encoding
    lead = len(prepare("a", False))
    for run, token_id, _ in self._text_splitter.split(text):
      if token_id is None: ids.extend(encoding.encode(prepare("a" + run, False)[lead:]))
      else: ids.append(token_id)
    return ids

  def ids_to_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
    """The bytes of the tokens one after the other (ids the tokenizer does not know give nothing)."""
    table = self._bytes_skipping if skip_special_tokens else self._bytes
    n = len(table)
    return b"".join([table[i] if 0 <= i < n else b"" for i in ids])

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """The text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
    raw = self.ids_to_bytes(ids, skip_special_tokens)
    if self.strip_leading_space and raw[:1] == b" ":
      raw = raw[1:]
    return raw.decode("utf-8", errors="replace")

  def token_bytes(self, token_id: int) -> bytes:
    """The bytes token `token_id` stands for (a special token: its text; an unknown id: b"")."""
    return self._bytes[token_id] if 0 <= token_id < self.vocab_size else b""

  def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          tokenize: bool = False, chat_template: str | None = None, continue_final_message: bool = False,
                          **kwargs: Any) -> str | list[int]:
    """The chat rendered by the model's template (or the `chat_template` source given); tokenize=True encodes it
    without adding BOS (the template has it). continue_final_message: the text stops inside the last message (HF's)."""
    template = self._chat_template if chat_template is None else self._template_from(chat_template)
    if template is None:
      raise TokenizerError(f"tokenizer {self.name!r} has no chat template "
                           "(looked for chat_template in tokenizer_config.json and chat_template.jinja)")
    text = template.render(messages, add_generation_prompt, self._template_tokens, continue_final_message, **kwargs)
    return self.encode(text, add_special_tokens=False) if tokenize else text

  def _template_from(self, source: str) -> ChatTemplate:
    template = self._other_templates.pop(source, None) or ChatTemplate(source)
    self._other_templates[source] = template   # the most recently used last
    if len(self._other_templates) > OTHER_TEMPLATES: del self._other_templates[next(iter(self._other_templates))]
    return template
