"""Acceptance 5: bad input raises a clear error that names the problem, and nothing else is lost."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.hf_models import make_model
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError
from tinyvllm.engine.llm_engine import PromptError
from tinyvllm.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tiny")
  make_model("llama", folder, max_position_embeddings=64)
  return folder


@pytest.fixture(scope="module")
def llm(model_dir):
  return LLM(str(model_dir), max_num_seqs=2)


def copy_with(model_dir, tmp_path, **config_changes):
  target = tmp_path / "model"
  shutil.copytree(model_dir, target)
  cfg = json.loads((target / "config.json").read_text())
  cfg.update(config_changes)
  (target / "config.json").write_text(json.dumps(cfg))
  return target


def test_missing_folder(tmp_path):
  with pytest.raises(ConfigError, match="does not exist"): LLM(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
  with pytest.raises(ConfigError, match=r"no config\.json"): LLM(str(tmp_path))


def test_unknown_architecture(model_dir, tmp_path):
  folder = copy_with(model_dir, tmp_path, architectures=["MambaForCausalLM"])
  with pytest.raises(ConfigError, match=r"unsupported architecture.*MambaForCausalLM"): LLM(str(folder))


def test_truncated_safetensors(model_dir, tmp_path):
  folder = copy_with(model_dir, tmp_path)
  weights = folder / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:-1000])
  with pytest.raises(ConfigError, match="truncated"): LLM(str(folder))


def test_missing_tensor_is_named(model_dir, tmp_path):
  folder = copy_with(model_dir, tmp_path, num_hidden_layers=3)
  with pytest.raises(ConfigError, match=r"model\.layers\.2\.input_layernorm\.weight"): LLM(str(folder))


def test_checkpoint_with_unused_tensors(model_dir, tmp_path):
  folder = copy_with(model_dir, tmp_path, num_hidden_layers=1)
  with pytest.raises(ConfigError, match=r"does not use: model\.layers\.1"): LLM(str(folder))


def test_no_weights(model_dir, tmp_path):
  folder = copy_with(model_dir, tmp_path)
  (folder / "model.safetensors").unlink()
  with pytest.raises(ConfigError, match="no weights found"): LLM(str(folder))


def test_max_model_len_beyond_model(model_dir):
  with pytest.raises(ConfigError, match="exceeds the model's context of 64"): LLM(str(model_dir), max_model_len=100)


def test_prompt_longer_than_context(llm):
  with pytest.raises(PromptError, match="prompt has 70 tokens, the model's context is 64"): llm.generate([[5] * 70])


def test_prompt_plus_max_tokens_beyond_context(llm):
  with pytest.raises(PromptError, match="prompt has 40 tokens and max_tokens is 30: 70 exceeds"):
    llm.generate([[5] * 40], SamplingParams(max_tokens=30))


def test_bad_prompt_in_a_batch_queues_nothing(llm):
  with pytest.raises(PromptError, match="prompt 1: the prompt is empty"): llm.generate([[5, 6], []])
  assert not llm.engine.has_unfinished_requests()
  out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
  assert len(out[0].outputs[0].token_ids) == 3


def test_token_ids_outside_vocab(llm):
  with pytest.raises(PromptError, match=r"outside the vocabulary \[0, 320\)"): llm.generate([[1, 320]])


def test_text_prompt_without_tokenizer(llm):
  with pytest.raises(PromptError, match="no tokenizer"): llm.generate("hello")


@pytest.mark.parametrize("kwargs, param", [
  ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"), ({"top_p": 0.0}, "top_p"),
  ({"top_p": 1.5}, "top_p"), ({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"),
  ({"n": 0}, "n"), ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 3}, "presence_penalty"),
  ({"stop": [""]}, "stop"), ({"logprobs": 21}, "logprobs"), ({"seed": "x"}, "seed"),
  # what the sampler's float32 cannot hold: flushed to zero, infinite, or a penalty that pushes logits past it
  ({"top_p": 1e-300}, "top_p"), ({"temperature": 1e308}, "temperature"), ({"temperature": 1e-300}, "temperature"),
  ({"temperature": float("nan")}, "temperature"), ({"min_p": 1e-39}, "min_p"), ({"repetition_penalty": 1e-300}, "repetition_penalty"),
  ({"repetition_penalty": 0.001}, "repetition_penalty"), ({"frequency_penalty": float("inf")}, "frequency_penalty"),
  ({"seed": 1 << 64}, "seed"), ({"seed": -(1 << 63) - 1}, "seed"),
])
def test_sampling_params_out_of_range(kwargs, param):
  with pytest.raises(SamplingParamsError, match=param) as info: SamplingParams(**kwargs)
  assert info.value.param == param


def test_sampling_params_at_the_edges_of_float32():
  """The smallest and largest values the sampler holds are taken as they are; tiny temperatures sample greedily."""
  for kwargs in ({"top_p": 1.2e-38}, {"temperature": 3.4e38}, {"temperature": 1.2e-38}, {"min_p": 0.0}, {"repetition_penalty": 0.01},
                 {"seed": (1 << 64) - 1}, {"seed": -(1 << 63)}):
    params = SamplingParams(**kwargs)
    assert all(getattr(params, k) == v for k, v in kwargs.items())


def test_a_tiny_top_p_keeps_the_most_likely_token(llm):
  """top_p 1e-30 (float32 holds it) keeps only the top token: the greedy one, whatever the seed (it once emitted token 0
  every step, from a top_p that float32 flushed to zero)."""
  greedy = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
  for seed in range(3):
    out = llm.generate([[5, 6]], SamplingParams(temperature=1.0, top_p=1e-30, seed=seed, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].token_ids == greedy


def test_unavailable_device(model_dir):
  with pytest.raises(ConfigError, match="device 'CUDA' is not available"): LLM(str(model_dir), device="CUDA")


@pytest.mark.parametrize("device, words", [
  ("CPU:1", ["device 'CPU:1'", "device indices are not supported"]),
  ("cuda:1", ["device 'cuda:1'", "device indices are not supported"]),
  ("TPU", ["device 'TPU'", "not a tinygrad backend"]),
  ("CPU:FOO", ["device 'CPU:FOO'", "no renderer 'FOO'"]),
])
def test_a_bad_device_name_is_named(model_dir, device, words):
  """The device's name is the error (not a dtype problem at the first kernel, as "CPU:1" gave)."""
  with pytest.raises(ConfigError) as e: LLM(str(model_dir), device=device)
  for word in words: assert word in str(e.value)


def test_vllm_device_names_work(model_dir):
  assert LLM(str(model_dir), device="cpu").engine.device == "CPU"
  assert LLM(str(model_dir), device="CPU:0").engine.device == "CPU"


@pytest.mark.parametrize("quantization_config", [
  {"quant_method": "aqlm", "in_group_size": 8, "nbits_per_codebook": 16},
  {"quant_method": "hqq", "nbits": 4, "group_size": 64},
])
def test_an_unsupported_quantized_checkpoint_fails_naming_its_method(model_dir, tmp_path, quantization_config):
  """At start-up, naming quantization_config.quant_method (the weights, stored differently, are never reached)."""
  folder = copy_with(model_dir, tmp_path, quantization_config=quantization_config)
  named = rf"quantization_config.quant_method '{quantization_config['quant_method']}' is not supported"
  with pytest.raises(ConfigError, match=named): LLM(str(folder))
