"""The decoder-only transformer shared by Llama 2/3, Qwen2 and Qwen3, on flat batches of tokens.

Differences between the three are flags on ModelConfig: q/k/v bias (Qwen2, Llama with attention_bias), per-head
RMSNorm on q and k before RoPE (Qwen3), head_dim independent of hidden_size (Qwen3). q/k/v and gate/up projections
are fused into one matrix each at load time, so a layer runs four matmuls.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tinygrad import Tensor

from tinyvllm.config import ModelConfig
from tinyvllm.kernels.portable import qkv_rope_write
from tinyvllm.layers.attention import AttentionMetadata, paged_attention, write_kv
from tinyvllm.layers.linear import LinearFn, portable_linear
from tinyvllm.layers.scatter import gather_rows

# An attention implementation: (q [N,H,D], k_cache, v_cache, metadata) -> [N, H*D]. The portable one is the default.
AttentionFn = Callable[[Tensor, Tensor, Tensor, AttentionMetadata], Tensor]
# A KV write: (k_cache, v_cache, k [N,KVH,D], v, slot_mapping [N]) -> the caches after the write.
WriteKVFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
# Split + QK-norm + RoPE + KV write: (qkv [N, (H + 2*KVH) * D], q_norm [D] | None, k_norm | None, cos [N, D/2],
# sin, k_cache, v_cache, slot_mapping [N], eps) -> (q [N, H, D], k_cache, v_cache) (see kernels/backend.py).
QkvRopeWriteFn = Callable[[Tensor, Tensor | None, Tensor | None, Tensor, Tensor, Tensor, Tensor, Tensor, float],
                          tuple[Tensor, Tensor, Tensor]]


@dataclass
class DecoderLayer:
  input_norm: Tensor
  qkv_proj: Tensor              # [q_size + 2 * kv_size, hidden]
  qkv_bias: Tensor | None
  q_norm: Tensor | None         # [head_dim], Qwen3
  k_norm: Tensor | None
  o_proj: Tensor                # [hidden, q_size]
  o_bias: Tensor | None
  post_attention_norm: Tensor
  gate_up_proj: Tensor          # [2 * intermediate, hidden]
  gate_up_bias: Tensor | None
  down_proj: Tensor             # [hidden, intermediate]
  down_bias: Tensor | None


KVCaches = list[tuple[Tensor, Tensor]]
# Every decoder layer of a decode step in persistent kernels: (layers, h, cos, sin, kv_caches, metadata, eps) -> (h,
# kv_caches after the step's writes), or None for a step or shape it does not take.
DecodeLayersFn = Callable[[list[DecoderLayer], Tensor, Tensor, Tensor, KVCaches, AttentionMetadata, float],
                          tuple[Tensor, KVCaches] | None]


@dataclass
class StepInputs:
  """One forward pass: N flat tokens, their positions, attention metadata and which rows to return logits for."""
  token_ids: Tensor             # [N] int32
  positions: Tensor             # [N] int32
  attention: AttentionMetadata
  logits_index: Tensor          # [S] int32: the flat token whose logits each sampled row needs


class TransformerLM:
  def __init__(self, config: ModelConfig, embed_tokens: Tensor, layers: list[DecoderLayer], norm: Tensor,
               lm_head: Tensor, rope_cos: Tensor, rope_sin: Tensor):
    self.config, self.embed_tokens, self.layers, self.norm, self.lm_head = config, embed_tokens, layers, norm, lm_head
    self.rope_cos, self.rope_sin = rope_cos, rope_sin
    self.attention_fn: AttentionFn = paged_attention
    self.write_kv_fn: WriteKVFn = write_kv
    self.linear_fn: LinearFn = portable_linear
    # default: the portable ops, writing K/V with whatever write_kv_fn is set (a backend replaces the whole step)
    self.qkv_rope_write_fn: QkvRopeWriteFn = self._qkv_rope_write_ops
    # all layers in persistent kernels, where the backend has them for the step (None from it: each layer op by op)
    self.decode_layers_fn: DecodeLayersFn | None = None

  @property
  def dtype(self): return self.embed_tokens.dtype

  @property
  def device(self) -> str: return str(self.embed_tokens.device)

  def parameters(self) -> list[Tensor]:
    tensors = [self.embed_tokens, self.norm, self.lm_head, self.rope_cos, self.rope_sin]
    for layer in self.layers: tensors += [t for t in vars(layer).values() if t is not None]
    return tensors

  def __call__(self, inputs: StepInputs, kv_caches: KVCaches) -> tuple[Tensor, KVCaches]:
    """Returns float32 logits [S, vocab] and the KV caches after this step's writes."""
    eps = self.config.rms_norm_eps
    h = gather_rows(self.embed_tokens, inputs.token_ids)
    cos, sin = gather_rows(self.rope_cos, inputs.positions), gather_rows(self.rope_sin, inputs.positions)
    fused = self.decode_layers_fn(self.layers, h, cos, sin, kv_caches, inputs.attention, eps) if self.decode_layers_fn else None
    if fused is not None: h, new_caches = fused
    else: h, new_caches = self.decoder_layers(h, cos, sin, kv_caches, inputs.attention)
    last = gather_rows(h, inputs.logits_index)
    return self.linear_fn(last, self.lm_head, norm=self.norm, eps=eps, out_float32=True), new_caches

  def decoder_layers(self, h: Tensor, cos: Tensor, sin: Tensor, kv_caches: KVCaches, meta: AttentionMetadata,
                     layers: list[DecoderLayer] | None = None) -> tuple[Tensor, KVCaches]:
    """The layers (default: all) op by op: the hidden states after them and the caches after their KV writes."""
    new_caches = []
    for layer, (k_cache, v_cache) in zip(self.layers if layers is None else layers, kv_caches, strict=True):
      h, k_cache, v_cache = self.decoder_layer(layer, h, cos, sin, k_cache, v_cache, meta)
      new_caches.append((k_cache, v_cache))
    return h, new_caches

  def decoder_layer(self, layer: DecoderLayer, h: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                    meta: AttentionMetadata) -> tuple[Tensor, Tensor, Tensor]:
    """One layer op by op: the hidden states after it and the caches after its KV write."""
    eps = self.config.rms_norm_eps
    qkv = self.linear_fn(h, layer.qkv_proj, layer.qkv_bias, norm=layer.input_norm, eps=eps)
    attn, k_cache, v_cache = self._attention(layer, qkv, cos, sin, k_cache, v_cache, meta)
    h = self.linear_fn(attn, layer.o_proj, layer.o_bias, residual=h)
    gate_up = self.linear_fn(h, layer.gate_up_proj, layer.gate_up_bias, norm=layer.post_attention_norm, eps=eps)
    h = self.linear_fn(gate_up, layer.down_proj, layer.down_bias, silu_mul=True, residual=h)
    return h, k_cache, v_cache

  def _attention(self, layer: DecoderLayer, qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                 meta: AttentionMetadata) -> tuple[Tensor, Tensor, Tensor]:
    """Split q/k/v, QK-norm and rotate, write K/V to the cache, attend; returns [N, heads * head_dim] and the caches."""
    q, k_cache, v_cache = self.qkv_rope_write_fn(qkv, layer.q_norm, layer.k_norm, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                                 self.config.rms_norm_eps)
    return self.attention_fn(q, k_cache, v_cache, meta), k_cache, v_cache

  def _qkv_rope_write_ops(self, qkv: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, cos: Tensor, sin: Tensor,
                          k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return qkv_rope_write(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, eps, write=self.write_kv_fn)
