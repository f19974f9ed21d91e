"""A quantized linear weight in the one packed form every format is converted to at load (GPTQ, AWQ, FP8 checkpoints,
GGUF blocks, and int8 / int4 / fp8 quantized on the fly), which the backends' linears read.

Integer codes are unsigned: w = code * scale + shift (shift = -zero * scale, plus GGUF Q4_1's additive min); FP8 codes
are E4M3 bytes: w = e4m3(code) * scale. Scales and shifts are float32, per output row and group of `group_size` input
columns, or per column's group `g_idx[column]` (GPTQ's act-order). An act-order weight whose groups each hold
`group_size` columns is loaded with its columns sorted by group instead (`perm`: packed column j holds input column
perm[j]), so that its groups are runs as in any other weight and the kernels take it: the product reads x's columns in
that order (layers/quantized.py's permute_input), as vLLM's act-order kernels do. For the formats' float16 scales and
small integer zero points, code * scale + shift is exactly (code - zero) * scale.
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
  # uint32 [out, ceil(in * bits / 32)]: each row's codes as 32-bit words, column j of a word's 32 / bits in its bits
  # j * bits and up (the last word of a row padded with zero codes); what a kernel reads, 16 bytes at a time
  codes: Tensor
  scales: Tensor                 # float32 [out, groups]
  shifts: Tensor | None = None   # float32 [out, groups] (int kind); None for FP8
  g_idx: Tensor | None = None    # int32 [in]: each input column's group, where groups are not contiguous runs
  perm: Tensor | None = None     # int32 [in]: the input column each packed column holds (act-order sorted by group)

  @property
  def groups(self) -> int: return -(-self.shape[1] // self.group_size)

  @property
  def code_format(self) -> str:
    """What a kernel reads: "int8", "int4" or "fp8" codes (kernels/plan.py's PACKED_WEIGHTS)."""
    return f"int{self.bits}" if self.kind == "int" else self.kind

  def tensors(self) -> list[Tensor]:
    return [t for t in (self.codes, self.scales, self.shifts, self.g_idx, self.perm) if t is not None]

  def nbytes(self) -> int: return sum(t.nbytes() for t in self.tensors())

  def describe(self) -> str:
    grouping = "per channel" if self.group_size >= self.shape[1] else f"group {self.group_size}"
    if self.g_idx is not None or self.perm is not None: grouping += ", act-order"
    return f"{self.method} ({self.bits}-bit {'E4M3' if self.kind == 'fp8' else 'int'}, {grouping})"
