"""Skinny matrix products for decode batches through kernels/linear.inc (CUDA/Metal): y = x @ w.T (+ bias).

tinygrad's generated kernels for a few-row product over a large bf16 weight run far from memory bandwidth without a
beam search, and a decode step is little else; this kernel streams each weight row once with 16-byte loads. It takes
rows <= MAX_ROWS (the batch's tokens); larger products (prefill, big batches) stay with tinygrad's matmul.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tinygrad import Tensor, dtypes

from tinyvllm.kernels.plan import DTYPE_CODES, ELEM_BYTES, Launch, Param, dtype_code
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import run_kernel

MAX_ROWS = 8
THREADS = 128
DTYPE_NAMES = {dtypes.float32: "float32", dtypes.float16: "float16", dtypes.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class LinearShape:
  dtype: str
  rows: int          # M: tokens in the batch (static, padded)
  in_features: int   # K
  out_features: int  # NOUT
  bias: bool
  out_float32: bool  # y in float32 (the logits) instead of the input dtype


@dataclass(frozen=True)
class LinearPlan:
  shape: LinearShape
  rows_per_warp: int
  defines: dict[str, int | str] = field(compare=False)
  launch: Launch = field(compare=False)


def unsupported_reason(shape: LinearShape) -> str | None:
  if shape.dtype not in DTYPE_CODES: return f"dtype {shape.dtype}"
  if not 1 <= shape.rows <= MAX_ROWS: return f"{shape.rows} rows (the kernel takes 1 to {MAX_ROWS})"
  vec = 16 // ELEM_BYTES[dtype_code(shape.dtype)]
  if shape.in_features % vec: return f"in_features {shape.in_features} not a multiple of {vec}"
  return None


def linear_plan(shape: LinearShape) -> LinearPlan:
  rpw = 2 if shape.rows <= 4 else 1   # more weight rows per warp while few x rows keep registers free
  warps = THREADS // 32
  blocks = -(-shape.out_features // (rpw * warps))
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_M": shape.rows, "TV_K": shape.in_features,
                                   "TV_NOUT": shape.out_features, "TV_RPW": rpw, "TV_NT": THREADS}
  if shape.bias: defines["TV_BIAS"] = 1
  if shape.out_float32: defines["TV_OUT_F32"] = 1
  m, k, o = shape.rows, shape.in_features, shape.out_features
  params = [Param("y", "float" if shape.out_float32 else "elem", True, m * o), Param("x", "elem", False, m * k),
            Param("w", "elem", False, o * k)]
  if shape.bias: params.append(Param("bias", "elem", False, o))
  return LinearPlan(shape, rpw, defines, Launch("tv_linear", (blocks, 1, 1), THREADS, tuple(params)))


@functools.cache
def _compiled(dialect: str, shape: LinearShape) -> tuple[LinearPlan, str]:
  plan = linear_plan(shape)
  return plan, kernel_source(dialect, "linear", plan.defines)


def skinny_linear(dialect: str, x: Tensor, w: Tensor, bias: Tensor | None = None, out_float32: bool = False) -> Tensor | None:
  """x [M, K] @ w[NOUT, K].T (+ bias) with the hand-written kernel, or None when the shape is not one it takes."""
  dtype = DTYPE_NAMES.get(w.dtype)
  if dtype is None or x.ndim != 2: return None
  shape = LinearShape(dtype, x.shape[0], x.shape[1], w.shape[0], bias is not None, out_float32)
  if unsupported_reason(shape) is not None: return None
  plan, source = _compiled(dialect, shape)
  y = Tensor.empty(shape.rows, shape.out_features, dtype=dtypes.float32 if out_float32 else w.dtype, device=x.device)
  args = [y, x.cast(w.dtype).contiguous(), w] + ([bias.cast(w.dtype)] if bias is not None else [])
  return run_kernel(plan.launch, source, args)[0]
