"""Rotary position embeddings: cos/sin tables (with Llama-3 frequency scaling) and HF's rotate-half application."""
from __future__ import annotations

import math

import numpy as np
from tinygrad import Tensor

from tinyvllm.model_config import RopeScaling, YarnScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None,
                        factors: tuple[float, ...] | None = None) -> np.ndarray:
  """1 / theta^(2i/d) as HF computes it (float32), rescaled per Llama-3.1's or YaRN's long-context recipe when asked, or
  divided by per-frequency `factors` (linear scaling, a GGUF file's rope_freqs as llama.cpp applies them)."""
  inv = (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))).astype(np.float32)
  if factors is not None: return (inv / np.asarray(factors, np.float32)).astype(np.float32)
  if isinstance(scaling, YarnScaling): return _yarn_frequencies(inv, head_dim, theta, scaling)
  if scaling is None: return inv
  low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
  smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / \
           (scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_frequencies(inv: np.ndarray, head_dim: int, theta: float, y: YarnScaling) -> np.ndarray:
  """HF's YaRN frequencies from the plain ones `inv`: kept (extrapolation) for dimensions that turn more than beta_fast
  times over the original context, divided by factor (interpolation) below beta_slow turns, a linear ramp between."""
  def dim_of(turns: float) -> float:   # the dimension that turns `turns` times over the original context
    return head_dim * math.log(y.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))
  low, high = dim_of(y.beta_fast), dim_of(y.beta_slow)
  if y.truncate: low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high: high += 0.001
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
  return ((inv / np.float32(y.factor)) * ramp + inv * (1 - ramp)).astype(np.float32)


def rope_tables(head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | YarnScaling | None,
                factors: tuple[float, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
  """cos and sin of shape [max_positions, head_dim // 2], float32 (YaRN's scaled by its attention factor, as HF's)."""
  angles = np.arange(max_positions, dtype=np.float32)[:, None] * inverse_frequencies(head_dim, theta, scaling, factors)[None, :]
  scale = np.float32(scaling.attention_factor if isinstance(scaling, YarnScaling) else 1.0)
  return (np.cos(angles) * scale).astype(np.float32), (np.sin(angles) * scale).astype(np.float32)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
  """x: [N, heads, head_dim]; cos/sin: [N, head_dim // 2]. Rotates the two halves (HF's rotate_half layout)."""
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  c, s = cos.unsqueeze(1).cast(x.dtype), sin.unsqueeze(1).cast(x.dtype)
  return (x1 * c - x2 * s).cat(x2 * c + x1 * s, dim=-1)
