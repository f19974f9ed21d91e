"""BOS/EOS/PAD and what encode() adds, from tokenizer_config.json, tokenizer.json's post_processor,
generation_config.json and config.json."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tinyvllm.tokenizer.errors import TokenizerError

Lookup = Callable[[str], "int | None"]


def read_json(path: Path) -> dict[str, Any]:
  """The JSON object in `path`, or {} when there is no such file."""
  if not path.is_file():
    return {}
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise TokenizerError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(data, dict):
    raise TokenizerError(f"{path} does not hold a JSON object")
  return data


def token_content(value: Any) -> str | None:
  """A special-token field: a string, or an AddedToken-like {"content": ...}, or null."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
  if isinstance(value, bool):
    return []
  if isinstance(value, int):
    return [value]
  if isinstance(value, list):
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
  return []


@dataclass(frozen=True)
class Specials:
  bos: int | None = None
  eos: int | None = None
  pad: int | None = None
  eos_ids: frozenset[int] = field(default_factory=frozenset)  # every id generation stops on
  prefix: tuple[int, ...] = ()  # what encode(add_special_tokens=True) puts before the text ...
  suffix: tuple[int, ...] = ()  # ... and after it


def template_ids(post_processor: dict[str, Any] | None, lookup: Lookup) -> tuple[tuple[int, ...], ...] | None:
  """(prefix, suffix) ids of a TemplateProcessing post_processor (also inside a Sequence), else None."""
  if not post_processor:
    return None
  if post_processor.get("type") == "Sequence":
    found = [template_ids(p, lookup) for p in post_processor.get("processors", [])]
    return next((f for f in found if f is not None), None)
  if post_processor.get("type") != "TemplateProcessing":
    return None
  known = post_processor.get("special_tokens", {})
  prefix: list[int] = []
  suffix: list[int] = []
  seen_text = False
  for item in post_processor.get("single", []):
    if "Sequence" in item:
      seen_text = True
      continue
    name = item["SpecialToken"]["id"]
    ids = known[name]["ids"] if name in known else [lookup(name)]
    if None in ids:
      raise TokenizerError(f"post_processor special token {name!r} is not in the vocab")
    (suffix if seen_text else prefix).extend(ids)
  return tuple(prefix), tuple(suffix)


def _field(config: dict[str, Any], key: str, lookup: Lookup, default: int | None) -> int | None:
  if key not in config:
    return default
  content = token_content(config[key])
  return None if content is None else lookup(content)


def _toggle(ids: tuple[int, ...], token: int | None, on: bool, front: bool) -> tuple[int, ...]:
  if token is None:
    return ids
  if not on:
    return tuple(i for i in ids if i != token)
  if token in ids:
    return ids
  return (token, *ids) if front else (*ids, token)


def resolve_specials(base: Specials, tokenizer_config: dict[str, Any], generation_config: dict[str, Any],
                     model_config: dict[str, Any], lookup: Lookup,
                     template: tuple[tuple[int, ...], ...] | None) -> Specials:
  """Start from the format's defaults (`base`), then apply the post_processor template and the config files."""
  tc = tokenizer_config
  prefix, suffix = template if template is not None else (base.prefix, base.suffix)
  bos = _field(tc, "bos_token", lookup, prefix[0] if prefix else base.bos)
  eos = _field(tc, "eos_token", lookup, base.eos)
  if "add_bos_token" in tc:
    prefix = _toggle(prefix, bos, bool(tc["add_bos_token"]), front=True)
  if "add_eos_token" in tc:
    suffix = _toggle(suffix, eos, bool(tc["add_eos_token"]), front=False)
  stops = _ids(generation_config.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))
  if eos is None and stops:
    eos = stops[0]
  pad = _field(tc, "pad_token", lookup, base.pad)
  if pad is None:
    pad = next(iter(_ids(generation_config.get("pad_token_id")) + _ids(model_config.get("pad_token_id"))), None)
  eos_ids = frozenset([*base.eos_ids, *stops, *([eos] if eos is not None else [])])
  return replace(base, bos=bos, eos=eos, pad=pad, eos_ids=eos_ids, prefix=prefix, suffix=suffix)
