"""The model creator's recommended sampling settings (vLLM's `--generation-config`): the sampling fields of a
generation_config.json become the defaults of every request that does not set them.

`auto` (the default, as vLLM's) reads the model folder's file, `vllm` reads none (SamplingParams' own defaults), any
other value is a folder whose generation_config.json is read; `override_generation_config` goes on top. Only the
sampling fields count (temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens);
do_sample is ignored, as vLLM ignores it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tinyvllm.config import GENERATION_CONFIG_FIELDS, ConfigError, EngineConfig
from tinyvllm.sampling_params import SamplingParams, SamplingParamsError

FILE = "generation_config.json"


def _read(path: Path) -> dict[str, Any]:
  try: data = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e: raise ConfigError(f"{path}: cannot be read as JSON ({e})") from e
  if not isinstance(data, dict): raise ConfigError(f"{path}: does not hold a JSON object")
  return data


def _source(config: EngineConfig, model_folder: Path | None) -> Path | None:
  """The generation_config.json to read, or None."""
  if config.generation_config == "vllm": return None
  if config.generation_config == "auto":
    return model_folder / FILE if model_folder is not None and (model_folder / FILE).is_file() else None
  folder = Path(config.generation_config).expanduser()
  if not folder.is_dir():
    raise ConfigError(f"generation_config {config.generation_config!r} is neither auto, vllm nor an existing folder")
  if not (folder / FILE).is_file(): raise ConfigError(f"generation_config: {folder} has no {FILE}")
  return folder / FILE


def default_sampling_params(config: EngineConfig, model_folder: Path | None) -> tuple[dict[str, Any], str]:
  """(SamplingParams keyword defaults, where they came from): the chosen file's sampling fields with
  override_generation_config on top; {} when none is set."""
  path = _source(config, model_folder)
  raw = {**(_read(path) if path is not None else {}), **config.override_generation_config}
  fields = {k: raw[k] for k in GENERATION_CONFIG_FIELDS if raw.get(k) is not None}
  if "max_new_tokens" in fields: fields["max_tokens"] = fields.pop("max_new_tokens")
  origin = " and ".join(([str(path)] if path is not None else []) + (["override_generation_config"]
                                                                      if config.override_generation_config else []))
  try: SamplingParams(**fields)
  except SamplingParamsError as e: raise ConfigError(f"{origin}: {e}") from None
  return fields, origin
