"""HFStyleTokenizer: a Tokenizer behind HF transformers' interface and defaults, as `LLM.get_tokenizer()` returns it
(vLLM hands out the transformers tokenizer, so scripts call these methods with these defaults).

HF's defaults differ from the engine's own calls: decode keeps special tokens unless told to skip them, and
apply_chat_template tokenizes (returning {input_ids, attention_mask}) without a generation prompt unless told otherwise.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

from tinyvllm.tokenizer.errors import TokenizerError
from tinyvllm.tokenizer.loader import SPECIAL_TOKEN_ATTRIBUTES
from tinyvllm.tokenizer.tokenizer import Tokenizer


class BatchEncoding(dict):
  """What __call__ returns: a dict (input_ids, attention_mask) whose keys also read as attributes, as HF's."""

  def __getattr__(self, name: str) -> Any:
    try: return self[name]
    except KeyError: raise AttributeError(name) from None


def _refuse(options: dict[str, Any], allowed: dict[str, tuple[Any, ...]]) -> None:
  """Options HF takes that change nothing here are fine at their neutral values; anything else fails, named."""
  for name, value in options.items():
    if name not in allowed: raise TokenizerError(f"{name}= is not supported by tinyvllm's tokenizer")
    if value not in allowed[name]: raise TokenizerError(f"{name}={value!r} is not supported by tinyvllm's tokenizer")


class HFStyleTokenizer:
  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer

  def __repr__(self) -> str: return f"HFStyleTokenizer({self.tokenizer.name!r}, vocab_size={self.vocab_size})"

  # ---- the vocab
  @cached_property
  def _vocab(self) -> dict[str, int]:
    vocab = self.tokenizer.base_vocab()
    vocab.update(self.tokenizer.added_tokens)
    return vocab

  @cached_property
  def _id_to_token(self) -> dict[int, str]: return {i: t for t, i in self._vocab.items()}

  @cached_property
  def vocab_size(self) -> int:
    """The base vocab's size, without added tokens (HF's meaning; len() counts them)."""
    return len(self.tokenizer.base_vocab())

  def __len__(self) -> int: return len(self._vocab)

  def get_vocab(self) -> dict[str, int]: return dict(self._vocab)

  def get_added_vocab(self) -> dict[str, int]: return dict(self.tokenizer.added_tokens)

  def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str | list[str | None] | None:
    if isinstance(ids, int): return self._id_to_token.get(ids)
    skip = set(self.all_special_ids) if skip_special_tokens else set()
    return [self._id_to_token.get(i) for i in ids if i not in skip]

  def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int | None] | None:
    """A token's id; one not in the vocab gives the unknown token's id (None when there is none), as HF's."""
    if isinstance(tokens, str): return self._vocab.get(tokens, self.unk_token_id)
    return [self._vocab.get(t, self.unk_token_id) for t in tokens]

  def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
    ids = self.convert_tokens_to_ids(list(tokens))
    assert isinstance(ids, list)
    if None in ids: raise TokenizerError(f"tokens not in the vocab: {[t for t, i in zip(tokens, ids, strict=True) if i is None]}")
    return self.tokenizer.decode(ids, skip_special_tokens=False)   # type: ignore[arg-type]

  # ---- special tokens
  def _special(self, attribute: str) -> str | None: return self.tokenizer.special_tokens_map.get(attribute)

  @property
  def special_tokens_map(self) -> dict[str, Any]: return self.tokenizer.special_tokens_map

  @property
  def all_special_tokens(self) -> list[str]:
    """The named special tokens in HF's order (bos, eos, unk, sep, pad, cls, mask), then the additional ones, once each."""
    named = [self._special(a) for a in SPECIAL_TOKEN_ATTRIBUTES]
    extra = self.tokenizer.special_tokens_map.get("additional_special_tokens") or []
    return list(dict.fromkeys(t for t in [*named, *extra] if t is not None))

  @property
  def all_special_ids(self) -> list[int]: return [self._vocab[t] for t in self.all_special_tokens if t in self._vocab]

  bos_token = property(lambda self: self._special("bos_token"))
  eos_token = property(lambda self: self._special("eos_token"))
  unk_token = property(lambda self: self._special("unk_token"))
  pad_token = property(lambda self: self._special("pad_token"))
  bos_token_id = property(lambda self: self.tokenizer.bos_token_id)
  eos_token_id = property(lambda self: self.tokenizer.eos_token_id)
  pad_token_id = property(lambda self: self.tokenizer.pad_token_id)

  @property
  def unk_token_id(self) -> int | None:
    token = self.unk_token
    return None if token is None else self._vocab.get(token)

  # ---- text <-> ids
  def encode(self, text: str, add_special_tokens: bool = True, truncation: bool | None = None,
             max_length: int | None = None) -> list[int]:
    ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if truncation:
      if max_length is None: raise TokenizerError("truncation=True needs max_length")
      ids = ids[:max_length]
    return ids

  def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, truncation: bool | None = None,
               max_length: int | None = None, **options: Any) -> BatchEncoding:
    """{input_ids, attention_mask} for a text or a list of texts (no padding: each keeps its own length)."""
    _refuse(options, {"padding": (False, None, "do_not_pad"), "return_tensors": (None,), "return_attention_mask": (True, None),
                      "text_pair": (None,)})
    if isinstance(text, str):
      ids = self.encode(text, add_special_tokens, truncation, max_length)
      return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))
    batch = [self.encode(t, add_special_tokens, truncation, max_length) for t in text]
    return BatchEncoding(input_ids=batch, attention_mask=[[1] * len(ids) for ids in batch])

  def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False,
             clean_up_tokenization_spaces: bool | None = None) -> str:
    _refuse({"clean_up_tokenization_spaces": clean_up_tokenization_spaces}, {"clean_up_tokenization_spaces": (None, False)})
    ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

  def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False,
                   clean_up_tokenization_spaces: bool | None = None) -> list[str]:
    return [self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces) for ids in sequences]

  # ---- chat
  @property
  def chat_template(self) -> str | None: return self.tokenizer.chat_template

  def apply_chat_template(self, conversation: list[dict[str, Any]] | list[list[dict[str, Any]]], tools: list | None = None,
                          documents: list | None = None, chat_template: str | None = None, add_generation_prompt: bool = False,
                          continue_final_message: bool = False, tokenize: bool = True, return_dict: bool = True,
                          **kwargs: Any) -> Any:
    """HF's defaults: tokenized, as {input_ids, attention_mask} (return_dict=False: the ids), no generation prompt.
    A list of conversations gives a list of results."""
    if conversation and isinstance(conversation[0], (list, tuple)):
      return [self.apply_chat_template(c, tools, documents, chat_template, add_generation_prompt, continue_final_message, tokenize,
                                       return_dict, **kwargs) for c in conversation]
    text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                                              chat_template=chat_template, continue_final_message=continue_final_message,
                                              tools=tools, documents=documents, **kwargs)
    if not tokenize: return text
    assert isinstance(text, str)
    ids = self.tokenizer.encode(text, add_special_tokens=False)
    return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids
