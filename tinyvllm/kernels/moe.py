"""A sparse layer's mixture of experts for decode-sized steps on hand-written kernels (csrc/neutral/moe*.inc, CUDA/Metal):
a step reads only the experts its tokens chose. The router's logits come first (linear.py's product with the RMSNorm
fused, float32 [N, E]); then one of two plans.

The grouped plan reads each chosen expert's weights once, in four launches:
  1. tv_moe_route, one block: each token's softmax, top k and renormalised probabilities, and the step's (token,
     expert) pairs grouped by expert (the `groups` layout of moe.inc);
  2. tv_moe_linear over gate_up: a column of blocks per used expert, each block reading its columns' weight rows once for
     all the expert's pairs, RMSNorm fused: [P, 2I] in pair order;
  3. tv_moe_linear over down, SwiGLU of gate_up's rows fused: [P, H] float32;
  4. tv_moe_combine: residual + each token's k outputs weighted by their probabilities, rounded once.
The direct plan (steps of up to DIRECT_MAX_TOKENS tokens, where tokens seldom share an expert) goes pair by pair in two:
  1. tv_moe_up: a block per (columns, pair) routes its token itself and computes the pair's gate_up columns;
  2. tv_moe_down: a block per (columns, token) computes the token's k pairs' down columns and combines them.
Both give the same bits (the same sums in the same order). Packed experts (MoEShape.weights; each projection's form
of its own) are read as codes with their scales and shifts (moe_products.inc's TV_WQ; packed_params).

In tinygrad ops (tinyvllm/layers/moe.py, the reference and the path for larger steps) the routing is a chain of small
kernels (softmax, k max-reductions, renormalisation) and the gathered products copy each pair's expert weights before
multiplying them: on an H200 at Qwen3-30B-A3B's shape a layer takes 755 us at one token there, 40 in the grouped plan
(bench/check_moe.py; 2,172 against 100 at four tokens, 5,720 against 291 at sixteen).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tinygrad import Tensor, dtypes

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.backend.weights import MoEWeights
from tinyvllm.kernels.linear import DTYPE_NAMES, MAX_ROWS, fused_linear, packed_operands
from tinyvllm.kernels.plan import DTYPE_CODES, ELEM_BYTES, PACKED_WEIGHTS, Launch, Param, cdiv, dtype_code
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import run_kernel
from tinyvllm.layers.norm import rms_norm
from tinyvllm.platform.target import DeviceTarget

# The kernels take steps of at most MAX_TOKENS tokens and MAX_PAIRS (token, expert) pairs; larger ones (prompts) run in
# tinygrad ops. A token picks an expert at most once, so a group holds at most MAX_TOKENS pairs: at most 16 passes (or
# rows of registers) a block, each used expert's weights read from memory once. Past 128 pairs most experts are in use
# anyway (Qwen3-30B-A3B: k = 8 of 128, so 16 tokens already use about 82 experts) and the groups grow while the reads
# the gathering saves shrink: there the portable form's dense products over every expert (tensor cores) are the better
# choice, the point where it switches itself for 128 experts (more pairs than experts). 128 pairs also keep the routing
# block's O(P) scans a pair and its shared memory small.
MAX_TOKENS = MAX_ROWS
MAX_PAIRS = 128
MAX_EXPERTS = 1024     # the routing block holds a token's logits in registers, E / 32 a lane
THREADS = 128          # the grouped products' blocks
BATCH_VECTORS = 16     # weight vectors a lane of the grouped products loads before multiplying any (4 registers each;
                       # on an H200 16 were as fast as 32 with 4 columns a warp, and faster with 8)
ROUTE_WARPS = 8        # the routing block's warps at most for the tokens (more for the pairs: a thread each)
DIRECT_MAX_TOKENS = 4  # steps the direct plan takes (2 launches against 4; an expert two tokens share read twice)
DIRECT_COLUMNS = (8, 4)  # the direct plan's gate_up and down columns a warp. At Qwen3-30B-A3B's shape on an H100, us a
                         # layer (bench/check_moe.py): one token 37.2 (with the grouped kernels' 4 and 8 columns: 38.5;
                         # the grouped plan 42.7), two 63.7 (66.9; 69.4), four 114.1 (118.1; 115.9)
DIRECT_WARPS = 8       # tv_moe_down's warps at most (a block's pairs: k of them)
LARGE_STEP = f"steps of more than {MAX_TOKENS} tokens or {MAX_PAIRS} (token, expert) pairs"
KIND_DTYPES = {"float": dtypes.float32, "int": dtypes.int32}


@dataclass(frozen=True)
class MoEShape:
  dtype: str           # activations and every weight
  tokens: int          # N (static, padded)
  hidden: int          # H
  intermediate: int    # I (each expert's; gate_up has 2I rows)
  experts: int         # E
  top_k: int           # k
  norm_topk_prob: bool
  eps: float           # the RMSNorm's
  # the experts' gate_up and down weights: (form, scale group): "elem" (the activations' dtype) or packed codes (int8,
  # int4, fp8) with their input columns a scale (a GGUF file's mixes differ between the two)
  weights: tuple[tuple[str, int], tuple[str, int]] = (("elem", 0), ("elem", 0))

  def product(self, product: str) -> tuple[str, int, int]:
    """A product's (form, scale group, K)."""
    (form, group), k = (self.weights[0], self.hidden) if product == "gate_up" else (self.weights[1], self.intermediate)
    return form, group, k

  @property
  def pairs(self) -> int: return self.tokens * self.top_k

  @property
  def slots(self) -> int: return min(self.pairs, self.experts)   # G: at most one group per used expert


@dataclass(frozen=True)
class MoEKernel:
  """One source of the op: its name in the plan, algorithm (sources.ALGORITHMS), #defines and launches."""
  name: str
  algorithm: str
  defines: dict[str, int | str] = field(compare=False)
  launches: tuple[Launch, ...] = field(compare=False)


@dataclass(frozen=True)
class MoEPlan:
  shape: MoEShape
  gate_up: MoEKernel   # tv_moe_linear (grouped) or tv_moe_up (direct), the RMSNorm fused
  down: MoEKernel      # tv_moe_linear (grouped, float32 out) or tv_moe_down (direct, the combine fused)
  routing: MoEKernel | None = None   # the grouped plan's tv_moe_route and tv_moe_combine

  @property
  def direct(self) -> bool: return self.routing is None

  @property
  def kernels(self) -> tuple[MoEKernel, ...]:
    return (self.gate_up, self.down) if self.routing is None else (self.routing, self.gate_up, self.down)

  @property
  def steps(self) -> tuple[tuple[Launch, MoEKernel], ...]:
    """Each launch with its source's kernel, in the order they run (the router product before them is linear.py's):
    route, gate_up, down, combine (grouped) or up, down (direct)."""
    products = (self.gate_up.launches[0], self.gate_up), (self.down.launches[0], self.down)
    if self.routing is None: return products
    route, combine = self.routing.launches
    return (route, self.routing), *products, (combine, self.routing)


def unsupported_reason(shape: MoEShape) -> str | None:
  if shape.dtype not in DTYPE_CODES: return f"dtype {shape.dtype}"
  if shape.tokens > MAX_TOKENS or shape.pairs > MAX_PAIRS: return LARGE_STEP
  if not 1 <= shape.top_k <= shape.experts <= MAX_EXPERTS:
    return f"top {shape.top_k} of {shape.experts} experts (1 <= k <= E <= {MAX_EXPERTS})"
  vec = 16 // ELEM_BYTES[dtype_code(shape.dtype)]
  if shape.hidden % vec or shape.intermediate % vec:
    return f"hidden {shape.hidden} or intermediate {shape.intermediate} not a multiple of {vec} (16-byte vectors)"
  return packed_reason(shape, vec)


def packed_reason(shape: MoEShape, vec: int) -> str | None:
  """Why the experts' packed weights do not fit the products' vectors of `vec` columns (None: they do, or are not
  packed): a vector's codes within one scale group, each expert row's codes whole 32-bit words."""
  for product in ("gate_up", "down"):
    form, group, k = shape.product(product)
    if form == "elem": continue
    if form not in PACKED_WEIGHTS: return f"{form} expert weights ({product})"
    if group % vec or k % group: return f"{product}'s scale group {group} (a multiple of {vec} dividing {k})"
    if k * PACKED_WEIGHTS[form][1] % 32: return f"{product}'s rows of {k} {form} codes (whole 32-bit words a row)"
  return None


def packed_params(shape: MoEShape, product: str, defines: dict[str, int | str], params: list[Param]) -> None:
  """A packed product's codes in place of its weight's parameter, its scales and shifts appended (TV_WQ_ARG); a lane's
  step a span of codes (16 bytes of them, TV_WSPAN) where K and the scale group are whole spans."""
  form, group, k = shape.product(product)
  if form == "elem": return
  code, bits = PACKED_WEIGHTS[form]
  rows = shape.experts * (2 * shape.intermediate if product == "gate_up" else shape.hidden)
  at = next(i for i, p in enumerate(params) if p.name == f"w_{product}")
  params[at] = Param(f"w_{product}", "uint", False, rows * k * bits // 32)
  defines.update({"TV_WQ": code, "TV_WGROUP": group, "TV_WQ_ARG": len(params)})
  if (span := code_span(shape, product)) is not None: defines["TV_WSPAN"] = span
  params += [Param(f"w_{product}_scale", "float", False, rows * (k // group)),
             Param(f"w_{product}_shift", "float", False, rows * (k // group))]


def routing_kernel(shape: MoEShape) -> MoEKernel:
  n, h, e, k, p, g = shape.tokens, shape.hidden, shape.experts, shape.top_k, shape.pairs, shape.slots
  threads = max(32 * min(n, ROUTE_WARPS), cdiv(p, 32) * 32)   # a warp a token (up to 8), a thread a pair
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_NT": threads, "TV_N": n, "TV_E": e, "TV_TOPK": k,
                                   "TV_P": p, "TV_G": g, "TV_EPL": cdiv(e, 32), "TV_KPL": cdiv(k, 32),
                                   "TV_NORM_TOPK": int(shape.norm_topk_prob), "TV_HIDDEN": h}
  route = Launch("tv_moe_route", (1, 1, 1), threads, (
    Param("ids", "int", True, p), Param("weights", "float", True, p), Param("groups", "int", True, p + 3 * g),
    Param("logits", "float", False, n * e)))
  combine = Launch("tv_moe_combine", (cdiv(h, threads), n, 1), threads, (
    Param("out", "elem", True, n * h), Param("down", "float", False, p * h), Param("weights", "float", False, p),
    Param("residual", "elem", False, n * h)))
  return MoEKernel("routing", "moe", defines, (route, combine))


def pass_rows(shape: MoEShape) -> int:
  """Rows (pairs) a pass of a group: the average group's when the pairs spread over G experts, at most a token's (one
  row at decode sizes of 128 experts). More cost registers: on an H200 at Qwen3-30B-A3B's shape, 16 tokens (groups of 1-3
  pairs), passes of 1 row took gate_up 154 us and down 114, of 4 rows 172 and 154, of 16 rows 313 and 270; a group's
  further passes re-read its block's slice of the weights from cache, not memory."""
  return min(shape.tokens, cdiv(shape.pairs, shape.slots))


def warp_columns(k: int, packed: bool = False) -> int:
  """Output columns a warp (TV_RPW): 4, or 8 for short rows (K < 1,024) of 16-bit weights so that a warp keeps as many
  bytes in flight. H200, one token of Qwen3-30B-A3B: gate_up (K 2,048) 13.7 us with 4 against 22 with 8 (fewer blocks)
  and 14.3 with 2; down (K 768) 8.9 us with 8 against 10.1 with 4 and 12.4 with 2. Packed codes take 4: a lane's
  16-byte load holds 2-4 times the columns already, and with 8 the 16-token int8 down spilled 72 bytes (nvcc, sm_90)."""
  return 4 if k >= 1024 or packed else 8


def batch_steps(shape: MoEShape, product: str, rpw: int, grouped: bool = False) -> int:
  """Steps of K a batch of loads (TV_SB): BATCH_VECTORS weight vectors a lane; where a step is a span of packed codes
  (code_span), as many columns of x' as that many vectors cover (the x' a batch holds in registers: with a span a
  load, the 16-token int4 gate_up spilled 284 bytes, nvcc sm_90); half as many vectors of packed codes taken a vector a
  step (each holds its scale and shift beside the codes: with as many, the 16-token int8 gate_up spilled 52 bytes).
  FP8 spans in the grouped plan one step a batch: their E4M3 conversion holds more registers (H200, Qwen3-30B-A3B's
  shape, us a layer at 8 / 16 tokens: 170.0 / 269.3 against 188.6 / 302.7 with two; int8 and int4 best as planned;
  bench/moe_packed_sweep.py)."""
  form, span, vec = shape.product(product)[0], code_span(shape, product), 16 // ELEM_BYTES[dtype_code(shape.dtype)]
  if grouped and form == "fp8" and span is not None: return 1
  vectors = BATCH_VECTORS if form == "elem" or span is not None else BATCH_VECTORS // 2
  return max(1, vectors // rpw // ((span or vec) // vec))


def code_span(shape: MoEShape, product: str) -> int | None:
  """The columns of a lane's step in a product of packed codes: a span (16 bytes of codes) where K and the product's
  scale group are whole spans (TV_WSPAN), else None (a vector of activations a step)."""
  form, group, k = shape.product(product)
  if form == "elem": return None
  span = 128 // PACKED_WEIGHTS[form][1]
  return span if k % span == 0 and group % span == 0 else None


def grouped_kernel(shape: MoEShape, product: str) -> MoEKernel:
  """tv_moe_linear for `product` "gate_up" (x: the tokens, RMSNorm fused) or "down" (x: gate_up's rows, SwiGLU fused)."""
  n, h, i, e, p, g = shape.tokens, shape.hidden, shape.intermediate, shape.experts, shape.pairs, shape.slots
  gate_up = product == "gate_up"
  k, nout = (h, 2 * i) if gate_up else (i, h)
  rows, rpw = pass_rows(shape), warp_columns(k, shape.product(product)[0] != "elem")
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_M": rows, "TV_K": k, "TV_NOUT": nout, "TV_RPW": rpw,
                                   "TV_NT": THREADS, "TV_MOE_GROUPED": 1, "TV_P": p, "TV_G": g,
                                   "TV_XDIV": shape.top_k if gate_up else 1, "TV_SB": batch_steps(shape, product, rpw, grouped=True)}
  params = [Param("gate_up" if gate_up else "down", "elem" if gate_up else "float", True, p * nout),
            Param("x" if gate_up else "gate_up", "elem", False, n * h if gate_up else p * 2 * i),
            Param(f"w_{product}", "elem", False, e * nout * k), Param("groups", "int", False, p + 3 * g)]
  if gate_up:
    defines.update({"TV_PRO_NORM": len(params), "TV_EPS": f"{shape.eps!r}f"})
    params.append(Param("norm", "elem", False, h))
  else: defines.update({"TV_PRO_SILU": 1, "TV_OUT_F32": 1})
  packed_params(shape, product, defines, params)
  grid = (cdiv(nout, rpw * THREADS // 32), g, 1)
  return MoEKernel(product, "moe_grouped", defines, (Launch("tv_moe_linear", grid, THREADS, tuple(params)),))


def direct_kernel(shape: MoEShape, product: str, columns: int | None = None) -> MoEKernel:
  """tv_moe_up (`product` "gate_up": routing, RMSNorm fused) or tv_moe_down ("down": SwiGLU and the combine fused) of
  the direct plan, `columns` a warp (else DIRECT_COLUMNS'), K in batches as the grouped kernels'."""
  n, h, i, e, k, p = shape.tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k, shape.pairs
  gate_up = product == "gate_up"
  kdim, nout = (h, 2 * i) if gate_up else (i, h)
  rpw = columns or DIRECT_COLUMNS[0 if gate_up else 1]
  warps = THREADS // 32 if gate_up else min(k, DIRECT_WARPS)
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_M": 1, "TV_K": kdim, "TV_NOUT": nout,
                                   "TV_RPW": rpw, "TV_NT": 32 * warps, "TV_MOE_GROUPED": 1, "TV_MOE_DIRECT": 1,
                                   "TV_SB": batch_steps(shape, product, rpw), "TV_N": n, "TV_E": e, "TV_TOPK": k, "TV_EPL": cdiv(e, 32),
                                   "TV_KPL": cdiv(k, 32), "TV_NORM_TOPK": int(shape.norm_topk_prob), "TV_DW": warps}
  if gate_up:
    params = [Param("gate_up", "elem", True, p * nout), Param("ids", "int", True, p), Param("weights", "float", True, p),
              Param("x", "elem", False, n * h), Param("w_gate_up", "elem", False, e * nout * kdim),
              Param("logits", "float", False, n * e), Param("norm", "elem", False, h)]
    defines.update({"TV_PRO_NORM": len(params) - 1, "TV_EPS": f"{shape.eps!r}f"})   # (the norm's buffer index)
    grid = (cdiv(nout, rpw * warps), k, n)
  else:
    defines["TV_PRO_SILU"] = 1
    params = [Param("out", "elem", True, n * h), Param("gate_up", "elem", False, p * 2 * i),
              Param("w_down", "elem", False, e * nout * kdim), Param("ids", "int", False, p), Param("weights", "float", False, p),
              Param("residual", "elem", False, n * h)]
    grid = (cdiv(nout, rpw), n, 1)
  packed_params(shape, product, defines, params)
  launch = Launch("tv_moe_up" if gate_up else "tv_moe_down", grid, 32 * warps, tuple(params))
  return MoEKernel(product, "moe_direct", defines, (launch,))


def moe_plan(shape: MoEShape, direct: bool | None = None, direct_columns: tuple[int, int] | None = None) -> MoEPlan:
  """The direct plan for steps of up to DIRECT_MAX_TOKENS tokens, else the grouped one (`direct` forces either;
  `direct_columns`: the direct kernels' columns a warp, gate_up's and down's, else the planner's)."""
  assert (reason := unsupported_reason(shape)) is None, reason
  if direct if direct is not None else shape.tokens <= DIRECT_MAX_TOKENS:
    up, down = direct_columns or (None, None)
    return MoEPlan(shape, direct_kernel(shape, "gate_up", up), direct_kernel(shape, "down", down))
  return MoEPlan(shape, grouped_kernel(shape, "gate_up"), grouped_kernel(shape, "down"), routing_kernel(shape))


@functools.cache
def moe_sources(dialect: str, shape: MoEShape, direct: bool | None = None,
                direct_columns: tuple[int, int] | None = None) -> tuple[MoEPlan, dict[str, str]]:
  """The plan (moe_plan's arguments) and each of its kernels' source by name."""
  plan = moe_plan(shape, direct, direct_columns)
  return plan, {kernel.name: kernel_source(dialect, kernel.algorithm, kernel.defines) for kernel in plan.kernels}


def moe_shape(x: Tensor, moe: MoEWeights, eps: float) -> tuple[MoEShape | None, str | None]:
  """The step's static shape and why the kernels do not take it (None: they do)."""
  weights = (moe.router, moe.gate_up_proj, moe.down_proj)
  if len({w.dtype for w in weights}) != 1: return None, "expert weights not all of one dtype"
  dtype = DTYPE_NAMES.get(moe.router.dtype)
  if dtype is None: return None, f"dtype {moe.router.dtype}"
  if x.ndim != 2 or x.shape[1] != moe.hidden: return None, f"activations of shape {x.shape}"
  form = lambda w: (w.code_format, w.group_size) if isinstance(w, QuantizedWeight) else ("elem", 0)
  shape = MoEShape(dtype, x.shape[0], moe.hidden, moe.intermediate, moe.num_experts, moe.top_k, moe.norm_topk_prob, eps,
                   (form(moe.gate_up_proj), form(moe.down_proj)))
  return shape, unsupported_reason(shape)


def expert_buffers(moe: MoEWeights) -> dict[str, Tensor]:
  """The experts' weights by parameter name: each product's, or a packed one's codes, scales and shifts."""
  buffers = {}
  for product, w in (("gate_up", moe.gate_up_proj), ("down", moe.down_proj)):
    parts = packed_operands(w) if isinstance(w, QuantizedWeight) else [w]
    buffers.update(zip((f"w_{product}", f"w_{product}_scale", f"w_{product}_shift"), parts, strict=False))
  return buffers


def router_logits(target: DeviceTarget, x: Tensor, moe: MoEWeights, norm: Tensor, eps: float) -> Tensor:
  """float32 [N, E]: rmsnorm(x) @ router.T on the product kernels, else in tinygrad ops (rounded as the portable route)."""
  logits = fused_linear(target, x, moe.router, None, norm=norm, eps=eps, out_float32=True)
  return logits if logits is not None else rms_norm(x, norm, eps).linear(moe.router.T).float()


def run_moe(target: DeviceTarget, shape: MoEShape, x: Tensor, moe: MoEWeights, norm: Tensor, residual: Tensor,
            direct: bool | None = None, direct_columns: tuple[int, int] | None = None) -> Tensor:
  """residual + the step's experts ([N, H], the weights' dtype): the router product, then the plan's launches, each
  buffer found by its parameter's name (the outputs made when first written; `direct`, `direct_columns` as
  moe_plan's)."""
  plan, sources = moe_sources(target.dialect, shape, direct, direct_columns)
  dtype = moe.router.dtype
  x, norm, residual = (t.cast(dtype).contiguous() for t in (x, norm, residual))
  buffers = {"x": x, "norm": norm, "residual": residual, **expert_buffers(moe),
             "logits": router_logits(target, x, moe, norm, shape.eps).contiguous(),
             # the output in its 2-D shape: the next layer's products take it as it is (a 1-D one reshaped cost a copy)
             "out": Tensor.empty(shape.tokens, shape.hidden, dtype=dtype, device=x.device)}
  for launch, kernel in plan.steps:
    for p in launch.params:
      if p.name not in buffers: buffers[p.name] = Tensor.empty(p.numel, dtype=KIND_DTYPES.get(p.kind, dtype), device=x.device)
    after = run_kernel(launch, sources[kernel.name], [buffers[p.name] for p in launch.params])
    buffers.update({p.name: t for p, t in zip(launch.params, after, strict=True) if p.written})
  return buffers["out"]
