"""scatter_rows: the UOp-DSL row scatter (KV-cache writes, sampler penalty tensors), eager and under TinyJit."""
from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, dtypes

from tinyvllm.layers.scatter import scatter_rows, scatter_rows_


def _reference(dst: np.ndarray, index: np.ndarray, src: np.ndarray) -> np.ndarray:
  out = dst.copy()
  for n, row in enumerate(index):
    if 0 <= row < len(dst):
      out[row] = src[n]
  return out


@pytest.mark.parametrize("dtype, np_dtype", [(dtypes.float32, np.float32), (dtypes.float16, np.float16),
                                             (dtypes.int32, np.int32)])
def test_writes_rows_skips_negative(dtype, np_dtype):
  rng = np.random.default_rng(0)
  dst = (rng.standard_normal((10, 3, 4)) * 10).astype(np_dtype)
  index = np.array([7, -1, 0, 9, -1], np.int32)
  src = (rng.standard_normal((5, 3, 4)) * 10).astype(np_dtype)
  out = scatter_rows(Tensor(dst, dtype=dtype), Tensor(index), Tensor(src, dtype=dtype)).numpy()
  np.testing.assert_array_equal(out, _reference(dst, index, src))


def test_lazy_dst_and_result_used_afterwards():
  base = Tensor.arange(12, dtype=dtypes.float32).reshape(6, 2)
  out = scatter_rows(base + 1, Tensor([2, -1], dtype=dtypes.int32), Tensor([[-5.0, -6.0], [9.0, 9.0]]))
  total = (out * 2).sum()  # a consumer of the result must see the write
  expected = np.arange(12, dtype=np.float32).reshape(6, 2) + 1
  expected[2] = [-5, -6]
  assert total.item() == pytest.approx(2 * expected.sum())
  np.testing.assert_array_equal(out.numpy(), expected)


def test_out_of_range_rows_skipped():
  out = scatter_rows(Tensor.zeros(4, 2).contiguous(), Tensor([4, 100, 1], dtype=dtypes.int32), Tensor.ones(3, 2))
  np.testing.assert_array_equal(out.numpy(), [[0, 0], [1, 1], [0, 0], [0, 0]])


def test_shape_and_dtype_checked():
  with pytest.raises(ValueError):
    scatter_rows(Tensor.zeros(4, 2), Tensor([1], dtype=dtypes.int32), Tensor.ones(1, 3))
  with pytest.raises(ValueError):
    scatter_rows(Tensor.zeros(4, 2), Tensor([1], dtype=dtypes.int64), Tensor.ones(1, 2))
  with pytest.raises(ValueError):
    scatter_rows(Tensor.zeros(4, 2), Tensor([1], dtype=dtypes.int32), Tensor.ones(1, 2, dtype=dtypes.float16))


def _steps(seed: int, rows: int, n: int, d: int) -> list[tuple[np.ndarray, np.ndarray]]:
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(5):
    index = rng.permutation(rows)[:n].astype(np.int32)
    index[rng.random(n) < 0.3] = -1
    out.append((index, rng.standard_normal((n, d)).astype(np.float32)))
  return out


def test_jit_dst_as_input():
  @TinyJit
  def step(dst: Tensor, index: Tensor, src: Tensor) -> Tensor: return (scatter_rows(dst, index, src) + 0).realize()
  for index, src in _steps(1, 16, 4, 8):
    dst = np.random.default_rng(int(index[0]) + 5).standard_normal((16, 8)).astype(np.float32)
    out = step(Tensor(dst), Tensor(index), Tensor(src)).numpy()
    np.testing.assert_array_equal(out, _reference(dst, index, src))


def test_jit_in_place_persistent_cache():
  cache = Tensor.zeros(16, 8).contiguous().realize()
  expected = np.zeros((16, 8), np.float32)

  @TinyJit
  def step(index: Tensor, src: Tensor) -> Tensor:
    scatter_rows_(cache, index, src)
    return cache.sum(1).realize()  # read back through the updated cache tensor inside the same graph

  for index, src in _steps(2, 16, 4, 8):
    row_sums = step(Tensor(index), Tensor(src)).numpy()
    expected = _reference(expected, index, src)
    np.testing.assert_allclose(row_sums, expected.sum(1), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cache.numpy(), expected)


def test_chained_in_place_writes():
  cache = Tensor.zeros(6, 2).contiguous().realize()
  scatter_rows_(cache, Tensor([1], dtype=dtypes.int32), Tensor([[1.0, 1.0]]))
  scatter_rows_(cache, Tensor([2, 1], dtype=dtypes.int32), Tensor([[2.0, 2.0], [3.0, 3.0]]))  # second write wins
  np.testing.assert_array_equal(cache.numpy(), [[0, 0], [3, 3], [2, 2], [0, 0], [0, 0], [0, 0]])
