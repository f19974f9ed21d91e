"""The attention-backend interface the model calls: attention over the paged cache and the KV write."""
from __future__ import annotations

from typing import Protocol

from tinygrad import Tensor

from tinyvllm.layers.attention import AttentionMetadata


class AttentionBackend(Protocol):
  name: str          # "portable", "cuda" or "metal"

  def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> Tensor:
    """q [N, heads, head_dim] (rotated); the caches already hold this step's K/V. Returns [N, heads * head_dim]."""
    ...

  def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """Write the new tokens' K/V ([N, kv_heads, head_dim]) to their slots (-1: skip); returns the caches after it."""
    ...

  def linear(self, x: Tensor, w: Tensor, bias: Tensor | None = None, **fused) -> Tensor:
    """[residual +] op(x) @ w.T [+ bias] with op an RMSNorm, the SwiGLU product or nothing (see layers/linear.py)."""
    ...

  def describe(self) -> str:
    """One line for the start-up log."""
    ...
