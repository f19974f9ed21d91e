"""A GGUF file (llama.cpp / ollama's single-file format), read with a numpy memmap: the header, the metadata key/values,
the tensor infos and each tensor's raw bytes (decoded by blocks.py).

The layout (GGUF v2 / v3, little-endian): magic b"GGUF", uint32 version, uint64 tensor count, uint64 key/value count;
each key/value is a string key, a uint32 value type and the value (an array: uint32 element type, uint64 count,
the elements); each tensor info is a string name, uint32 n_dims, n_dims uint64 dims (ne[0], the fastest-varying,
first), uint32 ggml type and a uint64 offset into the data, which starts at the first multiple of general.alignment
(default 32) after the infos. Strings are a uint64 length and UTF-8 bytes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tinyvllm.config import ConfigError
from tinyvllm.model.gguf.blocks import block_format, type_name, unreadable

MAGIC = b"GGUF"
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
  offset: int              # from the start of the file

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


class GGUFFile:
  """The metadata and tensors of one GGUF file; tensor bytes are read from the memmap on demand."""

  def __init__(self, path: str | Path):
    self.path = Path(path)
    try: self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e: raise ConfigError(f"{self.path}: cannot read the GGUF file ({e})") from e
    cur = _Cursor(self.data, self.path)
    if cur.take(4) != MAGIC: raise ConfigError(f"{self.path}: not a GGUF file (no GGUF magic)")
    self.version = cur.scalar(4)
    if self.version not in (2, 3): raise ConfigError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    self.metadata: dict[str, Any] = {}
    for _ in range(n_kv):
      key = cur.string()
      self.metadata[key] = cur.value(cur.scalar(4), key)
    infos = []
    for _ in range(n_tensors):
      name = cur.string()
      dims = [cur.scalar(10) for _ in range(cur.scalar(4))]
      infos.append((name, tuple(reversed(dims)), cur.scalar(4), cur.scalar(10)))
    alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cur.pos // alignment) * alignment
    self.tensors = {name: TensorInfo(name, shape, t, start + off) for name, shape, t, off in infos}

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
    if info.offset + size > len(self.data): raise ConfigError(f"{self.path}: tensor {name} runs past the end of the file")
    return self.data[info.offset:info.offset + size]
