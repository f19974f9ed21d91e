"""A sparse layer's mixture of experts for steps above the decode kernels' bound (prompt chunks, decode batches of 17 or
more sequences) on the tensor-core GEMM (CUDA sm_80+), vLLM's fused_moe / MegaBlocks idea: the step's (token, expert)
pairs sorted by expert, each expert's run padded to whole row blocks of the GEMM's tile, and one grouped product over
them per projection, so a step multiplies the pairs only (not every expert with every token) and reads each used
expert's weights once per row block. Launches, in order:

  1. tv_gemm_xprime: x' = RMSNorm(x) g over the tokens, once (gemm_xprime.inc);
  2. the router's logits from x' (linear.py's product, float32 [N, E]);
  3. moe_align.inc: tv_moe_topk (each token's k experts and weights), tv_moe_count (pairs an expert), tv_moe_align (the
     padded order: each row's pair, each row block's expert, the used blocks);
  4. tv_gemm over gate_up (gemm_tc.inc with TV_MOE_GATHER): row r multiplies x'[pair / k] with its block's expert, the
     SwiGLU in its epilogue (TV_MOE_SWIGLU): [M, I] in the padded order;
  5. tv_gemm over down (TV_MOE_SCATTER): float32 [P, H] in pair order;
  6. tv_moe_combine (moe.inc): residual + each token's k outputs weighted by their probabilities, rounded once.

M, the padded rows, is static: P + (used experts) (BM - 1) bounds them, and blocks past the step's used ones exit at
once. At 8,192 tokens of Qwen3-30B-A3B (P = 65,536) that is [73,600, 768] bf16 (113 MB) for gate_up's SwiGLU and
[65,536, 2,048] float32 (537 MB) for down, where the dense form over every expert needed [128, 8,192, 1,536] (3.2 GB)
and 16 times the products.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from tinygrad import Tensor

from tinyvllm.backend.weights import MoEWeights
from tinyvllm.kernels.gemm import GemmTiles, packed_reason, packed_ring
from tinyvllm.kernels.linear import fused_linear
from tinyvllm.kernels.moe import KIND_DTYPES, MoEKernel, MoEShape, expert_buffers
from tinyvllm.kernels.plan import PACKED_WEIGHTS, Launch, Param, cdiv, dtype_code
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import run_kernel
from tinyvllm.kernels.tuning import tuning_for
from tinyvllm.platform.target import DeviceTarget

ALIGN_THREADS = 512    # the routing / alignment / combine source's blocks (16 tokens a routing block)
MAX_ITEMS = 16         # pairs a thread of tv_moe_align takes per scan (a chunk: 8,192 pairs)
MAX_EXPERTS = 1024     # the routing warp holds a token's logits in registers, E / 32 a lane


Tiles = GemmTiles | tuple[GemmTiles, GemmTiles]   # both products' tiles, or gate_up's and down's (the same rows)


@dataclass(frozen=True)
class GroupedPlan:
  shape: MoEShape
  tiles: GemmTiles     # gate_up's
  down_tiles: GemmTiles
  rows: int            # M: the padded rows' static bound, a multiple of the tiles' rows
  routing: MoEKernel   # tv_moe_topk, tv_moe_count, tv_moe_align, tv_moe_combine
  gate_up: MoEKernel   # tv_gemm_xprime (RMSNorm over the tokens), tv_gemm (rows gathered, SwiGLU in the epilogue)
  down: MoEKernel      # tv_gemm (rows scattered to pair order)

  @property
  def kernels(self) -> tuple[MoEKernel, ...]: return self.routing, self.gate_up, self.down

  @property
  def steps(self) -> tuple[tuple[Launch, MoEKernel], ...]:
    """Each launch after the router product with its kernel, in the order they run (x' comes before: `xprime`)."""
    topk, count, align, combine = self.routing.launches
    r, g, d = self.routing, self.gate_up, self.down
    return (topk, r), (count, r), (align, r), (g.launches[1], g), (d.launches[0], d), (combine, r)

  @property
  def xprime(self) -> Launch: return self.gate_up.launches[0]


def grouped_reason(shape: MoEShape, target: DeviceTarget) -> str | None:
  """Why the grouped tensor-core path does not take the step, or None."""
  if not target.tensor_cores: return f"device {target.arch or target.device} (the grouped expert GEMM needs CUDA sm_80 or newer)"
  if shape.dtype not in ("float16", "bfloat16"): return f"dtype {shape.dtype} (the grouped expert GEMM takes float16 and bfloat16)"
  if not 1 <= shape.top_k <= shape.experts <= MAX_EXPERTS:
    return f"top {shape.top_k} of {shape.experts} experts (1 <= k <= E <= {MAX_EXPERTS})"
  if shape.hidden % 32 or shape.intermediate % 32:
    return f"hidden {shape.hidden} or intermediate {shape.intermediate} not a multiple of 32 (the GEMM's K slices)"
  for product in ("gate_up", "down"):
    if (reason := packed_reason(_ProductWeight(*shape.product(product)))) is not None: return f"packed experts ({product}): {reason}"
  return None


def takes_decode_step(shape: MoEShape, target: DeviceTarget) -> bool:
  """Whether a step the decode kernels could take runs here instead: 16-bit experts past the tuning table's
  decode_kernel_max_tokens, where the grouped GEMM reads the chosen experts faster (packed experts, whose GEMM
  dequantizes each slice in shared memory, keep the decode kernels up to their bound)."""
  return (all(form == "elem" for form, _ in shape.weights)
          and shape.tokens > tuning_for(target.kind).moe.decode_kernel_max_tokens and grouped_reason(shape, target) is None)


@dataclass(frozen=True)
class _ProductWeight:
  """An expert product's weight as gemm.packed_reason reads a LinearShape's."""
  weight: str
  group: int
  in_features: int


def grouped_tiles(shape: MoEShape, target: DeviceTarget) -> GemmTiles:
  """The tuning table's tile for the pairs an expert has on average: small row blocks for decode batches (each expert's
  run padded to one block; its weights read once), 128x128 for prompt chunks (wgmma on Hopper). 64-wide K slices where
  both products' K allow them and the ring keeps three stages."""
  t = tuning_for(target.kind).moe
  rows = shape.pairs / shape.experts
  bk64 = shape.hidden % 64 == 0 and shape.intermediate % 64 == 0
  if target.wgmma and bk64 and rows >= t.grouped_wgmma_rows: return GemmTiles.warpgroup(128, 128, ring=3)
  tile = next(tile for limit, tile in t.grouped_row_tiles if rows <= limit)
  deep = GemmTiles(*tile, 1, 0, 64)
  return deep if bk64 and deep.stages(target) >= 3 else GemmTiles(*tile, 1)


def padded_rows(shape: MoEShape, bm: int) -> int:
  """The static bound of the padded rows: each used expert's run rounded up to whole blocks of bm, at most P + (used
  experts) (bm - 1), floored to whole blocks (their sum is)."""
  return (shape.pairs + min(shape.experts, shape.pairs) * (bm - 1)) // bm * bm


def routing_kernel(shape: MoEShape, bm: int, rows: int) -> MoEKernel:
  n, h, e, k, p = shape.tokens, shape.hidden, shape.experts, shape.top_k, shape.pairs
  nt = ALIGN_THREADS
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_NT": nt, "TV_N": n, "TV_E": e, "TV_TOPK": k,
                                   "TV_P": p, "TV_EPL": cdiv(e, 32), "TV_KPL": cdiv(k, 32),
                                   "TV_NORM_TOPK": int(shape.norm_topk_prob), "TV_HIDDEN": h, "TV_BM": bm, "TV_M": rows,
                                   "TV_MOE_ITEMS": min(MAX_ITEMS, cdiv(p, nt)), "TV_MOE_ALIGN": 1}
  ids, counts = Param("ids", "int", False, p), Param("counts", "int", False, e)
  align = Param("align", "int", True, rows + rows // bm + 1)
  launches = (
    Launch("tv_moe_topk", (cdiv(n, nt // 32), 1, 1), nt, (
      Param("ids", "int", True, p), Param("weights", "float", True, p), Param("logits", "float", False, n * e))),
    Launch("tv_moe_count", (e, 1, 1), nt, (Param("counts", "int", True, e), ids)),
    Launch("tv_moe_align", (e, 1, 1), nt, (align, ids, counts)),
    Launch("tv_moe_combine", (cdiv(h, nt), n, 1), nt, (
      Param("out", "elem", True, n * h), Param("down", "float", False, p * h), Param("weights", "float", False, p),
      Param("residual", "elem", False, n * h))))
  return MoEKernel("routing", "moe_align", defines, launches)


def product_kernel(shape: MoEShape, product: str, tiles: GemmTiles, rows: int, target: DeviceTarget) -> MoEKernel:
  """gemm_tc.inc's grouped product for `product` "gate_up" (x': the tokens' RMSNorm, rows gathered, the SwiGLU of each
  row's gate and up in the epilogue) or "down" (x: gate_up's SwiGLU, rows scattered to pair order, float32)."""
  n, h, i, e, p = shape.tokens, shape.hidden, shape.intermediate, shape.experts, shape.pairs
  gate_up = product == "gate_up"
  k, nout = (h, 2 * i) if gate_up else (i, h)
  stages, smem = tiles.stages(target), tiles.shared_bytes(target)
  form, group, _ = shape.product(product)
  if form != "elem": stages, smem = packed_ring(tiles, PACKED_WEIGHTS[form][1], stages, target)
  if stages < 2: raise ValueError(f"tiles {tiles} leave room for {stages} shared-memory stage(s); at least 2 are needed")
  align = Param("align", "int", False, rows + rows // tiles.bm + 1)
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_M": rows, "TV_K": k, "TV_NOUT": nout, "TV_BM": tiles.bm,
                                   "TV_BN": tiles.bn, "TV_BK": tiles.bk, "TV_WM": tiles.wm, "TV_WN": tiles.wn,
                                   "TV_NT": tiles.threads, "TV_SPLITS": 1, "TV_STAGES": stages, "TV_SMEM_BYTES": smem,
                                   "TV_MIN_BLOCKS": tiles.min_blocks(target)}
  if tiles.wgmma: defines["TV_WGMMA"] = tiles.bn
  if gate_up:
    defines.update({"TV_PRO_NORM": 2, "TV_EPS": f"{shape.eps!r}f", "TV_XPRIME_PASS": 1, "TV_MOE_GATHER": 1,
                    "TV_MOE_XDIV": shape.top_k, "TV_MOE_SWIGLU": 1})
    pre = (Launch("tv_gemm_xprime", (n, 1, 1), tiles.threads, (
      Param("xn", "elem", True, n * h), Param("x", "elem", False, n * h), Param("norm", "elem", False, h))),)
    params = (Param("act", "elem", True, rows * i), Param("xn", "elem", False, n * h))
  else:
    defines.update({"TV_OUT_F32": 1, "TV_MOE_SCATTER": 1})
    pre = ()
    params = (Param("down", "float", True, p * nout), Param("act", "elem", False, rows * k))
  weight = [Param(f"w_{product}", "elem", False, e * nout * k)]
  if form != "elem":   # (gemm_tc.inc's arguments 2-4: codes, scales, shifts)
    code, bits = PACKED_WEIGHTS[form]
    weight = [Param(f"w_{product}", "uint", False, e * nout * k * bits // 32),
              Param(f"w_{product}_scale", "float", False, e * nout * (k // group)),
              Param(f"w_{product}_shift", "float", False, e * nout * (k // group))]
    defines.update({"TV_WQ": code, "TV_WGROUP": group})
  params = (*params, *weight, align)
  defines["TV_MOE"] = len(params) - 1
  gemm = Launch("tv_gemm", (cdiv(nout, tiles.bn), rows // tiles.bm, 1), tiles.threads, params, smem)
  return MoEKernel(product, "gemm_tc", defines, (*pre, gemm))


def grouped_plan(shape: MoEShape, target: DeviceTarget, tiles: Tiles | None = None) -> GroupedPlan:
  assert (reason := grouped_reason(shape, target)) is None, reason
  gate_up, down = (tiles or grouped_tiles(shape, target),) * 2 if not isinstance(tiles, tuple) else tiles
  for t in (gate_up, down):
    if t.splits != 1 or (reason := t.wgmma_error()) is not None:
      raise ValueError(reason or f"tiles {t}: the grouped products do not split K")
  if gate_up.bm != down.bm: raise ValueError(f"tiles {gate_up} and {down}: both products take the same row blocks")
  if shape.hidden % gate_up.bk or shape.intermediate % down.bk:
    raise ValueError(f"tiles {gate_up}, {down}: K slices that do not divide hidden {shape.hidden} / intermediate {shape.intermediate}")
  rows = padded_rows(shape, gate_up.bm)
  return GroupedPlan(shape, gate_up, down, rows, routing_kernel(shape, gate_up.bm, rows),
                     product_kernel(shape, "gate_up", gate_up, rows, target), product_kernel(shape, "down", down, rows, target))


@functools.cache
def grouped_sources(target: DeviceTarget, shape: MoEShape, tiles: Tiles | None = None) -> tuple[GroupedPlan, dict[str, str]]:
  """The plan and each of its kernels' source by name."""
  plan = grouped_plan(shape, target, tiles)
  return plan, {kernel.name: kernel_source("cuda", kernel.algorithm, kernel.defines) for kernel in plan.kernels}


def run_grouped(target: DeviceTarget, shape: MoEShape, x: Tensor, moe: MoEWeights, norm: Tensor, residual: Tensor,
                tiles: Tiles | None = None) -> Tensor:
  """residual + the step's experts ([N, H], the weights' dtype) on the grouped path (with `tiles`, else the planner's):
  x', the router product from it, then the plan's launches, each buffer found by its parameter's name (the outputs
  made when first written)."""
  plan, sources = grouped_sources(target, shape, tiles)
  dtype = moe.router.dtype
  buffers = {name: t.cast(dtype).contiguous() for name, t in (("x", x), ("norm", norm), ("residual", residual))}
  buffers.update(expert_buffers(moe))

  def launch(step: Launch, kernel: MoEKernel) -> None:
    for p in step.params:
      if p.name not in buffers: buffers[p.name] = Tensor.empty(p.numel, dtype=KIND_DTYPES.get(p.kind, dtype), device=x.device)
    after = run_kernel(step, sources[kernel.name], [buffers[p.name] for p in step.params])
    buffers.update({p.name: t for p, t in zip(step.params, after, strict=True) if p.written})

  # x' in a 2-D buffer, which the router product takes as it is (a 1-D one reshaped cost a copy)
  buffers["xn"] = Tensor.empty(shape.tokens, shape.hidden, dtype=dtype, device=x.device)
  launch(plan.xprime, plan.gate_up)
  xn = buffers["xn"]
  logits = fused_linear(target, xn, moe.router, None, out_float32=True)
  buffers["logits"] = (logits if logits is not None else xn.float().linear(moe.router.float().T)).contiguous()
  buffers["out"] = Tensor.empty(shape.tokens, shape.hidden, dtype=dtype, device=x.device)   # (2-D, as xn)
  for step, kernel in plan.steps: launch(step, kernel)
  return buffers["out"]
