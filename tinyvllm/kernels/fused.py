"""The hand-written-kernel backend (CUDA or Metal dialect), built for one device target.

Every op of tinyvllm/backend/interface.py runs on a hand-written kernel where the step's shape is in the kernel's range:
paged attention and the KV write (attention.py), the fused qkv split + QK-norm + RoPE + KV write (qkv_rope.py), the
products with their norm / SwiGLU / residual (linear.py, gemm.py), sampling (sample.py), a decode step's mixture of
experts (moe.py), and on Hopper every layer of a 1-4-sequence decode step in one persistent kernel (decode_layer.py). A
call outside a kernel's range goes to the portable op, and the first time each reason occurs it is logged, so a
fallback is never silent.
"""
from __future__ import annotations

import sys
from collections import Counter

from tinygrad import Tensor, dtypes

from tinyvllm.backend.interface import BackendCapabilities, Collectives, KVCaches
from tinyvllm.backend.metadata import AttentionMetadata
from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.backend.sampling import SamplerVariant
from tinyvllm.backend.weights import DecoderLayerWeights, MoEWeights, Weight
from tinyvllm.config import KernelOptions
from tinyvllm.kernels import decode_layer
from tinyvllm.kernels.all_reduce import PeerAllReduce, collectives_for
from tinyvllm.kernels.attention import attention_shape, kv_write_unsupported_reason, run_attention, run_kv_write
from tinyvllm.kernels.linear import MAX_ROWS, fused_linear, linear_all_reduce
from tinyvllm.kernels.moe import LARGE_STEP, moe_shape, run_moe
from tinyvllm.kernels.moe_grouped import grouped_reason, run_grouped, takes_decode_step
from tinyvllm.kernels.plan import AttentionShape, unsupported_reason
from tinyvllm.kernels.qkv_rope import qkv_rope_shape, run_qkv_rope_write
from tinyvllm.kernels.sample import fused_sample, takes
from tinyvllm.kernels.tuning import tuning_for
from tinyvllm.layers.attention import paged_attention, write_kv
from tinyvllm.layers.linear import portable_linear
from tinyvllm.layers.moe import portable_moe
from tinyvllm.layers.portable import qkv_rope_write
from tinyvllm.layers.quantized import permute_input
from tinyvllm.layers.tensor_parallel import TensorParallelGroup
from tinyvllm.platform.target import DeviceTarget

ATTENTION_DTYPES = ("float32", "float16", "bfloat16")
HEAD_SIZE_CANDIDATES = (8, 16, 32, 64, 128, 256, 512)


def _log(message: str) -> None: print(f"[tinyvllm] {message}", file=sys.stderr, flush=True)


def capabilities(target: DeviceTarget) -> BackendCapabilities:
  """What the kernels take on this target: the head sizes whose attention specialisations exist for every dtype."""
  def takes_head(d: int) -> bool:
    shapes = (AttentionShape(dtype, d, 1, 1, 16, 1, 2, 2, 16, 16) for dtype in ATTENTION_DTYPES)
    return all(unsupported_reason(shape, target) is None for shape in shapes)
  return BackendCapabilities(dtypes=ATTENTION_DTYPES, fp8_kv_cache_dtypes=("float16", "bfloat16"),
                             head_sizes=tuple(d for d in HEAD_SIZE_CANDIDATES if takes_head(d)))


class FusedBackend:
  # The smallest context bucket L: the kernels read each context's own length, so L only sizes the block tables and the
  # decode split; a coarse one keeps the number of step layouts (captures) small for contexts up to 2,048.
  min_context_bucket = 2048
  # steps with prompt chunks are padded to max_num_seqs sequences: one capture per token bucket rather than one per
  # (tokens, sequences) pair as admissions fill the batch (padding sequences exit at once)
  pads_prefill_rows = True
  splits_query_runs = False  # its kernels skip padded queries; a row is a sequence
  # ... and so take coarse prompt steps: at least 256 token rows (a product of 256 rows costs about what one of 16
  # does: reading the weights), query runs of 64, 256, 1024 ... tokens. A configuration then meets few prompt layouts,
  # all captured at start-up.
  min_prompt_tokens = 256
  coarse_query_runs = True
  builds_kernels = True      # a new step layout compiles kernel sources: collect and compile them in parallel first

  def __init__(self, target: DeviceTarget, options: KernelOptions | None = None, log=_log):
    if target.dialect is None: raise ValueError(f"no hand-written kernels for device {target.device}")
    options = options or KernelOptions()
    self._custom_all_reduce = options.custom_all_reduce
    self.name, self.target, self._log = target.dialect, target, log
    self.capabilities = capabilities(target)
    self.calls: Counter[str] = Counter()     # which path each traced call took (decode, prefill, write, portable-*)
    self._reported: set[tuple[str, str]] = set()
    # the persistent layer kernel's context bound by rows (none: it never runs), and its barrier counters: zeros the
    # kernel leaves zero, one buffer written by every launch of a step in turn (chained through each launch's result)
    bound = lambda rows: options.decode_layer_max_context or tuning_for(target.kind).decode_layer.max_context(rows)
    layered = options.decode_layer and target.wgmma and target.grid_sync
    self.decode_layer_bounds = {rows: bound(rows) for rows in range(1, decode_layer.MAX_ROWS + 1) if layered and bound(rows)}
    self._sync_base = (Tensor.zeros(2, dtype=dtypes.uint32, device=target.device).contiguous().realize()
                       if self.decode_layer_bounds else None)
    # a verification of proposals small enough runs as a decode step of a row per token: the layer kernel takes it
    self.decode_verify_tokens = max(self.decode_layer_bounds, default=0)

  def describe(self) -> str:
    bounds = ", ".join(f"{bound} at {rows}" for rows, bound in self.decode_layer_bounds.items())
    layers = (f", every layer of 1-{max(self.decode_layer_bounds)}-sequence decode steps in one persistent kernel on "
              f"{self.target.multiprocessors} SMs (context buckets up to {bounds} sequences)") if self.decode_layer_bounds else ""
    return (f"{self.name} (hand-written kernels for {self.target.arch or self.target.device}: fused paged attention, KV write, "
            f"qkv norm/RoPE/write, decode-batch matmuls, sampling{layers})")

  def collectives_for(self, group: TensorParallelGroup) -> Collectives:
    return collectives_for(group, self.name, self._log, self._custom_all_reduce)

  def linear(self, x: Tensor, w: Weight, bias: Tensor | None = None, **fused) -> Tensor:
    """Products (and the norm, SwiGLU or residual fused with them) in one kernel: the skinny one for decode rows, the
    tensor-core one above (CUDA), packed (quantized) weights dequantized in registers or shared memory; others in
    tinygrad ops (a packed weight no kernel takes, act-order groups say, said once per format)."""
    if fused.get("gelu_mul"):   # never reached through the selection: the capability record has SiLU only
      raise ValueError(f"the {self.name} kernels fuse SwiGLU only; a GeGLU (gelu_pytorch_tanh) model runs on the portable backend")
    ordered, ordered_fused = permute_input(w, x, fused)   # (an act-order weight's column order: then a plain grouped one)
    y = fused_linear(self.target, ordered, w, bias, **ordered_fused)
    if y is None and isinstance(w, QuantizedWeight):
      self._fallback("linear", f"{w.describe()} weights no kernel takes here (act-order groups of unequal sizes, or over {MAX_ROWS} rows "
                               "without the tensor-core kernel)")
      return portable_linear(x, w, bias, **fused)
    self.calls["linear" if y is not None else "portable-linear"] += 1
    return y if y is not None else portable_linear(x, w, bias, **fused)

  def row_parallel_linear(self, x: Tensor, w: Weight, collectives: Collectives, *, residual: Tensor, **fused) -> Tensor:
    """Decode rows with the peer all-reduce: the skinny product all-reduces its own outputs (linear.inc, TV_AR), one
    kernel where the product and the all-reduce kernel were two; else the product, then the group's all-reduce."""
    if isinstance(collectives, PeerAllReduce) and set(fused) <= {"silu_mul"}:
      y = linear_all_reduce(self.target, x, w, collectives.table, collectives.group.size, residual, **fused)
      if y is not None:
        self.calls["linear-all-reduce"] += 1
        return y
    return collectives.all_reduce(self.linear(x, w, **fused), residual)

  def moe(self, x: Tensor, moe: MoEWeights, *, norm: Tensor, eps: float, residual: Tensor) -> Tensor:
    """Decode-sized steps (up to moe.MAX_TOKENS tokens and MAX_PAIRS (token, expert) pairs; with 16-bit experts up to
    the tuning table's decode_kernel_max_tokens) on the skinny kernels: the router product, then pair by pair for a few
    tokens (routing in the gate_up product, the combine in down's), else grouped by expert (routing and grouping, the
    two grouped expert products, the combine), each chosen expert's weights read once (kernels/moe.py). Larger steps
    (prompt chunks, decode batches) on the grouped tensor-core GEMM over the pairs sorted by expert
    (kernels/moe_grouped.py, CUDA); otherwise in tinygrad ops, said once."""
    shape, reason = moe_shape(x, moe, eps)
    if shape is not None and reason is None and not takes_decode_step(shape, self.target):
      self.calls["moe"] += 1
      return run_moe(self.target, shape, x, moe, norm, residual)
    if shape is not None and reason in (None, LARGE_STEP):
      if (grouped := grouped_reason(shape, self.target)) is None:
        self.calls["moe-grouped"] += 1
        return run_grouped(self.target, shape, x, moe, norm, residual)
      reason = f"{LARGE_STEP}, where {grouped}"
    self._fallback("moe", reason or "unsupported")
    return portable_moe(x, moe, norm=norm, eps=eps, residual=residual)

  def qkv_rope_write(self, qkv: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, cos: Tensor, sin: Tensor, k_cache: Tensor,
                     v_cache: Tensor, slot_mapping: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Split, QK-norm, RoPE and the KV write in one kernel (qkv_rope.inc); else tinygrad ops + write_kv."""
    shape, reason = qkv_rope_shape(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, eps)
    if shape is None or reason is not None:
      self._fallback("qkv-rope", reason or "unsupported")
      return qkv_rope_write(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, eps, write=self.write_kv)
    self.calls["qkv-rope"] += 1
    return run_qkv_rope_write(self.name, shape, qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping)

  def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    if (reason := kv_write_unsupported_reason(k_cache, v_cache, k, slot_mapping)) is not None:
      self._fallback("kv-write", reason)
      return write_kv(k_cache, v_cache, k, v, slot_mapping)
    self.calls["write"] += 1
    return run_kv_write(self.target, k_cache, v_cache, k, v, slot_mapping)

  def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> Tensor:
    shape, reason = attention_shape(q, k_cache, v_cache, meta, self.target)
    if shape is None or reason is not None:
      self._fallback("attention", reason or "unsupported")
      return paged_attention(q, k_cache, v_cache, meta)
    self.calls["prefill" if shape.query_len > 1 else "decode"] += 1
    return run_attention(shape, self.target, q, k_cache, v_cache, meta)

  def decode_layers(self, layers: list[DecoderLayerWeights], h: Tensor, cos: Tensor, sin: Tensor, kv_caches: KVCaches,
                    meta: AttentionMetadata, eps: float) -> tuple[Tensor, KVCaches] | None:
    """A small decode step's layers in persistent kernels (csrc/cuda/decode_layer.inc), launched as
    decode_layer.layer_launches plans them; None where they do not take the step (the model then runs each layer op by
    op)."""
    if not self.decode_layer_bounds: return None
    k0, v0 = kv_caches[0]
    shape, reason = decode_layer.step_shape(layers, h, cos, k0, v0, meta, eps, self.target,
                                            self.decode_layer_bounds.get(h.shape[0], 0))
    if shape is None:
      if reason is not None and ("decode-layer", reason) not in self._reported:
        self._reported.add(("decode-layer", reason))
        self._log(f"the {self.name} layer kernel does not take this model's decode steps ({reason}): per-op kernels run them")
      return None
    self.calls["decode-layers"] += 1
    sync, new_caches = self._sync_base, []
    for first, launch in decode_layer.layer_launches(shape, layers):
      chunk, caches = layers[first:first + launch.layers], kv_caches[first:first + launch.layers]
      arguments = decode_layer.layer_arguments(chunk, h, cos, sin, caches, meta, sync)
      out = decode_layer.run_decode_layer(launch, self.target, arguments)
      h, sync = out["h_out"].reshape(h.shape), out["sync"]
      new_caches += [(out[f"k_cache_{li}"], out[f"v_cache_{li}"]) for li in range(len(chunk))]
    return h, new_caches

  def sample(self, logits: Tensor, params_bits: Tensor, rng_bits: Tensor, variant: SamplerVariant,
             penalties: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Greedy and temperature-only steps in one kernel (sample.inc); filters and penalties in tinygrad ops."""
    self.calls["sample" if takes(logits, variant, penalties) else "portable-sample"] += 1
    return fused_sample(self.target, logits, params_bits, rng_bits, variant, penalties)

  def _fallback(self, what: str, reason: str) -> None:
    self.calls[f"portable-{what}"] += 1
    if (what, reason) not in self._reported:
      self._reported.add((what, reason))
      self._log(f"{self.name} kernels do not take this {what} shape ({reason}): using the portable path for it")
