"""Splitting a loaded model's weights over a tensor-parallel group (vLLM's layout), each as a local view
(tinyvllm/layers/tensor_parallel.py says what that is).

- q/k/v (fused at load): device i takes its H / tp query heads and its K/V heads, one fused [q_i; k_i; v_i] matrix, so
  that its qkv split sees the usual layout. With fewer KV heads than devices each KV head is replicated on tp / KVH
  devices, as vLLM does: device i takes KV head i // (tp / KVH).
- gate/up (fused): device i takes [gate_i; up_i], its I / tp columns of each; a sparse layer's experts likewise, per
  expert, with the router whole on every device.
- o and down: device i takes its columns (the rows of the product's reduction); their biases stay whole, added once
  after the all-reduce.
- embedding and LM head: device i takes its V / tp rows of the vocabulary (replicated where tp does not divide V).
- norms and RoPE tables: whole on every device.
Each layer is split right after it is loaded, so the whole model is never on the first device.
"""
from __future__ import annotations

from dataclasses import replace

from tinygrad import Tensor, dtypes

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.backend.weights import DecoderLayerWeights, MoEWeights
from tinyvllm.config import ConfigError
from tinyvllm.layers.tensor_parallel import TensorParallelGroup
from tinyvllm.model_config import ModelConfig


def check_shardable(cfg: ModelConfig, tp: int) -> None:
  """Refuse a model whose heads or MLP columns do not split evenly over `tp` devices, naming the field."""
  checks = [("num_attention_heads", cfg.num_heads, cfg.num_heads % tp == 0),
            ("num_key_value_heads", cfg.num_kv_heads, cfg.num_kv_heads % tp == 0 or tp % cfg.num_kv_heads == 0),
            ("intermediate_size", cfg.intermediate_size, cfg.intermediate_size % tp == 0)]
  if cfg.moe is not None: checks.append(("moe_intermediate_size", cfg.moe.intermediate_size, cfg.moe.intermediate_size % tp == 0))
  for name, value, ok in checks:
    if not ok: raise ConfigError(f"tensor_parallel_size {tp} does not divide the model's {name} ({value})")


def kv_heads_per_device(cfg: ModelConfig, tp: int) -> int: return max(1, cfg.num_kv_heads // tp)


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
  """The config of one device's share: what its KV cache and kernels are sized by."""
  moe = None if cfg.moe is None else replace(cfg.moe, intermediate_size=cfg.moe.intermediate_size // tp)
  return replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=kv_heads_per_device(cfg, tp),
                 intermediate_size=cfg.intermediate_size // tp, moe=moe)


def _rows(t: Tensor, start: int, size: int) -> Tensor: return t[start:start + size]


def _split_rows(t: Tensor, tp: int) -> list[Tensor]:
  size = t.shape[0] // tp
  return [_rows(t, i * size, size) for i in range(tp)]


def _qkv_parts(w: Tensor, cfg: ModelConfig, tp: int) -> list[Tensor]:
  """Device i's [q_i; k_i; v_i] rows (or entries, for the bias)."""
  d, kv_local = cfg.head_dim, kv_heads_per_device(cfg, tp)
  q, k, v = _rows(w, 0, cfg.q_size), _rows(w, cfg.q_size, cfg.kv_size), _rows(w, cfg.q_size + cfg.kv_size, cfg.kv_size)
  q_local = cfg.q_size // tp
  replicas = max(1, tp // cfg.num_kv_heads)   # devices sharing each KV head
  def kv(t: Tensor, i: int) -> Tensor: return _rows(t, (i // replicas) * kv_local * d, kv_local * d)
  return [_rows(q, i * q_local, q_local).cat(kv(k, i), kv(v, i)) for i in range(tp)]


def _gate_up_parts(w: Tensor, inter: int, tp: int, axis: int = 0) -> list[Tensor]:
  """Device i's [gate_i; up_i] along `axis` (gate's rows first, then up's, in the fused tensor)."""
  size = inter // tp
  def part(start: int) -> Tensor: return w.shrink(tuple((start, start + size) if a == axis else None for a in range(w.ndim)))
  return [part(i * size).cat(part(inter + i * size), dim=axis) for i in range(tp)]


def _column_parts(w: Tensor, tp: int) -> list[Tensor]:
  size = w.shape[-1] // tp
  return [w[..., i * size:(i + 1) * size] for i in range(tp)]


def _plain(w) -> Tensor:
  if isinstance(w, QuantizedWeight): raise ConfigError("tensor parallelism with quantized weights is not supported yet")
  return w


def shard_layer(layer: DecoderLayerWeights, cfg: ModelConfig, group: TensorParallelGroup) -> DecoderLayerWeights:
  """One decoder layer's weights split over the group (the layer on the first device is dropped)."""
  tp, local, whole = group.size, group.local, lambda t: None if t is None else group.replicate(t)
  qkv = local(_qkv_parts(_plain(layer.qkv_proj), cfg, tp))
  qkv_bias = None if layer.qkv_bias is None else local(_qkv_parts(layer.qkv_bias, cfg, tp))
  dense = layer.gate_up_proj is not None
  return DecoderLayerWeights(
    input_norm=whole(layer.input_norm), qkv_proj=qkv, qkv_bias=qkv_bias, q_norm=whole(layer.q_norm), k_norm=whole(layer.k_norm),
    o_proj=local(_column_parts(_plain(layer.o_proj), tp)), o_bias=whole(layer.o_bias),
    post_attention_norm=whole(layer.post_attention_norm),
    gate_up_proj=local(_gate_up_parts(_plain(layer.gate_up_proj), cfg.intermediate_size, tp)) if dense else None,
    gate_up_bias=local(_gate_up_parts(layer.gate_up_bias, cfg.intermediate_size, tp)) if layer.gate_up_bias is not None else None,
    down_proj=local(_column_parts(_plain(layer.down_proj), tp)) if dense else None,
    down_bias=whole(layer.down_bias),
    moe=None if layer.moe is None else _shard_experts(layer.moe, group))


def _shard_experts(moe: MoEWeights, group: TensorParallelGroup) -> MoEWeights:
  return replace(moe, router=group.replicate(moe.router),
                 gate_up_proj=group.local(_gate_up_parts(_plain(moe.gate_up_proj), moe.intermediate, group.size, axis=1)),
                 down_proj=group.local(_column_parts(_plain(moe.down_proj), group.size)))


def splits_vocabulary(cfg: ModelConfig, tp: int) -> bool: return cfg.vocab_size % tp == 0


def shard_vocabulary(table: Tensor | QuantizedWeight, group: TensorParallelGroup, split: bool) -> Tensor:
  """The embedding / LM head [V, H]: device i's V / tp rows, or (not `split`) the whole table on every device."""
  if isinstance(table, QuantizedWeight): raise ConfigError("tensor parallelism with a quantized LM head is not supported yet")
  return group.local(_split_rows(table, group.size)) if split else group.replicate(table)


def vocabulary_starts(cfg: ModelConfig, group: TensorParallelGroup) -> Tensor:
  """Each device's first vocabulary row ([1] int32 per device, a local view)."""
  rows = cfg.vocab_size // group.size
  return group.local([Tensor([i * rows], dtype=dtypes.int32, device=group.first) for i in range(group.size)])
