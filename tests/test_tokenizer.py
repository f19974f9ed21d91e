"""Tokenizer: ids and text against HF `tokenizers` (and the data README's reference ids), config handling, errors."""
from __future__ import annotations

import json
import random
import shutil
import unicodedata
from functools import cache
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from tests.conftest import SHARED_DATA
from tinyvllm.tokenizer import Tokenizer, TokenizerError, load_tokenizer

QWEN3 = "tokenizers/qwen3"
QWEN3_JSON = "tokenizers/qwen3/derived/tokenizer.json"
LLAMA3 = "tokenizers/llama3"
STORIES_JSON = "models/stories260K-hf/tokenizer.json"

FIXED = [
  "", " ", "  ", "\n", "\n\n", "\r\n", "\t", "a", "Hello world", "Hello, world!", " Hello", "  Hello", "Hello  world",
  "Once upon a time, there was a little girl named Lily.", "The quick brown fox jumps over the lazy dog 12345.",
  "你好，世界！", "日本語のテキストです。", "한국어 텍스트", "😀😃😄 emoji 👍🏽 👨‍👩‍👧", "naïve café résumé — “quotes”",
  "Ünïcödé ǅ ﬁ ℌ", "e\u0301 vs é", "1234567890 3.14159", "x = 10**6 + 0xFF", "def f(x):\n    return x**2  # 😀",
  "for (int i = 0; i < n; i++) {\n\tprintf(\"%d\\n\", i);\n}", "    indented\n        more\n            deep",
  "line1\r\nline2\r\n\r\nline3", "tabs\t\tand\t spaces \t", "I'm sure they'll say \"we've done it\".",
  "don't DON'T Don'T", "trailing spaces   ", "   leading spaces", "a\n\n\n\nb", "                 many spaces",
  "<|im_start|>user\nhi<|im_end|>\n", "<think>\n\n</think>\n\n", "<s>Hello</s> world", "text<|endoftext|>more",
  "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", "<unk> <s> </s>", "a<s>b</s>",
  "https://example.com/path?q=1&r=2#frag", "email@example.org", "$100.00 €50 £20 ¥1000", "½ ¼ ¾ ² ³",
  "ÀÁÂÃÄÅ àáâãäå ÇÈÉÊË", "Привет, мир!", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก",
  "Γειά σου Κόσμε", "\u200b\u200c\u200d zero width", "\u00a0nbsp\u00a0", "\u3000ideographic space",
  "ｆｕｌｌ ｗｉｄｔｈ",
  "...!!!???", "--- === *** ###", "''''", "\"\"\"docstring\"\"\"", "a.b.c.d", "C++ C# F#", "x'y'z",
  "'s 't 're 've 'm 'll 'd", "'S 'T 'RE", "123abc456", "3.0e-10", "0.5%", "#!/usr/bin/env python3",
  "SELECT * FROM t WHERE a = 'b';", "<html><body>Hi</body></html>", "{\"key\": [1, 2, 3]}",
  "\\n\\t escaped", "🏳️‍🌈 flag", "🇺🇸🇬🇧", "𝕳𝖊𝖑𝖑𝖔", "𠀀𠀁 rare CJK", "ㄱㄴㄷ", "\x00\x01\x7f control",
  "She said, “Hello!” and left…", "It’s a dog’s life", "em—dash en–dash", "The end.\n", "\n ", " \n",
  "a  b   c    d     e", "\n\n\n", "\t\n\t\n", "\r", "\r\r\n", "word\u2581with\u2581lower\u2581blocks", "\u2581",
  "\u0085\u2028\u2029\x0b\x0c\u1680 odd whitespace", "İstanbul ǅemal ß ẞ Σσς",
]
_PIECES = ["Hello", " world", "the", " ", "  ", "\n", "\r\n", "\t", "你好", "世界", "😀", "👍🏽", "é", "e\u0301", "ß",
           "123", "4", ".", ",", "!", "'s", "'ll", "’", "“", "”", "—", "…", "<", "|", ">", "_", "-", "=", "(", ")",
           "{", "}", "<|im_end|>", "<s>", "</s>", "<think>", " Lily", " once", " upon", "ing", "ed", "\u00a0", "ñ",
           "€", "й", "ア"]
LONG = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. " * 40
        + "def f(x):\n    return x\n" * 30 + "你好世界。" * 50 + " " * 300 + "\n" * 50 + "😀" * 20)


def _random_strings(n: int, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  out = ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 30))) for _ in range(n)]
  ranges = [(0x20, 0x7E), (0xA0, 0x2FFF), (0x3000, 0x9FFF), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF)]
  for _ in range(n // 2):
    out.append("".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 12))))
  return out


CORPUS = [*FIXED, *_random_strings(200), LONG]


@cache
def tokenizer_at(rel: str) -> Tokenizer:
  """Our tokenizer for a path under shared/data, loaded once per test session."""
  return load_tokenizer(SHARED_DATA / rel)


@cache
def hf_tokenizer_at(rel: str) -> HFTokenizer:
  return HFTokenizer.from_file(str(SHARED_DATA / rel))


@pytest.fixture(scope="module")
def llama3(shared_data: Path) -> Tokenizer:
  return tokenizer_at(LLAMA3)


@pytest.fixture(scope="module")
def stories(stories_dir: Path) -> Tokenizer:
  return tokenizer_at("models/stories260K-hf")


def test_corpus_is_big_and_varied():
  assert len(CORPUS) >= 200 and "" in CORPUS and len(LONG) > 5000


# --- ids and text against HF tokenizers ------------------------------------------------------------------------------

@pytest.mark.parametrize("ours", [QWEN3, QWEN3_JSON, "models/stories260K-hf"])
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_hf(shared_data: Path, ours: str, add_special_tokens: bool):
  tok = tokenizer_at(ours)
  hf = hf_tokenizer_at(STORIES_JSON if "stories" in ours else QWEN3_JSON)
  for text in CORPUS:
    assert tok.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens).ids, text


@pytest.mark.parametrize("ours", [QWEN3, "models/stories260K-hf"])
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_matches_hf(shared_data: Path, ours: str, skip_special_tokens: bool):
  tok, hf = tokenizer_at(ours), hf_tokenizer_at(STORIES_JSON if "stories" in ours else QWEN3_JSON)
  for text in CORPUS:
    ids = hf.encode(text).ids
    assert tok.decode(ids, skip_special_tokens) == hf.decode(ids, skip_special_tokens=skip_special_tokens), text


def test_decode_random_ids_matches_hf(qwen: Tokenizer, stories: Tokenizer):
  """Random ids (valid UTF-8 once joined) decode as HF decodes them, special tokens and byte tokens included."""
  rng = random.Random(3)
  for tok, hf in ((qwen, hf_tokenizer_at(QWEN3_JSON)), (stories, hf_tokenizer_at(STORIES_JSON))):
    checked = 0
    while checked < 300:
      ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 20))]
      try:
        tok.ids_to_bytes(ids, False).decode("utf-8")
      except UnicodeDecodeError:
        continue  # HF replaces bad bytes differently (see test_invalid_utf8_decodes_with_replacement)
      checked += 1
      for skip in (False, True):
        assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), ids


def _is_utf8(raw: bytes) -> bool:
  try:
    raw.decode("utf-8")
  except UnicodeDecodeError:
    return False
  return True


def test_every_qwen_token_encodes_like_hf(qwen: Tokenizer):
  """Each vocab entry's own text: where tiktoken's whole-piece lookup and HF's merges could differ."""
  hf = hf_tokenizer_at(QWEN3_JSON)
  texts = [b.decode("utf-8") for b in map(qwen.token_bytes, range(0, 151643, 3)) if _is_utf8(b)]
  refs = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
  assert [qwen.encode(t) for t in texts] == refs


def test_qwen_reference_encodings(qwen: Tokenizer, shared_data: Path):
  ref = json.loads((shared_data / "tokenizers/qwen3/derived/reference_encodings.json").read_text())
  for case in ref["encodings"]:
    assert qwen.encode(case["text"]) == case["ids"]
    assert tokenizer_at(QWEN3_JSON).encode(case["text"]) == case["ids"]


def test_round_trip(qwen: Tokenizer, llama3: Tokenizer, stories: Tokenizer):
  for text in CORPUS:
    assert qwen.decode(qwen.encode(text), skip_special_tokens=False) == unicodedata.normalize("NFC", text)
    assert llama3.decode(llama3.encode(text), skip_special_tokens=False) == "<|begin_of_text|>" + text
    if "<|" not in text:
      assert llama3.decode(llama3.encode(text)) == text
    # SentencePiece loses a leading space, "▁" and the space it prepends after a special token written in the text
    if not text.startswith(" ") and "\u2581" not in text and not any(s in text for s in ("<s>", "</s>", "<unk>")):
      assert stories.decode(stories.encode(text)) == text


def _legacy_llama(data: dict) -> None:
  """Older Llama tokenizer.json files: Prepend("▁") + Replace(" ", "▁") normalizer, no pre_tokenizer."""
  data["normalizer"] = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
  data["pre_tokenizer"] = None


def _piece_crossing_a_space(data: dict) -> None:
  """A piece "a▁" makes the cut before "▁" unsafe, so the whole text must go to the BPE as one piece."""
  data["model"]["vocab"]["a\u2581"] = len(data["model"]["vocab"])
  data["model"]["merges"].append(["a", "\u2581"])


SENTENCEPIECE_VARIANTS = {
  "prepend_first": lambda d: d["pre_tokenizer"].update(prepend_scheme="first"),
  "metaspace_split": lambda d: d["pre_tokenizer"].update(split=True),
  "legacy_normalizer": _legacy_llama,
  "piece_crossing_a_space": _piece_crossing_a_space,
}


@pytest.mark.parametrize("variant", SENTENCEPIECE_VARIANTS)
def test_sentencepiece_variants_match_hf(stories_dir: Path, tmp_path: Path, variant: str):
  data = json.loads((stories_dir / "tokenizer.json").read_text())
  SENTENCEPIECE_VARIANTS[variant](data)
  (tmp_path / "tokenizer.json").write_text(json.dumps(data))
  tok, hf = load_tokenizer(tmp_path), HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
  if variant == "piece_crossing_a_space":  # "▁ba▁" -> "▁b", "a▁": cutting before the last "▁" would lose "a▁"
    assert tok.encode("ba ") == hf.encode("ba ").ids and 512 in hf.encode("ba ").ids
  for text in CORPUS:
    ids = hf.encode(text).ids
    assert tok.encode(text) == ids and tok.decode(ids) == hf.decode(ids), text


def test_invalid_utf8_decodes_with_replacement(qwen: Tokenizer, stories: Tokenizer):
  melting = qwen.encode("🫠")  # one character, three tokens
  assert len(melting) == 3 and qwen.decode(melting[:2]) == "\ufffd" and qwen.decode(melting) == "🫠"
  byte = {b: 3 + b for b in range(256)}  # stories260K's <0xNN> tokens
  assert stories.decode([byte[0xE4], byte[0xBD], byte[0xA0]]) == "你"
  assert stories.decode([byte[0xE4], byte[0xBD]]) == "\ufffd"


# --- Llama-3 tiktoken file --------------------------------------------------------------------------------------------

def test_llama3_reference_ids(llama3: Tokenizer):
  """Ids from the data README §4 (meta-llama/llama-models' own test vectors)."""
  ids = [2028, 374, 264, 1296, 11914, 13]
  assert llama3.encode("This is a test sentence.", add_special_tokens=False) == ids
  assert llama3.encode("This is a test sentence.") == [128000, *ids]
  assert [llama3.encode(w, add_special_tokens=False) for w in ("user", "system", "assistant", "\n\n")] == \
    [[882], [9125], [78191], [271]]
  assert llama3.encode("Hello, world!", add_special_tokens=False) == [9906, 11, 1917, 0]
  header = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
  assert llama3.encode(header, add_special_tokens=False) == [128006, 882, 128007, 271, 13347, 128009]


def test_llama3_special_tokens(llama3: Tokenizer):
  assert llama3.bos_token_id == 128000 and llama3.eos_token_id == 128001
  assert llama3.eos_token_ids == frozenset({128001, 128008, 128009})
  assert llama3.vocab_size == 128256 and llama3.special_token_ids == frozenset(range(128000, 128256))
  names = {128001: "<|end_of_text|>", 128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>",
           128011: "<|image|>", 128012: "<|reserved_special_token_2|>", 128255: "<|reserved_special_token_245|>"}
  for token_id, name in names.items():
    assert llama3.token_bytes(token_id) == name.encode()
  assert llama3.decode([128000, 9906, 128009]) == "Hello"
  assert llama3.decode([128000, 9906, 128009], skip_special_tokens=False) == "<|begin_of_text|>Hello<|eot_id|>"
  assert not llama3.has_chat_template


def test_llama3_matches_hf_conversion(llama3: Tokenizer, shared_data: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch):
  """transformers' TikTokenConverter turns the same file into a HF tokenizer: ids must agree on the corpus, for
  tokenizer.model and for the tokenizer.json (Llama-3 in HF form: Split regex + ByteLevel, BOS template) it saves."""
  converter = pytest.importorskip("transformers.convert_slow_tokenizer").TikTokenConverter
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken's loader would otherwise cache the file under /tmp
  specials = [llama3.token_bytes(i).decode() for i in range(128000, 128256)]
  hf = converter(vocab_file=str(shared_data / LLAMA3 / "tokenizer.model"), extra_special_tokens=specials).converted()
  hf.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                    special_tokens=[("<|begin_of_text|>", 128000)])
  hf.save(str(tmp_path / "tokenizer.json"))
  from_json = load_tokenizer(tmp_path)
  for text in CORPUS:
    expected = hf.encode(text).ids
    assert llama3.encode(text) == expected and from_json.encode(text) == expected, text
    assert llama3.encode(text, add_special_tokens=False) == expected[1:]


# --- BOS / EOS and other config -------------------------------------------------------------------------------------

def test_stories_bos_eos(stories: Tokenizer):
  assert (stories.bos_token_id, stories.eos_token_id, stories.eos_token_ids) == (1, 2, frozenset({2}))
  assert stories.vocab_size == 512 and stories.special_token_ids == frozenset({0, 1, 2})
  assert stories.encode("Zoo") == [1, 410, 469, 347]  # data README §6
  assert stories.encode("Zoo", add_special_tokens=False) == [410, 469, 347]
  assert stories.token_bytes(3 + 0xE4) == b"\xe4" and stories.token_bytes(stories.encode("Once")[1]) == b" Once"


def test_qwen_specials(qwen: Tokenizer):
  assert qwen.bos_token_id is None and qwen.eos_token_id == 151645 and qwen.eos_token_ids == frozenset({151645})
  assert qwen.pad_token_id == 151643 and qwen.vocab_size == 151669
  assert 151644 in qwen.special_token_ids and 151667 not in qwen.special_token_ids  # <think> is added, not special
  assert qwen.token_bytes(9707) == b"Hello" and qwen.token_bytes(151644) == b"<|im_start|>"
  assert qwen.token_bytes(10**6) == b"" and qwen.decode([9707, 151935]) == "Hello"  # padded embedding rows


def _folder(tmp_path: Path, files: dict[str, Path]) -> Path:
  for name, source in files.items():
    shutil.copy(source, tmp_path / name)
  return tmp_path


def test_eos_union_from_generation_config(shared_data: Path, tmp_path: Path):
  """Qwen2.5's configs beside the (identical) vocab: eos = <|im_end|> plus generation_config's <|endoftext|>."""
  q3, q25 = shared_data / QWEN3, shared_data / "tokenizers/qwen2.5"
  configs = {n: q25 / n for n in ("tokenizer_config.json", "generation_config.json", "config.json")}
  folder = _folder(tmp_path, {"vocab.json": q3 / "vocab.json", "merges.txt": q3 / "merges.txt", **configs})
  tok = load_tokenizer(folder)
  assert tok.eos_token_id == 151645 and tok.eos_token_ids == frozenset({151645, 151643})
  assert tok.pad_token_id == 151643 and tok.bos_token_id is None and tok.encode("Hi") == [13048]


def test_add_bos_eos_flags(stories_dir: Path, tmp_path: Path):
  folder = _folder(tmp_path, {"tokenizer.json": stories_dir / "tokenizer.json"})
  config = json.loads((stories_dir / "tokenizer_config.json").read_text())
  (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False, "add_eos_token": True}))
  assert load_tokenizer(folder).encode("Zoo") == [410, 469, 347, 2]
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  assert load_tokenizer(folder / "tokenizer.json").encode("Zoo") == [1, 410, 469, 347]


# --- errors ---------------------------------------------------------------------------------------------------------

def test_missing_folder(tmp_path: Path):
  with pytest.raises(TokenizerError, match="does not exist"):
    load_tokenizer(tmp_path / "nope")


def test_folder_without_tokenizer_files(tmp_path: Path):
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(TokenizerError, match=r"no tokenizer files in .*tokenizer\.json.*merges\.txt.*tokenizer\.model"):
    load_tokenizer(tmp_path)


def test_sentencepiece_model_needs_tokenizer_json(shared_data: Path, tmp_path: Path):
  folder = _folder(tmp_path, {"tokenizer.model": shared_data / "tokenizers/llama2/tokenizer.model"})
  with pytest.raises(TokenizerError, match=r"provide the model's tokenizer\.json"):
    load_tokenizer(folder)


def test_unsupported_tokenizer_json(tmp_path: Path):
  (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {"a": 0}}}))
  with pytest.raises(TokenizerError, match="WordPiece"):
    load_tokenizer(tmp_path)
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(TokenizerError, match="cannot read"):
    load_tokenizer(tmp_path)


def test_encode_needs_text(qwen: Tokenizer):
  with pytest.raises(TokenizerError):
    qwen.encode([1, 2])  # type: ignore[arg-type]
