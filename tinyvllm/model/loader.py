"""Build a TransformerLM from an HF checkpoint (or random "dummy" weights) on a tinygrad device."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

from tinyvllm.backend.interface import ComputeBackend
from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.backend.weights import DecoderLayerWeights, MoEWeights
from tinyvllm.config import ConfigError
from tinyvllm.layers.rotary import rope_tables
from tinyvllm.layers.tensor_parallel import TensorParallelGroup
from tinyvllm.model.kv_scales import fold_kv_scales, read_kv_scales
from tinyvllm.model.llama import ModelWeights, TransformerLM
from tinyvllm.model.quantization.config import QuantizationConfig
from tinyvllm.model.quantization.source import QuantizedSource
from tinyvllm.model.safetensors_file import Checkpoint, bf16_as_float32
from tinyvllm.model.sharding import shard_layer, shard_vocabulary, splits_vocabulary, vocabulary_starts
from tinyvllm.model_config import ModelConfig

DTYPE_BY_NAME = {"bfloat16": dtypes.bfloat16, "float16": dtypes.float16, "float32": dtypes.float32}
NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}   # (tinygrad's own names: "float", "__bf16")
# Weights that some checkpoints carry but the forward pass recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# (names, shape, kind) -> the tensor on the device in the compute dtype (kind "linear": a layer's projection, which a
# quantizing source returns as a QuantizedWeight; "lm_head": an untied LM head, packed where the file quantized it);
# raises KeyError for a missing name
TensorSource = Callable[[list[str], tuple[int, ...], str], Tensor]


def resolve_dtype(requested: str, config: ModelConfig, device: str) -> DType:
  """auto: the checkpoint's dtype on a GPU, float32 on the CPU (where half precision is slow and inexact)."""
  if requested != "auto": return DTYPE_BY_NAME[requested]
  if device.split(":")[0] in ("CPU", "PYTHON"): return dtypes.float32
  return DTYPE_BY_NAME.get(config.torch_dtype.replace("torch.", ""), dtypes.float32)


def _upload(arr: np.ndarray, stored: str, dtype: DType, device: str) -> Tensor:
  if stored == "F8_E4M3": raise ConfigError("the checkpoint stores FP8 weights but its config.json has no quantization_config")
  if stored == "BF16" and dtype == dtypes.bfloat16:
    return Tensor(np.ascontiguousarray(arr), device=device).bitcast(dtypes.bfloat16)
  if stored == "BF16": arr = bf16_as_float32(arr)
  t = Tensor(np.ascontiguousarray(arr), device=device)
  return t if t.dtype == dtype else t.cast(dtype)


def checkpoint_source(checkpoint: Checkpoint, dtype: DType, device: str, used: set[str]) -> TensorSource:
  """Reads (and concatenates, for fused projections) named tensors from the checkpoint, checking their shapes."""
  def get(names: list[str], shape: tuple[int, ...], kind: str) -> Tensor:
    missing = [n for n in names if n not in checkpoint]
    if missing: raise KeyError(", ".join(missing))
    used.update(names)
    arrays = [checkpoint.array(n) for n in names]
    stored = {checkpoint.dtype(n) for n in names}
    if len(stored) > 1: raise ConfigError(f"tensors {', '.join(names)} have different dtypes {sorted(stored)}")
    arr = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
    if tuple(arr.shape) != shape: raise ConfigError(f"tensor {' + '.join(names)} has shape {tuple(arr.shape)}, the config implies {shape}")
    return _upload(arr, stored.pop(), dtype, device)
  return get


def dummy_source(dtype: DType, device: str, seed: int) -> TensorSource:
  """Random weights (normal, std 0.02; norms at 1) so that speed can be measured without a checkpoint."""
  Tensor.manual_seed(seed)
  def get(names: list[str], shape: tuple[int, ...], kind: str) -> Tensor:
    if kind == "norm": return Tensor.ones(*shape, dtype=dtype, device=device).contiguous()
    return (Tensor.randn(*shape, dtype=dtypes.float32, device=device) * 0.02).cast(dtype).contiguous()
  return get


def _experts(cfg: ModelConfig, get: TensorSource, i: int) -> MoEWeights:
  """A sparse layer's router and experts, stacked from HF's per-expert tensors (Mixtral's w1/w3/w2 are gate/up/down)."""
  assert cfg.moe is not None
  moe, d, inter = cfg.moe, cfg.hidden_size, cfg.moe.intermediate_size
  mixtral = cfg.architecture == "MixtralForCausalLM"
  p = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}."
  gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
  expert = lambda e, name: f"{p}experts.{e}.{name}.weight"
  gate_up = get([expert(e, name) for e in range(moe.num_experts) for name in (gate, up)], (moe.num_experts * 2 * inter, d), "experts")
  down_proj = get([expert(e, down) for e in range(moe.num_experts)], (moe.num_experts * d, inter), "experts")
  stacked = lambda w, rows, cols: w if isinstance(w, QuantizedWeight) else w.reshape(moe.num_experts, rows, cols)
  return MoEWeights(router=get([p + "gate.weight"], (moe.num_experts, d), "matrix"),
                    gate_up_proj=stacked(gate_up, 2 * inter, d), down_proj=stacked(down_proj, d, inter),
                    top_k=moe.num_experts_per_tok, norm_topk_prob=moe.norm_topk_prob)


def _layer(cfg: ModelConfig, get: TensorSource, i: int) -> DecoderLayerWeights:
  p, d = f"model.layers.{i}.", cfg.hidden_size
  qkv_names = [f"{p}self_attn.{x}_proj" for x in "qkv"]
  qkv_rows = cfg.q_size + 2 * cfg.kv_size
  sparse = cfg.moe is not None and cfg.moe.is_sparse(i)
  return DecoderLayerWeights(
    input_norm=get([p + "input_layernorm.weight"], (d,), "norm"),
    qkv_proj=get([n + ".weight" for n in qkv_names], (qkv_rows, d), "linear"),
    qkv_bias=get([n + ".bias" for n in qkv_names], (qkv_rows,), "bias") if cfg.qkv_bias else None,
    q_norm=get([p + "self_attn.q_norm.weight"], (cfg.head_dim,), "norm") if cfg.qk_norm else None,
    k_norm=get([p + "self_attn.k_norm.weight"], (cfg.head_dim,), "norm") if cfg.qk_norm else None,
    o_proj=get([p + "self_attn.o_proj.weight"], (d, cfg.q_size), "linear"),
    o_bias=get([p + "self_attn.o_proj.bias"], (d,), "bias") if cfg.o_bias else None,
    post_attention_norm=get([p + "post_attention_layernorm.weight"], (d,), "norm"),
    gate_up_proj=None if sparse else get([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], (2 * cfg.intermediate_size, d),
                                         "linear"),
    gate_up_bias=get([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"], (2 * cfg.intermediate_size,), "bias")
    if cfg.mlp_bias and not sparse else None,
    down_proj=None if sparse else get([p + "mlp.down_proj.weight"], (d, cfg.intermediate_size), "linear"),
    down_bias=get([p + "mlp.down_proj.bias"], (d,), "bias") if cfg.mlp_bias and not sparse else None,
    moe=_experts(cfg, get, i) if sparse else None)


def offset_norms(get: TensorSource, offset: float) -> TensorSource:
  """Norm weights with `offset` added in float32 before the cast to the compute dtype (Gemma's RMSNorm scales by
  1 + weight, computed in float32 as HF does)."""
  def get_offset(names: list[str], shape: tuple[int, ...], kind: str) -> Tensor:
    t = get(names, shape, kind)
    return (t.float() + offset).cast(t.dtype).contiguous() if kind == "norm" else t
  return get_offset


def _realized(layer: DecoderLayerWeights) -> DecoderLayerWeights:
  """A layer's weights on the device now: realized all at once, a model's lazy intermediates (dummy weights' float32
  randn, a checkpoint's casts) would be alive together (a 61 GB MoE model did not fit an 80 GB GPU so)."""
  Tensor.realize(*layer.tensors())
  return layer


def build_model(cfg: ModelConfig, get: TensorSource, device: str, max_positions: int, backend: ComputeBackend,
                group: TensorParallelGroup | None = None, kv_scales: dict[int, tuple[float, float]] | None = None) -> TransformerLM:
  """The model from `get`'s tensors (on `device`); with a tensor-parallel `group` (its first device is `device`), each
  layer split over the group as soon as it is loaded (model/sharding.py); `kv_scales`: layers' (k_scale, v_scale)
  folded into their weights (model/kv_scales.py)."""
  if cfg.norm_weight_offset: get = offset_norms(get, cfg.norm_weight_offset)
  place = (lambda layer: layer) if group is None else (lambda layer: shard_layer(layer, cfg, group))
  scaled = lambda i, layer: fold_kv_scales(layer, cfg, *kv_scales[i]) if kv_scales and i in kv_scales else layer
  try:
    embed = get(["model.embed_tokens.weight"], (cfg.vocab_size, cfg.hidden_size), "matrix")
    layers = [place(_realized(scaled(i, _layer(cfg, get, i)))) for i in range(cfg.num_layers)]
    norm = get(["model.norm.weight"], (cfg.hidden_size,), "norm")
    lm_head = embed if cfg.tie_word_embeddings else get(["lm_head.weight"], (cfg.vocab_size, cfg.hidden_size), "lm_head")
  except KeyError as e:
    raise ConfigError(f"checkpoint is missing tensor(s) {e.args[0]} needed by {cfg.architecture}") from None
  cos, sin = rope_tables(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rope_freq_factors)
  weights = ModelWeights(embed, layers, norm, lm_head, Tensor(cos, device=device), Tensor(sin, device=device))
  if group is not None: weights = _shard_outer(weights, cfg, group)
  Tensor.realize(*weights.tensors())
  return TransformerLM(cfg, weights, backend, group)


def _shard_outer(w: ModelWeights, cfg: ModelConfig, group: TensorParallelGroup) -> ModelWeights:
  """The embedding and LM head split by vocabulary rows (where tp divides it), the rest whole on every device."""
  split = splits_vocabulary(cfg, group.size)
  embed = shard_vocabulary(w.embed_tokens, group, split)
  lm_head = embed if w.lm_head is w.embed_tokens else shard_vocabulary(w.lm_head, group, split)
  return ModelWeights(embed, w.layers, group.replicate(w.norm), lm_head, group.replicate(w.rope_cos), group.replicate(w.rope_sin),
                      vocabulary_starts(cfg, group) if split else None)


def load_model(cfg: ModelConfig, folder: Path | None, load_format: str, dtype: DType, device: str, max_positions: int,
               backend: ComputeBackend, seed: int = 0, quantization: QuantizationConfig | None = None,
               group: TensorParallelGroup | None = None, kv_fp8: bool = False) -> LoadedModel:
  """The model with its weights on `device` (split over `group`, whose first device it is), its ops run by `backend`,
  its linears quantized as `quantization` says; with an FP8 KV cache (`kv_fp8`), the checkpoint's KV cache scales
  applied (read, and said unused, otherwise)."""
  checkpoint, used = None if load_format == "dummy" else Checkpoint(folder), set()
  kv_scales = read_kv_scales(checkpoint, cfg.num_layers, used) if checkpoint is not None else None
  get = dummy_source(dtype, device, seed) if checkpoint is None else checkpoint_source(checkpoint, dtype, device, used)
  if quantization is not None: get = QuantizedSource(get, quantization, checkpoint, dtype, device, used)
  model = build_model(cfg, get, device, max_positions, backend, group, kv_scales.layers if kv_scales and kv_fp8 else None)
  notices = get.notices if isinstance(get, QuantizedSource) else []
  if kv_scales and kv_scales.layers: notices = [*notices, kv_scales.notice(applied=kv_fp8)]
  if checkpoint is None: return LoadedModel(model, notices)
  extra = [n for n in checkpoint.names() if n not in used and not n.endswith(IGNORED_SUFFIXES)]
  if cfg.tie_word_embeddings and "lm_head.weight" in extra: extra.remove("lm_head.weight")
  check_all_used(extra, f"{folder}: checkpoint has tensor(s) that {cfg.architecture} with this config does not use")
  return LoadedModel(model, notices)


def check_all_used(extra: list[str], what: str) -> None:
  """A tensor nobody read means the config describes a different model than the file holds: fail naming them."""
  if extra: raise ConfigError(f"{what}: {', '.join(extra[:5])}{f' and {len(extra) - 5} more' if len(extra) > 5 else ''}")


@dataclass
class LoadedModel:
  model: TransformerLM
  notices: list[str]    # what start-up should say about the weights (quantization's fallbacks)
