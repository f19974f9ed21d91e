"""Indexed row movement as tinygrad UOp-DSL kernels: scatter dst[index[n]] := src[n], gather out[m] := src[index[m]]
(and of columns, out[:, n] := src[:, index[n]]).

tinygrad 0.14's `setitem` with an index tensor, `Tensor.scatter`, one-hot tricks and even plain `table[index_tensor]`
compare every table row with every index (O(R * N * D): an embedding lookup would read the whole table, a KV-cache
read the whole cache); these kernels touch only the rows named (O(N * D)). Scatter is the KV-cache write (slot
mapping) and builds the sampler's dense penalty tensors; gather is the embedding lookup, the RoPE table lookup and
the portable attention's reads through block tables; the column gather puts a product's input in an act-order weight's
column order. Generic over dtype and row shape; they render on every backend.
"""
from __future__ import annotations

import math

from tinygrad import Tensor, UOp, dtypes

from tinyvllm.platform.tinygrad_compat import KernelInfo, Ops

# flat offsets at or above this need 64-bit index math (row * D overflows int32)
INT32_LIMIT = 2**31


def _flat(p: UOp) -> UOp:
  # custom_kernel placeholders are a flat PARAM reshaped to the tensor's shape; indexing the flat PARAM directly keeps
  # tinygrad from wrapping a data-dependent row index in a `% size` (it cannot bound a loaded int32)
  return p.src[0] if p.op is Ops.RESHAPE else p


def _scatter_kernel(dst: UOp, index: UOp, src: UOp) -> UOp:
  rows, n_src = dst.shape[0], index.shape[0]
  d = math.prod(dst.shape[1:])
  n, j = UOp.range(n_src, 0), UOp.range(d, 1)
  row = _flat(index).index(n)
  if rows * d >= INT32_LIMIT:
    row = row.cast(dtypes.int64)
  ok = (row >= 0) & (row < rows)  # out-of-range rows are skipped too: a bad slot must not write outside the buffer
  store = _flat(dst).index((row * d + j).valid(ok)).store(_flat(src).index(n * d + j))
  name = f"scatter_rows_{rows}_{n_src}_{d}_{dst.dtype.name}"
  return store.end(n, j).sink(arg=KernelInfo(name=name))


def _check(dst: Tensor, index: Tensor, src: Tensor) -> None:
  if index.ndim != 1 or index.dtype != dtypes.int32:
    raise ValueError(f"index must be 1-D int32, got {index.shape} {index.dtype}")
  if src.shape != (index.shape[0], *dst.shape[1:]):
    raise ValueError(f"src shape {src.shape} != (len(index), *dst.shape[1:]) = {(index.shape[0], *dst.shape[1:])}")
  if src.dtype != dst.dtype:
    raise ValueError(f"src dtype {src.dtype} != dst dtype {dst.dtype}")


def scatter_rows(dst: Tensor, index: Tensor, src: Tensor) -> Tensor:
  """Return dst after writing row index[n] := src[n] (dst [R, ...], index [N] int32, src [N, ...]).

  Rows with index < 0 (or >= R) are skipped; indices must be unique. The write happens in dst's buffer when dst is
  realized; read the result through the returned tensor (or use `scatter_rows_`), never through the old `dst` tensor,
  else tinygrad has no edge ordering the read after the kernel (and may never run it).
  """
  _check(dst, index, src)
  if index.shape[0] == 0:
    return dst
  # the kernel writes into dst's buffer: a buffer (or an already written one) is used in place, anything else (lazy,
  # a view) is copied into a new buffer first; `contiguous()` is not enough, it is a no-op on device-less consts
  if not dst.uop.has_buffer_identity(after_ok=True):
    dst = dst.clone()
  return Tensor.custom_kernel(dst, index, src, fxn=_scatter_kernel)[0]


def scatter_rows_(dst: Tensor, index: Tensor, src: Tensor) -> Tensor:
  """In-place `scatter_rows`: afterwards `dst` itself is the written tensor (like `Tensor.assign`), e.g. a KV cache."""
  return dst.replace(scatter_rows(dst, index, src))


def _gather_kernel(out: UOp, src: UOp, index: UOp) -> UOp:
  rows, n_out = src.shape[0], index.shape[0]
  d = math.prod(src.shape[1:])
  m, j = UOp.range(n_out, 0), UOp.range(d, 1)
  row = _flat(index).index(m)
  if rows * d >= INT32_LIMIT: row = row.cast(dtypes.int64)
  ok = (row >= 0) & (row < rows)  # an out-of-range index reads zeros, never outside the buffer
  store = _flat(out).index(m * d + j).store(_flat(src).index((row * d + j).valid(ok)))
  name = f"gather_rows_{rows}_{n_out}_{d}_{src.dtype.name}"
  return store.end(m, j).sink(arg=KernelInfo(name=name))


def gather_rows(src: Tensor, index: Tensor) -> Tensor:
  """out[m] = src[index[m]] for src [R, ...] and int32 index of any shape: the result has shape index.shape + src.shape[1:].

  Rows outside [0, R) read as zeros."""
  if index.dtype != dtypes.int32: raise ValueError(f"index must be int32, got {index.dtype}")
  flat = index.reshape(-1)
  out = Tensor.empty(flat.shape[0], *src.shape[1:], dtype=src.dtype, device=src.device)
  out = Tensor.custom_kernel(out, src, flat, fxn=_gather_kernel)[0]
  return out.reshape(*index.shape, *src.shape[1:])


def _gather_columns_kernel(out: UOp, src: UOp, index: UOp) -> UOp:
  rows, cols, n_out = src.shape[0], src.shape[1], index.shape[0]
  m, n = UOp.range(rows, 0), UOp.range(n_out, 1)
  col = _flat(index).index(n)
  ok = (col >= 0) & (col < cols)  # an out-of-range index reads zeros, never outside the buffer
  store = _flat(out).index(m * n_out + n).store(_flat(src).index((m * cols + col).valid(ok)))
  return store.end(m, n).sink(arg=KernelInfo(name=f"gather_columns_{rows}_{cols}_{n_out}_{src.dtype.name}"))


def gather_columns(src: Tensor, index: Tensor) -> Tensor:
  """out[:, n] = src[:, index[n]] for src [M, K] and int32 index [N]: [M, N]. Columns outside [0, K) read as zeros."""
  if index.ndim != 1 or index.dtype != dtypes.int32: raise ValueError(f"index must be 1-D int32, got {index.shape} {index.dtype}")
  if src.ndim != 2: raise ValueError(f"src must be 2-D, got {src.shape}")
  if src.shape[0] * src.shape[1] >= INT32_LIMIT: raise ValueError(f"src {src.shape} needs 64-bit offsets")
  out = Tensor.empty(src.shape[0], index.shape[0], dtype=src.dtype, device=src.device)
  return Tensor.custom_kernel(out, src.contiguous(), index, fxn=_gather_columns_kernel)[0]
