"""GGUF models on the hub named as vLLM names them (`--model REPO_ID:QUANT_TYPE`): a real HF cache layout holding a GGUF
repo as unsloth's and Qwen's are laid out (one file per quant type, lowercase names, a split quant type in its own
folder, a vision projector), resolved with no network, offline and with the hub's listing but no downloads; the
model read from the hub gives the logits of the same file read locally; what cannot be chosen is named."""
from __future__ import annotations

import numpy as np
import pytest
from huggingface_hub import constants

from tests.gguf_files import write_tiny_llama
from tests.hf_cache import add_commit
from tinyvllm import LLM
from tinyvllm.config import ConfigError, HubSettings
from tinyvllm.model.gguf import hub as gguf_hub
from tinyvllm.model.gguf.hub import gguf_model_file, is_hub_gguf, matching_files
from tinyvllm.model.gguf.reader import GGUFFile

pytest.importorskip("gguf", reason="the gguf package (test extra) writes the test files")
REPO_ID, COMMIT = "tinyvllm-tests/tiny-GGUF", "c" * 40
PROMPT = [int(x) for x in np.random.default_rng(9).integers(0, 256, 16)]
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# a real repo's names (unsloth/Qwen3-0.6B-GGUF's, and a 235B's split quant types in folders, as unsloth keeps them)
UNSLOTH = ["Qwen3-0.6B-BF16.gguf", "Qwen3-0.6B-IQ4_XS.gguf", "Qwen3-0.6B-Q4_K_M.gguf", "Qwen3-0.6B-Q4_K_S.gguf",
           "Qwen3-0.6B-UD-Q4_K_XL.gguf", "Qwen3-0.6B-Q8_0.gguf", "mmproj-F16.gguf", "README.md",
           "Q8_0/Qwen3-235B-A22B-Q8_0-00001-of-00002.gguf", "Q8_0/Qwen3-235B-A22B-Q8_0-00002-of-00002.gguf"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
  """The cache (HubSettings) and the repo's files, written locally."""
  local = tmp_path_factory.mktemp("gguf-repo")
  write_tiny_llama(local / "tiny-Q8_0.gguf", dict.fromkeys(LINEARS, "Q8_0"))
  write_tiny_llama(local / "tiny-q4_k_m.gguf", {**dict.fromkeys(LINEARS, "Q4_K"), "attn_v": "Q6_K", "ffn_down": "Q6_K"}, seed=1)
  (local / "Q6_K").mkdir()
  write_tiny_llama(local / "Q6_K" / "tiny-Q6_K.gguf", dict.fromkeys(LINEARS, "Q6_K"), seed=2, split_max_tensors=8)
  (local / "mmproj-F16.gguf").write_bytes(b"GGUF")   # a vision projector: never taken for the model
  for name in ("tiny-Q5_0.gguf", "other-Q5_0.gguf"): (local / name).write_bytes((local / "tiny-Q8_0.gguf").read_bytes())
  files = {str(p.relative_to(local)): p.read_bytes() for p in local.rglob("*.gguf")}
  cache = tmp_path_factory.mktemp("hf-cache")
  add_commit(cache, REPO_ID, COMMIT, files, ("main",))
  return HubSettings(str(cache)), local, sorted(files)


@pytest.fixture
def offline(monkeypatch): monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_quant_type_picks_one_model_from_a_real_repos_names():
  pick = lambda quant: matching_files(UNSLOTH, "unsloth/Qwen3-0.6B-GGUF", quant)
  assert pick("Q4_K_M") == ["Qwen3-0.6B-Q4_K_M.gguf"] and pick("q4_k_m") == ["Qwen3-0.6B-Q4_K_M.gguf"]
  assert pick("UD-Q4_K_XL") == ["Qwen3-0.6B-UD-Q4_K_XL.gguf"] and pick("IQ4_XS") == ["Qwen3-0.6B-IQ4_XS.gguf"]
  assert pick("BF16") == ["Qwen3-0.6B-BF16.gguf"]
  with pytest.raises(ConfigError, match=r"no GGUF file of quant type 'Q4_K'; its GGUF files: Q8_0/Qwen3-235B"): pick("Q4_K")
  with pytest.raises(ConfigError, match="no GGUF file of quant type 'F16'"): pick("F16")   # the projector is no model
  with pytest.raises(ConfigError, match="no GGUF file of quant type 'Q4_XS'"): pick("Q4_XS")   # inside IQ4_XS
  with pytest.raises(ConfigError, match=r"Q8_0 matches 2 GGUF models \(Q8_0/Qwen3-235B-A22B-Q8_0-00001-of-00002.gguf, "
                                        r"Qwen3-0.6B-Q8_0.gguf\)"): pick("Q8_0")
  split = [n for n in UNSLOTH if "235B" in n]
  assert matching_files(split, "unsloth/Qwen3-235B-A22B-GGUF", "Q8_0") == split
  with pytest.raises(ConfigError, match=r"lacks Q8_0/Qwen3-235B-A22B-Q8_0-00002-of-00002\.gguf"):
    matching_files(split[:1], "unsloth/Qwen3-235B-A22B-GGUF", "Q8_0")


def test_what_names_a_hub_gguf(tmp_path):
  assert is_hub_gguf("unsloth/Qwen3-0.6B-GGUF:Q4_K_M") and is_hub_gguf("Qwen/Qwen3-0.6B-GGUF:q8_0")
  assert not is_hub_gguf("Qwen/Qwen3-0.6B") and not is_hub_gguf("/models/x:Q4_K_M") and not is_hub_gguf("a:b:c")
  local = tmp_path / "Qwen" / "x:Q8_0"
  local.mkdir(parents=True)   # a local folder of that name wins, as every local path does
  assert not is_hub_gguf(str(local))


def test_model_from_the_hub_cache_as_the_local_file(hub, offline, capfd):
  settings, local, _ = hub
  path = gguf_model_file(f"{REPO_ID}:Q8_0", settings, None)
  assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == (local / "tiny-Q8_0.gguf").read_bytes()
  assert gguf_model_file(f"{REPO_ID}:Q4_K_M", settings, "main").name == "tiny-q4_k_m.gguf"   # any case, at a revision
  first = gguf_model_file(f"{REPO_ID}:q6_k", settings, COMMIT)
  assert first.name.startswith("tiny-Q6_K-00001-of-") and len(GGUFFile(first).splits) > 1
  for quant, file in (("Q8_0", "tiny-Q8_0.gguf"), ("Q6_K", first.name)):
    kw = dict(device="CPU", max_num_seqs=2, num_gpu_blocks=32, max_model_len=128)
    from_hub = LLM(f"{REPO_ID}:{quant}", download_dir=settings.cache_dir, **kw)
    ours = from_hub.engine.compute_logits(PROMPT)
    folder = local / "Q6_K" if quant == "Q6_K" else local
    np.testing.assert_array_equal(ours, LLM(str(folder / file), **kw).engine.compute_logits(PROMPT))


def test_hub_listing_then_the_cache(hub, monkeypatch):
  """Online, the hub lists the repo's files; the chosen ones come from the cache when the downloads cannot reach it."""
  import huggingface_hub
  settings, _, names = hub
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
  # the hub unreachable for the listing too: the cached files are the choices
  assert gguf_model_file(f"{REPO_ID}:Q8_0", settings, None).name == "tiny-Q8_0.gguf"
  listed = []
  monkeypatch.setattr(gguf_hub, "check_reachable", lambda *args: None)   # the hub answers its listing, not the downloads
  monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo, **kw: listed.append((repo, kw["revision"])) or names)
  assert gguf_model_file(f"{REPO_ID}:Q4_K_M", settings, None).name == "tiny-q4_k_m.gguf" and listed == [(REPO_ID, None)]
  monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo, **kw: [n for n in names if "00002-of" not in n])
  with pytest.raises(ConfigError, match="the split GGUF model Q6_K lacks Q6_K/tiny-Q6_K-00002-of-"):
    gguf_model_file(f"{REPO_ID}:Q6_K", settings, None)


def test_choices_that_fail_are_named(hub, offline, tmp_path):
  settings, _, _ = hub
  with pytest.raises(ConfigError, match=r"has no GGUF file of quant type 'Q3_K_M'; its GGUF files: Q6_K/tiny-Q6_K-00001"):
    LLM(f"{REPO_ID}:Q3_K_M", download_dir=settings.cache_dir, device="CPU")
  with pytest.raises(ConfigError, match=r"Q5_0 matches 2 GGUF models \(other-Q5_0.gguf, tiny-Q5_0.gguf\)"):
    LLM(f"{REPO_ID}:Q5_0", download_dir=settings.cache_dir, device="CPU")
  with pytest.raises(ConfigError, match=r"'tinyvllm-tests/absent-GGUF' .*is not in the HuggingFace cache"):
    LLM("tinyvllm-tests/absent-GGUF:Q8_0", download_dir=settings.cache_dir, device="CPU")
  local = write_tiny_llama(tmp_path / "m.gguf", dict.fromkeys(LINEARS, "Q8_0"))
  with pytest.raises(ConfigError, match=r"a revision \('v1'\) applies to hub ids only"): LLM(str(local), revision="v1", device="CPU")
