"""A mixture-of-experts model's routing, read from its HF config.json: Qwen3-MoE and Mixtral.

Both route each token to its `num_experts_per_tok` highest-scoring experts by a softmax over the router's logits, and
add the experts' SwiGLU outputs weighted by those probabilities (renormalised over the chosen ones: Mixtral always,
Qwen3-MoE when `norm_topk_prob`). Qwen3-MoE keeps some layers dense: those in `mlp_only_layers`, and all but every
`decoder_sparse_step`-th. A config field that would change this routing (shared experts, another scoring function, a
scaling factor, grouped top-k) is refused, naming it, rather than ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
# fields of other MoE designs, and the value that means "as Qwen3-MoE / Mixtral route" (None: the field must be absent)
_ROUTING_VARIANTS: dict[str, Any] = {
  "shared_expert_intermediate_size": 0, "n_shared_experts": 0, "num_shared_experts": 0, "moe_shared_expert_intermediate_size": 0,
  "scoring_func": "softmax", "routed_scaling_factor": 1.0, "topk_method": None, "n_group": None, "topk_group": None,
  "first_k_dense_replace": None, "moe_layer_freq": None, "router_bias": False, "moe_topk_method": None,
}


@dataclass(frozen=True)
class MoEConfig:
  num_experts: int
  num_experts_per_tok: int
  intermediate_size: int                 # each expert's (HF's moe_intermediate_size; Mixtral's intermediate_size)
  norm_topk_prob: bool                   # renormalise the chosen experts' probabilities to sum to 1
  decoder_sparse_step: int = 1           # every this-many-th layer is sparse (Qwen3-MoE)
  mlp_only_layers: tuple[int, ...] = ()  # dense layers nonetheless (Qwen3-MoE)

  def is_sparse(self, layer: int) -> bool:
    """Whether layer `layer` (0-based) has experts rather than a dense MLP (HF's rule)."""
    return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def moe_config(arch: str, raw: dict[str, Any], source: str, error: type[Exception]) -> MoEConfig | None:
  """The routing of a MoE architecture's config (None for a dense one); `error` is raised naming a bad field."""
  if arch not in MOE_ARCHITECTURES: return None
  for name, neutral in _ROUTING_VARIANTS.items():
    if name in raw and raw[name] is not None and raw[name] != neutral:
      raise error(f"{source}: {name}={raw[name]!r} is a MoE variant tinyvllm does not run ({arch} routes by a softmax "
                  "top-k over routed experts only)")
  experts = raw.get("num_experts", raw.get("num_local_experts"))
  per_token = raw.get("num_experts_per_tok")
  size = raw.get("moe_intermediate_size") if arch == "Qwen3MoeForCausalLM" else raw.get("intermediate_size")
  for name, value in (("num_experts", experts), ("num_experts_per_tok", per_token), ("moe_intermediate_size", size)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise error(f"{source}: {name} must be a positive integer, got {value!r}")
  if per_token > experts: raise error(f"{source}: num_experts_per_tok {per_token} is more than num_experts {experts}")
  step = raw.get("decoder_sparse_step", 1) if arch == "Qwen3MoeForCausalLM" else 1
  if not isinstance(step, int) or isinstance(step, bool) or step < 1:
    raise error(f"{source}: decoder_sparse_step must be a positive integer, got {step!r}")
  dense = (raw.get("mlp_only_layers") or []) if arch == "Qwen3MoeForCausalLM" else []
  if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
    raise error(f"{source}: mlp_only_layers must be a list of layer indices, got {dense!r}")
  norm = bool(raw.get("norm_topk_prob", False)) if arch == "Qwen3MoeForCausalLM" else True
  return MoEConfig(experts, per_token, size, norm, step, tuple(dense))
