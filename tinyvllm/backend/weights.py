"""A decoder layer's weights, as the model loads them and the backends' ops read them."""
from __future__ import annotations

from dataclasses import dataclass, fields

from tinygrad import Tensor


@dataclass
class DecoderLayerWeights:
  """q/k/v and gate/up are fused into one matrix each at load, so a layer runs four products."""
  input_norm: Tensor
  qkv_proj: Tensor              # [q_size + 2 * kv_size, hidden]
  qkv_bias: Tensor | None
  q_norm: Tensor | None         # [head_dim]: Qwen3's per-head RMSNorm of q and k
  k_norm: Tensor | None
  o_proj: Tensor                # [hidden, q_size]
  o_bias: Tensor | None
  post_attention_norm: Tensor
  gate_up_proj: Tensor          # [2 * intermediate, hidden]
  gate_up_bias: Tensor | None
  down_proj: Tensor             # [hidden, intermediate]
  down_bias: Tensor | None

  def tensors(self) -> list[Tensor]: return [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None]

  def signature(self) -> tuple:
    """Each weight's shape and dtype (None for an absent one): layers with equal signatures share a specialisation."""
    return tuple(None if t is None else (t.shape, t.dtype) for t in (getattr(self, f.name) for f in fields(self)))
