"""A decoder layer's weights, as the model loads them and the backends' ops read them."""
from __future__ import annotations

from dataclasses import dataclass, fields

from tinygrad import Tensor

from tinyvllm.backend.quantized import QuantizedWeight

Weight = Tensor | QuantizedWeight   # a linear's weight: plain, or packed (quantized)


@dataclass
class MoEWeights:
  """A sparse layer's experts, stacked at load (from HF's per-expert tensors) so that a kernel indexes them. A packed
  (quantized) projection keeps the experts' rows stacked in one 2-D weight: expert e's rows are [e R, (e + 1) R)."""
  router: Tensor                # [experts, hidden]: the gate whose softmax picks each token's experts
  gate_up_proj: Weight          # [experts, 2 * intermediate, hidden]: each expert's gate rows, then its up rows
  down_proj: Weight             # [experts, hidden, intermediate]
  top_k: int                    # experts per token
  norm_topk_prob: bool          # renormalise the chosen experts' probabilities

  @property
  def num_experts(self) -> int: return self.router.shape[0]

  @property
  def hidden(self) -> int: return self.router.shape[1]

  @property
  def intermediate(self) -> int: return self.down_proj.shape[-1]

  def tensors(self) -> list[Tensor]:
    return [x for t in (self.router, self.gate_up_proj, self.down_proj)
            for x in (t.tensors() if isinstance(t, QuantizedWeight) else [t])]


@dataclass
class DecoderLayerWeights:
  """q/k/v and gate/up are fused into one matrix each at load, so a layer runs four products (each a plain or a
  quantized weight); a sparse layer (`moe`) has experts in place of the dense MLP's two."""
  input_norm: Tensor
  qkv_proj: Weight              # [q_size + 2 * kv_size, hidden]
  qkv_bias: Tensor | None
  q_norm: Tensor | None         # [head_dim]: Qwen3's per-head RMSNorm of q and k
  k_norm: Tensor | None
  o_proj: Weight                # [hidden, q_size]
  o_bias: Tensor | None
  post_attention_norm: Tensor
  gate_up_proj: Weight | None   # [2 * intermediate, hidden] (None in a sparse layer)
  gate_up_bias: Tensor | None
  down_proj: Weight | None      # [hidden, intermediate]
  down_bias: Tensor | None
  moe: MoEWeights | None = None

  def tensors(self) -> list[Tensor]:
    held = (getattr(self, f.name) for f in fields(self))
    return [x for t in held if t is not None for x in (t.tensors() if isinstance(t, (QuantizedWeight, MoEWeights)) else [t])]

  def linears(self) -> list[Weight]:
    return [w for w in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj) if w is not None]

  def signature(self) -> tuple:
    """Each weight's shape and dtype (None for an absent one): layers with equal signatures share a specialisation."""
    held = (getattr(self, f.name) for f in fields(self))
    return tuple(None if t is None else ("moe", *(x.shape for x in t.tensors())) if isinstance(t, MoEWeights) else (t.shape, t.dtype)
                 for t in held)
