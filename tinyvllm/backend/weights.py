"""A decoder layer's weights, as the model loads them and the backends' ops read them."""
from __future__ import annotations

from dataclasses import dataclass, fields

from tinygrad import Tensor

from tinyvllm.backend.quantized import QuantizedWeight

Weight = Tensor | QuantizedWeight   # a linear's weight: plain, or packed (quantized)


@dataclass
class DecoderLayerWeights:
  """q/k/v and gate/up are fused into one matrix each at load, so a layer runs four products (each a plain or a
  quantized weight)."""
  input_norm: Tensor
  qkv_proj: Weight              # [q_size + 2 * kv_size, hidden]
  qkv_bias: Tensor | None
  q_norm: Tensor | None         # [head_dim]: Qwen3's per-head RMSNorm of q and k
  k_norm: Tensor | None
  o_proj: Weight                # [hidden, q_size]
  o_bias: Tensor | None
  post_attention_norm: Tensor
  gate_up_proj: Weight          # [2 * intermediate, hidden]
  gate_up_bias: Tensor | None
  down_proj: Weight             # [hidden, intermediate]
  down_bias: Tensor | None

  def tensors(self) -> list[Tensor]:
    held = (getattr(self, f.name) for f in fields(self))
    return [x for t in held if t is not None for x in (t.tensors() if isinstance(t, QuantizedWeight) else [t])]

  def linears(self) -> list[Weight]: return [self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj]

  def signature(self) -> tuple:
    """Each weight's shape and dtype (None for an absent one): layers with equal signatures share a specialisation."""
    return tuple(None if t is None else (t.shape, t.dtype) for t in (getattr(self, f.name) for f in fields(self)))
