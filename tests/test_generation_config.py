"""--generation-config auto|vllm|FOLDER: a model's generation_config.json sampling fields are the defaults of requests
that do not set them (offline, in the server, in the CLI), as vLLM applies them; override_generation_config on top."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tinyvllm import LLM, SamplingParams
from tinyvllm.cli import main
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.engine.generation_config import default_sampling_params
from tinyvllm.entrypoints.api_server import create_app
from tinyvllm.entrypoints.common import ServerState

# Qwen/Qwen3-0.6B's generation_config.json as shipped (every Qwen3 size ships the same sampling fields)
QWEN3_SHIPPED = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                 "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def folder_with(tmp_path: Path, name: str, generation_config: dict) -> Path:
  folder = tmp_path / name
  folder.mkdir()
  (folder / "generation_config.json").write_text(json.dumps(generation_config))
  return folder


def defaults(generation_config: str = "auto", model_folder: Path | None = None, **override) -> dict:
  return default_sampling_params(EngineConfig("m", generation_config=generation_config, override_generation_config=override),
                                 model_folder)[0]


def test_qwen3s_shipped_sampling_defaults(tmp_path):
  qwen3 = folder_with(tmp_path, "qwen3", QWEN3_SHIPPED)
  assert defaults("auto", qwen3) == defaults(str(qwen3)) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
  assert defaults("vllm", qwen3) == {}


def test_qwen25s_shipped_sampling_defaults(shared_data):
  """tokenizers/qwen2.5/generation_config.json is Qwen2.5-0.5B-Instruct's (data README §3)."""
  assert defaults("auto", shared_data / "tokenizers/qwen2.5") == \
    {"repetition_penalty": 1.1, "temperature": 0.7, "top_k": 20, "top_p": 0.8}


def test_override_goes_on_top_and_max_new_tokens_is_max_tokens(tmp_path):
  qwen3 = folder_with(tmp_path, "qwen3", {**QWEN3_SHIPPED, "max_new_tokens": 300})
  assert defaults("auto", qwen3, temperature=0.1, min_p=0.05) == \
    {"temperature": 0.1, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "max_tokens": 300}
  assert defaults("vllm", qwen3, max_new_tokens=5) == {"max_tokens": 5}
  assert defaults("auto", None) == {}   # a dummy preset has no folder


def test_bad_generation_configs_are_named(tmp_path):
  with pytest.raises(ConfigError, match="neither auto, vllm nor an existing folder"): defaults(str(tmp_path / "nope"))
  with pytest.raises(ConfigError, match=r"has no generation_config\.json"): defaults(str(tmp_path))
  bad = folder_with(tmp_path, "bad", {"top_p": 2.0})
  with pytest.raises(ConfigError, match=r"generation_config\.json.*top_p must be a number in \(0, 1\]"): defaults(str(bad))
  with pytest.raises(ConfigError, match="override_generation_config: do_sample"): defaults(do_sample=True)


@pytest.fixture(scope="module")
def greedy_model(stories_dir, tmp_path_factory) -> Path:
  """stories260K whose generation_config.json asks for greedy decoding of at most 7 tokens."""
  folder = tmp_path_factory.mktemp("model") / "stories-greedy"
  shutil.copytree(stories_dir, folder)
  config = json.loads((folder / "generation_config.json").read_text())
  (folder / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "max_new_tokens": 7}))
  return folder


@pytest.mark.slow
def test_offline_requests_without_params_take_the_models_defaults(greedy_model, reference, capsys):
  llm = LLM(str(greedy_model), num_gpu_blocks=64)
  assert "default sampling parameters from" in capsys.readouterr().err
  params = llm.get_default_sampling_params()
  assert (params.temperature, params.max_tokens, params.top_p) == (0.0, 7, 1.0)
  prompt = reference["prompt_ids"]
  assert llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids == reference["greedy_ids"][:7]
  given = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
  assert given.outputs[0].token_ids == reference["greedy_ids"][:3]   # a request's own params win
  plain = LLM(str(greedy_model), num_gpu_blocks=64, generation_config="vllm")
  assert plain.get_default_sampling_params() == SamplingParams()
  capped = LLM(str(greedy_model), num_gpu_blocks=64, override_generation_config={"max_new_tokens": 4})
  assert capped.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids == reference["greedy_ids"][:4]


@pytest.mark.slow
def test_the_cli_takes_the_models_defaults_for_flags_not_given(greedy_model, reference, capsys):
  decode = LLM(str(greedy_model), num_gpu_blocks=16).get_tokenizer().decode
  capsys.readouterr()
  assert main(["generate", "--model", str(greedy_model), "--prompt", "", "--num-gpu-blocks", "16"]) == 0
  assert capsys.readouterr().out == decode(reference["greedy_ids"][:7]) + "\n"
  assert main(["generate", "--model", str(greedy_model), "--prompt", "", "--num-gpu-blocks", "16", "--max-tokens", "3"]) == 0
  assert capsys.readouterr().out == decode(reference["greedy_ids"][:3]) + "\n"


@pytest.mark.slow
def test_the_server_fills_unset_request_fields_from_the_models_defaults(greedy_model, reference):
  state = ServerState("stories", str(greedy_model))
  with TestClient(create_app(state, lambda: AsyncLLM.from_config(EngineConfig(str(greedy_model), num_gpu_blocks=64)))) as c:
    while c.get("/health").status_code != 200: assert state.load_error is None, state.load_error   # not ready yet
    greedy = reference["greedy_ids"]
    unset = c.post("/v1/completions", json={"prompt": reference["prompt_ids"], "max_tokens": 20}).json()
    assert unset["usage"]["completion_tokens"] == 7   # the model's max_new_tokens caps the request's, as vLLM's
    assert unset["choices"][0]["text"] == state.require_engine().tokenizer.decode(greedy[:7])
    given = c.post("/v1/completions", json={"prompt": reference["prompt_ids"], "max_tokens": 3, "temperature": 1.0,
                                            "seed": 3}).json()
    assert given["usage"]["completion_tokens"] == 3
