"""Skinny matrix products for decode batches through kernels/linear.inc (CUDA/Metal), with the neighbouring small ops
fused in: y = [residual +] (norm(x) | silu(x1) * x2 | x) @ w.T [+ bias].

tinygrad's generated kernels for a few-row product over a large bf16 weight run far from memory bandwidth without a
beam search, and a decode step is little else; this kernel streams each weight row once with 16-byte loads, and folds
the RMSNorm before it, the SwiGLU product and the residual add into its loads and stores. It takes up to MAX_ROWS rows
(the batch's tokens); larger products (prefill, big batches) stay with tinygrad's matmul.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tinygrad import Tensor, dtypes

from tinyvllm.kernels.plan import DTYPE_CODES, ELEM_BYTES, Launch, Param, dtype_code
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import run_kernel

MAX_ROWS = 16
THREADS = 128
DTYPE_NAMES = {dtypes.float32: "float32", dtypes.float16: "float16", dtypes.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class LinearShape:
  dtype: str
  rows: int          # M: tokens in the batch (static, padded)
  in_features: int   # K (x has 2K columns with silu_mul)
  out_features: int  # NOUT
  bias: bool
  norm_eps: float | None   # RMSNorm of x (weight g) before the product
  silu_mul: bool
  residual: bool
  out_float32: bool  # y in float32 (the logits) instead of the input dtype


@dataclass(frozen=True)
class LinearPlan:
  shape: LinearShape
  defines: dict[str, int | str] = field(compare=False)
  launch: Launch = field(compare=False)


def unsupported_reason(shape: LinearShape) -> str | None:
  if shape.dtype not in DTYPE_CODES: return f"dtype {shape.dtype}"
  if not 1 <= shape.rows <= MAX_ROWS: return f"{shape.rows} rows (the kernel takes 1 to {MAX_ROWS})"
  vec = 16 // ELEM_BYTES[dtype_code(shape.dtype)]
  if shape.in_features % vec: return f"in_features {shape.in_features} not a multiple of {vec}"
  if shape.norm_eps is not None and shape.silu_mul: return "norm and silu_mul together"
  return None


def linear_plan(shape: LinearShape) -> LinearPlan:
  # weight rows per warp: each 16-byte w load is matched by rows/rpw x loads (from cache), so more rows want a larger
  # rpw; 4 keeps 16 rows at ~170 registers without spills (nvcc -Xptxas -v, sm_90)
  rpw = 2 if shape.rows <= 2 else 4
  blocks = -(-shape.out_features // (rpw * (THREADS // 32)))
  m, k, o = shape.rows, shape.in_features, shape.out_features
  params = [Param("y", "float" if shape.out_float32 else "elem", True, m * o),
            Param("x", "elem", False, m * k * (2 if shape.silu_mul else 1)), Param("w", "elem", False, o * k)]
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_M": m, "TV_K": k, "TV_NOUT": o, "TV_RPW": rpw,
                                   "TV_NT": THREADS}
  for flag, name, numel in (("TV_BIAS", "bias", o), ("TV_PRO_NORM", "g", k), ("TV_RESIDUAL", "residual", m * o)):
    wanted = {"TV_BIAS": shape.bias, "TV_PRO_NORM": shape.norm_eps is not None, "TV_RESIDUAL": shape.residual}[flag]
    if wanted:
      defines[flag] = len(params)   # the argument's buffer index
      params.append(Param(name, "elem", False, numel))
  if shape.norm_eps is not None: defines["TV_EPS"] = f"{shape.norm_eps!r}f"
  if shape.silu_mul: defines["TV_PRO_SILU"] = 1
  if shape.out_float32: defines["TV_OUT_F32"] = 1
  return LinearPlan(shape, defines, Launch("tv_linear", (blocks, 1, 1), THREADS, tuple(params)))


@functools.cache
def _compiled(dialect: str, shape: LinearShape) -> tuple[LinearPlan, str]:
  plan = linear_plan(shape)
  return plan, kernel_source(dialect, "linear", plan.defines)


def fused_linear(dialect: str, x: Tensor, w: Tensor, bias: Tensor | None = None, norm: Tensor | None = None,
                 eps: float = 1e-6, silu_mul: bool = False, residual: Tensor | None = None,
                 out_float32: bool = False) -> Tensor | None:
  """The kernel's result, or None when the shape is not one it takes (the caller then uses tinygrad ops)."""
  dtype = DTYPE_NAMES.get(w.dtype)
  if dtype is None or x.ndim != 2: return None
  k = x.shape[1] // 2 if silu_mul else x.shape[1]
  shape = LinearShape(dtype, x.shape[0], k, w.shape[0], bias is not None, eps if norm is not None else None, silu_mul,
                      residual is not None, out_float32)
  if w.shape[1] != k or unsupported_reason(shape) is not None: return None
  plan, source = _compiled(dialect, shape)
  y = Tensor.empty(shape.rows, shape.out_features, dtype=dtypes.float32 if out_float32 else w.dtype, device=x.device)
  extras = [t.cast(w.dtype).contiguous() for t in (bias, norm, residual) if t is not None]
  return run_kernel(plan.launch, source, [y, x.cast(w.dtype).contiguous(), w, *extras])[0]
