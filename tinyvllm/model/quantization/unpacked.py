"""A quantized linear as the loaders read it, in numpy before upload: every format (GPTQ, AWQ, FP8 checkpoints, GGUF
blocks) is read into this form, its parts (q/k/v, gate/up) stacked along the output rows, then uploaded as the packed
QuantizedWeight of tinyvllm/backend/quantized.py."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinygrad import Tensor
from tinygrad.dtype import DType

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.config import ConfigError


@dataclass
class UnpackedWeight:
  codes: np.ndarray              # uint8 [out, in]: one code per weight
  scales: np.ndarray             # [out, groups] float16 / float32
  zeros: np.ndarray | None       # uint8 [out, groups]; None: symmetric (2 ** (bits - 1))
  g_idx: np.ndarray | None       # int32 [in]; None: groups are runs of group_size columns
  group_size: int
  bits: int                      # 4 or 8
  offsets: np.ndarray | None = None   # [out, groups] added after scaling (GGUF Q4_1's min); None: none


def stack(parts: list[UnpackedWeight], names: list[str]) -> UnpackedWeight:
  """One linear's weight from its parts, stacked along the output rows."""
  first, where = parts[0], " + ".join(names)
  if any(p.group_size != first.group_size or p.bits != first.bits or p.scales.dtype != first.scales.dtype for p in parts):
    raise ConfigError(f"{where}: the parts are quantized with different bits, group sizes or scale dtypes")
  if len({None if p.g_idx is None else p.g_idx.tobytes() for p in parts}) > 1:
    raise ConfigError(f"{where}: the parts have different g_idx (act-order), which one fused product cannot take")
  join = lambda field: None if getattr(first, field) is None else np.concatenate([getattr(p, field) for p in parts])
  return UnpackedWeight(join("codes"), join("scales"), join("zeros"), first.g_idx, first.group_size, first.bits, join("offsets"))


def upload(w: UnpackedWeight, method: str, kind: str, dtype: DType, device: str) -> QuantizedWeight:
  """The packed form on the device: each row's codes as 32-bit words; float32 scales and shifts (exact for float16
  scales and small zero points: every product and their difference fit float32)."""
  out, cols = w.codes.shape
  per = 32 // w.bits
  fields = np.pad(w.codes, ((0, 0), (0, -cols % per))).astype(np.uint32).reshape(out, -1, per)
  codes = (fields << (w.bits * np.arange(per, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)   # fields never overlap
  scales = w.scales.astype(np.float32)
  shifts = None
  if kind == "int":   # w = (code - zero) * scale (+ offset) as code * scale + shift
    zeros = np.float32(2 ** (w.bits - 1)) if w.zeros is None else w.zeros.astype(np.float32)
    shifts = -zeros * scales + (0 if w.offsets is None else w.offsets.astype(np.float32))
  put = lambda a: None if a is None else Tensor(np.ascontiguousarray(a), device=device).contiguous()
  return QuantizedWeight(method, kind, w.bits, (out, cols), dtype, w.group_size, put(codes), put(scales),
                         put(shifts), put(w.g_idx))
