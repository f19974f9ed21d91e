"""RMSNorm as HF computes it: normalise in float32, scale by the weight in the input's dtype."""
from __future__ import annotations

from tinygrad import Tensor, dtypes


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
  xf = x.cast(dtypes.float32)
  normed = xf * (xf.square().mean(axis=-1, keepdim=True) + eps).rsqrt()
  return weight * normed.cast(x.dtype)
