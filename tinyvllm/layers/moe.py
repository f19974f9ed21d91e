"""A sparse layer's mixture of experts in tinygrad ops: the portable form and the reference the kernels are checked
against.

    residual + sum_k w_k * down_e_k( silu(gate_e_k(x')) * up_e_k(x') ),   x' = rmsnorm(x)

where e_1..e_k are each token's k experts of highest router probability (softmax over the router's logits, in
float32) and w their probabilities, renormalised to sum to 1 when norm_topk_prob (HF's Qwen3-MoE and Mixtral). Two
exact ways to compute the experts' outputs, chosen by the step's shape:
- gathered: each (token, expert) pair's weights are gathered and applied to its token; it reads only the chosen
  experts, so it is the one for decode-sized steps (fewer pairs than experts);
- dense: every expert applied to every token, the outputs weighted by a [tokens, experts] table that is zero outside
  each token's k; its products are large batched ones, the better form when most experts have tokens anyway. Its
  intermediates hold every expert's rows for every token ([E, N, 2I] + [E, N, I] + [E, N, H]: 9 GB for 8,192 tokens of
  Qwen3-30B-A3B in bf16), so a large step runs in chunks of tokens, one after another, each within DENSE_CHUNK_ELEMENTS.
Packed (quantized) experts are dequantized as they are read: the gathered form dequantizes the pairs' experts only.
(The CUDA kernels take larger steps on a grouped GEMM over the pairs only: tinyvllm/kernels/moe_grouped.py.)
"""
from __future__ import annotations

from dataclasses import replace

from tinygrad import Tensor

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.backend.weights import MoEWeights, Weight
from tinyvllm.layers.norm import rms_norm
from tinyvllm.layers.quantized import dequantize
from tinyvllm.layers.scatter import gather_rows
from tinyvllm.layers.top_k import top_k


def route(x: Tensor, moe: MoEWeights) -> tuple[Tensor, Tensor]:
  """Each token's experts and their weights: (weights [N, k] float32, expert ids [N, k] int32). The router's product
  and softmax are in float32: HF rounds the logits to the model's dtype first, where two of 128 bf16 experts often
  tie; exact logits route a step the same on every path (the kernels' too: tinyvllm/kernels/moe.py)."""
  weights, ids = top_k(x.float().linear(moe.router.float().T).softmax(-1), moe.top_k)
  if moe.norm_topk_prob: weights = weights / weights.sum(-1, keepdim=True)
  return weights, ids


def gathered_experts(w: Weight, experts: int, ids: Tensor) -> Tensor:
  """The weights of expert ids[p] for each p ([P, R, K]): a packed weight's rows (R of each expert, stacked) gathered in
  their packed form, then dequantized."""
  if not isinstance(w, QuantizedWeight): return gather_rows(w, ids)
  rows, pairs = w.shape[0] // experts, ids.shape[0]
  take = lambda t: gather_rows(t.reshape(experts, rows, -1), ids).reshape(pairs * rows, -1)
  chosen = replace(w, shape=(pairs * rows, w.shape[1]), codes=take(w.codes), scales=take(w.scales),
                   shifts=None if w.shifts is None else take(w.shifts))
  return dequantize(chosen).reshape(pairs, rows, w.shape[1])


def every_expert(w: Weight, experts: int) -> Tensor:
  """Every expert's weights [E, R, K] (a packed weight dequantized)."""
  return w if not isinstance(w, QuantizedWeight) else dequantize(w).reshape(experts, w.shape[0] // experts, w.shape[1])


def experts_gathered(x: Tensor, moe: MoEWeights, weights: Tensor, ids: Tensor) -> Tensor:
  """sum_k weights[:, k] * expert_{ids[:, k]}(x), reading only the chosen experts' weights: x [N, H] -> [N, H]."""
  n, k = ids.shape
  inter, e = moe.intermediate, moe.num_experts
  flat = ids.reshape(-1)
  xs = x.reshape(n, 1, -1).expand(n, k, x.shape[1]).reshape(n * k, 1, x.shape[1])
  gate_up = (xs @ gathered_experts(moe.gate_up_proj, e, flat).transpose(1, 2)).reshape(n * k, 2 * inter)
  act = (gate_up[:, :inter].silu() * gate_up[:, inter:]).contiguous()
  y = (act.reshape(n * k, 1, inter) @ gathered_experts(moe.down_proj, e, flat).transpose(1, 2)).reshape(n, k, x.shape[1])
  return (y * weights.cast(y.dtype).reshape(n, k, 1)).sum(1)


# elements of the dense form's intermediates a chunk of tokens may take (256 MB in bf16; 240 tokens of Qwen3-30B-A3B)
DENSE_CHUNK_ELEMENTS = 1 << 27


def experts_dense(x: Tensor, moe: MoEWeights, weights: Tensor, ids: Tensor, chunk_elements: int = DENSE_CHUNK_ELEMENTS) -> Tensor:
  """The same sum with every expert applied to every token and the outputs weighted by a table that is zero outside
  each token's chosen experts: x [N, H] -> [N, H]. Above `chunk_elements` of intermediates, in chunks of tokens made to
  run one after another: each chunk reads its tokens from the buffer the previous chunks wrote their results into (a
  dependency the scheduler keeps; independent chunks it would start together, their intermediates all alive at once).
  In a captured step (TinyJit, as the engine runs) the chunks share their buffers; run eagerly, each chunk's SwiGLU rows
  (a materialised intermediate) keep a buffer of their own, [E, N, I] in all (computed inside the down product instead
  they would cost a SiLU per output column: ten times the time on the CPU)."""
  n, hidden = x.shape
  inter, experts = moe.intermediate, moe.num_experts
  chunk = max(1, chunk_elements // (experts * (3 * inter + hidden)))
  if n <= chunk: return _experts_dense(x, moe, weights, ids)
  out = Tensor.empty(n, hidden, dtype=x.dtype, device=x.device).assign(x.contiguous())
  for i in range(0, n, chunk):
    part = slice(i, min(n, i + chunk))
    out[part].assign(_experts_dense(out[part], moe, weights[part], ids[part]))
  return out


def _experts_dense(x: Tensor, moe: MoEWeights, weights: Tensor, ids: Tensor) -> Tensor:
  inter, experts = moe.intermediate, moe.num_experts
  gate_up = x.reshape(1, *x.shape) @ every_expert(moe.gate_up_proj, experts).transpose(1, 2)   # [E, N, 2I]
  act = (gate_up[..., :inter].silu() * gate_up[..., inter:]).contiguous()
  y = act @ every_expert(moe.down_proj, experts).transpose(1, 2)                               # [E, N, H]
  table = ((ids.reshape(*ids.shape, 1) == Tensor.arange(experts).to(ids.device)).where(weights.reshape(*weights.shape, 1), 0)
           .sum(1))                                                         # [N, E]
  return (y * table.T.cast(y.dtype).reshape(experts, -1, 1)).sum(0)


def portable_moe(x: Tensor, moe: MoEWeights, *, norm: Tensor, eps: float, residual: Tensor) -> Tensor:
  """residual + the experts' weighted outputs for rmsnorm(x) [N, H]."""
  xn = rms_norm(x, norm, eps)
  weights, ids = route(xn, moe)
  gathered = ids.shape[0] * ids.shape[1] <= moe.num_experts   # fewer (token, expert) pairs than experts: read only theirs
  return residual + (experts_gathered if gathered else experts_dense)(xn, moe, weights, ids)
