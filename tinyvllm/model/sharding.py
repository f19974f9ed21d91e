"""Splitting a loaded model's weights over a tensor-parallel group (vLLM's layout), each as a local view
(tinyvllm/layers/tensor_parallel.py says what that is).

- q/k/v (fused at load): device i takes its H / tp query heads and its K/V heads, one fused [q_i; k_i; v_i] matrix, so
  that its qkv split sees the usual layout. With fewer KV heads than devices each KV head is replicated on tp / KVH
  devices, as vLLM does: device i takes KV head i // (tp / KVH).
- gate/up (fused): device i takes [gate_i; up_i], its I / tp columns of each; a sparse layer's experts likewise, per
  expert, with the router whole on every device.
- o and down: device i takes its columns (the rows of the product's reduction); their biases stay whole, added once
  after the all-reduce.
- embedding and LM head: device i takes its V / tp rows of the vocabulary (replicated where tp does not divide V), a
  packed LM head (a GGUF file's output layer) its codes, scales and shifts of those rows.
- packed (quantized) weights split as their float form would: their codes, scales and shifts by the same rows, or by
  input columns in whole scale groups (a per-channel scale kept by every device's part), codes repacked where a
  device's columns end inside a 32-bit word.
- norms and RoPE tables: whole on every device.
Each layer is split right after it is loaded, so the whole model is never on the first device.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tinygrad import Tensor, dtypes

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.backend.weights import DecoderLayerWeights, MoEWeights, Weight
from tinyvllm.config import ConfigError
from tinyvllm.layers.quantized import pack_words, unpack_codes
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


RowSplit = Callable[[Tensor], list[Tensor]]


def split_rows(w: Weight, split: RowSplit) -> list[Weight]:
  """A weight's per-device parts by output rows, as `split` takes a tensor's rows: a packed weight's codes, scales and
  shifts alike (each holds its rows first)."""
  if not isinstance(w, QuantizedWeight): return split(w)
  _check_packed(w)
  codes, scales = split(w.codes), split(w.scales)
  shifts = split(w.shifts) if w.shifts is not None else [None] * len(codes)
  return [replace(w, shape=(c.shape[0], w.shape[1]), codes=c, scales=sc, shifts=sh)
          for c, sc, sh in zip(codes, scales, shifts, strict=True)]


def split_columns(w: Weight, tp: int, name: str) -> list[Weight]:
  """A weight's per-device parts by input columns (o, down: the rows of their reduction). A packed weight's scale
  groups split whole: a device's columns are whole groups, or the weight has one group a row (per channel), whose scale
  and shift every device's part keeps. Its codes split in whole 32-bit words, or, where a device's columns end inside
  a word, are unpacked and packed again a device each."""
  if not isinstance(w, QuantizedWeight): return _column_parts(w, tp)
  _check_packed(w)
  cols = w.shape[1] // tp
  per_channel = w.group_size >= w.shape[1]
  if not (per_channel or cols % w.group_size == 0):
    raise ConfigError(f"tensor_parallel_size {tp}: a device's {cols} input columns of {name} ({w.describe()}) are not whole "
                      f"scale groups of {w.group_size}")
  words, groups = cols * w.bits // 32, 1 if per_channel else cols // w.group_size
  codes = unpack_codes(w) if cols * w.bits % 32 else None
  def part(i: int) -> QuantizedWeight:
    take = lambda t: t if per_channel else t[:, i * groups:(i + 1) * groups]
    mine = w.codes[:, i * words:(i + 1) * words] if codes is None else pack_words(codes[:, i * cols:(i + 1) * cols], w.bits)
    return replace(w, shape=(w.shape[0], cols), group_size=cols if per_channel else w.group_size, codes=mine,
                   scales=take(w.scales), shifts=None if w.shifts is None else take(w.shifts))
  return [part(i) for i in range(tp)]


def _check_packed(w: QuantizedWeight) -> None:
  if w.g_idx is not None or w.perm is not None:
    raise ConfigError("tensor parallelism with act-order (desc_act / g_idx) weights is not supported: each device would read "
                      "its input in an order of its own")


def place(group: TensorParallelGroup, parts: list[Weight]) -> Weight:
  """Per-device parts as one local view (a packed weight's codes, scales and shifts each)."""
  first = parts[0]
  if not isinstance(first, QuantizedWeight): return group.local(parts)
  shifts = None if first.shifts is None else group.local([p.shifts for p in parts])
  return replace(first, codes=group.local([p.codes for p in parts]), scales=group.local([p.scales for p in parts]), shifts=shifts)


def shard_layer(layer: DecoderLayerWeights, cfg: ModelConfig, group: TensorParallelGroup) -> DecoderLayerWeights:
  """One decoder layer's weights split over the group (the layer on the first device is dropped)."""
  tp, local, whole = group.size, group.local, lambda t: None if t is None else group.replicate(t)
  qkv = place(group, split_rows(layer.qkv_proj, lambda t: _qkv_parts(t, cfg, tp)))
  qkv_bias = None if layer.qkv_bias is None else local(_qkv_parts(layer.qkv_bias, cfg, tp))
  dense = layer.gate_up_proj is not None
  gate_up = lambda w: place(group, split_rows(w, lambda t: _gate_up_parts(t, cfg.intermediate_size, tp)))
  return DecoderLayerWeights(
    input_norm=whole(layer.input_norm), qkv_proj=qkv, qkv_bias=qkv_bias, q_norm=whole(layer.q_norm), k_norm=whole(layer.k_norm),
    o_proj=place(group, split_columns(layer.o_proj, tp, "o_proj")), o_bias=whole(layer.o_bias),
    post_attention_norm=whole(layer.post_attention_norm),
    gate_up_proj=gate_up(layer.gate_up_proj) if dense else None,
    gate_up_bias=local(_gate_up_parts(layer.gate_up_bias, cfg.intermediate_size, tp)) if layer.gate_up_bias is not None else None,
    down_proj=place(group, split_columns(layer.down_proj, tp, "down_proj")) if dense else None,
    down_bias=whole(layer.down_bias),
    moe=None if layer.moe is None else _shard_experts(layer.moe, group))


def _shard_experts(moe: MoEWeights, group: TensorParallelGroup) -> MoEWeights:
  """Each expert's gate_up split as a dense layer's (a packed weight's rows, stacked expert by expert, split per
  expert), its down by columns."""
  tp, experts = group.size, moe.num_experts
  def per_expert(t: Tensor) -> list[Tensor]:
    if not isinstance(moe.gate_up_proj, QuantizedWeight): return _gate_up_parts(t, moe.intermediate, tp, axis=1)
    parts = _gate_up_parts(t.reshape(experts, -1, t.shape[-1]), moe.intermediate, tp, axis=1)
    return [p.reshape(-1, t.shape[-1]) for p in parts]
  return replace(moe, router=group.replicate(moe.router), gate_up_proj=place(group, split_rows(moe.gate_up_proj, per_expert)),
                 down_proj=place(group, split_columns(moe.down_proj, tp, "the experts' down_proj")))


def splits_vocabulary(cfg: ModelConfig, tp: int) -> bool: return cfg.vocab_size % tp == 0


def shard_vocabulary(table: Weight, group: TensorParallelGroup, split: bool) -> Weight:
  """The embedding / LM head [V, H]: device i's V / tp rows, or (not `split`) the whole table on every device (a
  packed LM head's codes, scales and shifts alike)."""
  if split: return place(group, split_rows(table, lambda t: _split_rows(t, group.size)))
  if not isinstance(table, QuantizedWeight): return group.replicate(table)
  whole = lambda t: None if t is None else group.replicate(t)
  return replace(table, codes=whole(table.codes), scales=whole(table.scales), shifts=whole(table.shifts),
                 g_idx=whole(table.g_idx), perm=whole(table.perm))


def vocabulary_starts(cfg: ModelConfig, group: TensorParallelGroup) -> Tensor:
  """Each device's first vocabulary row ([1] int32 per device, a local view)."""
  rows = cfg.vocab_size // group.size
  return group.local([Tensor([i * rows], dtype=dtypes.int32, device=group.first) for i in range(group.size)])
