"""--model: a local folder, or a HuggingFace hub id downloaded into a cache folder (with a progress bar)."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

from tqdm import tqdm

from tinyvllm.config import ConfigError, HubSettings

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WANTED = re.compile(r"^(config\.json|generation_config\.json|tokenizer.*|special_tokens_map\.json|vocab\.json|merges\.txt|"
                    r".*\.safetensors|model\.safetensors\.index\.json)$")
CONNECT_TIMEOUT_S = 10.0


def resolve_model(model: str, hub: HubSettings) -> Path:
  """The folder holding the model: `model` itself when it is a directory, else the hub id's cached download."""
  path = Path(model).expanduser()
  if path.is_dir(): return path
  if path.exists(): raise ConfigError(f"--model {model!r} is a file; pass the model's folder")
  if not HUB_ID.match(model) or model.startswith((".", "/", "~")):
    raise ConfigError(f"model folder {model!r} does not exist")
  folder = hub.cache_dir / model.replace("/", "--")
  if (folder / ".complete").exists(): return folder
  return download(model, folder, hub)


def _request(url: str, hub: HubSettings) -> urllib.request.Request:
  headers = {"User-Agent": "tinyvllm"}
  if hub.token: headers["Authorization"] = f"Bearer {hub.token}"
  return urllib.request.Request(url, headers=headers)


def _list_files(model: str, hub: HubSettings) -> list[str]:
  url = f"{hub.endpoint}/api/models/{model}"
  try:
    with urllib.request.urlopen(_request(url, hub), timeout=CONNECT_TIMEOUT_S) as r: info = json.load(r)
  except urllib.error.HTTPError as e:
    raise ConfigError(f"model {model!r} is neither a local folder nor a hub model this machine can fetch "
                      f"({url} answered HTTP {e.code}); pass a local folder with --model") from e
  except (urllib.error.URLError, TimeoutError, OSError) as e:
    raise ConfigError(f"model {model!r} is not a local folder and the HuggingFace hub cannot be reached "
                      f"({getattr(e, 'reason', e)}); download it elsewhere and pass its local folder with --model") from e
  return [s["rfilename"] for s in info.get("siblings", []) if WANTED.match(s["rfilename"])]


def _fetch(model: str, name: str, dest: Path, hub: HubSettings) -> None:
  url = f"{hub.endpoint}/{model}/resolve/main/{name}"
  part = dest.with_name(dest.name + ".part")
  with urllib.request.urlopen(_request(url, hub), timeout=CONNECT_TIMEOUT_S) as r, part.open("wb") as f:
    total = int(r.headers.get("Content-Length") or 0)
    with tqdm(total=total or None, unit="B", unit_scale=True, desc=name, leave=False) as bar:
      while chunk := r.read(1 << 20):
        f.write(chunk)
        bar.update(len(chunk))
  part.rename(dest)


def download(model: str, folder: Path, hub: HubSettings) -> Path:
  names = _list_files(model, hub)
  if "config.json" not in names: raise ConfigError(f"hub model {model!r} has no config.json; is it a transformers model?")
  folder.mkdir(parents=True, exist_ok=True)
  try:
    for name in tqdm(names, desc=f"downloading {model}", unit="file"):
      if not (folder / name).exists(): _fetch(model, name, folder / name, hub)
  except (urllib.error.URLError, TimeoutError, OSError) as e:
    raise ConfigError(f"downloading {model!r} failed ({e}); files fetched so far are kept in {folder}") from e
  (folder / ".complete").touch()
  return folder
