"""GGUF files as llama.cpp's converter writes HF models and tokenizers: a SentencePiece tokenizer ("llama": pieces and
scores, no merges) against HF transformers reading the same file and against the real stories260K and Llama 2
tokenizers, byte-level tokenizers' pre-tokenizer names against HF, the real stories260K model converted and run to its
reference text, and RoPE scaling as llama.cpp stores it (Llama-3.1's rope_freqs tensor, linear and YaRN metadata)
against HF transformers running the original model, with the scalings it cannot run named."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import SHARED_DATA, require_shared
from tests.gguf_files import llama3_rope_factors, sentencepiece_fields, write_hf_llama
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError
from tinyvllm.model.gguf.reader import GGUFFile
from tinyvllm.model.gguf.tokenizer import PRE_TOKENIZER_PATTERNS, gguf_tokenizer
from tinyvllm.tokenizer.byte_level import byte_to_unicode

gguf = pytest.importorskip("gguf", reason="the gguf package (test extra) writes the test files")
TOKENIZER_MODELS = {"stories260K": ("models", "stories260K", "tok512.model"), "llama2": ("tokenizers", "llama2", "tokenizer.model")}
TEXTS = ["Hello world!", "Once upon a time, there was a little girl named Lily.", " leading space", "  two  spaces\n\nnew\tx",
         "héllo wörld — 日本語 🤖 naïve", "<s> special </s> and <unk>", "x = 12345 * 3.14", "", " ", "ünïcödé ÅÆØ",
         "Lily's mom said, \"don't\"", "a\x04b\x06", "def f():\n        return 1\n" + " " * 23 + "end"]


def tokenizer_only_file(path, model_file, merges: list[str] | None = None):
  """A GGUF file of just a SentencePiece tokenizer (and one tensor, which GGUF files carry); with `merges`, as llama.cpp
  writes a Llama converted from an HF tokenizer.json (its merges beside the scores)."""
  fields = sentencepiece_fields(model_file)
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_string("tokenizer.ggml.model", "llama")
  w.add_array("tokenizer.ggml.tokens", fields["tokens"])
  w.add_array("tokenizer.ggml.scores", fields["scores"])
  w.add_array("tokenizer.ggml.token_type", fields["types"])
  if merges is not None: w.add_array("tokenizer.ggml.merges", merges)
  for key, token_id in (("bos_token_id", 1), ("eos_token_id", 2), ("unknown_token_id", 0)): w.add_uint32(f"tokenizer.ggml.{key}", token_id)
  w.add_tensor("unused", np.zeros(4, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


@pytest.mark.parametrize("name", [*TOKENIZER_MODELS, "stories260K-merges"])
def test_sentencepiece_tokenizer_matches_hf_on_the_same_file(name, tmp_path):
  import json

  from transformers import AutoTokenizer
  model_file = require_shared(SHARED_DATA.joinpath(*TOKENIZER_MODELS[name.removesuffix("-merges")]))
  merges = None
  if name.endswith("-merges"):   # the first 80 merges of stories260K-hf's tokenizer.json: with only these, the ids
    # differ from those the scores' merges give, so the file's merges must be the ones taken
    data = json.loads(require_shared(SHARED_DATA / "models" / "stories260K-hf" / "tokenizer.json").read_text())
    merges = [" ".join(m) for m in data["model"]["merges"][:80]]
  path = tokenizer_only_file(tmp_path / "t.gguf", model_file, merges)
  ours, hf = gguf_tokenizer(GGUFFile(path)), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
  rng = np.random.default_rng(0)
  alphabet = list("abcXYZ  \n\t.,;éü日本🤖")   # runs of spaces: Llama 2's space pieces, whose merges interleave
  texts = TEXTS + ["".join(rng.choice(alphabet, int(rng.integers(1, 60)))) for _ in range(300)]
  for text in texts:
    ids = ours.encode(text)
    assert ids == hf.encode(text), text
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
  assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)


# merges whose pieces cross where one split regex cuts and another does not: case changes (tekken, gpt-4o), digit runs
# (one at a time, up to three, any), a space before a word or a letter after punctuation, contractions
BYTE_LEVEL_MERGES = ["o W", "l d", "1 2", "12 3", "123 4", "Ġ t", "Ġt h", "' s", "' S", "- a", "a B", "Ġ 1", "\u010a \u010a"]
PRE_TEXTS = ["HelloWorld its 1234567 digits", "it's IT'S aBc-abc", "x\n\ny  \n z", "this is 12 and 123 4", "-abc ABC's",
             "naïve Ünïcode İstanbul ǅemal", "tab\there / path/to\n"]


@pytest.mark.parametrize("pre", ["gpt2", "qwen2", "llama-bpe", "tekken", "gpt-4o", "falcon3", "megrez"])
def test_byte_level_pre_tokenizer_names_split_as_hf(pre, tmp_path):
  from transformers import AutoTokenizer
  alphabet = byte_to_unicode()
  tokens = [*alphabet, *(a + b for a, b in (m.split(" ") for m in BYTE_LEVEL_MERGES)), "<|end|>"]
  w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
  w.add_string("tokenizer.ggml.model", "gpt2")
  w.add_string("tokenizer.ggml.pre", pre)
  w.add_array("tokenizer.ggml.tokens", tokens)
  w.add_array("tokenizer.ggml.token_type", [1] * (len(tokens) - 1) + [3])
  w.add_array("tokenizer.ggml.merges", BYTE_LEVEL_MERGES)
  w.add_uint32("tokenizer.ggml.eos_token_id", len(tokens) - 1)
  w.add_tensor("unused", np.zeros(4, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  ours, hf = gguf_tokenizer(GGUFFile(tmp_path / "t.gguf")), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
  for text in PRE_TEXTS: assert ours.encode(text) == hf.encode(text), (pre, text)
  assert len({PRE_TOKENIZER_PATTERNS[p] for p in ("gpt2", "qwen2", "llama-bpe", "tekken", "gpt-4o")}) == 5


def test_sentencepiece_tokenizer_agrees_with_sentencepiece(tmp_path):
  """Against the SentencePiece library on the real model file, for text it and HF agree on (no leading spaces)."""
  import sentencepiece
  model_file = require_shared(SHARED_DATA / "tokenizers" / "llama2" / "tokenizer.model")
  ours = gguf_tokenizer(GGUFFile(tokenizer_only_file(tmp_path / "t.gguf", model_file)))
  sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
  for text in ["Hello world!", "Once upon a time, Lily's mom said: \"don't\".", "日本語 🤖 naïve ÅÆØ", "x = 12345 * 3.14"]:
    assert ours.encode(text) == [1, *sp.encode(text)], text


@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory):
  """stories260K (the real tiny Llama) converted to GGUF with its own SentencePiece tokenizer."""
  import json

  from safetensors.numpy import load_file
  folder = require_shared(SHARED_DATA / "models" / "stories260K-hf")
  model_file = require_shared(SHARED_DATA / "models" / "stories260K" / "tok512.model")
  config = json.loads((folder / "config.json").read_text())
  path = tmp_path_factory.mktemp("stories") / "stories260K.gguf"
  return write_hf_llama(path, load_file(folder / "model.safetensors"), config, sentencepiece_fields(model_file))


def test_stories260k_gguf_tells_its_reference_story(stories_gguf, reference):
  llm = LLM(str(stories_gguf), device="CPU", max_num_seqs=2, max_model_len=512)
  tok = llm.get_tokenizer()
  assert tok.encode("") == reference["prompt_ids"]
  out = llm.generate([""], SamplingParams(temperature=0, max_tokens=256, ignore_eos=True), use_tqdm=False)[0].outputs[0]
  assert list(out.token_ids) == reference["greedy_ids"]
  assert out.text == reference["greedy_text"]
  zoo = reference["zoo"]
  assert tok.encode(tok.decode(zoo["prompt_ids"], skip_special_tokens=True)) == zoo["prompt_ids"]


def test_scores_of_another_length_are_named(tmp_path):
  fields = sentencepiece_fields(require_shared(SHARED_DATA / "models" / "stories260K" / "tok512.model"))
  w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
  w.add_string("tokenizer.ggml.model", "llama")
  w.add_array("tokenizer.ggml.tokens", fields["tokens"])
  w.add_array("tokenizer.ggml.scores", fields["scores"][:-1])
  w.add_tensor("unused", np.zeros(4, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ConfigError, match=r"tokenizer\.ggml\.scores has 511 entries for 512 tokens"):
    gguf_tokenizer(GGUFFile(tmp_path / "t.gguf"))


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def test_llama3_frequency_scaling_from_rope_freqs_matches_hf(tmp_path):
  """A Llama-3.1-style model (rope_type llama3) written as llama.cpp writes it: no rope scaling metadata, the factors
  in rope_freqs.weight. tinyvllm must run it as HF runs the original model; the same weights without the scaling give
  logits far from it."""
  from tests.hf_models import hf_logits, make_model
  fields = sentencepiece_fields(require_shared(SHARED_DATA / "models" / "stories260K" / "tok512.model"))
  hf = make_model("llama", tmp_path / "hf", vocab_size=512, rope_scaling=LLAMA3_ROPE, rope_theta=10000.0)
  config = hf.config.to_dict()
  state = {k: v.numpy() for k, v in hf.state_dict().items() if not (config["tie_word_embeddings"] and k == "lm_head.weight")}
  head_dim = config["hidden_size"] // config["num_attention_heads"]
  path = write_hf_llama(tmp_path / "m.gguf", state, config, fields, llama3_rope_factors(head_dim, 10000.0, LLAMA3_ROPE))
  prompt = [int(x) for x in np.random.default_rng(2).integers(3, 512, 120)]
  ref = hf_logits(hf, prompt)[-1]
  llm = LLM(str(path), device="CPU", dtype="float32", max_num_seqs=2, max_model_len=256)
  assert llm.engine.model_config.rope_freq_factors is not None
  ours = llm.engine.compute_logits(prompt)
  assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4
  plain = make_model("llama", tmp_path / "plain", vocab_size=512, rope_theta=10000.0)   # (the same seed: the same weights)
  assert np.abs(hf_logits(plain, prompt)[-1] - ref).max() / np.abs(ref).max() > 1e-2


def test_rope_freqs_of_the_wrong_length_are_named(tmp_path):
  from tests.hf_models import make_model
  fields = sentencepiece_fields(require_shared(SHARED_DATA / "models" / "stories260K" / "tok512.model"))
  hf = make_model("llama", tmp_path / "hf", vocab_size=512)
  config = hf.config.to_dict()
  state = {k: v.numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
  path = write_hf_llama(tmp_path / "m.gguf", state, config, fields, np.ones(3, np.float32))
  with pytest.raises(ConfigError, match=r"rope_freqs.weight is F32 \(3,\).*\(8,\) for heads of 16"):
    LLM(str(path), device="CPU", max_num_seqs=2, max_model_len=128)


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_scaling_metadata_matches_hf(kind, tmp_path):
  """rope.scaling.* as llama.cpp writes a model whose config scales RoPE linearly, or by YaRN (type, factor, original
  context), against HF running the original model."""
  from tests.hf_models import hf_logits, make_model
  fields = sentencepiece_fields(require_shared(SHARED_DATA / "models" / "stories260K" / "tok512.model"))
  rope = {"rope_type": kind, "factor": 4.0, **({"original_max_position_embeddings": 32} if kind == "yarn" else {})}
  hf = make_model("llama", tmp_path / "hf", vocab_size=512, rope_scaling=rope)
  config = hf.config.to_dict()
  state = {k: v.numpy() for k, v in hf.state_dict().items()}
  metadata = {"rope.scaling.type": kind, "rope.scaling.factor": 4.0,
              **({"rope.scaling.original_context_length": 32} if kind == "yarn" else {})}
  path = write_hf_llama(tmp_path / "m.gguf", state, config, fields, metadata=metadata)
  prompt = [int(x) for x in np.random.default_rng(3).integers(3, 512, 100)]
  llm = LLM(str(path), device="CPU", dtype="float32", max_num_seqs=2, max_model_len=256)
  ref = hf_logits(hf, prompt)[-1]
  assert np.abs(llm.engine.compute_logits(prompt) - ref).max() / np.abs(ref).max() < 1e-4


@pytest.mark.parametrize("metadata,error", [
  ({"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}, r"rope\.scaling\.type = 'longrope': rope scaling other"),
  ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_log_multiplier": 0.1},
   r"rope\.scaling\.yarn_log_multiplier: YaRN's own tuning is not supported"),
  ({"rope.scaling.factor": 2.0}, r"rope\.scaling\.factor = 2\.0 without a rope\.scaling\.type"),
  ({"rope.scaling.type": "linear"}, r"linear rope scaling needs a positive factor, got None")])
def test_rope_scaling_metadata_it_cannot_run_is_named(metadata, error, tmp_path):
  from tests.hf_models import make_model
  fields = sentencepiece_fields(require_shared(SHARED_DATA / "models" / "stories260K" / "tok512.model"))
  hf = make_model("llama", tmp_path / "hf", vocab_size=512)
  state = {k: v.numpy() for k, v in hf.state_dict().items()}
  path = write_hf_llama(tmp_path / "m.gguf", state, hf.config.to_dict(), fields, metadata=metadata)
  with pytest.raises(ConfigError, match=error): LLM(str(path), device="CPU", max_num_seqs=2, max_model_len=128)
