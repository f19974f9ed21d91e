"""The KV cache's static scales a quantized checkpoint carries, applied as vLLM applies them under --kv-cache-dtype
fp8: the cache holds e4m3(k / k_scale) and e4m3(v / v_scale), and attention reads them back times the scales.

Here the scales are folded into each layer's weights at load, so that every attention path (the portable ops, the
kernels, the persistent layer kernel) runs unchanged: q is multiplied by k_scale and k divided by it (q . k is the same),
v is divided by v_scale and o_proj's input multiplied by it (o is the same); what reaches the cache is k / k_scale and
v / v_scale. Qwen3's q and k are RMS-normed per head after their projections, so there the factors go to q_norm and
k_norm. A packed weight takes them in its float32 scales and shifts; a float one is multiplied in float32 and rounded
back to its dtype. Without an FP8 cache the scales are not used (the cache holds k and v as they are); start-up says
which it is.

Where checkpoints put them (per layer, one float32 value each; the first found is used):
- ModelOpt (kv_cache_quant_algo FP8): `self_attn.k_proj.k_scale`, `self_attn.v_proj.v_scale`;
- compressed-tensors (kv_cache_scheme) and vLLM's own name: `self_attn.k_scale`, `self_attn.v_scale`;
- AutoFP8 (static FP8): `self_attn.k_proj.output_scale`, `self_attn.v_proj.output_scale`; older files one
  `self_attn.kv_scale` for both.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from tinygrad import Tensor, dtypes

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.backend.weights import DecoderLayerWeights, Weight
from tinyvllm.config import ConfigError
from tinyvllm.model.safetensors_file import Checkpoint, bf16_as_float32
from tinyvllm.model_config import ModelConfig

NAMES = {"k": ("self_attn.k_scale", "self_attn.k_proj.k_scale", "self_attn.k_proj.output_scale", "self_attn.kv_scale"),
         "v": ("self_attn.v_scale", "self_attn.v_proj.v_scale", "self_attn.v_proj.output_scale", "self_attn.kv_scale")}


@dataclass(frozen=True)
class KVScales:
  layers: dict[int, tuple[float, float]]   # each layer's (k_scale, v_scale) where the checkpoint has either
  kinds: tuple[str, ...]                   # the tensors' own names (k_scale, output_scale, ...), for start-up

  def notice(self, applied: bool) -> str:
    what = f"the checkpoint's KV cache scales ({', '.join(self.kinds)})"
    if applied: return f"{what} are applied in {len(self.layers)} layers: the FP8 cache holds k / k_scale and v / v_scale"
    return f"{what} are not used: the KV cache is not FP8 (--kv-cache-dtype fp8 applies them)"


def read_kv_scales(checkpoint: Checkpoint, num_layers: int, used: set[str]) -> KVScales:
  """Each layer's (k_scale, v_scale) where the checkpoint has either (1.0 for the other), the tensors marked used."""
  scales, kinds = {}, set()
  for i in range(num_layers):
    found = [_scale(checkpoint, [f"model.layers.{i}.{n}" for n in NAMES[part]], used, kinds) for part in ("k", "v")]
    if any(s is not None for s in found): scales[i] = (found[0] or 1.0, found[1] or 1.0)
  return KVScales(scales, tuple(sorted(kinds)))


def _scale(checkpoint: Checkpoint, names: list[str], used: set[str], kinds: set[str]) -> float | None:
  name = next((n for n in names if n in checkpoint), None)
  if name is None: return None
  used.update(n for n in names if n in checkpoint)   # (every name holding this scale: one of them is read)
  kinds.add(name.rsplit(".", 1)[1])
  values = bf16_as_float32(np.asarray(checkpoint.array(name))).astype(np.float32).reshape(-1)
  if values.size != 1 or not np.isfinite(values[0]) or values[0] <= 0:
    raise ConfigError(f"KV cache scale {name} is {values.tolist()}, expected one finite positive value")
  return float(values[0])


def fold_kv_scales(layer: DecoderLayerWeights, cfg: ModelConfig, k_scale: float, v_scale: float) -> DecoderLayerWeights:
  """The layer with k_scale and v_scale folded into its q, k, v and o weights (the module docstring)."""
  q_factor, k_factor = (1.0, 1.0) if cfg.qk_norm else (k_scale, 1.0 / k_scale)
  rows = np.concatenate([np.full(cfg.q_size, q_factor), np.full(cfg.kv_size, k_factor), np.full(cfg.kv_size, 1.0 / v_scale)])
  norm = lambda w, f: None if w is None else _scaled(w, np.full(w.shape[0], f))
  return replace(layer, qkv_proj=_scaled(layer.qkv_proj, rows), qkv_bias=None if layer.qkv_bias is None else _scaled(layer.qkv_bias, rows),
                 q_norm=norm(layer.q_norm, k_scale), k_norm=norm(layer.k_norm, 1.0 / k_scale),
                 o_proj=_scaled(layer.o_proj, np.full(cfg.hidden_size, v_scale)))


def _scaled(w: Weight, factors: np.ndarray) -> Weight:
  """w with its output row r multiplied by factors[r]."""
  if isinstance(w, QuantizedWeight):
    f = Tensor(factors.astype(np.float32).reshape(-1, 1), device=w.scales.device)
    return replace(w, scales=(w.scales * f).contiguous(), shifts=None if w.shifts is None else (w.shifts * f).contiguous())
  f = Tensor(factors.astype(np.float32).reshape(-1, *([1] * (w.ndim - 1))), device=w.device)
  return (w.cast(dtypes.float32) * f).cast(w.dtype).contiguous()
