"""Tensor-core matrix products (kernels/gemm_tc.inc, CUDA only): the model's projections for decode batches above the
skinny kernel's rows and for prefill chunks, with the same fused RMSNorm / SwiGLU / bias / residual as the skinny one.

tinygrad's generated GEMMs for these shapes (without a beam search) use tensor cores but few blocks and unvectorised
loads; a decode step at batch 32 took 23 ms for weights that one pass reads in 0.4 ms. This plan picks a block tile for
the rows, then splits K (grid z, float32 partials + a reduce kernel) until the grid covers the GPU,
as long as the partial sums cost less traffic than the weights.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from tinyvllm.kernels.plan import Launch, Param, cdiv, dtype_code

TARGET_BLOCKS = 256        # ~2 blocks per H100 SM
SHARED_BYTES = 48 * 1024   # static shared memory per block
MAX_STAGES = 4             # K slices in the shared-memory ring (3 in flight while one is multiplied)
# the RMSNorm / SwiGLU prologue runs once, as its own pass, for products of at least XPRIME_ROWS rows and more than
# XPRIME_COLUMN_BLOCKS column blocks (each would redo it on its copy of every slice: at 2,048 rows the SwiGLU product
# ran at a third of the plain one's speed); below that its launch costs more than the repeats
XPRIME_ROWS = 128
XPRIME_COLUMN_BLOCKS = 4
MAX_SPLITS = 8
MIN_KTILES_PER_SPLIT = 4   # 32-wide K slices each split keeps (fewer leave the double buffer nothing to overlap)
# (BM, BN, warps along M, warps along N) tried in order: the first that makes TARGET_BLOCKS blocks without splitting K
WIDE_TILES = ((64, 128, 2, 2), (64, 64, 2, 2), (32, 64, 2, 2), (16, 64, 1, 4))
# else by rows M, with K split
TILES = ((16, (16, 64, 1, 4)), (32, (32, 64, 2, 2)), (64, (64, 64, 2, 2)), (1 << 30, (64, 128, 2, 2)))
FALLBACK_TILE = (64, 64, 2, 2)   # three stages even with SwiGLU's two halves of x
# for products big enough to give it 4 blocks per SM: fewer, larger blocks won at 2,048 rows (qkv 119 -> 102 us, gate_up
# 186 -> 156 us) and for the logits at 256 rows (731 -> 510 us), though with two stages only (not with SwiGLU's x)
BIG_TILE, BIG_TILE_BLOCKS = (128, 128, 2, 4), 2 * TARGET_BLOCKS


@dataclass(frozen=True)
class GemmTiles:
  bm: int
  bn: int
  wm: int
  wn: int
  splits: int

  @property
  def threads(self) -> int: return 32 * self.wm * self.wn

  def stages(self, silu_mul: bool = False) -> int:
    """Shared-memory stages that fit: each holds a 32-wide K slice of x (both halves for SwiGLU) and of w, in rows
    padded to 40 elements."""
    per_stage = (self.bm * (2 if silu_mul else 1) + self.bn) * 40 * 2
    return min(MAX_STAGES, (SHARED_BYTES - 4 * self.bm - 256) // per_stage)


def unsupported_reason(dtype: str, rows: int, in_features: int, out_features: int) -> str | None:
  if dtype not in ("float16", "bfloat16"): return f"dtype {dtype} (the tensor-core kernel takes float16 and bfloat16)"
  if rows < 1: return "no rows"
  if in_features % 32: return f"in_features {in_features} not a multiple of 32"
  return None


def choose_tiles(rows: int, in_features: int, out_features: int, silu_mul: bool = False) -> GemmTiles:
  """Measured on an H100/H200 (bench/gemm_bench.py, docs/benchmarks.md): many small tiles beat fewer large ones while
  the weights dominate, and splitting K only pays when even the smallest tiles leave the GPU idle. Tiles that leave
  room for fewer than three shared-memory stages are skipped where a smaller one will do."""
  fits = lambda t: GemmTiles(*t, 1).stages(silu_mul) >= 3
  if not silu_mul and rows >= BIG_TILE[0] and cdiv(rows, BIG_TILE[0]) * cdiv(out_features, BIG_TILE[1]) >= BIG_TILE_BLOCKS:
    return GemmTiles(*BIG_TILE, 1)
  for bm, bn, wm, wn in WIDE_TILES:
    if bm <= rows and cdiv(rows, bm) * cdiv(out_features, bn) >= TARGET_BLOCKS and fits((bm, bn, wm, wn)):
      return GemmTiles(bm, bn, wm, wn, 1)
  bm, bn, wm, wn = next((t for limit, t in TILES if rows <= limit and fits(t)), FALLBACK_TILE)
  blocks = cdiv(rows, bm) * cdiv(out_features, bn)
  splits = 1
  # the float32 partials (written and read: 8 bytes per split, row and output) must stay below the weight bytes
  while (splits * 2 <= MAX_SPLITS and blocks * splits < TARGET_BLOCKS and in_features % (32 * splits * 2) == 0
         and in_features // (32 * splits * 2) >= MIN_KTILES_PER_SPLIT and 4 * rows * splits * 2 <= in_features):
    splits *= 2
  return GemmTiles(bm, bn, wm, wn, splits)


def gemm_plan(shape, tiles: GemmTiles | None = None) -> tuple[dict[str, int | str], tuple[Launch, ...]]:
  """Defines and launches (tv_gemm_xprime when the prologue runs as its own pass, tv_gemm, then tv_gemm_reduce when K
  is split) for a LinearShape."""
  m, k, o = shape.rows, shape.in_features, shape.out_features
  t = tiles or choose_tiles(m, k, o, shape.silu_mul)
  prologue = shape.norm_eps is not None or shape.silu_mul
  xprime = prologue and m >= XPRIME_ROWS and cdiv(o, t.bn) > XPRIME_COLUMN_BLOCKS
  stages = t.stages(shape.silu_mul and not xprime)
  if k % (32 * t.splits): raise ValueError(f"tiles {t}: K = {k} does not split into {t.splits} runs of 32-wide slices")
  if stages < 2: raise ValueError(f"tiles {t} leave room for {stages} shared-memory stage(s); at least 2 are needed")
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_M": m, "TV_K": k, "TV_NOUT": o, "TV_BM": t.bm,
                                   "TV_BN": t.bn, "TV_WM": t.wm, "TV_WN": t.wn, "TV_NT": t.threads, "TV_SPLITS": t.splits,
                                   "TV_STAGES": stages}
  y = Param("y", "float" if shape.out_float32 else "elem", True, m * o)
  part = Param("part", "float", True, t.splits * m * o)
  x = Param("x", "elem", False, m * k * (2 if shape.silu_mul else 1))
  gemm = [part if t.splits > 1 else y, Param("xp", "elem", False, m * k) if xprime else x, Param("w", "elem", False, o * k)]
  epilogue = [y, Param("part", "float", False, t.splits * m * o)] if t.splits > 1 else gemm
  pre = [Param("xp", "elem", True, m * k), x]
  if shape.norm_eps is not None:
    defines["TV_PRO_NORM"], defines["TV_EPS"] = len(pre if xprime else gemm), f"{shape.norm_eps!r}f"
    (pre if xprime else gemm).append(Param("g", "elem", False, k))
  if shape.silu_mul: defines["TV_PRO_SILU"] = 1
  if xprime: defines["TV_XPRIME_PASS"] = 1
  if shape.out_float32: defines["TV_OUT_F32"] = 1
  for flag, name, numel, wanted in (("TV_BIAS", "bias", o, shape.bias), ("TV_RESIDUAL", "residual", m * o, shape.residual)):
    if wanted:
      defines[flag] = len(epilogue)
      epilogue.append(Param(name, "elem", False, numel))
  launches = [Launch("tv_gemm_xprime", (m, 1, 1), t.threads, tuple(pre))] if xprime else []
  launches.append(Launch("tv_gemm", (cdiv(o, t.bn), cdiv(m, t.bm), t.splits), t.threads, tuple(gemm)))
  if t.splits > 1: launches.append(Launch("tv_gemm_reduce", (cdiv(m * o, t.threads), 1, 1), t.threads, tuple(epilogue)))
  return defines, tuple(launches)


@functools.cache
def gemm_source(shape, tiles: GemmTiles | None = None) -> tuple[tuple[Launch, ...], str]:
  from tinyvllm.kernels.sources import kernel_source
  defines, launches = gemm_plan(shape, tiles)
  return launches, kernel_source("cuda", "gemm_tc", defines)
