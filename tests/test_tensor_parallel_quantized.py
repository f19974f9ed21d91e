"""Tensor parallelism with quantized weights over 2 and 4 tinygrad CPU devices: int8 / int4 / fp8 quantized at load, a
GPTQ checkpoint (its LM head quantized too) and an NVFP4 one, dense (Qwen3) and mixture-of-experts (Qwen3-MoE)
models, give HF transformers' greedy tokens on the dequantized weights, and GGUF files (a llama file's packed output
layer split by vocabulary rows; a qwen3moe file) HF's logits reading the same file; each device's packed share is the
packed form of its float share (rows for qkv and gate_up, input columns in whole scale groups for o and down, a
per-channel scale kept whole, codes repacked where a device's columns end inside a word); what cannot be split is
refused naming the weight."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tests.hf_models import assert_same_greedy, hf_greedy, make_model
from tests.quant_checkpoints import load_dequantized, write_quantized
from tests.test_moe_quantization import round_to_nearest
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError
from tinyvllm.layers.quantized import dequantize, quantize_rtn
from tinyvllm.model.sharding import _column_parts, split_columns

PROMPTS = [[5, 9, 17, 3], [44, 2, 91, 7, 120, 33, 8, 19, 250, 11, 6]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# int4's group of 128 divides every device's share of every input at tp 2 (hidden 256, intermediates 512 and 256)
DENSE = ("qwen3", dict(hidden_size=256, intermediate_size=512, head_dim=32, tie_word_embeddings=True))
MOE = ("qwen3_moe", dict(hidden_size=256, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                         intermediate_size=512, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True))
CASES = {"int8-dense-tp4": (DENSE, "int8", 4), "int4-dense-tp2": (DENSE, "int4", 2), "fp8-dense-tp2": (DENSE, "fp8", 2),
         "int8-moe-tp2": (MOE, "int8", 2), "int4-moe-tp2": (MOE, "int4", 2), "fp8-moe-tp2": (MOE, "fp8", 2)}


def same_greedy_as_hf(hf, llm: LLM) -> None:
  outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
  for out, prompt in zip(outs, PROMPTS, strict=True):
    ref, scores = hf_greedy(hf, prompt, GREEDY.max_tokens)
    assert_same_greedy(out.outputs[0].token_ids, ref, scores)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_quantized_at_load_split_over_devices_gives_hf_greedy(case: str, tmp_path: Path):
  (kind, overrides), method, tp = CASES[case]
  hf = make_model(kind, tmp_path, **overrides)
  llm = LLM(str(tmp_path), quantization=method, tensor_parallel_size=tp, max_num_seqs=4, num_gpu_blocks=48)
  layer = llm.engine.model.weights.layers[0]
  q_size = hf.config.num_attention_heads * hf.config.head_dim
  assert isinstance(layer.o_proj.codes.device, tuple) and layer.o_proj.shape[1] == q_size // tp   # a device's columns
  same_greedy_as_hf(load_dequantized(hf, round_to_nearest(hf, method)), llm)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "options"), [
  ("gptq", dict(bits=4, group_size=32, lm_head=True)),   # its LM head quantized too (GPTQModel's lm_head true)
  ("modelopt", dict(algo="NVFP4", hf_quant_config=True)),   # E4M3 codes in blocks of 16, each part its own global scale
])
def test_checkpoint_split_over_devices_gives_hf_greedy(method: str, options: dict, tmp_path: Path):
  """A quantized checkpoint over two devices; a quantized LM head split by vocabulary rows."""
  kind, overrides = DENSE
  hf = make_model(kind, tmp_path / "float", **{**overrides, "tie_word_embeddings": False})
  dequantized = write_quantized(hf, tmp_path / "q", method, **options)
  llm = LLM(str(tmp_path / "q"), tensor_parallel_size=2, max_num_seqs=4, num_gpu_blocks=48)
  head = llm.engine.model.weights.lm_head
  assert isinstance(head.codes.device, tuple) if options.get("lm_head") else isinstance(head.device, tuple)
  same_greedy_as_hf(load_dequantized(hf, dequantized), llm)


@pytest.mark.parametrize(("method", "group", "cols"), [("int4", 32, 128), ("int8", 128, 128), ("fp8", 128, 128),
                                                     ("int4", 172, 172), ("int8", 172, 172)])
def test_a_devices_columns_are_the_packed_form_of_its_float_columns(method: str, group: int, cols: int):
  """Each device's packed share of a row-parallel weight dequantizes to that device's columns of the whole weight's
  dequantization: per group, and per channel (group = every column), also where a device's columns end inside a word
  of codes (stories260K's 172-wide down: 86 columns a device, repacked)."""
  w = Tensor(np.random.default_rng(0).standard_normal((8, cols)).astype(np.float32))
  packed = quantize_rtn(w, method, group)
  whole = dequantize(packed, dtypes.float32)
  for tp in ((2, 4) if cols % 4 == 0 else (2,)):
    for part, want in zip(split_columns(packed, tp, "o_proj"), _column_parts(whole, tp), strict=True):
      np.testing.assert_array_equal(dequantize(part, dtypes.float32).numpy(), want.numpy())


@pytest.mark.parametrize(("overrides", "method", "words"), [
  (dict(intermediate_size=384), "int4", "a device's 192 input columns of down_proj (int4 (4-bit int, group 128)) are not "
                                        "whole scale groups of 128"),
])
def test_what_does_not_split_is_refused_naming_the_weight(overrides: dict, method: str, words: str, tmp_path: Path):
  kind, base = DENSE
  make_model(kind, tmp_path, **{**base, **overrides})
  with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
    LLM(str(tmp_path), quantization=method, tensor_parallel_size=2, num_gpu_blocks=16)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_gguf_file_split_over_devices_matches_hf(arch: str, tmp_path: Path):
  """A GGUF file's packed linears (and a llama file's packed Q6_K output layer, split by vocabulary rows) over 2
  devices: HF transformers' logits reading the same file."""
  import torch
  from transformers import AutoModelForCausalLM

  from tests.gguf_files import write_tiny_llama
  from tests.test_gguf_moe import INTER, hf_qwen3moe
  types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
           "ffn_down": "Q6_K"}
  if arch == "llama": path = write_tiny_llama(tmp_path / "t.gguf", types, "F32", "Q6_K")
  else: path = write_tiny_llama(tmp_path / "t.gguf", types, "F32", None, arch=arch, experts=(8, 2, INTER), heads=2, kv_heads=1)
  llm = LLM(str(path), device="CPU", tensor_parallel_size=2, max_num_seqs=2, num_gpu_blocks=32, max_model_len=128)
  hf = (AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32) if arch == "llama"
        else hf_qwen3moe(path))
  prompt = PROMPTS[1]
  with torch.no_grad(): ref = hf(torch.tensor([prompt])).logits[0, -1].numpy()
  ours = llm.engine.compute_logits(prompt)
  assert float(np.abs(ours - ref).max() / np.abs(ref).max()) < 1e-4


def test_a_packed_output_layer_is_whole_on_every_device_where_the_vocabulary_does_not_split(tmp_path: Path):
  """A vocabulary of 259 rows over 2 devices: the packed Q6_K output layer on every device whole, the logits one
  device's (to float32 rounding)."""
  from tests.gguf_files import write_tiny_llama
  types = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q8_0")
  path = write_tiny_llama(tmp_path / "t.gguf", types, "F32", "Q6_K", vocab=259)
  logits = {}
  for tp in (1, 2):
    llm = LLM(str(path), device="CPU", tensor_parallel_size=tp, max_num_seqs=2, num_gpu_blocks=32, max_model_len=128)
    logits[tp] = llm.engine.compute_logits(PROMPTS[1])
  head = llm.engine.model.weights.lm_head
  assert head.shape == (259, 256) and isinstance(head.codes.device, tuple)
  assert float(np.abs(logits[2] - logits[1]).max() / np.abs(logits[1]).max()) < 1e-5
