"""Skinny matrix products for decode batches through csrc/neutral/linear.inc (CUDA/Metal), with the neighbouring small ops
fused in: y = [residual +] (norm(x) | silu(x1) * x2 | x) @ w.T [+ bias].

tinygrad's generated kernels for a few-row product over a large bf16 weight run far from memory bandwidth without a
beam search, and a decode step is little else; this kernel streams each weight row once with 16-byte loads, and folds
the RMSNorm before it, the SwiGLU product and the residual add into its loads and stores. It takes up to MAX_ROWS rows
(the batch's tokens); on CUDA larger products (prefill, big batches) go to the tensor-core kernel (gemm.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from tinygrad import Tensor, dtypes

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.backend.weights import Weight
from tinyvllm.kernels.all_reduce import MAX_BLOCKS, peer_defines, table_words
from tinyvllm.kernels.all_reduce import unsupported_reason as peer_reason
from tinyvllm.kernels.gemm import GemmTiles, gemm_source, packed_reason
from tinyvllm.kernels.gemm import unsupported_reason as gemm_unsupported_reason
from tinyvllm.kernels.plan import DTYPE_CODES, ELEM_BYTES, PACKED_WEIGHTS, Launch, Param, dtype_code
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import run_kernel
from tinyvllm.kernels.tuning import tuning_for
from tinyvllm.platform.target import DeviceTarget

MAX_ROWS = 16
MAX_KSPLIT = 8         # warps a block at most, sharing its columns' K (a step: 32 lanes' 16-byte vectors of each row)
INT4_SWIGLU_KSPLIT = 4    # ... for int4 codes behind the SwiGLU prologue at one or two rows (skinny_layout)
INT8_WIDE_OUT = 8192      # int8 products outside SwiGLU at one or two rows this wide take 4 columns a block, not 2
# from three rows a K split costs its cross-warp sums (rows x columns partials a block), so it goes only as far as a
# grid of GRID_WARPS warps (an H100's 132 SMs x 64 resident) and MAX_WARP_STEPS steps a warp need
GRID_WARPS, MAX_WARP_STEPS = 8192, 4
TC_COLUMNS, TC_STEP = 16, 64   # linear_tc.inc: columns a block, K a step
# a row-parallel product that all-reduces its own outputs takes a decode step's few rows
MAX_ALL_REDUCE_OUTPUTS = 4 * 4096
DTYPE_NAMES = {dtypes.float32: "float32", dtypes.float16: "float16", dtypes.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class LinearShape:
  dtype: str
  rows: int          # M: tokens in the batch (static, padded)
  in_features: int   # K (x has 2K columns with silu_mul)
  out_features: int  # NOUT
  bias: bool
  norm_eps: float | None   # RMSNorm of x (weight g) before the product
  silu_mul: bool
  residual: bool
  out_float32: bool  # y in float32 (the logits) instead of the input dtype
  weight: str = "elem"   # "elem" (w in the activation dtype) or a packed QuantizedWeight's codes: int8, int4, fp8
  group: int = 0         # input columns per scale of a packed weight
  all_reduce: int = 0    # tensor parallelism's row-parallel product: its outputs all-reduced over this many GPUs (CUDA)


@dataclass(frozen=True)
class SkinnyLayout:
  rpw: int      # output columns a block (and a warp: each warp sums its share of K for all of them)
  ksplit: int   # warps a block, each taking every ksplit-th step of K
  tensor_cores: bool = False   # the sums on tensor cores (csrc/cuda/linear_tc.inc: 16 columns a block, 64 K a step)


@dataclass(frozen=True)
class LinearPlan:
  shape: LinearShape
  defines: dict[str, int | str] = field(compare=False)
  launch: Launch = field(compare=False)



def unsupported_reason(shape: LinearShape) -> str | None:
  if shape.dtype not in DTYPE_CODES: return f"dtype {shape.dtype}"
  if not 1 <= shape.rows <= MAX_ROWS: return f"{shape.rows} rows (the kernel takes 1 to {MAX_ROWS})"
  vec = 16 // ELEM_BYTES[dtype_code(shape.dtype)]
  if shape.in_features % vec: return f"in_features {shape.in_features} not a multiple of {vec}"
  if shape.weight != "elem":
    if shape.weight not in PACKED_WEIGHTS: return f"{shape.weight} weights"
    if shape.group % vec or shape.in_features % shape.group: return f"group {shape.group} (a multiple of {vec} dividing K)"
    if shape.in_features * PACKED_WEIGHTS[shape.weight][1] % 32: return f"in_features {shape.in_features} (whole words of codes a row)"
  if shape.norm_eps is not None and shape.silu_mul: return "norm and silu_mul together"
  if shape.all_reduce: return all_reduce_reason(shape)
  return None


def all_reduce_reason(shape: LinearShape) -> str | None:
  """Why the skinny product cannot all-reduce its outputs itself (None: it can)."""
  elem = ELEM_BYTES[dtype_code(shape.dtype)]
  outputs = shape.rows * shape.out_features
  if shape.bias or shape.out_float32 or shape.norm_eps is not None: return "a bias, a norm or float32 outputs"
  if shape.out_features * elem % 16: return f"{shape.out_features} columns (whole 16-byte vectors a row)"
  if outputs > MAX_ALL_REDUCE_OUTPUTS: return f"{outputs} outputs (decode rows: at most {MAX_ALL_REDUCE_OUTPUTS})"
  return peer_reason(outputs, shape.dtype, shape.all_reduce)


def tensor_core_reason(shape: LinearShape, target: DeviceTarget) -> str | None:
  """Why the skinny product cannot take its sums from tensor cores (csrc/cuda/linear_tc.inc), or None."""
  if not target.tensor_cores: return f"device {target.arch or target.device} (mma.sync needs CUDA sm_80 or newer)"
  if shape.dtype != "bfloat16": return f"dtype {shape.dtype} (x' split exactly into two bfloat16 terms)"
  if shape.weight != "elem": return f"{shape.weight} weights"
  if shape.all_reduce: return "an all-reduce"
  if shape.in_features % TC_STEP: return f"in_features {shape.in_features} not a multiple of {TC_STEP}"
  return unsupported_reason(shape)


def tensor_core_layout(shape: LinearShape) -> SkinnyLayout:
  """16 columns a block; K's 64-column steps shared by as many warps as divide them, up to MAX_KSPLIT. nvidia-h200,
  Qwen3-0.6B's logits (K 1,024: 16 steps) at 1 / 2 / 5 / 8 rows: 89.9 / 80.6 / 90.6 / 88.8 µs with 8 warps, 98.6 at
  5 rows with 4 (the FMA form 100.8 / 100.7 / 109.1 / 154.4); Qwen3-30B-A3B's (K 2,048) at 5 / 8 rows 158.8 / 173.4
  with 8, 193.5 / 196.8 with 4 (FMA 199.8 / 296.8); at 12 and 16 rows 127-135 and 131-138 µs with 2-8 warps against
  the GEMM's 136.5 and 141.0 (bench/skinny_bench.py)."""
  steps = shape.in_features // TC_STEP
  return SkinnyLayout(TC_COLUMNS, max(s for s in range(1, MAX_KSPLIT + 1) if steps % s == 0), tensor_cores=True)


def lane_columns(shape: LinearShape) -> int:
  """Input columns a lane covers a step: a 16-byte vector of activations, or a span of packed codes (16 bytes of them)."""
  vec = 16 // ELEM_BYTES[dtype_code(shape.dtype)]
  if shape.weight == "elem": return vec
  span = 128 // PACKED_WEIGHTS[shape.weight][1]
  return span if shape.in_features % span == 0 and shape.group % span == 0 else vec


def skinny_layout(shape: LinearShape) -> SkinnyLayout:
  """Columns a block: each 16-byte w load is matched by rows/rpw x loads (from cache), so more rows want a larger rpw
  (4 keeps 16 rows at ~170 registers without spills: nvcc -Xptxas -v, sm_90), and so do packed codes, whose 16 bytes a
  lane cover more columns, but for int8 codes at one or two rows outside SwiGLU, which take 2 as 16-bit weights do
  (Llama-3.2-1B's int8 qkv 5.7 -> 4.5 us alone, its decode step on the GPU 0.866 -> 0.853 ms; its SwiGLU down 9.3 with
  4 columns, 9.6 with 2) but from INT8_WIDE_OUT outputs (its gate_up, 16,384: 15.4 us with 2, 14.2 with 4 on
  nvidia-h200). Warps: K's steps shared by as many as divide them evenly, up to MAX_KSPLIT. One row on an H100
  (bench/skinny_bench.py, us a call): Qwen3-30B-A3B's o (K 4,096, 16 steps) 11.5 with one warp a block, 7.5 with 8;
  Llama-3.2-1B's down (K 8,192) 30.9 and 15.1; its int4 down (8 steps of 32-column spans) 29.8 with 4 columns and one
  warp, 10.0 with 8 warps; a K of 3,072 (12 steps) 14.0 with 8 warps (four take one step more), 12.2 with 4. Wide
  outputs have warps to spare: Qwen3-0.6B's logits (37,984 blocks) at 5 rows 150.2 with 4 warps, 121.2 with one; at 8
  rows 209.6 and 160.4; Qwen3-30B-A3B's (K 2,048) at 8 rows 498.4 with 8 warps, 300.1 with 2. Int4 codes behind the
  SwiGLU prologue at one or two rows take at most INT4_SWIGLU_KSPLIT warps: Llama-3.2-1B's int4 down 10.2 us with 8
  warps, 8.0 with 4, its decode step on the GPU 0.838 -> 0.816 ms (int8's down, 9.3 and 8.9 alone, made its step 0.877
  -> 0.915 ms: it keeps 8)."""
  steps = -(-shape.in_features // (32 * lane_columns(shape)))
  most = INT4_SWIGLU_KSPLIT if shape.silu_mul and shape.weight == "int4" and shape.rows <= 2 else MAX_KSPLIT
  splits = [s for s in range(1, most + 1) if steps % s == 0]
  narrow = shape.weight == "elem" or (shape.weight == "int8" and not shape.silu_mul and shape.out_features < INT8_WIDE_OUT)
  rpw, ksplit = 2 if shape.rows <= 2 and narrow else 4, max(splits)
  if shape.rows > 2:
    blocks = -(-shape.out_features // rpw)
    ksplit = next((s for s in splits if blocks * s >= GRID_WARPS and steps // s <= MAX_WARP_STEPS), ksplit)
  return SkinnyLayout(rpw, ksplit)


def linear_plan(shape: LinearShape, layout: SkinnyLayout | None = None) -> LinearPlan:
  """The skinny product's specialisation (`layout`: another than skinny_layout's, for benchmarks)."""
  layout = layout or skinny_layout(shape)
  rpw, threads = layout.rpw, 32 * layout.ksplit
  blocks = -(-shape.out_features // rpw)
  m, k, o = shape.rows, shape.in_features, shape.out_features
  params = [Param("y", "float" if shape.out_float32 else "elem", True, m * o),
            Param("x", "elem", False, m * k * (2 if shape.silu_mul else 1))]
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_M": m, "TV_K": k, "TV_NOUT": o, "TV_RPW": rpw,
                                   "TV_KSPLIT": layout.ksplit, "TV_NT": threads}
  if shape.weight == "elem": params.append(Param("w", "elem", False, o * k))
  else:   # codes as 32-bit words, float32 scales and shifts per (row, group)
    code, bits = PACKED_WEIGHTS[shape.weight]
    groups = o * (k // shape.group)
    params += [Param("w", "uint", False, o * k * bits // 32), Param("wscale", "float", False, groups),
               Param("wshift", "float", False, groups)]
    defines.update({"TV_WQ": code, "TV_WGROUP": shape.group})
    if (span := lane_columns(shape)) != 16 // ELEM_BYTES[dtype_code(shape.dtype)]: defines["TV_WSPAN"] = span   # whole 16-byte code loads
  for flag, name, numel in (("TV_BIAS", "bias", o), ("TV_PRO_NORM", "g", k), ("TV_RESIDUAL", "residual", m * o)):
    wanted = {"TV_BIAS": shape.bias, "TV_PRO_NORM": shape.norm_eps is not None, "TV_RESIDUAL": shape.residual}[flag]
    if wanted:
      defines[flag] = len(params)   # the argument's buffer index
      params.append(Param(name, "elem", False, numel))
  if shape.norm_eps is not None: defines["TV_EPS"] = f"{shape.norm_eps!r}f"
  if shape.silu_mul: defines["TV_PRO_SILU"] = 1
  if shape.out_float32: defines["TV_OUT_F32"] = 1
  if layout.tensor_cores:
    assert rpw == TC_COLUMNS and shape.weight == "elem" and shape.in_features % TC_STEP == 0, layout
    defines["TV_TC"] = 1
  grid = blocks
  if shape.all_reduce:   # the group's table last (csrc/cuda/peer.inc), the reducers after the product's blocks
    elem = ELEM_BYTES[dtype_code(shape.dtype)]
    columns = reducer_columns(shape, rpw, threads)
    reducers = -(-o // columns)
    defines.update({"TV_AR": len(params), "TV_BLOCKS": blocks, "TV_REDUCERS": reducers, "TV_RCOLS": columns,
                    **peer_defines(shape.all_reduce, m * o * elem // 4)})
    params.append(Param("table", "uint", False, table_words(shape.all_reduce)))
    grid += reducers
  return LinearPlan(shape, defines, Launch("tv_linear", (grid, 1, 1), threads, tuple(params)))


def reducer_columns(shape: LinearShape, rpw: int, threads: int) -> int:
  """Columns of every row a reducer block of the all-reducing product adds up: a 16-byte vector of one device's
  words a thread (so that each waits for one arrival), a multiple of the vector and of a product block's columns (a
  product block has one reducer), and at most MAX_BLOCKS reducers (one launch counter each)."""
  vec = 16 // ELEM_BYTES[dtype_code(shape.dtype)]
  unit = math.lcm(vec, rpw)
  columns = max(unit, threads // shape.all_reduce * vec // shape.rows // unit * unit)
  least = -(-shape.out_features // MAX_BLOCKS)   # columns a reducer needs for MAX_BLOCKS of them to cover the row
  return max(columns, -(-least // unit) * unit)


@functools.cache
def skinny_source(dialect: str | None, shape: LinearShape, layout: SkinnyLayout | None = None) -> tuple[LinearPlan, str]:
  plan = linear_plan(shape, layout)
  algorithm = "linear_all_reduce" if shape.all_reduce else "linear_tc" if "TV_TC" in plan.defines else "linear"
  return plan, kernel_source(dialect, algorithm, plan.defines)


def pick_kernel(target: DeviceTarget, shape: LinearShape) -> str | None:
  """"skinny" (linear.inc) up to the tuning table's rows (more for wide outputs: the logits, which from
  skinny_tc_min_rows take their sums from tensor cores: "skinny_tc"), "gemm" (tensor cores, CUDA) above, the skinny one
  up to MAX_ROWS where the gemm cannot run (Metal, float32); None: neither takes it."""
  skinny, t = unsupported_reason(shape) is None, tuning_for(target.kind).linear
  wide = shape.out_features >= t.skinny_wide_out
  if skinny and shape.rows <= (t.skinny_wide_max_rows if wide else t.skinny_max_rows):
    tc = wide and 0 < t.skinny_tc_min_rows <= shape.rows and tensor_core_reason(shape, target) is None
    return "skinny_tc" if tc else "skinny"
  if gemm_unsupported_reason(shape.dtype, shape.rows, shape.in_features, shape.out_features, target) is None \
      and packed_reason(shape) is None: return "gemm"
  return "skinny" if skinny else None


def linear_shape(x: Tensor, w: Weight, bias: Tensor | None, norm: Tensor | None, eps: float, silu_mul: bool,
                 residual: Tensor | None, out_float32: bool) -> LinearShape | None:
  """The static shape of one product, None where no kernel dtype or layout fits (a packed weight with act-order
  groups, say)."""
  dtype = DTYPE_NAMES.get(w.dtype)
  if dtype is None or x.ndim != 2: return None
  k = x.shape[1] // 2 if silu_mul else x.shape[1]
  if w.shape[1] != k: return None
  packed = {}
  if isinstance(w, QuantizedWeight):
    if w.g_idx is not None: return None
    packed = {"weight": w.code_format, "group": w.group_size}
  return LinearShape(dtype, x.shape[0], k, w.shape[0], bias is not None, eps if norm is not None else None, silu_mul,
                     residual is not None, out_float32, **packed)


def fused_linear(target: DeviceTarget, x: Tensor, w: Weight, bias: Tensor | None = None, norm: Tensor | None = None,
                 eps: float = 1e-6, silu_mul: bool = False, residual: Tensor | None = None, out_float32: bool = False
                 ) -> Tensor | None:
  """The kernels' result, or None when no kernel takes the shape (the caller then uses tinygrad ops)."""
  shape = linear_shape(x, w, bias, norm, eps, silu_mul, residual, out_float32)
  if shape is None or (kernel := pick_kernel(target, shape)) is None: return None
  return run_linear(target, shape, kernel, x, w, bias, norm, residual)


def run_linear(target: DeviceTarget, shape: LinearShape, kernel: str, x: Tensor, w: Weight, bias: Tensor | None = None,
               norm: Tensor | None = None, residual: Tensor | None = None, tiles: GemmTiles | None = None,
               layout: SkinnyLayout | None = None, peers: Tensor | None = None) -> Tensor:
  """The product on the "skinny", "skinny_tc" or "gemm" kernel (with `tiles` or `layout`, else the planner's); `peers`: a
  tensor-parallel group's peer table, for the skinny product that all-reduces its outputs (shape.all_reduce)."""
  y = Tensor.empty(shape.rows, shape.out_features, dtype=dtypes.float32 if shape.out_float32 else w.dtype, device=x.device)
  x, extras = x.cast(w.dtype).contiguous(), {n: t.cast(w.dtype).contiguous() for n, t in
                                             (("bias", bias), ("norm", norm), ("residual", residual)) if t is not None}
  weights = [w] if isinstance(w, Tensor) else packed_operands(w)
  if kernel == "gemm": return _run_gemm(shape, target, tiles, y, x, weights, w.dtype, extras)
  if kernel == "skinny_tc": layout = layout or tensor_core_layout(shape)
  plan, source = skinny_source(target.dialect, shape, layout)
  return run_kernel(plan.launch, source, [y, x, *weights, *extras.values(), *([] if peers is None else [peers])])[0]


def linear_all_reduce(target: DeviceTarget, x: Tensor, w: Weight, table: Tensor, world: int, residual: Tensor | None = None,
                      silu_mul: bool = False) -> Tensor | None:
  """[residual +] the all-reduce over the group's `world` GPUs of each one's x @ w.T (a local view: each GPU's shard),
  in the skinny product's kernel (`table`: the group's peer table, kernels/all_reduce.py); None where it does not
  take the product (the caller then runs the product and the all-reduce kernel)."""
  shape = linear_shape(x, w, None, None, 1e-6, silu_mul, residual, False)
  if shape is None or target.dialect != "cuda" or pick_kernel(target, shape) != "skinny": return None
  shape = replace(shape, all_reduce=world)
  if unsupported_reason(shape) is not None: return None
  return run_linear(target, shape, "skinny", x, w, residual=residual, peers=table)


def packed_operands(w: QuantizedWeight) -> list[Tensor]:
  """A packed weight's buffers as the kernel takes them: codes, scales, shifts (FP8 has none: its scales stand in,
  never read)."""
  shifts = w.shifts if w.shifts is not None else w.scales
  return [w.codes.reshape(-1), w.scales.reshape(-1), shifts.reshape(-1)]


def _run_gemm(shape: LinearShape, target: DeviceTarget, tiles: GemmTiles | None, y: Tensor, x: Tensor, weights: list[Tensor],
              dtype, extras: dict[str, Tensor]) -> Tensor:
  """The plan's launches in order, each buffer found by its parameter's name (scratch ones made when first written).
  `weights`: w, or a packed weight's codes, scales and shifts; `dtype` the activations'."""
  launches, source = gemm_source(shape, target, tiles)
  buffers = {"y": y, "x": x, **dict(zip(("w", "wscale", "wshift"), weights, strict=False)),
             **({"g": extras["norm"]} if "norm" in extras else {}), **{n: extras[n] for n in ("bias", "residual") if n in extras}}
  for launch in launches:
    for p in launch.params:
      if p.name not in buffers:
        buffers[p.name] = Tensor.empty(p.numel, dtype=dtypes.float32 if p.kind == "float" else dtype, device=x.device)
    after = run_kernel(launch, source, [buffers[p.name] for p in launch.params])
    buffers.update({p.name: t for p, t in zip(launch.params, after, strict=True) if p.written})
  return buffers["y"]
