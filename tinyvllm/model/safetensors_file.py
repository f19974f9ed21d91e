"""Reading HF safetensors checkpoints (single file or sharded with an index), checked before anything is loaded."""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.config import ConfigError

# bfloat16 has no numpy dtype: it is read as raw uint16 and converted by the loader.
NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
                "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
                "F8_E4M3": np.uint8}   # FP8 E4M3 weights: their raw codes


def bf16_as_float32(a: np.ndarray) -> np.ndarray:
  """bfloat16 read as raw uint16 -> float32 (exact: its bits are the float32's top half); other arrays as they are."""
  return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a


@dataclass(frozen=True)
class TensorEntry:
  path: Path
  dtype: str          # safetensors dtype name: "BF16", "F16", "F32", ...
  shape: tuple[int, ...]
  start: int          # absolute byte offset in the file
  end: int


def read_header(path: Path) -> dict[str, TensorEntry]:
  """Parse and validate one file's header: every tensor's bytes must lie inside the file and match its shape."""
  size = path.stat().st_size
  with path.open("rb") as f:
    head = f.read(8)
    if len(head) < 8: raise ConfigError(f"{path}: not a safetensors file (only {size} bytes)")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > size - 8:
      raise ConfigError(f"{path}: truncated or corrupt safetensors file (header of {header_len} bytes in a {size}-byte file)")
    try: header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as e: raise ConfigError(f"{path}: corrupt safetensors header ({e})") from e
  base, entries = 8 + header_len, {}
  for name, info in header.items():
    if name == "__metadata__": continue
    if info.get("dtype") not in NUMPY_DTYPES: raise ConfigError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
    start, end = (base + o for o in info["data_offsets"])
    shape = tuple(info["shape"])
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(NUMPY_DTYPES[info["dtype"]]).itemsize
    if end - start != expected: raise ConfigError(f"{path}: tensor {name} holds {end - start} bytes, its shape {shape} needs {expected}")
    if end > size:
      raise ConfigError(f"{path}: truncated safetensors file: tensor {name} ends at byte {end} but the file has {size} bytes")
    entries[name] = TensorEntry(path, info["dtype"], shape, start, end)
  return entries


def weight_files(folder: Path) -> list[Path]:
  """The checkpoint's files: the index's shards, or model.safetensors, or every *.safetensors in the folder."""
  index = folder / "model.safetensors.index.json"
  if index.is_file():
    try: shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError) as e: raise ConfigError(f"{index}: not a valid safetensors index ({e})") from e
    missing = [n for n in shard_names if not (folder / n).is_file()]
    if missing: raise ConfigError(f"{folder}: shard(s) listed in {index.name} are missing: {', '.join(missing)}")
    return [folder / n for n in shard_names]
  if (folder / "model.safetensors").is_file(): return [folder / "model.safetensors"]
  files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise ConfigError(f"{folder}: no weights found (looked for model.safetensors, model.safetensors.index.json, *.safetensors); "
                      "use --load-format dummy for random weights")
  return files


class Checkpoint:
  """All tensors of a checkpoint by name, read lazily through memory maps."""

  def __init__(self, folder: Path):
    self.entries: dict[str, TensorEntry] = {}
    for path in weight_files(folder): self.entries.update(read_header(path))
    self._maps: dict[Path, np.memmap] = {}

  def __contains__(self, name: str) -> bool: return name in self.entries

  def names(self) -> Iterator[str]: return iter(self.entries)

  def dtype(self, name: str) -> str: return self.entries[name].dtype

  def array(self, name: str) -> np.ndarray:
    """The tensor as stored (bfloat16 as raw uint16), without copying."""
    e = self.entries[name]
    if e.path not in self._maps: self._maps[e.path] = np.memmap(e.path, dtype=np.uint8, mode="c")
    return self._maps[e.path][e.start:e.end].view(NUMPY_DTYPES[e.dtype]).reshape(e.shape)
