"""Row scatter as a tinygrad UOp-DSL kernel: dst[index[n]] := src[n] for every n with index[n] >= 0.

tinygrad 0.14's `setitem` with an index tensor, `Tensor.scatter` and one-hot tricks compare every destination row
with every index (O(R * N * D)); this kernel touches only the N written rows (O(N * D)). It is the KV-cache write
(slot mapping) and builds the sampler's dense penalty tensors. Generic over dtype and row shape; renders on every
backend.
"""
from __future__ import annotations

import math

from tinygrad import Tensor, UOp, dtypes
from tinygrad.uop.ops import KernelInfo, Ops

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
  return store.end(n, j).sink(arg=KernelInfo(name=name, opts_to_apply=()))


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
