"""The k largest values of each row and their column ids, without a sort.

tinygrad's `topk` sorts (a bitonic network: about forty kernels for a row of 128); here each row's elements are
ranked by a uint64 key (the value's order key, then the lower id first) and round r takes the largest key below round
r-1's: k max-reductions over the rows, always k distinct ids (ties, -inf included). The sampler's top logprobs and
the mixture-of-experts router use it.
"""
from __future__ import annotations

from tinygrad import Tensor, dtypes

_U32 = 0xFFFFFFFF


def order_key(x: Tensor) -> Tensor:
  """float32 -> uint32 whose unsigned order is the float order (-inf lowest)."""
  bits = x.bitcast(dtypes.uint32)
  return (bits >= 0x80000000).where(bits ^ _U32, bits | 0x80000000)


def from_order_key(key: Tensor) -> Tensor:
  return (key >= 0x80000000).where(key ^ 0x80000000, key ^ _U32).bitcast(dtypes.float32)


def top_k(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
  """x [B, V] float32 -> (values [B, k] float32, ids [B, k] int32), largest first, the lower id first among equals."""
  b, v = x.shape
  if k == 0: return Tensor.zeros(b, 0), Tensor.zeros(b, 0, dtype=dtypes.int32)
  low = (_U32 - Tensor.arange(v, dtype=dtypes.uint32)[None, :]).cast(dtypes.uint64)   # lower id ranks higher on ties
  rank = (order_key(x.float()).cast(dtypes.uint64) * (1 << 32) + low).contiguous()
  best = rank.max(1)
  keys = [best]
  for _ in range(k - 1):
    best = (rank < best[:, None]).where(rank, 0).max(1)
    keys.append(best)
  key = Tensor.stack(*keys, dim=1)
  return from_order_key((key // (1 << 32)).cast(dtypes.uint32)), (_U32 - (key & _U32)).cast(dtypes.int32)
