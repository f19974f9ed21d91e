"""IncrementalDetokenizer: deltas add up to HF's decode of the sequence minus the prompt's text; no half characters."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.test_tokenizer import CORPUS, QWEN3, QWEN3_JSON, STORIES_JSON, hf_tokenizer_at, tokenizer_at
from tinyvllm.tokenizer import IncrementalDetokenizer, Tokenizer

STORIES = "models/stories260K-hf"
FFFD = "\ufffd"


def _stream(tok: Tokenizer, prompt: list[int], out: list[int], skip: bool = True, seed: int = 0) -> list[str]:
  """The deltas of feeding `out` in chunks of 1-3 tokens, then flush()."""
  rng = random.Random(seed)
  det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
  deltas, i = [], 0
  while i < len(out):
    k = rng.randint(1, 3)
    deltas.append(det.add(out[i:i + k]))
    i += k
  deltas.append(det.flush())
  assert det.text == "".join(deltas)
  return deltas


def _hf_suffix(hf, prompt: list[int], out: list[int], skip: bool) -> str | None:
  """HF's decode of prompt + out minus HF's decode of the prompt (None when the prompt ends inside a character)."""
  head, full = hf.decode(prompt, skip_special_tokens=skip), hf.decode(prompt + out, skip_special_tokens=skip)
  return full[len(head):] if full.startswith(head) and not head.endswith(FFFD) else None


@pytest.fixture(scope="module", params=[QWEN3, STORIES])
def pair(request, shared_data: Path):
  return tokenizer_at(request.param), hf_tokenizer_at(STORIES_JSON if request.param == STORIES else QWEN3_JSON)


@pytest.mark.parametrize("skip", [True, False])
def test_real_encodings_match_hf(pair, skip: bool):
  tok, hf = pair
  rng = random.Random(1)
  checked = 0
  for n, text in enumerate(CORPUS):
    ids = hf.encode(text).ids
    cut = rng.randint(0, len(ids))
    expected = _hf_suffix(hf, ids[:cut], ids[cut:], skip)
    if expected is None:
      continue
    deltas = _stream(tok, ids[:cut], ids[cut:], skip, seed=n)
    assert "".join(deltas) == expected, text
    if FFFD not in expected:
      assert not any(FFFD in d for d in deltas), text
    checked += 1
  assert checked > 150


def test_random_ids(pair):
  """Random ids: the deltas add up to decode(), and never hold a U+FFFD for bytes that may still complete."""
  tok, hf = pair
  rng = random.Random(2)
  prompt = [1] if tok.bos_token_id == 1 else []
  for n in range(200):
    out = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 25))]
    deltas = _stream(tok, prompt, out, seed=n)
    assert "".join(deltas) == tok.decode(prompt + out)
    if FFFD not in (reference := hf.decode(prompt + out)):
      assert "".join(deltas) == reference
    det, so_far = IncrementalDetokenizer(tok, prompt), ""
    for k in range(len(out)):
      so_far += det.add(out[k:k + 1])
      whole = tok.decode(prompt + out[:k + 1])
      assert whole.startswith(so_far) and whole[len(so_far):] in ("", FFFD)


def test_character_split_across_tokens(shared_data: Path):
  qwen = tokenizer_at(QWEN3)
  melting = qwen.encode("🫠")
  assert len(melting) == 3
  assert [IncrementalDetokenizer(qwen, []).add([t]) for t in melting[:1]] == [""]
  det = IncrementalDetokenizer(qwen, qwen.encode("Hi "))
  assert [det.add([t]) for t in melting] == ["", "", "🫠"]
  ids = qwen.encode("x🫠y")  # a prompt that ends inside a character: the output finishes it
  assert "".join(_stream(qwen, ids[:2], ids[2:])) == "🫠y"


def test_byte_fallback_characters(stories_dir: Path):
  stories = tokenizer_at(STORIES)
  ids = stories.encode("你好 Lily")
  assert 3 + 0xE4 in ids  # 你 is not in the 512-token vocab: byte fallback
  det = IncrementalDetokenizer(stories, ids[:1])
  deltas = [det.add([t]) for t in ids[1:]]
  assert "".join(deltas) == hf_tokenizer_at(STORIES_JSON).decode(ids) == "你好 Lily"
  # "▁" (the prepended space, stripped), <0xE4> <0xBD> <0xA0>, <0xE5> <0xA5> <0xBD>, "▁Lily"
  assert deltas == ["", "", "", "你", "", "", "好", " Lily"]


def test_sentencepiece_leading_space(stories_dir: Path):
  stories, hf = tokenizer_at(STORIES), hf_tokenizer_at(STORIES_JSON)
  ids = stories.encode("Once upon a time")
  prompt, out = ids[:-1], ids[-1:]
  assert _stream(stories, prompt, out)[0] == " time" == _hf_suffix(hf, prompt, out, True)
  assert _stream(stories, ids[:1], ids[1:2])[0] == "Once"  # only a skipped BOS before: the space is stripped
  assert _stream(stories, ids[:1], ids[1:2], skip=False)[0] == " Once" == _hf_suffix(hf, ids[:1], ids[1:2], False)
  assert _stream(stories, [], ids[1:3])[0] == "Once upon"


def test_skip_special_tokens(shared_data: Path):
  qwen = tokenizer_at(QWEN3)
  prompt = qwen.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
  out = qwen.encode("<think>\n\n</think>\n\nHello!<|im_end|>")
  assert "".join(_stream(qwen, prompt, out)) == "<think>\n\n</think>\n\nHello!"  # <think> is not a special token
  assert "".join(_stream(qwen, prompt, out, skip=False)) == "<think>\n\n</think>\n\nHello!<|im_end|>"


def test_llama3_stream(shared_data: Path):
  llama3 = tokenizer_at("tokenizers/llama3")
  for n, text in enumerate(CORPUS[:150]):
    if "<|" in text:
      continue
    ids = llama3.encode(text)
    assert "".join(_stream(llama3, ids[:1], ids[1:], seed=n)) == text


def test_each_step_touches_only_new_tokens(shared_data: Path, monkeypatch: pytest.MonkeyPatch):
  qwen = tokenizer_at(QWEN3)
  prompt = qwen.encode(CORPUS[-1]) * 4
  det = IncrementalDetokenizer(qwen, prompt)
  seen: list[int] = []
  real = qwen.ids_to_bytes

  def spy(ids, skip_special_tokens=True):
    ids = list(ids)
    seen.append(len(ids))
    return real(ids, skip_special_tokens)
  monkeypatch.setattr(qwen, "ids_to_bytes", spy)
  for t in prompt[:2000]:
    det.add([t])
  assert len(seen) == 2000 and max(seen) == 1
