"""Quantized weights the portable way: dequantized with tinygrad ops inside the step's graph (exact; the reference the
hand-written kernels are checked against), and RTN quantization of float weights (int8, int4, fp8 on the fly)."""
from __future__ import annotations

from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.layers.fp8 import FP8_MAX, decode_e4m3, encode_e4m3
from tinyvllm.layers.scatter import gather_columns


def permute_input(w: Tensor | QuantizedWeight, x: Tensor, fused: dict) -> tuple[Tensor, dict]:
  """The product's input in an act-order weight's column order (QuantizedWeight.perm): x's columns (each half's behind
  SwiGLU / GeGLU) and the RMSNorm's weight, whose 1 / RMS the order leaves as it is; any other weight's as they are."""
  if not isinstance(w, QuantizedWeight) or w.perm is None: return x, fused
  gated = fused.get("silu_mul") or fused.get("gelu_mul")
  index = w.perm.cat(w.perm + w.shape[1]) if gated else w.perm
  if fused.get("norm") is not None: fused = {**fused, "norm": gather_columns(fused["norm"].reshape(1, -1), w.perm).reshape(-1)}
  return gather_columns(x, index), fused


def unpack_codes(w: QuantizedWeight) -> Tensor:
  """The codes as [out, in] integers."""
  out, cols = w.shape
  per, mask = 32 // w.bits, (1 << w.bits) - 1
  fields = [w.codes.rshift(j * w.bits).bitwise_and(mask).unsqueeze(-1) for j in range(per)]
  return fields[0].cat(*fields[1:], dim=-1).reshape(out, -1)[:, :cols]


def pack_words(q: Tensor, bits: int) -> Tensor:
  """[out, in] codes below 2 ** bits -> uint32 [out, ceil(in * bits / 32)], the first column in the lowest bits."""
  per = 32 // bits
  if q.shape[1] % per: q = q.pad((None, (0, per - q.shape[1] % per)))
  fields = q.cast(dtypes.uint32).reshape(q.shape[0], -1, per)
  words = fields[:, :, 0]
  for j in range(1, per): words = words.bitwise_or(fields[:, :, j].lshift(j * bits))
  return words


def _per_column(t: Tensor, w: QuantizedWeight) -> Tensor:
  """[out, groups] -> [out, in]: each column's group's value."""
  out, cols = w.shape
  if w.g_idx is not None: return t[:, w.g_idx]
  if cols % w.group_size == 0: return t.reshape(out, -1, 1).expand(out, w.groups, w.group_size).reshape(out, cols)
  return t[:, Tensor.arange(cols).to(t.device) // w.group_size]


def dequantize(w: QuantizedWeight, dtype: DType | None = None) -> Tensor:
  """The weight [out, in] in `dtype` (default: its compute dtype), computed in float32."""
  codes = unpack_codes(w)
  values = decode_e4m3(codes, dtypes.float32) if w.kind == "fp8" else codes.float()
  scaled = values * _per_column(w.scales, w)
  if w.shifts is not None: scaled = scaled + _per_column(w.shifts, w)
  return scaled.cast(dtype or w.dtype)


def quantize_rtn(weight: Tensor, method: str, group_size: int) -> QuantizedWeight:
  """Round-to-nearest, symmetric, one scale per row and group of `group_size` input columns (dividing in):
  int8 (codes 1..255 about 128), int4 (1..15 about 8) or fp8 (E4M3, the group's largest magnitude at 448)."""
  out, cols = weight.shape
  bits, kind = {"int8": (8, "int"), "experts_int8": (8, "int"), "int4": (4, "int"), "fp8": (8, "fp8")}[method]
  groups = weight.float().reshape(out, cols // group_size, group_size)
  top = groups.abs().max(axis=-1, keepdim=True)
  limit = FP8_MAX if kind == "fp8" else 2 ** (bits - 1) - 1
  scale = (top > 0).where(top / limit, 1.0)   # an all-zero group keeps scale 1
  scaled, zero = groups / scale, 2 ** (bits - 1)
  q = encode_e4m3(scaled.reshape(out, cols)) if kind == "fp8" else scaled.round().clip(-limit, limit).reshape(out, cols) + zero
  codes = pack_words(q, bits)
  scales = scale.reshape(out, -1)
  return QuantizedWeight(method, kind, bits, (out, cols), weight.dtype, group_size, codes.contiguous(), scales.contiguous(),
                         None if kind == "fp8" else (scales * -zero).contiguous())
