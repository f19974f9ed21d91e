"""The decoder-only transformer shared by Llama 2/3, Mistral, Qwen2, Qwen3 and Gemma, on flat batches of tokens.

Differences between them are fields of ModelConfig: q/k/v bias (Qwen2, Llama with attention_bias), per-head
RMSNorm on q and k before RoPE (Qwen3), head_dim independent of hidden_size (Qwen3, Gemma), Gemma's GeGLU MLP and
embeddings scaled by sqrt(hidden_size) (its RMSNorm's 1 + weight is folded into the weights at load). Mistral is
Llama's shape (the engine refuses a sliding window that could apply). q/k/v and gate/up projections are fused into one
matrix each at load time, so a layer runs four products. Qwen3-MoE and Mixtral are these layers with experts in place
of the dense MLP (in every layer, or Qwen3-MoE's sparse ones), a backend op of its own. Every op goes through the
compute backend the model is built with (tinyvllm/backend/interface.py): the portable tinygrad ops or the hand-written
kernels. Under tensor parallelism (`group`) every device runs the layers on its share of the heads and MLP columns,
and the products that reduce over the shares meet in an all-reduce (tinyvllm/layers/tensor_parallel.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tinygrad import Tensor

from tinyvllm.backend.interface import Collectives, ComputeBackend, KVCaches
from tinyvllm.backend.metadata import AttentionMetadata
from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.backend.weights import DecoderLayerWeights
from tinyvllm.layers.scatter import gather_rows
from tinyvllm.layers.tensor_parallel import TensorParallelGroup, broadcast_together
from tinyvllm.model_config import ModelConfig


@dataclass
class ModelWeights:
  embed_tokens: Tensor          # [vocab, hidden]
  layers: list[DecoderLayerWeights]
  norm: Tensor                  # [hidden]
  # [vocab, hidden] (the embedding table itself when tied; packed where the checkpoint quantized it: GGUF's output)
  lm_head: Tensor | QuantizedWeight
  rope_cos: Tensor              # [max_positions, head_dim / 2] float32
  rope_sin: Tensor
  # under tensor parallelism with the vocabulary split (embedding and LM head): each device's first row (a local view)
  vocab_start: Tensor | None = None

  def tensors(self) -> list[Tensor]:
    head = self.lm_head.tensors() if isinstance(self.lm_head, QuantizedWeight) else [self.lm_head]
    return [self.embed_tokens, self.norm, *head, self.rope_cos, self.rope_sin, *(t for layer in self.layers for t in layer.tensors())]

  def nbytes(self) -> int: return sum(t.nbytes() for t in {id(t): t for t in self.tensors()}.values())

  def unquantized_bytes(self) -> int:
    """What the weights would take with every linear in the compute dtype."""
    experts = lambda layer: (layer.moe.gate_up_proj, layer.moe.down_proj) if layer.moe is not None else ()
    quantized = [w for layer in self.layers for w in (*layer.linears(), *experts(layer)) if isinstance(w, QuantizedWeight)]
    if isinstance(self.lm_head, QuantizedWeight): quantized.append(self.lm_head)
    inside = {id(t) for w in quantized for t in w.tensors()}
    plain = {id(t): t for t in self.tensors() if id(t) not in inside}
    size = self.embed_tokens.dtype.itemsize
    return sum(t.nbytes() for t in plain.values()) + sum(w.shape[0] * w.shape[1] * size for w in quantized)


@dataclass
class StepInputs:
  """One forward pass: N flat tokens, their positions, attention metadata and which rows to return logits for."""
  token_ids: Tensor             # [N] int32
  positions: Tensor             # [N] int32
  attention: AttentionMetadata
  logits_index: Tensor          # [S] int32: the flat token whose logits each sampled row needs

  def on(self, group: Collectives) -> StepInputs:
    """The inputs on every device of the group (those on its first device broadcast, in one call)."""
    meta, names = self.attention, ("slot_mapping", "block_tables", "query_index", "query_pos", "output_index", "context_lens",
                                   "query_start", "new_keys", "row_order")
    token_ids, positions, logits_index, *fields = broadcast_together(
      group, [self.token_ids, self.positions, self.logits_index, *(getattr(meta, name) for name in names)])
    return StepInputs(token_ids, positions, replace(meta, **dict(zip(names, fields, strict=True))), logits_index)


class TransformerLM:
  def __init__(self, config: ModelConfig, weights: ModelWeights, backend: ComputeBackend, group: TensorParallelGroup | None = None):
    """`config` is the whole model's; under tensor parallelism (`group`) the weights are the devices' shares."""
    self.config, self.weights, self.backend, self.group = config, weights, backend, group
    # the backend's collectives for the group, their buffers (if any) allocated now, outside any capture
    self.collectives = backend.collectives_for(group) if group is not None else None
    self.gated_activation = {"gelu_mul" if config.hidden_act == "gelu_pytorch_tanh" else "silu_mul": True}

  @property
  def dtype(self): return self.weights.embed_tokens.dtype

  @property
  def device(self) -> str:
    """Where the step's inputs and logits are (the first device of a tensor-parallel group)."""
    return self.group.first if self.group is not None else str(self.weights.embed_tokens.device)

  def __call__(self, inputs: StepInputs, kv_caches: KVCaches) -> tuple[Tensor, KVCaches]:
    """Returns float32 logits [S, vocab] and the KV caches after this step's writes."""
    w, eps, group = self.weights, self.config.rms_norm_eps, self.group
    if self.collectives is not None: inputs = inputs.on(self.collectives)
    h = self._embed(inputs.token_ids)
    if self.config.embed_scale != 1.0: h = h * self.config.embed_scale   # a constant of h's dtype: rounded to it, as HF's
    cos, sin = gather_rows(w.rope_cos, inputs.positions), gather_rows(w.rope_sin, inputs.positions)
    # the persistent layer kernels would need the all-reduces inside them: a tensor-parallel model runs op by op
    fused = None if group is not None else self.backend.decode_layers(w.layers, h, cos, sin, kv_caches, inputs.attention, eps)
    h, new_caches = fused if fused is not None else self.decoder_layers(h, cos, sin, kv_caches, inputs.attention)
    last = gather_rows(h, inputs.logits_index)
    logits = self.backend.linear(last, w.lm_head, norm=w.norm, eps=eps, out_float32=True)
    if self.collectives is None: return logits, new_caches
    return (self.collectives.gather_columns(logits) if w.vocab_start is not None else group.first_of(logits)), new_caches

  def _embed(self, token_ids: Tensor) -> Tensor:
    """The tokens' embeddings; with the vocabulary split, each device's rows (zeros for tokens outside its part), summed."""
    w = self.weights
    if w.vocab_start is None or self.group is None: return gather_rows(w.embed_tokens, token_ids)
    return self.collectives.all_reduce(gather_rows(w.embed_tokens, token_ids - w.vocab_start))

  def _row_parallel(self, x: Tensor, w, bias: Tensor | None, residual: Tensor, **fused) -> Tensor:
    """residual + x @ w.T + bias for the products whose reduction runs over the shards (o, down): each device's partial
    product, all-reduced, then the bias and residual (once)."""
    if self.group is None: return self.backend.linear(x, w, bias, residual=residual, **fused)
    if bias is None: return self.backend.row_parallel_linear(x, w, self.collectives, residual=residual, **fused)
    return residual + (self.collectives.all_reduce(self.backend.linear(x, w, **fused)) + bias)

  def decoder_layers(self, h: Tensor, cos: Tensor, sin: Tensor, kv_caches: KVCaches, meta: AttentionMetadata,
                     layers: list[DecoderLayerWeights] | None = None) -> tuple[Tensor, KVCaches]:
    """The layers (default: all) op by op: the hidden states after them and the caches after their KV writes."""
    new_caches = []
    for layer, (k_cache, v_cache) in zip(self.weights.layers if layers is None else layers, kv_caches, strict=True):
      h, k_cache, v_cache = self.decoder_layer(layer, h, cos, sin, k_cache, v_cache, meta)
      new_caches.append((k_cache, v_cache))
    return h, new_caches

  def decoder_layer(self, layer: DecoderLayerWeights, h: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                    meta: AttentionMetadata) -> tuple[Tensor, Tensor, Tensor]:
    """One layer op by op: the hidden states after it and the caches after its KV write."""
    ops, eps = self.backend, self.config.rms_norm_eps
    qkv = ops.linear(h, layer.qkv_proj, layer.qkv_bias, norm=layer.input_norm, eps=eps)
    q, k_cache, v_cache = ops.qkv_rope_write(qkv, layer.q_norm, layer.k_norm, cos, sin, k_cache, v_cache, meta.slot_mapping, eps)
    h = self._row_parallel(ops.attention(q, k_cache, v_cache, meta), layer.o_proj, layer.o_bias, residual=h)
    if layer.moe is not None: return self._experts(h, layer), k_cache, v_cache
    gate_up = ops.linear(h, layer.gate_up_proj, layer.gate_up_bias, norm=layer.post_attention_norm, eps=eps)
    h = self._row_parallel(gate_up, layer.down_proj, layer.down_bias, residual=h, **self.gated_activation)
    return h, k_cache, v_cache

  def _experts(self, h: Tensor, layer: DecoderLayerWeights) -> Tensor:
    """A sparse layer's MLP; under tensor parallelism each device's experts have its share of their columns: their
    partial outputs (added to zeros, the op's residual) are all-reduced, then the residual added."""
    assert layer.moe is not None
    ops, eps = self.backend, self.config.rms_norm_eps
    if self.group is None: return ops.moe(h, layer.moe, norm=layer.post_attention_norm, eps=eps, residual=h)
    partial = ops.moe(h, layer.moe, norm=layer.post_attention_norm, eps=eps, residual=h.zeros_like())
    return self.collectives.all_reduce(partial, h)
