"""The hand-written-kernel backend (CUDA or Metal dialect): fused paged attention and the KV write.

Per call it derives the static shape (S, N, Tq, L, heads) from the tensors, picks the decode kernel (Tq == 1, with a
split-K reduce when S * KV heads is too small to fill the GPU) or the prefill/mixed kernel (Tq > 1), and runs it
through `Tensor.custom_kernel`. Shapes the kernels do not take (unsupported dtype, head_dim, ...) go to the portable
path, and the first time each reason occurs it is printed to stderr, so a fallback is never silent.
"""
from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from dataclasses import replace

from tinygrad import Tensor, dtypes

from tinyvllm.kernels.decode_layer import MAX_LAYERS, DecodeLayerShape, layer_arguments, run_decode_layer
from tinyvllm.kernels.decode_layer import MAX_ROWS as LAYER_MAX_ROWS
from tinyvllm.kernels.decode_layer import unsupported_reason as layer_unsupported_reason
from tinyvllm.kernels.linear import fused_linear
from tinyvllm.kernels.plan import (
  AttentionShape,
  decode_plan,
  default_decode_stages,
  prefill_plan,
  unsupported_reason,
  write_plan,
  write_unsupported_reason,
)
from tinyvllm.kernels.portable import qkv_rope_write
from tinyvllm.kernels.qkv_rope import qkv_rope_shape, run_qkv_rope_write
from tinyvllm.kernels.sample import fused_sample, takes
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import has_buffer_identity, multiprocessor_count, run_kernel
from tinyvllm.layers.attention import AttentionMetadata, paged_attention, write_kv
from tinyvllm.layers.fp8 import is_fp8
from tinyvllm.layers.linear import portable_linear
from tinyvllm.layers.sampler import SamplerVariant
from tinyvllm.model.llama import DecoderLayer

# TINYVLLM_DECODE_LAYER=0 turns the persistent layer kernel off (decode steps then run the per-op kernels)
DECODE_LAYER = os.environ.get("TINYVLLM_DECODE_LAYER", "1") != "0"
# the longest context bucket it takes, by rows: its attention items run their 128-key tiles one after another, so for
# long contexts the split decode kernel is faster (or the layer kernel was not measured there). On an H100
# (docs/benchmarks.md, session 11): batch 1, bucket 8,192: 811 against 686 tok/s, bucket 16,384: 460 against 600;
# 2 / 3 / 4 rows, bucket 4,096: 1,296 / 1,390 / 1,627 against 1,092 / 911 / 1,119. TINYVLLM_DECODE_LAYER_MAX_CONTEXT
# sets one bound for every row count (bench/layer_bound.py measures both sides).
_MAX_CONTEXT_OVERRIDE = os.environ.get("TINYVLLM_DECODE_LAYER_MAX_CONTEXT")
DECODE_LAYER_MAX_CONTEXT = ({rows: int(_MAX_CONTEXT_OVERRIDE) for rows in range(1, LAYER_MAX_ROWS + 1)} if _MAX_CONTEXT_OVERRIDE
                            else {1: 8192, 2: 4096, 3: 4096, 4: 4096})

DTYPE_NAMES = {dtypes.float32: "float32", dtypes.float16: "float16", dtypes.bfloat16: "bfloat16"}


def _log(message: str) -> None: print(f"[tinyvllm] {message}", file=sys.stderr, flush=True)


@functools.cache
def _decode(dialect: str, shape: AttentionShape, splits: int | None = None, kv_together: bool = False,
            stages: int | None = None):
  plan = decode_plan(shape, splits, kv_together, default_decode_stages(shape, dialect) if stages is None else stages)
  return plan, kernel_source(dialect, plan.algorithm, plan.defines)


@functools.cache
def _prefill(dialect: str, shape: AttentionShape):
  plan = prefill_plan(shape, dialect)
  return plan, kernel_source(dialect, plan.algorithm, plan.defines)


@functools.cache
def _write(dialect: str, dtype: str, row: int, num_tokens: int, num_slots: int, kv_fp8: bool):
  plan = write_plan(dtype, row, num_tokens, num_slots, kv_fp8)
  return plan, kernel_source(dialect, "kv_write", plan.defines)


def _layer_signature(layer: DecoderLayer) -> tuple:
  """What the layer kernel is specialised on: each weight's shape and dtype (None for an absent one)."""
  return tuple(None if t is None else (t.shape, t.dtype) for t in vars(layer).values())


class FusedBackend:
  # The smallest context bucket L: the kernels read each context's own length, so L only sizes the block tables and the
  # decode split; a coarse one keeps the number of step layouts (captures) small for contexts up to 2,048.
  min_context_bucket = 2048
  # steps with prompt chunks are padded to max_num_seqs sequences: one capture per token bucket rather than one per
  # (tokens, sequences) pair as admissions fill the batch (padding sequences exit at once)
  pads_prefill_rows = True
  builds_kernels = True      # a new step layout compiles kernel sources: collect and compile them in parallel first

  def __init__(self, dialect: str, device: str, log=_log, decode_splits: int | None = None, kv_together: bool = False,
               decode_stages: int | None = None):
    """decode_splits / kv_together / decode_stages: override the decode plan (for timing experiments; the defaults
    are the tuned ones)."""
    self.name, self.device, self._log = dialect, device, log
    self.decode_splits, self.kv_together, self.decode_stages = decode_splits, kv_together, decode_stages
    self.calls: Counter[str] = Counter()     # which path each traced call took (decode, prefill, write, portable-*)
    self._reported: set[tuple[str, str]] = set()
    # the layer kernel's grid (0: no layer kernel here) and its barrier counters: zeros the kernel leaves zero, one
    # buffer written by every launch of a step in turn (chained through each launch's result)
    self.layer_blocks = multiprocessor_count(device) if dialect == "cuda" and DECODE_LAYER else 0
    self._sync_base = Tensor.zeros(2, dtype=dtypes.uint32, device=device).contiguous().realize() if self.layer_blocks else None

  def describe(self) -> str:
    bounds = ", ".join(f"{bound} at {rows}" for rows, bound in DECODE_LAYER_MAX_CONTEXT.items())
    layers = (f", every layer of 1-{LAYER_MAX_ROWS}-sequence decode steps in one persistent kernel on {self.layer_blocks} SMs "
              f"(context buckets up to {bounds} sequences)") if self.layer_blocks else ""
    return (f"{self.name} (hand-written kernels: fused paged attention, KV write, qkv norm/RoPE/write, decode-batch matmuls, "
            f"sampling{layers}; kernels/*.inc)")

  def linear(self, x: Tensor, w: Tensor, bias: Tensor | None = None, **fused) -> Tensor:
    """Decode-sized products (and the norm, SwiGLU or residual fused with them) in one kernel; others in tinygrad ops."""
    y = fused_linear(self.name, x, w, bias, **fused)
    self.calls["linear" if y is not None else "portable-linear"] += 1
    return y if y is not None else portable_linear(x, w, bias, **fused)

  def sample(self, logits: Tensor, params_bits: Tensor, rng_bits: Tensor, variant: SamplerVariant,
             penalties: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Greedy and temperature-only steps in one kernel (kernels/sample.inc); filters and penalties in tinygrad ops."""
    self.calls["sample" if takes(logits, variant, penalties) else "portable-sample"] += 1
    return fused_sample(self.name, logits, params_bits, rng_bits, variant, penalties)

  def decode_layers(self, layers: list[DecoderLayer], h: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                    meta: AttentionMetadata, eps: float) -> tuple[Tensor, list[tuple[Tensor, Tensor]]] | None:
    """A small decode step's layers in persistent kernels (kernels/decode_layer.inc), up to MAX_LAYERS a launch; None
    where they do not take the step (the model then runs each layer op by op)."""
    k0, v0 = kv_caches[0]
    shape = self._decode_layer_shape(layers, h, cos, k0, v0, meta, eps)
    if shape is None: return None
    self.calls["decode-layers"] += 1
    sync, new_caches = self._sync_base, []
    for first in range(0, len(layers), MAX_LAYERS):
      chunk, caches = layers[first:first + MAX_LAYERS], kv_caches[first:first + MAX_LAYERS]
      out = run_decode_layer(replace(shape, layers=len(chunk)), layer_arguments(chunk, h, cos, sin, caches, meta, sync))
      h, sync = out["h_out"].reshape(h.shape), out["sync"]
      new_caches += [(out[f"k_cache_{li}"], out[f"v_cache_{li}"]) for li in range(len(chunk))]
    return h, new_caches

  def _decode_layer_shape(self, layers: list[DecoderLayer], h: Tensor, cos: Tensor, k_cache: Tensor, v_cache: Tensor,
                          meta: AttentionMetadata, eps: float) -> DecodeLayerShape | None:
    """The kernel's shape for this step (its first launch's number of layers), or None."""
    rows = h.shape[0]
    if (not self.layer_blocks or meta.query_index.shape[1] != 1 or rows != meta.block_tables.shape[0]
        or meta.block_tables.shape[1] * meta.block_size > DECODE_LAYER_MAX_CONTEXT.get(rows, 0)):
      # not a small, short decode step: the per-op kernels are the design there, nothing to report (at every row count it
      # takes, 1-4, the layer kernel is faster: on an H100 1,294 against 825 tok/s at batch 1, 3,804 against 1,591 at 4)
      return None
    head_dim, kv_fp8, layer = 2 * cos.shape[1], is_fp8(k_cache), layers[0]
    dtype = DTYPE_NAMES.get(h.dtype)
    reason = next((r for bad, r in (
      (any(_layer_signature(x) != _layer_signature(layer) for x in layers), "layers of different shapes"),
      (any(b is not None for b in (layer.o_bias, layer.gate_up_bias, layer.down_bias)), "o / MLP biases"),
      (dtype is None or layer.qkv_proj.dtype != h.dtype, f"activations {h.dtype.name}, weights {layer.qkv_proj.dtype.name}"),
      (v_cache.dtype != k_cache.dtype or (not kv_fp8 and k_cache.dtype != h.dtype), "cache dtype"),
      (cos.dtype != dtypes.float32, "RoPE tables not float32"),
      (any(t.dtype != dtypes.int32 for t in (meta.slot_mapping, meta.block_tables, meta.context_lens)), "metadata not int32"),
      (k_cache.shape[1] % head_dim, "cache row is not a whole number of heads")) if bad), None)
    shape = None
    if reason is None:
      shape = DecodeLayerShape(dtype, rows, h.shape[1], layer.o_proj.shape[1] // head_dim, k_cache.shape[1] // head_dim, head_dim,
                               layer.down_proj.shape[1], layer.q_norm is not None, layer.qkv_bias is not None, eps,
                               meta.block_size, meta.block_tables.shape[1], k_cache.shape[0], kv_fp8, self.layer_blocks,
                               layers=min(len(layers), MAX_LAYERS))
      reason = layer_unsupported_reason(shape)
    if reason is None: return shape
    if ("decode-layer", reason) not in self._reported:
      self._reported.add(("decode-layer", reason))
      self._log(f"the {self.name} layer kernel does not take this model's decode steps ({reason}): per-op kernels run them")
    return None

  def _fallback(self, what: str, reason: str) -> None:
    self.calls[f"portable-{what}"] += 1
    if (what, reason) not in self._reported:
      self._reported.add((what, reason))
      self._log(f"{self.name} kernels do not take this {what} shape ({reason}): using the portable path for it")

  def attention_shape(self, q: Tensor, k_cache: Tensor, meta: AttentionMetadata) -> tuple[AttentionShape | None, str | None]:
    n, heads, head_dim = q.shape
    kv_fp8 = is_fp8(k_cache)
    dtype = DTYPE_NAMES.get(q.dtype if kv_fp8 else k_cache.dtype)
    if dtype is None: return None, f"{'activation' if kv_fp8 else 'cache'} dtype {(q if kv_fp8 else k_cache).dtype.name}"
    if k_cache.shape[1] % head_dim: return None, "cache row is not a whole number of heads"
    if any(t.dtype != dtypes.int32 for t in (meta.block_tables, meta.context_lens, meta.query_start)):
      return None, "metadata not int32"
    s, tq = meta.query_index.shape
    max_blocks = meta.block_tables.shape[1]
    shape = AttentionShape(dtype, head_dim, heads, k_cache.shape[1] // head_dim, meta.block_size, s, n, tq,
                           max_blocks * meta.block_size, k_cache.shape[0], kv_fp8)
    return shape, unsupported_reason(shape, self.name)

  def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> Tensor:
    shape, reason = self.attention_shape(q, k_cache, meta)
    if reason is None and v_cache.dtype != k_cache.dtype: reason = "K and V caches differ in dtype"
    if shape is None or reason is not None:
      self._fallback("attention", reason or "unsupported")
      return paged_attention(q, k_cache, v_cache, meta)
    n, elem = shape.num_tokens, q.dtype if shape.kv_fp8 else k_cache.dtype
    # q straight from a kernel (the fused qkv step) goes in as it is: a reshape + contiguous of it would cost a copy kernel
    qf = q if q.dtype == elem and has_buffer_identity(q) else q.reshape(n, shape.num_heads * shape.head_dim).cast(elem).contiguous()
    ints = [meta.block_tables, meta.context_lens, meta.query_start]
    out = Tensor.empty(n, shape.num_heads * shape.head_dim, dtype=elem, device=q.device)
    if shape.query_len == 1:
      plan, source = _decode(self.name, shape, self.decode_splits, self.kv_together, self.decode_stages)
      self.calls["decode" if plan.splits == 1 else "decode-split"] += 1
      if plan.splits == 1:
        out = run_kernel(plan.launches[0], source, [out, qf, k_cache, v_cache, *ints])[0]
      else:
        numel = {p.name: p.numel for p in plan.launches[0].params}
        part_o = Tensor.empty(numel["part_o"], dtype=dtypes.float32, device=q.device)
        part_ml = Tensor.empty(numel["part_ml"], dtype=dtypes.float32, device=q.device)
        part_o, part_ml = run_kernel(plan.launches[0], source, [part_o, part_ml, qf, k_cache, v_cache, *ints])[:2]
        out = run_kernel(plan.launches[1], source, [out, part_o, part_ml, meta.context_lens, meta.query_start])[0]
    else:
      plan, source = _prefill(self.name, shape)
      self.calls["prefill"] += 1
      out = run_kernel(plan.launches[0], source, [out, qf, k_cache, v_cache, *ints])[0]
    return out if out.dtype == q.dtype else out.cast(q.dtype)

  def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    n, row, kv_fp8 = k.shape[0], k_cache.shape[1], is_fp8(k_cache)
    elem = k.dtype if kv_fp8 else k_cache.dtype
    dtype = DTYPE_NAMES.get(elem)
    reason = (f"dtype {elem.name}" if dtype is None else write_unsupported_reason(dtype, row, kv_fp8)) \
      or ("K and V caches differ" if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape else None) \
      or ("slot mapping not int32" if slot_mapping.dtype != dtypes.int32 else None)
    if reason is not None or dtype is None:
      self._fallback("kv-write", reason or "unsupported")
      return write_kv(k_cache, v_cache, k, v, slot_mapping)
    self.calls["write"] += 1
    plan, source = _write(self.name, dtype, row, n, k_cache.shape[0], kv_fp8)
    kr, vr = k.reshape(n, row).cast(elem).contiguous(), v.reshape(n, row).cast(elem).contiguous()
    if not has_buffer_identity(k_cache): k_cache = k_cache.clone()
    if not has_buffer_identity(v_cache): v_cache = v_cache.clone()
    kc, vc = run_kernel(plan.launches[0], source, [k_cache, v_cache, kr, vr, slot_mapping])[:2]
    return kc, vc

  def qkv_rope_write(self, qkv: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, cos: Tensor, sin: Tensor, k_cache: Tensor,
                     v_cache: Tensor, slot_mapping: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Split, QK-norm, RoPE and the KV write in one kernel (kernels/qkv_rope.inc); else tinygrad ops + write_kv."""
    shape, reason = qkv_rope_shape(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, eps)
    if shape is None or reason is not None:
      self._fallback("qkv-rope", reason or "unsupported")
      return qkv_rope_write(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, eps, write=self.write_kv)
    self.calls["qkv-rope"] += 1
    return run_qkv_rope_write(self.name, shape, qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping)
