"""GGUF models named on the hub as vLLM names them, `--model REPO_ID:QUANT_TYPE` (unsloth/Qwen3-0.6B-GGUF:Q4_K_M, as
`llama-server -hf` takes them too): the repo's GGUF file whose name holds the quant type, in any case (Qwen's own repos
name theirs qwen3-0.6b-q8_0.gguf), or every file of a split one, fetched into HF's cache as model/hub.py fetches
folders; offline, or with the hub unreachable, the files already cached."""
from __future__ import annotations

import re
from contextlib import suppress
from pathlib import Path

from tinyvllm.config import ConfigError, HubSettings
from tinyvllm.model.gguf.config import is_gguf_path
from tinyvllm.model.gguf.reader import SPLIT_NAME, split_names
from tinyvllm.model.hub import HUB_ID, check_reachable, hub_errors, huggingface_hub_module, snapshot

HUB_GGUF = re.compile(r"^(?P<repo>[^:]+):(?P<quant>\w[\w.-]*)$")
LISTED = 12   # file names an error lists at most


def is_hub_gguf(model: str) -> bool:
  """Whether --model names a hub repo's GGUF file (REPO_ID:QUANT_TYPE) rather than a local path."""
  match = HUB_GGUF.match(model)
  return match is not None and HUB_ID.match(match["repo"]) is not None and not Path(model).expanduser().exists()


def gguf_model_file(model: str, hub: HubSettings, revision: str | None) -> Path | None:
  """The GGUF file --model names, local or fetched from the hub (a split model's first file); None: not a GGUF model."""
  if is_gguf_path(model):
    if revision is not None: raise ConfigError(f"a revision ({revision!r}) applies to hub ids only, and {model!r} is a GGUF file")
    return Path(model).expanduser()
  if not is_hub_gguf(model): return None
  repo, quant = HUB_GGUF.match(model).group("repo", "quant")
  files = matching_files(_gguf_files(repo, hub, revision), repo, quant)
  folder = Path(snapshot(repo, hub, revision, files, ignore=[]))
  missing = [f for f in files if not (folder / f).is_file()]
  if missing: raise ConfigError(f"hub model {repo!r}: {', '.join(missing)} not in the HuggingFace cache ({folder}) and the hub "
                                "cannot be reached to fetch it")
  return folder / files[0]


def matching_files(names: list[str], repo: str, quant: str) -> list[str]:
  """The repo files of the one GGUF model of quant type `quant`: one file, or a split model's files in order. Projector
  files (mmproj-*, for vision models) are not models."""
  ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and not Path(n).name.lower().startswith("mmproj"))
  holds = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
  found = [n for n in ggufs if holds.search(Path(n).name)]
  if not found:
    raise ConfigError(f"hub model {repo!r} has no GGUF file of quant type {quant!r}; its GGUF files: {_listed(ggufs)}")
  models: dict[str, list[str]] = {}
  for name in found:
    split = SPLIT_NAME.match(Path(name).name)
    models.setdefault(str(Path(name).parent / split["prefix"]) if split else name, []).append(name)
  if len(models) > 1:
    raise ConfigError(f"{repo}:{quant} matches {len(models)} GGUF models ({_listed([m[0] for m in models.values()])}); "
                      "name the quant type whole (e.g. UD-Q4_K_XL), or download the file and pass its path")
  (files,) = models.values()
  split = SPLIT_NAME.match(Path(files[0]).name)
  if split is not None:
    expected = [str(Path(files[0]).parent / name) for name in split_names(split["prefix"], int(split["count"]))]
    if files != expected:
      raise ConfigError(f"hub model {repo!r}: the split GGUF model {quant} lacks {', '.join(sorted(set(expected) - set(files)))}")
  return files


def _gguf_files(repo: str, hub: HubSettings, revision: str | None) -> list[str]:
  """The repo's files at `revision`, from the hub; offline or unreachable, those cached."""
  hf = huggingface_hub_module(repo)
  from huggingface_hub import constants, errors
  if not constants.HF_HUB_OFFLINE:
    # one request first: the listing itself retries for ~20 s when the hub is unreachable
    with hub_errors(repo, hub, revision), suppress(errors.LocalEntryNotFoundError):
      check_reachable(hf, repo, hub, revision)
      return hf.list_repo_files(repo, revision=revision, token=hub.token)
  folder = Path(snapshot(repo, hub, revision, ["*.gguf"], ignore=[]))
  return [str(p.relative_to(folder)) for p in folder.rglob("*.gguf")]


def _listed(names: list[str]) -> str:
  if not names: return "none"
  return ", ".join(names[:LISTED]) + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")
