"""Paged attention and the KV write on the hand-written kernels: a call's static shape, its plan, its launches.

Per call the static shape (S, N, Tq, L, heads) comes from the tensors; the decode kernel runs steps with one new token
per sequence (Tq == 1, with a split-K merge when S * KV heads is too small to fill the GPU; large GQA groups at large
batches go to the tensor-core prefill kernel, plan.decode_on_tensor_cores), the prefill/mixed kernel the others.
tinyvllm/kernels/fused.py decides when these run and hands other shapes to the portable ops.
"""
from __future__ import annotations

import functools

from tinygrad import Tensor, dtypes

from tinyvllm.backend.metadata import AttentionMetadata
from tinyvllm.kernels.plan import (
  TC_DECODE_KEY_WARPS,
  AttentionShape,
  DecodePlan,
  PrefillPlan,
  decode_on_tensor_cores,
  decode_plan,
  prefill_plan,
  tc_prefill_plan,
  unsupported_reason,
  write_plan,
)
from tinyvllm.kernels.plan import write_unsupported_reason as _write_unsupported
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import has_buffer_identity, run_kernel, zeroed_counters
from tinyvllm.layers.fp8 import is_fp8
from tinyvllm.platform.target import DeviceTarget

DTYPE_NAMES = {dtypes.float32: "float32", dtypes.float16: "float16", dtypes.bfloat16: "bfloat16"}


@functools.cache
def attention_source(shape: AttentionShape, target: DeviceTarget) -> tuple[DecodePlan | PrefillPlan, str]:
  """The plan and source for a call: decode steps on the decode kernel (or, for large GQA groups at large batches, the
  tensor-core kernel with its warps over the keys), the others on the prefill kernel."""
  if shape.query_len > 1: plan: DecodePlan | PrefillPlan = prefill_plan(shape, target)
  elif decode_on_tensor_cores(shape, target): plan = tc_prefill_plan(shape, TC_DECODE_KEY_WARPS)
  else: plan = decode_plan(shape, target)
  return plan, kernel_source(target.dialect, plan.algorithm, plan.defines)


def attention_shape(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                    target: DeviceTarget) -> tuple[AttentionShape | None, str | None]:
  """The call's static shape and why the kernels cannot take it (None: they can)."""
  n, heads, head_dim = q.shape
  kv_fp8 = is_fp8(k_cache)
  dtype = DTYPE_NAMES.get(q.dtype if kv_fp8 else k_cache.dtype)
  if dtype is None: return None, f"{'activation' if kv_fp8 else 'cache'} dtype {(q if kv_fp8 else k_cache).dtype.name}"
  if v_cache.dtype != k_cache.dtype: return None, "K and V caches differ in dtype"
  if k_cache.shape[1] % head_dim: return None, "cache row is not a whole number of heads"
  if any(t.dtype != dtypes.int32 for t in (meta.block_tables, meta.context_lens, meta.query_start, meta.row_order)):
    return None, "metadata not int32"
  s, tq = meta.query_index.shape
  shape = AttentionShape(dtype, head_dim, heads, k_cache.shape[1] // head_dim, meta.block_size, s, n, tq,
                         meta.block_tables.shape[1] * meta.block_size, k_cache.shape[0], kv_fp8)
  return shape, unsupported_reason(shape, target)


def run_attention(shape: AttentionShape, target: DeviceTarget, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                  meta: AttentionMetadata, plan_source: tuple[DecodePlan | PrefillPlan, str] | None = None) -> Tensor:
  """[N, heads * head_dim] in q's dtype, by the plan for the shape (or the given plan and its source)."""
  n, elem = shape.num_tokens, q.dtype if shape.kv_fp8 else k_cache.dtype
  # q straight from a kernel (the fused qkv step) goes in as it is: a reshape + contiguous of it would cost a copy kernel
  qf = q if q.dtype == elem and has_buffer_identity(q) else q.reshape(n, shape.num_heads * shape.head_dim).cast(elem).contiguous()
  ints = [meta.block_tables, meta.context_lens, meta.query_start, meta.row_order]
  out = Tensor.empty(n, shape.num_heads * shape.head_dim, dtype=elem, device=q.device)
  plan, source = plan_source or attention_source(shape, target)
  out = launch_attention(plan, source, out, qf, k_cache, v_cache, ints)
  return out if out.dtype == q.dtype else out.cast(q.dtype)


def launch_attention(plan: DecodePlan | PrefillPlan, source: str, out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                     ints: list[Tensor], scratch: tuple[Tensor, Tensor] | None = None) -> Tensor:
  """The plan's launches writing `out`; `ints`: block tables, context lengths, query starts, the rows' launch order. A
  split-K decode writes its splits' partial results to `scratch` (part_o, part_ml; new buffers if None), merged by the
  last split of each (sequence, KV head) or by a second launch."""
  first = plan.launches[0]
  if first.kernel != "tv_paged_decode_split": return run_kernel(first, source, [out, q, k_cache, v_cache, *ints])[0]
  numel = {p.name: p.numel for p in first.params}
  part_o, part_ml = scratch or (Tensor.empty(numel["part_o"], dtype=dtypes.float32, device=q.device),
                                Tensor.empty(numel["part_ml"], dtype=dtypes.float32, device=q.device))
  if len(plan.launches) == 1:
    arrivals = zeroed_counters(q.device, numel["arrivals"])
    return run_kernel(first, source, [part_o, part_ml, q, k_cache, v_cache, *ints, out, arrivals])[9]
  part_o, part_ml = run_kernel(first, source, [part_o, part_ml, q, k_cache, v_cache, *ints])[:2]
  return run_kernel(plan.launches[1], source, [out, part_o, part_ml, ints[1], ints[2]])[0]


def kv_write_unsupported_reason(k_cache: Tensor, v_cache: Tensor, k: Tensor, slot_mapping: Tensor) -> str | None:
  kv_fp8 = is_fp8(k_cache)
  elem = k.dtype if kv_fp8 else k_cache.dtype
  dtype = DTYPE_NAMES.get(elem)
  if dtype is None: return f"dtype {elem.name}"
  if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape: return "K and V caches differ"
  if slot_mapping.dtype != dtypes.int32: return "slot mapping not int32"
  return _write_unsupported(dtype, k_cache.shape[1], kv_fp8)


@functools.cache
def _write_source(dialect: str, dtype: str, row: int, num_tokens: int, num_slots: int, kv_fp8: bool):
  plan = write_plan(dtype, row, num_tokens, num_slots, kv_fp8)
  return plan, kernel_source(dialect, "kv_write", plan.defines)


def run_kv_write(target: DeviceTarget, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor,
                 slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
  """The new tokens' K/V rows into their slots, in place (the caches after the write)."""
  n, row, kv_fp8 = k.shape[0], k_cache.shape[1], is_fp8(k_cache)
  elem = k.dtype if kv_fp8 else k_cache.dtype
  plan, source = _write_source(target.dialect, DTYPE_NAMES[elem], row, n, k_cache.shape[0], kv_fp8)
  kr, vr = k.reshape(n, row).cast(elem).contiguous(), v.reshape(n, row).cast(elem).contiguous()
  if not has_buffer_identity(k_cache): k_cache = k_cache.clone()
  if not has_buffer_identity(v_cache): v_cache = v_cache.clone()
  kc, vc = run_kernel(plan.launches[0], source, [k_cache, v_cache, kr, vr, slot_mapping])[:2]
  return kc, vc
