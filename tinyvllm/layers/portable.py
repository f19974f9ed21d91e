"""The portable backend: tinygrad tensor ops on every device. It is the reference the hand-written kernels are checked
against, and what they hand a call to where a step's shape is outside their range."""
from __future__ import annotations

from tinygrad import Tensor

from tinyvllm.backend.interface import BackendCapabilities, Collectives, KVCaches
from tinyvllm.backend.metadata import AttentionMetadata
from tinyvllm.backend.weights import DecoderLayerWeights, MoEWeights, Weight
from tinyvllm.layers.attention import paged_attention, write_kv
from tinyvllm.layers.linear import portable_linear
from tinyvllm.layers.moe import portable_moe
from tinyvllm.layers.norm import rms_norm
from tinyvllm.layers.rotary import apply_rope
from tinyvllm.layers.sampler import sample_packed
from tinyvllm.layers.tensor_parallel import TensorParallelGroup

CAPABILITIES = BackendCapabilities(dtypes=("float32", "float16", "bfloat16"),
                                   fp8_kv_cache_dtypes=("float32", "float16", "bfloat16"), head_sizes=None,
                                   activations=("silu", "gelu_pytorch_tanh"))


def split_qkv_rope(qkv: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, cos: Tensor, sin: Tensor, num_kv_heads: int,
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
  """qkv [N, (H + 2 * KVH) * D] -> q [N, H, D], k, v [N, KVH, D]: q and k per-head RMS-normed (when both weights are
  given: Qwen3's QK-norm) and rotated (HF's rotate-half RoPE; cos/sin [N, D / 2] float32, gathered per position)."""
  n, head_dim = qkv.shape[0], 2 * cos.shape[1]
  kv_size = num_kv_heads * head_dim
  q_size = qkv.shape[1] - 2 * kv_size
  q = qkv[:, :q_size].reshape(n, q_size // head_dim, head_dim)
  k = qkv[:, q_size:q_size + kv_size].reshape(n, num_kv_heads, head_dim)
  v = qkv[:, q_size + kv_size:].reshape(n, num_kv_heads, head_dim)
  if q_norm is not None and k_norm is not None: q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
  return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def qkv_rope_write(qkv: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, cos: Tensor, sin: Tensor, k_cache: Tensor,
                   v_cache: Tensor, slot_mapping: Tensor, eps: float, write=write_kv) -> tuple[Tensor, Tensor, Tensor]:
  """split_qkv_rope, then K/V to the caches [slots, KVH * D] at slot_mapping (-1: skip) with `write` (a KV write of
  the write_kv signature). Returns q [N, H, D] and the caches after the write."""
  q, k, v = split_qkv_rope(qkv, q_norm, k_norm, cos, sin, k_cache.shape[1] // (2 * cos.shape[1]), eps)
  k_cache, v_cache = write(k_cache, v_cache, k, v, slot_mapping)
  return q, k_cache, v_cache


class PortableBackend:
  name = "portable"
  capabilities = CAPABILITIES
  min_context_bucket = 16    # it gathers L keys per sequence: the tightest power of two
  pads_prefill_rows = False  # it computes every padded row
  splits_query_runs = True   # ... and every padded query: decode rows beside a prompt chunk would pad to its length
  min_prompt_tokens = 1
  coarse_query_runs = False
  decode_verify_tokens = 0   # (its split query runs already fit a verification's tokens)
  builds_kernels = False

  def __init__(self, reason: str = ""):
    self.reason = reason

  def describe(self) -> str: return "portable (tinygrad ops)" + (f": {self.reason}" if self.reason else "")

  def linear(self, x: Tensor, w: Weight, bias: Tensor | None = None, **fused) -> Tensor: return portable_linear(x, w, bias, **fused)

  def row_parallel_linear(self, x: Tensor, w: Weight, collectives: Collectives, *, residual: Tensor, **fused) -> Tensor:
    return collectives.all_reduce(self.linear(x, w, **fused), residual)

  def collectives_for(self, group: TensorParallelGroup) -> TensorParallelGroup: return group

  def moe(self, x: Tensor, moe: MoEWeights, *, norm: Tensor, eps: float, residual: Tensor) -> Tensor:
    return portable_moe(x, moe, norm=norm, eps=eps, residual=residual)

  def qkv_rope_write(self, qkv: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, cos: Tensor, sin: Tensor, k_cache: Tensor,
                     v_cache: Tensor, slot_mapping: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return qkv_rope_write(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, eps)

  def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    return write_kv(k_cache, v_cache, k, v, slot_mapping)

  def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> Tensor:
    return paged_attention(q, k_cache, v_cache, meta)

  def decode_layers(self, layers: list[DecoderLayerWeights], h: Tensor, cos: Tensor, sin: Tensor, kv_caches: KVCaches,
                    meta: AttentionMetadata, eps: float) -> tuple[Tensor, KVCaches] | None:
    return None   # no fused layers: the model runs each layer op by op

  def sample(self, logits: Tensor, params_bits: Tensor, rng_bits: Tensor, variant, penalties=None) -> Tensor:
    return sample_packed(logits, params_bits, rng_bits, variant, penalties)
