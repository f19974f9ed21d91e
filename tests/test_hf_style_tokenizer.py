"""`LLM.get_tokenizer()`'s interface against transformers' AutoTokenizer on the same real files: every method and
default a vLLM script uses (vLLM hands out the transformers tokenizer)."""
from __future__ import annotations

import random
from functools import cache

import pytest

from tests.conftest import SHARED_DATA
from tests.test_tokenizer import CORPUS, LLAMA3, QWEN3, tokenizer_at
from tinyvllm.tokenizer import HFStyleTokenizer, TokenizerError

transformers = pytest.importorskip("transformers")
FOLDERS = [QWEN3, "models/stories260K-hf"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? 😀"}]


@cache
def pair(folder: str) -> tuple[HFStyleTokenizer, object]:
  """(ours, transformers') for a folder under shared/data."""
  return HFStyleTokenizer(tokenizer_at(folder)), transformers.AutoTokenizer.from_pretrained(str(SHARED_DATA / folder))


@pytest.fixture(params=FOLDERS)
def tokenizers(request, shared_data):
  return pair(request.param)


def test_vocab_sizes_and_the_vocab(tokenizers):
  ours, hf = tokenizers
  assert (ours.vocab_size, len(ours)) == (hf.vocab_size, len(hf))
  assert ours.get_vocab() == hf.get_vocab()
  assert ours.get_added_vocab() == hf.get_added_vocab()


def test_special_tokens(tokenizers):
  ours, hf = tokenizers
  assert ours.all_special_tokens == hf.all_special_tokens and ours.all_special_ids == hf.all_special_ids
  for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
    assert getattr(ours, name) == getattr(hf, name), name


def test_ids_and_tokens_both_ways(tokenizers):
  ours, hf = tokenizers
  ids = [*range(len(hf)), len(hf) + 5]   # every id, and one past the vocab
  assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
  assert ours.convert_ids_to_tokens(ids[:300], skip_special_tokens=True) == hf.convert_ids_to_tokens(ids[:300], skip_special_tokens=True)
  assert ours.convert_ids_to_tokens(7) == hf.convert_ids_to_tokens(7)
  tokens = [*hf.convert_ids_to_tokens(ids[:-1]), "not-a-token-xyz"]
  assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
  assert ours.convert_tokens_to_ids(tokens[42]) == hf.convert_tokens_to_ids(tokens[42])
  for text in CORPUS[:60]:
    pieces = hf.convert_ids_to_tokens(hf.encode(text, add_special_tokens=False))
    assert ours.convert_tokens_to_string(pieces) == hf.convert_tokens_to_string(pieces), text


def plain_texts(hf) -> list[str]:
  """Corpus texts without special tokens written out: for those, transformers 5 rebuilds the Llama tokenizer's
  pre-tokenizer (prepend_scheme first, where stories260K's tokenizer.json says always) and so differs from the files'
  own tokenizer, which tinyvllm follows (tests/test_tokenizer.py checks it against HF tokenizers)."""
  return [t for t in CORPUS if t and not any(s in t for s in hf.all_special_tokens)][:80]


def test_call_encode_decode_and_batch_decode(tokenizers):
  ours, hf = tokenizers
  texts = plain_texts(hf)
  for text in texts:
    assert ours(text) == dict(hf(text)) and ours(text).input_ids == hf(text).input_ids
    assert ours(text, add_special_tokens=False) == dict(hf(text, add_special_tokens=False))
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, truncation=True, max_length=3) == hf.encode(text, truncation=True, max_length=3)
  assert ours(texts) == dict(hf(texts))
  batches = [hf.encode(t) for t in texts]
  for skip in (False, True):
    assert ours.batch_decode(batches, skip_special_tokens=skip) == hf.batch_decode(batches, skip_special_tokens=skip)
  assert ours.decode(batches[3]) == hf.decode(batches[3])   # HF's default keeps special tokens
  rng = random.Random(0)
  picks = [rng.randrange(len(hf)) for _ in range(50)]
  assert [ours.decode(i) for i in picks if hf.decode(i) != "\ufffd"] == [hf.decode(i) for i in picks if hf.decode(i) != "\ufffd"]


def test_apply_chat_template_with_hfs_defaults(shared_data):
  ours, hf = pair(QWEN3)
  assert ours.apply_chat_template(MESSAGES) == dict(hf.apply_chat_template(MESSAGES))   # tokenized, no generation prompt
  for kwargs in ({"tokenize": False}, {"tokenize": False, "add_generation_prompt": True, "enable_thinking": False},
                 {"return_dict": False}, {"return_dict": False, "add_generation_prompt": True}):
    assert ours.apply_chat_template(MESSAGES, **kwargs) == hf.apply_chat_template(MESSAGES, **kwargs), kwargs
  batch = [MESSAGES, MESSAGES[1:]]
  assert ours.apply_chat_template(batch, tokenize=False) == hf.apply_chat_template(batch, tokenize=False)
  template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
  assert ours.apply_chat_template(MESSAGES, chat_template=template, tokenize=False) == \
    hf.apply_chat_template(MESSAGES, chat_template=template, tokenize=False)
  assert ours.chat_template == hf.chat_template


def test_options_it_does_not_have_are_named(shared_data):
  ours, _ = pair(QWEN3)
  with pytest.raises(TokenizerError, match="return_tensors='pt'"): ours("hi", return_tensors="pt")
  with pytest.raises(TokenizerError, match="padding=True"): ours(["a", "b c"], padding=True)


def test_llama3_tiktoken_tokens_are_hfs_byte_level_strings(shared_data, monkeypatch):
  """For a tiktoken file (no token strings in it), the vocab is written as transformers' TikTokenConverter writes it."""
  converter = pytest.importorskip("transformers.convert_slow_tokenizer").TikTokenConverter
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
  ours = HFStyleTokenizer(tokenizer_at(LLAMA3))
  specials = [ours.convert_ids_to_tokens(i) for i in range(128000, 128256)]
  hf = converter(vocab_file=str(SHARED_DATA / LLAMA3 / "tokenizer.model"), extra_special_tokens=specials).converted()
  assert ours.get_vocab() == hf.get_vocab(with_added_tokens=True)
  assert ours.vocab_size == 128000 and len(ours) == 128256
