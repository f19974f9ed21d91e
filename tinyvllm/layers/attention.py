"""Paged attention, the portable way: tinygrad tensor ops that read K/V through block tables.

The batch is flat: N new tokens from S sequences. For attention the queries are laid out as [S, Tq] (Tq = the longest
query run in the batch, 1 for pure decode); each sequence's keys are gathered from the cache through its block table
up to a static length L (a multiple of the block size, at least every context in the batch). A key j is visible to a
query at position p iff j <= p, which is the causal mask and also hides whatever lies past the context.

This path runs on every backend and is the reference the hand-written kernels are checked against.
"""
from __future__ import annotations

import math

from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

from tinyvllm.backend.metadata import AttentionMetadata
from tinyvllm.layers.fp8 import decode_e4m3, encode_e4m3, is_fp8
from tinyvllm.layers.scatter import gather_rows, scatter_rows


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
  """Scatter the new tokens' K/V ([N, kv_heads, head_dim]) into the [slots, kv_heads * head_dim] caches (as FP8 codes
  into uint8 caches; k and v are in the activations' dtype, so FP8 rounds that, as the kernels do)."""
  n = k.shape[0]
  k_rows, v_rows = (_to_cache(x.reshape(n, -1), c) for x, c in ((k, k_cache), (v, v_cache)))
  return scatter_rows(k_cache, slot_mapping, k_rows), scatter_rows(v_cache, slot_mapping, v_rows)


def _to_cache(rows: Tensor, cache: Tensor) -> Tensor: return encode_e4m3(rows) if is_fp8(cache) else rows.cast(cache.dtype)


def context_slots(meta: AttentionMetadata) -> Tensor:
  """[S, L] int32: the cache slot of each sequence's first L tokens (block table entry * block_size + offset)."""
  s, max_blocks = meta.block_tables.shape
  bs = meta.block_size
  blocks = meta.block_tables.unsqueeze(-1).expand(s, max_blocks, bs).reshape(s, max_blocks * bs)[:, :meta.context_len]
  offsets = Tensor.arange(bs, dtype=dtypes.int32).reshape(1, 1, bs).expand(1, max_blocks, bs).reshape(1, -1)
  return blocks * bs + offsets[:, :meta.context_len]


def gather_context(cache: Tensor, slots: Tensor, kv_heads: int, head_dim: int, dtype: DType) -> Tensor:
  """[S, kv_heads, L, head_dim] in `dtype` (the cache's, or the activations' for FP8 codes): each sequence's first L
  cached tokens, read through its block table."""
  s, length = slots.shape
  rows = gather_rows(cache, slots)
  if is_fp8(cache): rows = decode_e4m3(rows, dtype)
  return rows.reshape(s, length, kv_heads, head_dim).permute(0, 2, 1, 3)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> Tensor:
  """q: [N, heads, head_dim] (already rotated); the caches already hold this step's K/V. Returns [N, heads * head_dim]."""
  _, heads, head_dim = q.shape
  kv_heads = k_cache.shape[1] // head_dim
  group = heads // kv_heads
  s, tq = meta.query_index.shape
  qp = gather_rows(q.reshape(q.shape[0], heads * head_dim), meta.query_index)
  qp = qp.reshape(s, tq, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(s, kv_heads, group * tq, head_dim)
  slots = context_slots(meta)
  keys, values = (gather_context(c, slots, kv_heads, head_dim, q.dtype if is_fp8(c) else c.dtype) for c in (k_cache, v_cache))
  scores = qp.matmul(keys.transpose(-1, -2), dtype=dtypes.float32) * (1.0 / math.sqrt(head_dim))  # [S, KVH, G*Tq, L]
  visible = Tensor.arange(meta.context_len, dtype=dtypes.int32).reshape(1, 1, -1) <= meta.query_pos.unsqueeze(-1)
  visible = visible.unsqueeze(1).expand(s, group, tq, meta.context_len).reshape(s, 1, group * tq, meta.context_len)
  # computed once: fused into the product with the values, tinygrad would recompute every exp for each head dimension
  # (on the CPU, 0.4 ms of a 0.5 ms attention layer in stories260K's 8-row decode step)
  probs = scores.masked_fill(visible.logical_not(), float("-inf")).softmax(-1).cast(values.dtype).contiguous()
  out = (probs @ values).reshape(s, kv_heads, group, tq, head_dim).permute(0, 3, 1, 2, 4)      # [S, Tq, KVH, G, D]
  return gather_rows(out.reshape(s * tq, heads * head_dim), meta.output_index)
