"""KV storage: per layer, K and V in realized tensors of [num_blocks * block_size, kv_heads * head_dim], allocated once.

A slot is block * block_size + offset. The contiguous baseline uses the same storage with one max_model_len "block"
per sequence, so both cache kinds share the write kernel and the attention code.
"""
from __future__ import annotations

import numpy as np
from tinygrad import Tensor
from tinygrad.dtype import DType

from tinyvllm.config import ModelConfig
from tinyvllm.layers.scatter import scatter_rows


class KVCache:
  def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: DType, device: str):
    self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
    slots = num_blocks * block_size
    self.layers: list[tuple[Tensor, Tensor]] = [
      tuple(Tensor.zeros(slots, config.kv_size, dtype=dtype, device=device).contiguous().realize() for _ in range(2))
      for _ in range(config.num_layers)]

  @staticmethod
  def bytes_per_token(config: ModelConfig, dtype: DType) -> int: return 2 * config.num_layers * config.kv_size * dtype.itemsize

  @property
  def nbytes(self) -> int: return sum(t.nbytes() for pair in self.layers for t in pair)

  def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks (source -> destination) in every layer: copy-on-write and forks of contiguous rows."""
    offsets = np.arange(self.block_size, dtype=np.int32)
    src = Tensor(np.concatenate([s * self.block_size + offsets for s, _ in copies]).astype(np.int32))
    dst = Tensor(np.concatenate([d * self.block_size + offsets for _, d in copies]).astype(np.int32))
    written = []
    for k, v in self.layers: written += [scatter_rows(k, dst, k[src].contiguous()), scatter_rows(v, dst, v[src].contiguous())]
    Tensor.realize(*written)
