"""Quantized weights the portable way: dequantized with tinygrad ops inside the step's graph (exact; the reference the
hand-written kernels are checked against), and RTN quantization of float weights (int8, int4, fp8 on the fly)."""
from __future__ import annotations

from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.layers.fp8 import FP8_MAX, decode_e4m3, encode_e4m3


def unpack_codes(w: QuantizedWeight) -> Tensor:
  """The codes as [out, in] integers (uint8 for 8 bits; the two nibbles of each byte for 4)."""
  if w.bits == 8: return w.codes
  out, cols = w.shape
  low, high = w.codes.bitwise_and(0xF), w.codes.rshift(4)
  return low.unsqueeze(-1).cat(high.unsqueeze(-1), dim=-1).reshape(out, -1)[:, :cols]


def _per_column(t: Tensor, w: QuantizedWeight) -> Tensor:
  """[out, groups] -> [out, in]: each column's group's value."""
  out, cols = w.shape
  if w.g_idx is not None: return t[:, w.g_idx]
  if cols % w.group_size == 0: return t.reshape(out, -1, 1).expand(out, w.groups, w.group_size).reshape(out, cols)
  return t[:, Tensor.arange(cols, device=t.device) // w.group_size]


def dequantize(w: QuantizedWeight, dtype: DType | None = None) -> Tensor:
  """The weight [out, in] in `dtype` (default: its compute dtype), computed in float32."""
  codes = unpack_codes(w)
  values = decode_e4m3(codes, dtypes.float32) if w.kind == "fp8" else codes.float()
  scaled = values * _per_column(w.scales, w)
  if w.shifts is not None: scaled = scaled + _per_column(w.shifts, w)
  return scaled.cast(dtype or w.dtype)


def pack_nibbles(q: Tensor) -> Tensor:
  """[out, in] codes 0..15 -> uint8 [out, ceil(in / 2)], column 2j in the low nibble."""
  if q.shape[1] % 2: q = q.pad((None, (0, 1)))
  pairs = q.cast(dtypes.uint8).reshape(q.shape[0], -1, 2)
  return pairs[:, :, 0].bitwise_or(pairs[:, :, 1].lshift(4))


def quantize_rtn(weight: Tensor, method: str, group_size: int) -> QuantizedWeight:
  """Round-to-nearest, symmetric, one scale per row and group of `group_size` input columns (a multiple of in):
  int8 (codes 1..255 about 128), int4 (1..15 about 8) or fp8 (E4M3, the group's largest magnitude at 448)."""
  out, cols = weight.shape
  bits, kind = {"int8": (8, "int"), "int4": (4, "int"), "fp8": (8, "fp8")}[method]
  groups = weight.float().reshape(out, cols // group_size, group_size)
  top = groups.abs().max(axis=-1, keepdim=True)
  limit = FP8_MAX if kind == "fp8" else 2 ** (bits - 1) - 1
  scale = (top > 0).where(top / limit, 1.0)   # an all-zero group keeps scale 1
  scaled, zero = groups / scale, 2 ** (bits - 1)
  if kind == "fp8": codes = encode_e4m3(scaled.reshape(out, cols))
  else:
    q = scaled.round().clip(-limit, limit).reshape(out, cols) + zero
    codes = pack_nibbles(q) if bits == 4 else q.cast(dtypes.uint8)
  scales = scale.reshape(out, -1)
  return QuantizedWeight(method, kind, bits, (out, cols), weight.dtype, group_size, codes.contiguous(), scales.contiguous(),
                         None if kind == "fp8" else (scales * -zero).contiguous())
