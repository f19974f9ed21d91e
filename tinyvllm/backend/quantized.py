"""A quantized linear weight in the one packed form every format is converted to at load (GPTQ, AWQ, FP8 checkpoints,
and int8 / int4 / fp8 quantized on the fly), which the backends' linears read.

Integer codes are unsigned with a zero point: w = (code - zero) * scale (+ offset, where the format has an additive
per-group minimum, as GGUF's Q4_1: w = q * d + m, whose -m / d is no integer zero point); FP8 codes are E4M3 bytes: w = e4m3(code) *
scale. Scales (and zero points) are per output row and per group of `group_size` input columns, or per column's group
`g_idx[column]` (GPTQ's act-order).
"""
from __future__ import annotations

from dataclasses import dataclass

from tinygrad import Tensor
from tinygrad.dtype import DType


@dataclass
class QuantizedWeight:
  method: str                    # the format it came from (gptq, awq, fp8, int8, int4): for logs
  kind: str                      # "int" or "fp8"
  bits: int                      # 4 or 8
  shape: tuple[int, int]         # (out_features, in_features) of the weight it stands for
  dtype: DType                   # the compute dtype it dequantizes to
  group_size: int                # input columns per scale group (in_features: one scale per row)
  codes: Tensor                  # uint8 [out, in] (8 bits) or [out, in // 2] (4 bits: column 2j low nibble, 2j+1 high)
  scales: Tensor                 # [out, groups], float16 or float32
  zeros: Tensor | None = None    # uint8 [out, groups] zero points (int kind); None: 2 ** (bits - 1), symmetric
  g_idx: Tensor | None = None    # int32 [in]: each input column's group, where groups are not contiguous runs
  offsets: Tensor | None = None  # [out, groups] float16 / float32 added after scaling (int kind); None: no offset

  @property
  def groups(self) -> int: return -(-self.shape[1] // self.group_size)

  def tensors(self) -> list[Tensor]:
    return [t for t in (self.codes, self.scales, self.zeros, self.g_idx, self.offsets) if t is not None]

  def nbytes(self) -> int: return sum(t.nbytes() for t in self.tensors())

  def describe(self) -> str:
    grouping = "per channel" if self.group_size >= self.shape[1] else f"group {self.group_size}"
    return f"{self.method} ({self.bits}-bit {'E4M3' if self.kind == 'fp8' else 'int'}, {grouping})"
