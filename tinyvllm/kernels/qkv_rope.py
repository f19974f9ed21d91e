"""The step between the qkv projection and attention in one kernel (csrc/neutral/qkv_rope.inc, CUDA/Metal): split q/k/v, the
per-head RMSNorm of q and k (Qwen3's QK-norm; optional), RoPE on q and k, and the K/V write to the paged cache.

In tinygrad ops that step is about six small kernels per layer (split, two norms, two rotations, casts) before the KV
write; at batch-1 decode each is a launch of a few microseconds. The kernel reads each qkv row once with 16-byte loads
and writes q (rotated) and the cache rows; the portable form (tinyvllm/layers/portable.py: `qkv_rope_write`) is the
reference and the fallback.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tinygrad import Tensor, dtypes

from tinyvllm.kernels.plan import DTYPE_CODES, ELEM_BYTES, Launch, Param, cdiv, dtype_code
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import has_buffer_identity, run_kernel
from tinyvllm.layers.fp8 import is_fp8

MAX_THREADS = 256
MAX_HEAD_DIM = 256
DTYPE_NAMES = {dtypes.float32: "float32", dtypes.float16: "float16", dtypes.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class QkvRopeShape:
  dtype: str           # qkv, q, norm weights and (without kv_fp8) the caches
  num_tokens: int      # N (static, padded)
  num_heads: int       # H
  num_kv_heads: int    # KVH
  head_dim: int        # D
  num_slots: int       # cache rows
  qk_norm: bool
  eps: float           # RMSNorm epsilon (used with qk_norm)
  kv_fp8: bool = False  # the caches hold FP8 E4M3 codes

  @property
  def vec(self) -> int: return 16 // ELEM_BYTES[dtype_code(self.dtype)]


@dataclass(frozen=True)
class QkvRopePlan:
  shape: QkvRopeShape
  lanes_per_head: int  # TV_LPH: a power of two >= the 16-byte vectors in half a head
  threads: int
  passes: int          # heads are covered in this many rounds of threads / lanes_per_head
  defines: dict[str, int | str] = field(compare=False)
  launch: Launch = field(compare=False)


def unsupported_reason(shape: QkvRopeShape) -> str | None:
  if shape.dtype not in DTYPE_CODES: return f"dtype {shape.dtype} (float32, float16 and bfloat16 are supported)"
  if shape.kv_fp8 and dtype_code(shape.dtype) == 0: return "an FP8 KV cache with float32 activations"
  if shape.num_heads < 1 or shape.num_kv_heads < 1: return "no heads"
  d, vec = shape.head_dim, shape.vec
  if d > MAX_HEAD_DIM: return f"head_dim {d} > {MAX_HEAD_DIM}"
  if d % 2 or (d // 2) % vec: return f"head_dim {d}: half a head is not a whole number of 16-byte vectors ({vec} elements)"
  return None


def qkv_rope_plan(shape: QkvRopeShape) -> QkvRopePlan:
  assert (reason := unsupported_reason(shape)) is None, reason
  hv = shape.head_dim // 2 // shape.vec
  lph = 1 << (hv - 1).bit_length()
  units = shape.num_heads + 2 * shape.num_kv_heads
  lanes = units * lph
  passes = cdiv(lanes, MAX_THREADS)
  threads = max(32, cdiv(cdiv(lanes, passes), 32) * 32)   # the lanes spread evenly over the passes, in whole warps
  passes = cdiv(units, threads // lph)
  n, h, kvh, d = shape.num_tokens, shape.num_heads, shape.num_kv_heads, shape.head_dim
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_NT": threads, "TV_N": n, "TV_H": h, "TV_KVH": kvh,
                                   "TV_D": d, "TV_NSLOTS": shape.num_slots, "TV_LPH": lph, "TV_HV": hv, "TV_PASSES": passes,
                                   "TV_KV_FP8": int(shape.kv_fp8)}
  params = [Param("q", "elem", True, n * h * d), Param("k_cache", "kv", True, shape.num_slots * kvh * d),
            Param("v_cache", "kv", True, shape.num_slots * kvh * d), Param("qkv", "elem", False, n * units * d),
            Param("cos", "float", False, n * d // 2), Param("sin", "float", False, n * d // 2),
            Param("slot_mapping", "int", False, n)]
  if shape.qk_norm:
    defines["TV_QK_NORM"] = len(params)
    defines["TV_EPS"] = f"{float(shape.eps)!r}f"
    params += [Param("q_norm", "elem", False, d), Param("k_norm", "elem", False, d)]
  return QkvRopePlan(shape, lph, threads, passes, defines, Launch("tv_qkv_rope_write", (n, 1, 1), threads, tuple(params)))


@functools.cache
def _compiled(dialect: str, shape: QkvRopeShape) -> tuple[QkvRopePlan, str]:
  plan = qkv_rope_plan(shape)
  return plan, kernel_source(dialect, "qkv_rope", plan.defines)


def qkv_rope_shape(qkv: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, cos: Tensor, sin: Tensor, k_cache: Tensor,
                   v_cache: Tensor, slot_mapping: Tensor, eps: float) -> tuple[QkvRopeShape | None, str | None]:
  """The static shape of one call and why the kernel cannot take it (None: it can)."""
  if qkv.ndim != 2 or k_cache.ndim != 2 or cos.ndim != 2 or slot_mapping.ndim != 1: return None, "tensor ranks"
  n, d = qkv.shape[0], 2 * cos.shape[1]
  if not all(isinstance(x, int) for x in (*qkv.shape, *k_cache.shape, *cos.shape)): return None, "symbolic shape"
  kv_fp8 = is_fp8(k_cache)
  dtype = DTYPE_NAMES.get(qkv.dtype if kv_fp8 else k_cache.dtype)
  if dtype is None: return None, f"{'qkv' if kv_fp8 else 'cache'} dtype {(qkv if kv_fp8 else k_cache).dtype.name}"
  if not kv_fp8 and qkv.dtype != k_cache.dtype: return None, f"qkv dtype {qkv.dtype.name} differs from the cache's {k_cache.dtype.name}"
  if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape: return None, "K and V caches differ"
  if slot_mapping.dtype != dtypes.int32: return None, "slot mapping not int32"
  if d == 0 or k_cache.shape[1] % d or qkv.shape[1] % d: return None, "rows not a whole number of heads"
  if cos.shape != (n, d // 2) or sin.shape != cos.shape or slot_mapping.shape[0] != n: return None, "cos/sin/slots do not match qkv"
  if (q_norm is None) != (k_norm is None): return None, "only one of q_norm and k_norm"
  if q_norm is not None and (q_norm.shape != (d,) or k_norm is None or k_norm.shape != (d,)): return None, "norm weights not [head_dim]"
  kvh = k_cache.shape[1] // d
  shape = QkvRopeShape(dtype, n, qkv.shape[1] // d - 2 * kvh, kvh, d, k_cache.shape[0], q_norm is not None, float(eps), kv_fp8)
  return shape, unsupported_reason(shape)


def _as_buffer(t: Tensor) -> Tensor: return t if has_buffer_identity(t) else t.contiguous()


def run_qkv_rope_write(dialect: str, shape: QkvRopeShape, qkv: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, cos: Tensor,
                       sin: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor, Tensor]:
  """q [N, H, D] and the caches after the write (written in place, like the KV write kernel).

  Inputs that already are buffers (or kernel outputs) go in as they are; `slot_mapping` always does (as in the KV write):
  it is a slice of the step's packed JIT input, and `.contiguous()` on that slice made the TinyJit replays compute wrong
  results (H200, tinygrad 0.14: stories260K greedy diverged at the first replayed step; mechanism not pinned down).
  q is allocated [N, H, D], so no reshape sits between it and the attention kernel (a reshaped kernel output costs a copy
  kernel when made contiguous)."""
  plan, source = _compiled(dialect, shape)
  n, h, d = shape.num_tokens, shape.num_heads, shape.head_dim
  q = Tensor.empty(n, h, d, dtype=qkv.dtype, device=qkv.device)
  if not has_buffer_identity(k_cache): k_cache = k_cache.clone()
  if not has_buffer_identity(v_cache): v_cache = v_cache.clone()
  ins = [_as_buffer(qkv), _as_buffer(cos.cast(dtypes.float32)), _as_buffer(sin.cast(dtypes.float32)), slot_mapping]
  if shape.qk_norm:
    assert q_norm is not None and k_norm is not None
    ins += [_as_buffer(q_norm.cast(qkv.dtype)), _as_buffer(k_norm.cast(qkv.dtype))]
  q, kc, vc = run_kernel(plan.launch, source, [q, k_cache, v_cache, *ins])[:3]
  return q, kc, vc
