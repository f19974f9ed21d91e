"""A quantized linear as the loaders read it, in numpy before upload: every format (GPTQ, AWQ, FP8 checkpoints, GGUF
blocks) is read into this form, its parts (q/k/v, gate/up) stacked along the output rows, then uploaded as the packed
QuantizedWeight of tinyvllm/backend/quantized.py."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

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


class TensorReader(Protocol):   # checkpoint_formats.Reader: one linear's tensors, as the format readers take them
  prefix: str

  def has(self, suffix: str) -> bool: ...
  def get(self, suffix: str, dtypes: tuple[str, ...]) -> np.ndarray: ...
  def check(self, suffix: str, a: np.ndarray, shape: tuple[int, ...]) -> None: ...


def unpack_bits(packed: np.ndarray, bits: int, axis: int) -> np.ndarray:
  """int32 words -> their 32 / bits fields (lowest bits first), laid out along `axis` in place of each word."""
  per, mask = 32 // bits, (1 << bits) - 1
  words = packed.view(np.uint32)
  fields = (words[..., None] >> (bits * np.arange(per, dtype=np.uint32))) & mask   # [..., words, per]
  fields = np.moveaxis(fields, -1, axis + 1 if axis >= 0 else axis)                 # the fields after their word
  shape = list(packed.shape)
  shape[axis] *= per
  return fields.reshape(shape).astype(np.uint8)


def label(names: list[str]) -> str:
  """The parts of one product, as an error names them (a sparse layer's experts: the first and last of many)."""
  return " + ".join(names) if len(names) <= 3 else f"{names[0]} + ... + {names[-1]} ({len(names)} parts)"


def stack(parts: list[UnpackedWeight], names: list[str]) -> UnpackedWeight:
  """One linear's weight from its parts, stacked along the output rows."""
  first, where = parts[0], label(names)
  if any(p.group_size != first.group_size or p.bits != first.bits or p.scales.dtype != first.scales.dtype for p in parts):
    raise ConfigError(f"{where}: the parts are quantized with different bits, group sizes or scale dtypes")
  if len({None if p.g_idx is None else p.g_idx.tobytes() for p in parts}) > 1:
    raise ConfigError(f"{where}: the parts have different g_idx (act-order), which one fused product cannot take")
  join = lambda field: None if getattr(first, field) is None else np.concatenate([getattr(p, field) for p in parts])
  return UnpackedWeight(join("codes"), join("scales"), join("zeros"), first.g_idx, first.group_size, first.bits, join("offsets"))


def common_form(parts: list[UnpackedWeight]) -> list[UnpackedWeight]:
  """Parts of one fused linear (q/k/v, gate/up) in one packed form: as they are where their bits, groups and fields
  agree, else each as codes of the most bits in the smallest group, float32 scales, explicit zero points and offsets
  (GGUF's Q4_K_M files hold attn_v in Q6_K beside Q4_K q and k). Exact: codes keep their values, and each group's
  scale, zero point and offset repeat over the smaller groups it holds."""
  first = parts[0]
  form = lambda p: (p.bits, p.group_size, p.scales.dtype, p.zeros is None, p.offsets is None, p.g_idx is None)
  if all(form(p) == form(first) for p in parts): return parts
  bits, group = max(p.bits for p in parts), min(p.group_size for p in parts)
  if any(p.g_idx is not None or p.group_size % group for p in parts):
    raise ConfigError(f"parts quantized in groups of {sorted({p.group_size for p in parts})} (or act-order) cannot share one form")
  offsets = any(p.offsets is not None for p in parts)
  def convert(p: UnpackedWeight) -> UnpackedWeight:
    rep = lambda a: np.repeat(a, p.group_size // group, axis=1)
    zeros = np.full(p.scales.shape, 2 ** (p.bits - 1), np.uint8) if p.zeros is None else p.zeros
    offset = rep(p.offsets.astype(np.float32)) if p.offsets is not None else np.zeros((p.codes.shape[0], p.codes.shape[1] // group),
                                                                                     np.float32)
    return UnpackedWeight(p.codes, rep(p.scales.astype(np.float32)), rep(zeros), None, group, bits, offset if offsets else None)
  return [convert(p) for p in parts]


def sorted_by_group(w: UnpackedWeight) -> tuple[UnpackedWeight, np.ndarray | None]:
  """An act-order weight (g_idx) whose groups each hold group_size columns with its columns sorted by group, and the
  order (QuantizedWeight.perm); any other weight as it is, and None."""
  if w.g_idx is None: return w, None
  cols = w.codes.shape[1]
  if cols % w.group_size or np.any(np.bincount(w.g_idx, minlength=cols // w.group_size) != w.group_size): return w, None
  perm = np.argsort(w.g_idx, kind="stable").astype(np.int32)
  return replace(w, codes=np.ascontiguousarray(w.codes[:, perm]), g_idx=None), perm


def upload(w: UnpackedWeight, method: str, kind: str, dtype: DType, device: str) -> QuantizedWeight:
  """The packed form on the device: each row's codes as 32-bit words; float32 scales and shifts (exact for float16
  scales and small zero points: every product and their difference fit float32). Act-order columns sorted by group
  where the groups allow (sorted_by_group)."""
  w, perm = sorted_by_group(w)
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
                         put(shifts), put(w.g_idx), put(perm))
