"""--model: a local folder, or a HuggingFace hub id fetched through huggingface_hub into HF's cache.

The cache is the one every HF tool shares (`HF_HOME`, `HF_HUB_CACHE`, or --download-dir), and huggingface_hub itself
honours `HF_TOKEN`, `HF_ENDPOINT` and `HF_HUB_OFFLINE`, resumes interrupted downloads and resolves a cached revision
without the network. Only what the engine reads is fetched: the config files, the tokenizer's files, and the weights
the safetensors index names (or the folder's *.safetensors when there is no index).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from tinyvllm.config import ConfigError, EngineConfig, HubSettings

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")
INDEX = "model.safetensors.index.json"
# what the engine reads besides the weights: the configs (ModelOpt's quantization config too), the weights' index, the
# tokenizer's files, the chat template
METADATA_FILES = ["config.json", "generation_config.json", "hf_quant_config.json", INDEX, "tokenizer*", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja"]
# top-level files only (the patterns match across "/"): Llama's and Mistral's repos also hold their weights in other
# formats, in sub-folders (original/) and as consolidated*.safetensors
IGNORED_FILES = ["*/*", "consolidated*"]


def resolve_model(model: str, hub: HubSettings, revision: str | None = None, weights: bool = True) -> Path:
  """The folder holding the model: `model` itself when it is a directory, else the hub id's snapshot in the cache
  (downloaded first where needed). `weights`: fetch the safetensors too (not for a tokenizer or dummy weights)."""
  path = Path(model).expanduser()
  if path.is_dir():
    if revision is not None: raise ConfigError(f"a revision ({revision!r}) applies to hub ids only, and {model!r} is a local folder")
    return path
  if path.exists(): raise ConfigError(f"--model {model!r} is a file but not a GGUF file; pass the model's folder (or a GGUF file)")
  if not HUB_ID.match(model) or model.startswith((".", "/", "~")):
    raise ConfigError(f"model folder {model!r} does not exist (nor is it a hub id such as Qwen/Qwen3-0.6B)")
  folder = Path(snapshot(model, hub, revision, METADATA_FILES))
  if not (folder / "config.json").is_file(): raise ConfigError(f"hub model {model!r} has no config.json; is it a transformers model?")
  if weights: snapshot(model, hub, revision, weight_patterns(folder))
  return folder


def weight_patterns(folder: Path) -> list[str]:
  """The shards the index names, else every top-level *.safetensors."""
  index = folder / INDEX
  if not index.is_file(): return ["*.safetensors"]
  try: return sorted(set(json.loads(index.read_text())["weight_map"].values()))
  except (json.JSONDecodeError, KeyError) as e: raise ConfigError(f"{index}: not a valid safetensors index ({e})") from e


def snapshot(model: str, hub: HubSettings, revision: str | None, patterns: list[str],
             ignore: list[str] = IGNORED_FILES) -> str:
  """The snapshot folder of hub id `model` at `revision` holding the files that match `patterns` (fetched where needed)."""
  hf = huggingface_hub_module(model)
  from huggingface_hub import constants, errors
  cache_dir = None if hub.cache_dir is None else str(Path(hub.cache_dir).expanduser())
  fetch = lambda **local: hf.snapshot_download(model, revision=revision, cache_dir=cache_dir, token=hub.token,
                                               allow_patterns=patterns, ignore_patterns=ignore, **local)
  with hub_errors(model, hub, revision):
    if revision is not None and COMMIT_HASH.fullmatch(revision):
      # a commit never changes: one in the cache needs no network (as hf_hub_download does for a file). For one that is
      # not, ask the hub once first: the library lists a commit's files with retries (~20 s) when the hub is unreachable
      with suppress(errors.LocalEntryNotFoundError): return fetch(local_files_only=True)
      if not constants.HF_HUB_OFFLINE: check_reachable(hf, model, hub, revision)
    return fetch()


@contextmanager
def hub_errors(model: str, hub: HubSettings, revision: str | None) -> Iterator[None]:
  """huggingface_hub's errors as ConfigErrors that say what to do."""
  from huggingface_hub import constants, errors
  try: yield
  except errors.RevisionNotFoundError as e:
    raise ConfigError(f"hub model {model!r} has no revision {revision!r} (a branch, tag or commit hash)") from e
  except errors.GatedRepoError as e:
    raise ConfigError(f"hub model {model!r} is gated: accept its licence on the hub, then pass a token that may read it "
                      "(HF_TOKEN, `hf auth login`, or hf_token / --hf-token)") from e
  except errors.RepositoryNotFoundError as e:
    raise ConfigError(f"hub model {model!r} does not exist, or it is private and no token that may read it was given "
                      "(HF_TOKEN, `hf auth login`, or hf_token / --hf-token)") from e
  except errors.LocalEntryNotFoundError as e:
    raise ConfigError(_not_cached_message(model, hub, revision, constants)) from e
  except (errors.HfHubHTTPError, OSError) as e:
    raise ConfigError(f"fetching hub model {model!r} failed ({type(e).__name__}: {str(e).splitlines()[0]}); what was "
                      f"downloaded stays in the cache and the next attempt resumes it") from e


def huggingface_hub_module(model: str):
  try:
    import huggingface_hub
  except ImportError as e:
    raise ConfigError(f"{model!r} is not a local folder, and fetching hub models needs huggingface_hub: install the hub "
                      "extra (pip install 'tinyvllm[hub]'), or pass a local folder with --model") from e
  return huggingface_hub


def check_reachable(hf, model: str, hub: HubSettings, revision: str | None) -> None:
  """One request, no retries: the hub's answers (no such repo or revision, gated) go on as the library raises them."""
  from huggingface_hub import errors
  try: hf.HfApi().repo_info(model, revision=revision, token=hub.token)
  except errors.HfHubHTTPError: raise
  except Exception as e:   # the transport's own connection errors (httpx's, or the fork later versions use)
    raise errors.LocalEntryNotFoundError(f"the hub cannot be reached ({type(e).__name__})") from e


def _not_cached_message(model: str, hub: HubSettings, revision: str | None, constants) -> str:
  cache = Path(hub.cache_dir or constants.HF_HUB_CACHE).expanduser()
  folder = cache / f"models--{model.replace('/', '--')}"
  why = ("offline mode is on (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE
         else f"the hub ({constants.ENDPOINT}) cannot be reached")
  fetch = f"hf download {model}" + (f" --revision {revision}" if revision else "") + (f" --cache-dir {cache}" if hub.cache_dir else "")
  return (f"hub model {model!r}{f' at revision {revision!r}' if revision else ''} is not in the HuggingFace cache ({folder}) "
          f"and {why}. Fetch it where the hub is reachable (`{fetch}`, then copy {folder} here), or pass a local folder "
          "with --model")


def resolve_tokenizer(cfg: EngineConfig) -> Path | None:
  """The folder of --tokenizer, or of the model's tokenizer at --tokenizer-revision; None: the model folder's own.
  As vLLM's, the tokenizer's revision defaults to the model's (for a tokenizer that is a hub id)."""
  if cfg.tokenizer is None:
    if cfg.tokenizer_revision in (None, cfg.revision): return None
    return resolve_model(cfg.model, cfg.hub_settings(), cfg.tokenizer_revision, weights=False)
  revision = cfg.tokenizer_revision
  if revision is None and not Path(cfg.tokenizer).expanduser().is_dir(): revision = cfg.revision
  return resolve_model(cfg.tokenizer, cfg.hub_settings(), revision, weights=False)
