"""The attention-backend interface the model calls: attention over the paged cache and the KV write."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tinygrad import Tensor

from tinyvllm.layers.attention import AttentionMetadata
from tinyvllm.layers.sampler import SamplerVariant


class AttentionBackend(Protocol):
  name: str          # "portable", "cuda" or "metal"
  min_context_bucket: int    # the smallest context bucket L its steps may use
  pads_prefill_rows: bool    # whether steps with prompt chunks may be padded to max_num_seqs sequences
  builds_kernels: bool       # whether a new step layout compiles hand-written kernel sources

  def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> Tensor:
    """q [N, heads, head_dim] (rotated); the caches already hold this step's K/V. Returns [N, heads * head_dim]."""
    ...

  def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """Write the new tokens' K/V ([N, kv_heads, head_dim]) to their slots (-1: skip); returns the caches after it."""
    ...

  def qkv_rope_write(self, qkv: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, cos: Tensor, sin: Tensor, k_cache: Tensor,
                     v_cache: Tensor, slot_mapping: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """qkv [N, (heads + 2 * kv_heads) * head_dim] -> q [N, heads, head_dim], per-head RMS-normed (q_norm/k_norm [head_dim],
    or None: no norm) and rotated (cos/sin [N, head_dim / 2] float32, per token); K (normed, rotated) and V written to
    the caches at slot_mapping (-1: skip). Returns q and the caches after the write."""
    ...

  def linear(self, x: Tensor, w: Tensor, bias: Tensor | None = None, **fused) -> Tensor:
    """[residual +] op(x) @ w.T [+ bias] with op an RMSNorm, the SwiGLU product or nothing (see layers/linear.py)."""
    ...

  def sample(self, logits: Tensor, params_bits: Tensor, rng_bits: Tensor, variant: SamplerVariant,
             penalties: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """One token id per row ([B] int32) from logits [B, V]: layers/sampler.py's `sample_packed` contract (params and
    rng as the int32 bits of the step's packed input)."""
    ...

  # a small decode step's layers in persistent kernels ((layers, h, cos, sin, kv_caches, metadata, eps) -> (h, kv_caches),
  # or None where it does not take the step; see model/llama.py's DecodeLayersFn); None: the backend has none
  decode_layers: Callable[..., tuple[Tensor, list[tuple[Tensor, Tensor]]] | None] | None

  def describe(self) -> str:
    """One line for the start-up log."""
    ...
