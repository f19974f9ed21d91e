"""The ops a compute backend provides to the model and the runner, and the capability record it declares.

A backend is chosen once, at engine start (tinyvllm/kernels/selection.py), and checked against the model and the
engine settings through its `capabilities`, as vLLM's attention backends declare theirs; the model is then built with
it. Within what a backend declares, an op may still hand an individual call to the portable op where a step's shape
is outside a kernel's range (a hand-written product takes up to a few rows, say); it says so once in the log.

Two backends exist: `PortableBackend` (tinygrad ops on every device, tinyvllm/layers/portable.py: the reference) and
`FusedBackend` (hand-written CUDA/Metal kernels, tinyvllm/kernels/fused.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tinygrad import Tensor

from tinyvllm.backend.metadata import AttentionMetadata
from tinyvllm.backend.sampling import SamplerVariant
from tinyvllm.backend.weights import DecoderLayerWeights, MoEWeights, Weight

KVCaches = list[tuple[Tensor, Tensor]]   # per layer: K and V caches [slots, kv_heads * head_dim]
FP8_KV_CACHE = "fp8_e4m3"                # the FP8 KV cache's storage, as a capability name


@dataclass(frozen=True)
class BackendCapabilities:
  """What a backend takes, checked once against the model and the engine settings."""
  dtypes: tuple[str, ...]                     # activation and weight dtypes
  fp8_kv_cache_dtypes: tuple[str, ...]        # activation dtypes with which it takes an FP8 E4M3 KV cache
  head_sizes: tuple[int, ...] | None          # None: any
  block_sizes: tuple[int, ...] | None = None  # None: any power of two
  quantization: tuple[str, ...] = ()          # weight quantization formats it runs (none yet)
  activations: tuple[str, ...] = ("silu",)    # the MLP's gated activations (HF's hidden_act names) its products fuse

  def unsupported_reason(self, dtype: str, kv_cache_dtype: str, head_size: int, block_size: int, activation: str = "silu",
                         quantization: str | None = None) -> str | None:
    """Why the backend cannot run this configuration (None: it can). kv_cache_dtype: "auto" or FP8_KV_CACHE."""
    if dtype not in self.dtypes: return f"dtype {dtype} (it takes {', '.join(self.dtypes)})"
    if activation not in self.activations:
      return f"the MLP activation {activation} (its fused products do {', '.join(self.activations)})"
    if kv_cache_dtype == FP8_KV_CACHE and dtype not in self.fp8_kv_cache_dtypes:
      return f"an FP8 KV cache with {dtype} activations (it takes one with {', '.join(self.fp8_kv_cache_dtypes) or 'none'})"
    if self.head_sizes is not None and head_size not in self.head_sizes:
      return f"head size {head_size} (it takes {', '.join(map(str, self.head_sizes))})"
    if self.block_sizes is not None and block_size not in self.block_sizes:
      return f"block size {block_size} (it takes {', '.join(map(str, self.block_sizes))})"
    if quantization is not None and quantization not in self.quantization:
      return f"quantization {quantization} (it runs {', '.join(self.quantization) or 'none'})"
    return None


class Collectives(Protocol):
  """How a tensor-parallel group's devices meet: portable (TensorParallelGroup, tinyvllm/layers/tensor_parallel.py)
  or in a backend's kernels."""

  def all_reduce(self, partial: Tensor, residual: Tensor | None = None) -> Tensor:
    """[residual +] the sum over the devices of a local view's per-device values, on every device."""
    ...

  def gather_columns(self, local: Tensor) -> Tensor:
    """A local view's shards side by side along its last axis, on the group's first device."""
    ...

  def broadcast(self, t: Tensor) -> Tensor:
    """t (on the group's first device, or already on all) on every device: a step's inputs."""
    ...


class DeviceGroup(Collectives, Protocol):
  """What a backend needs of a tensor-parallel group: its devices and the portable collectives."""
  devices: tuple[str, ...]


class ComputeBackend(Protocol):
  name: str                   # "portable", "cuda" or "metal"
  capabilities: BackendCapabilities
  min_context_bucket: int     # the smallest context bucket L its steps may use
  pads_prefill_rows: bool     # whether steps with prompt chunks may be padded to max_num_seqs sequences
  splits_query_runs: bool     # whether a sequence's new tokens may span query rows (padded queries cost as much as real ones)
  min_prompt_tokens: int      # the fewest token rows of a step with prompt chunks (padding rows cost it little)
  coarse_query_runs: bool     # whether prompt steps' query runs may round up to powers of four (it skips padded queries)
  decode_verify_tokens: int   # a verification of proposals of up to this many tokens runs laid out as decode rows (0: none)
  builds_kernels: bool        # whether a new step layout compiles hand-written kernel sources

  def describe(self) -> str:
    """One line for the start-up log."""
    ...

  def linear(self, x: Tensor, w: Weight, bias: Tensor | None = None, *, norm: Tensor | None = None, eps: float = 1e-6,
             silu_mul: bool = False, gelu_mul: bool = False, residual: Tensor | None = None, out_float32: bool = False) -> Tensor:
    """[residual +] op(x) @ w.T [+ bias], op an RMSNorm (norm weights), the SwiGLU product silu(x1) * x2 of x's two
    halves (silu_mul), the GeGLU product gelu_tanh(x1) * x2 (gelu_mul; only where `capabilities.activations` has
    gelu_pytorch_tanh) or nothing; float32 out with out_float32 (the logits), else w's dtype."""
    ...

  def row_parallel_linear(self, x: Tensor, w: Weight, collectives: Collectives, *, residual: Tensor, **fused) -> Tensor:
    """Tensor parallelism's row-parallel product (o, down): residual + the all-reduce over the group of each device's
    op(x) @ w_shard.T (`fused`: linear's silu_mul or gelu_mul), the sum's bits those of linear then all_reduce."""
    ...

  def moe(self, x: Tensor, moe: MoEWeights, *, norm: Tensor, eps: float, residual: Tensor) -> Tensor:
    """A sparse layer's experts: residual + sum over each token's top-k experts (softmax over the router's logits,
    renormalised when moe.norm_topk_prob) of the expert's SwiGLU MLP of rmsnorm(x), weighted by its probability
    (tinyvllm/layers/moe.py, the reference). x [N, hidden]."""
    ...

  def qkv_rope_write(self, qkv: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, cos: Tensor, sin: Tensor,
                     k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """qkv [N, (heads + 2 * kv_heads) * head_dim] -> q [N, heads, head_dim], per-head RMS-normed (q_norm/k_norm
    [head_dim], or None: no norm) and rotated (HF's rotate-half RoPE; cos/sin [N, head_dim / 2] float32); K (normed,
    rotated) and V written to the caches at slot_mapping (-1: skip). Returns q and the caches after the write."""
    ...

  def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """Write the new tokens' K/V ([N, kv_heads, head_dim]) to their slots (-1: skip); returns the caches after it."""
    ...

  def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> Tensor:
    """Decode (meta.is_decode) or prefill / mixed attention over the paged cache: q [N, heads, head_dim] (rotated), the
    caches already holding this step's K/V. Returns [N, heads * head_dim]."""
    ...

  def decode_layers(self, layers: list[DecoderLayerWeights], h: Tensor, cos: Tensor, sin: Tensor, kv_caches: KVCaches,
                    meta: AttentionMetadata, eps: float) -> tuple[Tensor, KVCaches] | None:
    """Every decoder layer of a decode step in fused kernels, where the backend has them for this step: the hidden
    states after the layers and the caches after their writes; None: the model runs each layer op by op."""
    ...

  def collectives_for(self, group: DeviceGroup) -> Collectives:
    """The collectives of a tensor-parallel group's model: the group's own or kernels of the backend's with their
    results. Called once, as the model is built (a kernel's buffers are allocated then, outside any capture)."""
    ...

  def sample(self, logits: Tensor, params_bits: Tensor, rng_bits: Tensor, variant: SamplerVariant,
             penalties: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """One token id per row ([B] int32) from float32 logits [B, V]: tinyvllm/layers/sampler.py's `sample_packed`
    contract (params and rng as the int32 bits of the step's packed input, backend/sampling.py's layout)."""
    ...
