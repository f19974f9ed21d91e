"""KV storage: per layer, K and V in realized tensors of [num_blocks * block_size, kv_heads * head_dim], allocated once.

A slot is block * block_size + offset. The contiguous baseline uses the same storage with one max_model_len "block"
per sequence, so both cache kinds share the write kernel and the attention code.

The swap space (--preemption-mode swap) is host memory of the same layout, every layer's K and V of each of its
blocks held as the cache's raw bits (numpy has no bfloat16; the FP8 cache's codes are bytes already). Blocks move
between the two in one batched copy each way: a gather of every layer's rows and one download, or one upload and a
scatter into every layer. The block count is padded to a power of two (padding rows read as zeros and are never
written), so that a few kernel shapes serve every swap.
"""
from __future__ import annotations

import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

from tinyvllm.layers.scatter import gather_rows, scatter_rows
from tinyvllm.model_config import ModelConfig
from tinyvllm.worker.input_batch import bucket

RAW_BITS = {1: dtypes.uint8, 2: dtypes.uint16, 4: dtypes.uint32}   # itemsize -> the unsigned type holding its bits
NUMPY_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


class KVCache:
  def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: DType, device: str, num_swap_blocks: int = 0):
    self.num_blocks, self.block_size, self.dtype, self.device = num_blocks, block_size, dtype, device
    slots = num_blocks * block_size
    self.layers: list[tuple[Tensor, Tensor]] = [
      tuple(Tensor.zeros(slots, config.kv_size, dtype=dtype, device=device).contiguous().realize() for _ in range(2))
      for _ in range(config.num_layers)]
    # zero pages are mapped on first touch, so an unused swap space costs no memory
    self.swap = np.zeros((2 * config.num_layers, num_swap_blocks * block_size, config.kv_size), NUMPY_BITS[dtype.itemsize])

  @staticmethod
  def bytes_per_token(config: ModelConfig, dtype: DType) -> int: return 2 * config.num_layers * config.kv_size * dtype.itemsize

  @property
  def nbytes(self) -> int: return sum(t.nbytes() for pair in self.layers for t in pair)

  def _slots(self, blocks: tuple[int, ...] | list[int]) -> np.ndarray:
    return (np.asarray(blocks, dtype=np.int32)[:, None] * self.block_size + np.arange(self.block_size, dtype=np.int32)).reshape(-1)

  def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks (source -> destination) in every layer: copy-on-write and forks of contiguous rows."""
    offsets = np.arange(self.block_size, dtype=np.int32)
    src = Tensor(np.concatenate([s * self.block_size + offsets for s, _ in copies]).astype(np.int32))
    dst = Tensor(np.concatenate([d * self.block_size + offsets for _, d in copies]).astype(np.int32))
    written = []
    for k, v in self.layers: written += [scatter_rows(k, dst, k[src].contiguous()), scatter_rows(v, dst, v[src].contiguous())]
    Tensor.realize(*written)

  def _device_slots(self, blocks: tuple[int, ...]) -> Tensor:
    """The blocks' slots on the device, padded with -1 to a power-of-two block count."""
    slots = self._slots(blocks)
    return Tensor(np.pad(slots, (0, bucket(len(blocks)) * self.block_size - len(slots)), constant_values=-1), device=self.device)

  def swap_out(self, pairs: list[tuple[int, int]]) -> None:
    """Copy device blocks into swap-space blocks ((device, swap) pairs): every layer's rows gathered, one download."""
    device, swap = zip(*pairs, strict=True)
    index, slots = self._device_slots(device), self._slots(swap)
    rows = Tensor.stack(*[gather_rows(cache, index) for pair in self.layers for cache in pair])
    self.swap[:, slots] = rows.bitcast(RAW_BITS[self.dtype.itemsize]).numpy()[:, :len(slots)]

  def swap_in(self, pairs: list[tuple[int, int]]) -> None:
    """Copy swap-space blocks into device blocks ((swap, device) pairs): one upload, a scatter into every layer."""
    swap, device = zip(*pairs, strict=True)
    index, slots = self._device_slots(device), self._slots(swap)
    host = np.zeros((self.swap.shape[0], index.shape[0], self.swap.shape[2]), self.swap.dtype)
    host[:, :len(slots)] = self.swap[:, slots]
    rows = Tensor(host, device=self.device).bitcast(self.dtype)
    caches = [cache for pair in self.layers for cache in pair]
    Tensor.realize(*[scatter_rows(cache, index, rows[i].contiguous()) for i, cache in enumerate(caches)])
