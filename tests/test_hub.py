"""Hub ids through huggingface_hub, with no network: a real HF cache layout (blobs, refs, snapshots of the stories260K
folder; huggingface_hub's own scan_cache_dir reads it back) resolved by id, by branch, tag and commit, offline and with
the hub unreachable; an id that is not cached fails at once, naming its cache folder."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from tests.conftest import REPO
from tests.hf_cache import add_commit
from tinyvllm import LLM, SamplingParams
from tinyvllm.cli.args import add_engine_args, engine_config
from tinyvllm.config import ConfigError, EngineConfig, HubSettings
from tinyvllm.model.hub import IGNORED_FILES, METADATA_FILES, resolve_model, resolve_tokenizer, weight_patterns

REPO_ID = "tinyvllm-tests/stories260K"
MAIN, TAGGED = "a" * 40, "b" * 40   # commits: main, and the one tagged v1 (a shorter context, to tell them apart)


@pytest.fixture(scope="module")
def cache(stories_dir, tmp_path_factory) -> Path:
  cache = tmp_path_factory.mktemp("hf-cache")
  files = {p.name: p.read_bytes() for p in stories_dir.iterdir() if p.is_file()}
  add_commit(cache, REPO_ID, MAIN, files, ("main",))
  shorter = {**json.loads(files["config.json"]), "max_position_embeddings": 48}
  add_commit(cache, REPO_ID, TAGGED, {**files, "config.json": json.dumps(shorter).encode()}, ("v1",))
  return cache


@pytest.fixture
def offline(monkeypatch):
  """HF_HUB_OFFLINE=1 as huggingface_hub read it at import (the variable itself is covered by a subprocess below)."""
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def unreachable(monkeypatch):
  """Online, but the hub refuses connections (HF_ENDPOINT as huggingface_hub read it)."""
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")


def snapshot(cache: Path, commit: str) -> Path: return cache / "models--tinyvllm-tests--stories260K" / "snapshots" / commit


def test_the_layout_is_a_real_hf_cache(cache):
  info = huggingface_hub.scan_cache_dir(cache)
  (repo,) = info.repos
  assert repo.repo_id == REPO_ID and repo.repo_type == "model" and not info.warnings
  assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {MAIN: {"main"}, TAGGED: {"v1"}}


@pytest.mark.parametrize("mode", ["offline", "unreachable"])
@pytest.mark.parametrize("revision, commit", [(None, MAIN), ("main", MAIN), ("v1", TAGGED), (MAIN, MAIN), (TAGGED, TAGGED)])
def test_cached_ids_resolve_without_the_network(cache, mode, revision, commit, request):
  request.getfixturevalue(mode)
  assert resolve_model(REPO_ID, HubSettings(str(cache)), revision) == snapshot(cache, commit)


def test_engine_from_a_cached_id_at_a_revision(cache, offline, reference):
  llm = LLM(REPO_ID, download_dir=str(cache), max_num_seqs=2, num_gpu_blocks=16)
  out = llm.generate([reference["prompt_ids"]], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
  assert out.outputs[0].token_ids == reference["greedy_ids"][:32]
  assert llm.engine.max_model_len == 512 and LLM(REPO_ID, revision="v1", download_dir=str(cache), num_gpu_blocks=16,
                                                 max_num_seqs=2).engine.max_model_len == 48


def test_tokenizer_revision_defaults_to_the_models(cache, offline):
  """As vLLM's: the tokenizer is the model's at tokenizer_revision, which defaults to revision."""
  at = lambda **kw: resolve_tokenizer(EngineConfig(model=REPO_ID, download_dir=str(cache), **kw))
  assert at() is None and at(revision="v1") is None and at(revision="v1", tokenizer_revision="v1") is None   # the model's own
  assert at(revision="v1", tokenizer_revision="main") == snapshot(cache, MAIN)
  assert at(tokenizer=REPO_ID, revision="v1") == snapshot(cache, TAGGED)


@pytest.mark.parametrize("mode, why", [("offline", r"offline mode is on \(HF_HUB_OFFLINE=1\)"),
                                       ("unreachable", r"the hub \(http://127.0.0.1:9\) cannot be reached")])
def test_an_id_not_cached_fails_at_once_naming_the_cache_folder(cache, mode, why, request):
  request.getfixturevalue(mode)
  folder = cache / "models--tinyvllm-tests--absent"
  start = time.perf_counter()
  with pytest.raises(ConfigError, match=rf"'tinyvllm-tests/absent' is not in the HuggingFace cache \({folder}\) and {why}.*"
                                        rf"hf download tinyvllm-tests/absent --cache-dir {cache}"):
    LLM("tinyvllm-tests/absent", download_dir=str(cache))
  for revision in ("v2", "c" * 40):   # a branch or tag, and a commit (which the library would list with retries)
    with pytest.raises(ConfigError, match=rf"at revision '{revision}' is not in the HuggingFace cache \(.*"
                                          rf"models--tinyvllm-tests--stories260K\) and {why}.*--revision {revision}"):
      LLM(REPO_ID, revision=revision, download_dir=str(cache))
  assert time.perf_counter() - start < 10   # no retries, no waiting on a network that is not there


def test_hf_hub_offline_variable_in_a_fresh_process(cache, tmp_path):
  """The user's way: HF_HUB_OFFLINE=1 and HF_HOME, read by huggingface_hub itself; the command line fails with the
  cache folder in its message."""
  env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "PYTHONPATH": str(REPO)}
  env.pop("HF_HUB_CACHE", None)
  out = subprocess.run([sys.executable, "main.py", "generate", "--model", "tinyvllm-tests/absent", "--prompt", "x"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr
  assert f"not in the HuggingFace cache ({tmp_path / 'hf-home' / 'hub' / 'models--tinyvllm-tests--absent'})" in out.stderr
  assert "HF_HUB_OFFLINE=1" in out.stderr and "Traceback" not in out.stderr


# the file listings of two hub repos (mistralai/Mistral-7B-Instruct-v0.3, meta-llama/Llama-3.2-1B), other formats included
MISTRAL = ["config.json", "consolidated.safetensors", "generation_config.json", "model-00001-of-00003.safetensors",
           "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors", "model.safetensors.index.json", "params.json",
           "special_tokens_map.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "README.md", ".gitattributes"]
LLAMA = ["config.json", "generation_config.json", "model.safetensors", "original/consolidated.00.pth", "original/params.json",
         "original/tokenizer.model", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "LICENSE.txt"]


def test_only_what_the_engine_reads_is_fetched(tmp_path):
  """The patterns through huggingface_hub's own filter (the one snapshot_download applies): the configs and tokenizer
  first, then the index's shards (or the top-level safetensors), never another format of the same weights."""
  fetched = lambda files, patterns: sorted(filter_repo_objects(files, allow_patterns=patterns, ignore_patterns=IGNORED_FILES))
  assert fetched(MISTRAL, METADATA_FILES) == ["config.json", "generation_config.json", "model.safetensors.index.json",
                                              "special_tokens_map.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
  shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {f"w{i}": s for i, s in enumerate(shards * 2)}}))
  assert fetched(MISTRAL, weight_patterns(tmp_path)) == shards
  assert fetched(LLAMA, METADATA_FILES) == ["config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
                                            "tokenizer_config.json"]
  assert fetched(LLAMA, weight_patterns(tmp_path / "no-index")) == ["model.safetensors"]


def test_a_revision_of_a_local_folder_is_refused(stories_dir):
  with pytest.raises(ConfigError, match=r"a revision \('v1'\) applies to hub ids only"):
    resolve_model(str(stories_dir), HubSettings(), "v1")


def test_not_a_folder_nor_a_hub_id(tmp_path):
  with pytest.raises(ConfigError, match="does not exist"): resolve_model(str(tmp_path / "missing"), HubSettings())


def test_without_the_hub_extra(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "huggingface_hub", None)   # as if not installed
  with pytest.raises(ConfigError, match=r"needs huggingface_hub: install the hub extra \(pip install 'tinyvllm\[hub\]'\)"):
    resolve_model("Qwen/Qwen3-0.6B", HubSettings(str(tmp_path)))


def test_flags_and_fields():
  p = argparse.ArgumentParser()
  add_engine_args(p)
  cfg = engine_config(p.parse_args(["--model", "m", "--revision", "v1", "--tokenizer-revision", "main", "--download-dir", "/c",
                                    "--hf-token"]))
  assert (cfg.revision, cfg.tokenizer_revision, cfg.download_dir, cfg.hf_token) == ("v1", "main", "/c", True)
  assert cfg.hub_settings() == HubSettings("/c", True)
  assert engine_config(p.parse_args(["--model", "m", "--hf-token", "hf_x"])).hf_token == "hf_x"
  assert engine_config(p.parse_args(["--model", "m"])).hf_token is None
  with pytest.raises(ConfigError, match="hf_token must be a token string or True"): EngineConfig(model="m", hf_token=3)
