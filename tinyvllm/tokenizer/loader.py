"""load_tokenizer: find the tokenizer files of a HuggingFace model folder and pick the format from them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tinyvllm.tokenizer import added_tokens, byte_level, sentencepiece, tiktoken_file
from tinyvllm.tokenizer.added_tokens import AddedToken
from tinyvllm.tokenizer.chat_template import ChatTemplate, find_chat_template
from tinyvllm.tokenizer.config import Specials, read_json, resolve_specials, template_ids, token_content
from tinyvllm.tokenizer.encoding import ModelParts
from tinyvllm.tokenizer.errors import TokenizerError
from tinyvllm.tokenizer.tokenizer import Tokenizer

LOOKED_FOR = "tokenizer.json, vocab.json + merges.txt, or tokenizer.model (tiktoken format)"
# HF's named special tokens, in the order its all_special_tokens lists them
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_tokenizer(path: str | Path) -> Tokenizer:
  """The tokenizer of a model folder, or of one tokenizer.json / tokenizer.model file (other files beside it in
  the same folder still supply BOS/EOS and the chat template)."""
  path = Path(path).expanduser()
  if path.is_file():
    folder, file = path.parent, path
  elif path.is_dir():
    folder, file = path, None
  else:
    raise TokenizerError(f"tokenizer path {path} does not exist")
  tc = read_json(folder / "tokenizer_config.json")
  parts, added, template, base = _load_model(folder, file, tc)
  added = added_tokens.merge(added, added_tokens.from_added_tokens_decoder(tc.get("added_tokens_decoder", {})),
                             _added_tokens_json(folder))
  lookup = _lookup(parts, added)
  specials = resolve_specials(base, tc, read_json(folder / "generation_config.json"), read_json(folder / "config.json"),
                              lookup, template)
  source = find_chat_template(folder, tc)
  return Tokenizer(folder.name or str(folder), parts, added, specials, ChatTemplate(source) if source else None,
                   _template_tokens(folder, tc, added, specials))


def _load_model(folder: Path, file: Path | None, tc: dict[str, Any]):
  """(parts, added tokens, post-processor (prefix, suffix) or None, format defaults)."""
  if file is not None and file.suffix == ".json":
    return _from_tokenizer_json(file)
  if file is not None:
    return _from_tokenizer_model(file)
  if (folder / "tokenizer.json").is_file():
    return _from_tokenizer_json(folder / "tokenizer.json")
  if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
    parts = byte_level.from_vocab_merges(folder.name, folder, tc.get("tokenizer_class"))
    return parts, [], None, Specials()
  if (folder / "tokenizer.model").is_file():
    return _from_tokenizer_model(folder / "tokenizer.model")
  raise TokenizerError(f"no tokenizer files in {folder}: looked for {LOOKED_FOR}")


def _from_tokenizer_json(path: Path):
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise TokenizerError(f"cannot read {path}: {e}") from e
  model = data.get("model") if isinstance(data, dict) else None
  if not isinstance(model, dict) or "vocab" not in model:
    raise TokenizerError(f"{path} has no model vocab")
  if model.get("type", "BPE") != "BPE":
    raise TokenizerError(f"{path}: tokenizer model {model.get('type')!r} is not supported (only BPE)")
  if sentencepiece.is_sentencepiece_style(data):
    style = sentencepiece
  elif "ByteLevel" in sentencepiece.step_types([data.get("pre_tokenizer"), data.get("decoder")]):
    style = byte_level
  else:
    raise TokenizerError(f"{path}: BPE that is neither byte-level nor SentencePiece-style is not supported")
  parts = style.from_tokenizer_json(path.parent.name, data)
  added = added_tokens.from_tokenizer_json(data.get("added_tokens") or [])
  lookup = _lookup(parts, added)
  return parts, added, template_ids(data.get("post_processor"), lookup), Specials()


def _from_tokenizer_model(path: Path):
  if not tiktoken_file.is_tiktoken_file(path):
    raise TokenizerError(f"{path} is not in tiktoken format (a SentencePiece model?), and SentencePiece models are "
                         "not supported: provide the model's tokenizer.json (transformers' "
                         "AutoTokenizer.from_pretrained(...).save_pretrained(...) writes one)")
  parts, specials = tiktoken_file.load(path)
  ids = {t.content: t.id for t in specials}
  bos, eos = ids[tiktoken_file.BOS], ids[tiktoken_file.EOS]
  stops = frozenset({eos, ids[tiktoken_file.EOM], ids[tiktoken_file.EOT]})
  return parts, specials, None, Specials(bos=bos, eos=eos, eos_ids=stops, prefix=(bos,))


def _added_tokens_json(folder: Path) -> list[AddedToken]:
  """The legacy added_tokens.json ({content: id}); special when special_tokens_map.json names the token."""
  table = read_json(folder / "added_tokens.json")
  if not table:
    return []
  names = read_json(folder / "special_tokens_map.json")
  special = {token_content(v) for v in names.values() if not isinstance(v, list)}
  special |= {token_content(v) for v in names.get("additional_special_tokens", [])}
  return [AddedToken(int(i), content, special=content in special) for content, i in table.items()]


def _lookup(parts: ModelParts, added: list[AddedToken]):
  by_content = {t.content: t.id for t in added}
  by_bytes: dict[bytes, int] | None = None

  def lookup(content: str) -> int | None:
    nonlocal by_bytes
    if content in by_content:
      return by_content[content]
    if by_bytes is None:
      by_bytes = {b: i for i, b in parts.token_bytes.items()}
    return by_bytes.get(content.encode("utf-8"))
  return lookup


def _template_tokens(folder: Path, tc: dict[str, Any], added: list[AddedToken], specials: Specials) -> dict[str, Any]:
  """HF's special_tokens_map (what chat templates see as bos_token, eos_token, ...): the named tokens of
  tokenizer_config.json, else of special_tokens_map.json, else the ids found for BOS/EOS/PAD; additional_special_tokens
  (transformers 5 writes them as extra_special_tokens)."""
  names = read_json(folder / "special_tokens_map.json")
  out: dict[str, Any] = {}
  for key in SPECIAL_TOKEN_ATTRIBUTES:
    content = token_content(tc.get(key, names.get(key)))
    if content is not None:
      out[key] = content
  by_id = {t.id: t.content for t in added}
  for key, token_id in (("bos_token", specials.bos), ("eos_token", specials.eos), ("pad_token", specials.pad)):
    if key not in out and token_id is not None and token_id in by_id:
      out[key] = by_id[token_id]
  extra = next((v for v in (tc.get("additional_special_tokens"), tc.get("extra_special_tokens"),
                            names.get("additional_special_tokens")) if v), None)
  if isinstance(extra, dict):
    extra = list(extra.values())
  if isinstance(extra, list):
    out["additional_special_tokens"] = [token_content(t) for t in extra]
  return out
