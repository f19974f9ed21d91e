"""A GGUF model (llama.cpp / ollama's format), read with numpy memmaps: the header, the metadata key/values, the tensor
infos and each tensor's raw bytes (decoded by blocks.py). One file, or a model that llama.cpp's gguf-split (or
convert_hf_to_gguf.py --split-max-size) cut into PREFIX-0000i-of-0000N.gguf files, opened by its first: that one holds
the metadata, each holds some of the tensors and its split.no / split.count.

The layout (GGUF v2 / v3, little-endian): magic b"GGUF", uint32 version, uint64 tensor count, uint64 key/value count;
each key/value is a string key, a uint32 value type and the value (an array: uint32 element type, uint64 count,
the elements); each tensor info is a string name, uint32 n_dims, n_dims uint64 dims (ne[0], the fastest-varying,
first), uint32 ggml type and a uint64 offset into the data, which starts at the first multiple of general.alignment
(default 32) after the infos. Strings are a uint64 length and UTF-8 bytes.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tinyvllm.config import ConfigError
from tinyvllm.model.gguf.blocks import block_format, type_name, unreadable

MAGIC = b"GGUF"
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
DEFAULT_ALIGNMENT = 32
# metadata value types: (struct format, size) for the scalars; 8 is a string, 9 an array
SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4), 7: ("<?", 1),
           10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
NUMPY_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
  name: str
  shape: tuple[int, ...]   # numpy order (the file's dims reversed: rows first), e.g. (out_features, in_features)
  ggml_type: int
  offset: int              # from the start of its file
  split: int = 0           # which of a split model's files holds it

  @property
  def type_name(self) -> str: return type_name(self.ggml_type)


class _Cursor:
  """Reads the header's fields one after the other."""

  def __init__(self, data: np.ndarray, path: Path):
    self.data, self.pos, self.path = data, 0, path

  def take(self, n: int) -> bytes:
    if self.pos + n > len(self.data): raise ConfigError(f"{self.path}: truncated GGUF header (at byte {self.pos})")
    out = self.data[self.pos:self.pos + n].tobytes()
    self.pos += n
    return out

  def scalar(self, vtype: int) -> Any:
    fmt, size = SCALARS[vtype]
    return struct.unpack(fmt, self.take(size))[0]

  def string(self) -> str:
    return self.take(self.scalar(10)).decode("utf-8", errors="replace")

  def value(self, vtype: int, key: str) -> Any:
    if vtype == STRING: return self.string()
    if vtype in SCALARS: return self.scalar(vtype)
    if vtype != ARRAY: raise ConfigError(f"{self.path}: metadata {key} has unknown value type {vtype}")
    etype, count = self.scalar(4), self.scalar(10)
    if etype == STRING: return [self.string() for _ in range(count)]
    if etype in NUMPY_SCALARS:   # numbers in one read (token types, scores)
      size = SCALARS[etype][1] * count
      return np.frombuffer(self.take(size), dtype=NUMPY_SCALARS[etype]).tolist()
    return [self.value(etype, key) for _ in range(count)]


@dataclass
class _Split:
  """One file's memmap, metadata and tensor infos (offsets from the start of that file)."""
  path: Path
  data: np.ndarray
  metadata: dict[str, Any]
  infos: list[tuple[str, tuple[int, ...], int, int]]


def _read_split(path: Path) -> _Split:
  try: data = np.memmap(path, dtype=np.uint8, mode="r")
  except (OSError, ValueError) as e: raise ConfigError(f"{path}: cannot read the GGUF file ({e})") from e
  cur = _Cursor(data, path)
  if cur.take(4) != MAGIC: raise ConfigError(f"{path}: not a GGUF file (no GGUF magic)")
  version = cur.scalar(4)
  if version not in (2, 3): raise ConfigError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
  n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
  metadata: dict[str, Any] = {}
  for _ in range(n_kv):
    key = cur.string()
    metadata[key] = cur.value(cur.scalar(4), key)
  infos = []
  for _ in range(n_tensors):
    name = cur.string()
    dims = [cur.scalar(10) for _ in range(cur.scalar(4))]
    infos.append((name, tuple(reversed(dims)), cur.scalar(4), cur.scalar(10)))
  alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
  start = -(-cur.pos // alignment) * alignment
  return _Split(path, data, metadata, [(name, shape, t, start + off) for name, shape, t, off in infos])


def split_names(prefix: str, count: int) -> list[str]:
  """A split model's file names, first to last, as llama.cpp's gguf-split names them: PREFIX-00001-of-0000N.gguf."""
  return [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def _split_paths(path: Path, count: int) -> list[Path]:
  """A split model's files, from its first."""
  match = SPLIT_NAME.match(path.name)
  if match is None or int(match["count"]) != count:
    raise ConfigError(f"{path}: the file is split 1 of {count} (split.count), but its name does not end in "
                      f"-00001-of-{count:05d}.gguf, so the other splits cannot be found; keep llama.cpp's split names")
  return [path.with_name(name) for name in split_names(match["prefix"], count)]


def _read_splits(path: Path) -> list[_Split]:
  """The model's files, the given one first: one file, or every split of a model llama.cpp's gguf-split cut (the first
  holds the metadata; each holds split.no and split.count, the first split.tensors.count)."""
  first = _read_split(path)
  count = int(first.metadata.get(SPLIT_COUNT, 1))
  if count <= 1: return [first]
  index = int(first.metadata.get(SPLIT_NO, 0))
  if index != 0:
    match = SPLIT_NAME.match(path.name)
    first = split_names(match["prefix"], count)[0] if match else "its -00001-of- file"
    raise ConfigError(f"{path}: the file is split {index + 1} of {count}; pass the model's first split ({first})")
  splits = [first]
  for i, p in enumerate(_split_paths(path, count)[1:], start=1):
    if not p.is_file(): raise ConfigError(f"{path}: split {i + 1} of {count} ({p.name}) is missing beside it")
    split = _read_split(p)
    got = (split.metadata.get(SPLIT_NO), split.metadata.get(SPLIT_COUNT))
    if got != (i, count): raise ConfigError(f"{p}: its split.no / split.count are {got}, expected ({i}, {count}) for this name")
    splits.append(split)
  total, expected = sum(len(s.infos) for s in splits), first.metadata.get(SPLIT_TENSORS)
  if expected is not None and total != expected:
    raise ConfigError(f"{path}: its {count} splits hold {total} tensors, split.tensors.count says {expected}")
  return splits


class GGUFFile:
  """The metadata and tensors of one GGUF model (one file, or the splits of one); tensor bytes are read from the
  memmaps on demand."""

  def __init__(self, path: str | Path):
    self.path = Path(path)
    self.splits = _read_splits(self.path)
    self.metadata = self.splits[0].metadata
    self.tensors: dict[str, TensorInfo] = {}
    for index, split in enumerate(self.splits):
      for name, shape, ggml_type, offset in split.infos:
        if name in self.tensors: raise ConfigError(f"{split.path}: tensor {name} appears twice in the model's files")
        self.tensors[name] = TensorInfo(name, shape, ggml_type, offset, index)

  def __contains__(self, name: str) -> bool: return name in self.tensors

  def get(self, key: str, default: Any = None) -> Any: return self.metadata.get(key, default)

  def require(self, key: str) -> Any:
    if key not in self.metadata: raise ConfigError(f"{self.path}: GGUF metadata {key} is missing")
    return self.metadata[key]

  def raw(self, name: str) -> np.ndarray:
    """The tensor's bytes as stored (uint8), checked to be whole blocks of its type."""
    info = self.tensors[name]
    fmt = block_format(info.ggml_type)
    if fmt is None: raise ConfigError(f"{self.path}: tensor {name} has GGUF type {info.type_name}, {unreadable(info.ggml_type)}")
    count = int(np.prod(info.shape))
    if count % fmt.block: raise ConfigError(f"{self.path}: tensor {name} ({count} values) is not whole {fmt.name} blocks of {fmt.block}")
    size = count // fmt.block * fmt.nbytes
    split = self.splits[info.split]
    if info.offset + size > len(split.data): raise ConfigError(f"{split.path}: tensor {name} runs past the end of the file")
    return split.data[info.offset:info.offset + size]
