"""Tensor-core matrix products (kernels/gemm_tc.inc, CUDA only): the model's projections for decode batches above the
skinny kernel's rows and for prefill chunks, with the same fused RMSNorm / SwiGLU / bias / residual as the skinny one.

tinygrad's generated GEMMs for these shapes (without a beam search) use tensor cores but few blocks and unvectorised
loads; a decode step at batch 32 took 23 ms for weights that one pass reads in 0.4 ms. This plan picks a block tile for
the rows, then splits K (grid z, float32 partials + a reduce kernel) until the grid covers the GPU,
as long as the partial sums cost less traffic than the weights. tv_gemm's ring of K slices is dynamic shared memory:
its Launch carries the bytes (`shared_bytes`), which tinygrad_program.py gives tinygrad's CUDA program.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from tinyvllm.kernels.plan import CUDA_SHARED_OPT_IN, Launch, Param, cdiv, dtype_code

TARGET_BLOCKS = 256        # ~2 blocks per H100 SM
# the stage ring is dynamic shared memory (a block may opt into up to SHARED_LIMIT on an H100/H200); the planner keeps
# each block within SHARED_BYTES, the opt-in limit of sm_86/89/120 GPUs, which also leaves room for two blocks in an
# H100 SM's 228 KB
SHARED_BYTES = 99 * 1024
SHARED_LIMIT = CUDA_SHARED_OPT_IN
MAX_STAGES = 4             # K slices in the shared-memory ring (3 in flight while one is multiplied)
BK = 32                    # the K slice the planner's tiles step in (a tile may ask for 64: half the barriers)
# an H100 SM: shared memory (each resident block takes 1 KB more than it asks) and registers, of which the kernel's
# __launch_bounds__ leaves each thread at least MIN_REGISTERS (the 128x128 tile's warps hold 64 accumulators each)
SM_SHARED_BYTES, SM_REGISTERS, MIN_REGISTERS = 228 * 1024, 65536, 128
# the RMSNorm / SwiGLU prologue runs once, as its own pass, for products of more than XPRIME_COLUMN_BLOCKS column
# blocks (each would redo it on its copy of every slice: at 2,048 rows the SwiGLU product ran at a third of the plain
# one's speed; at 8-64 rows the pass and the product take 0.6-0.9 of the time of the loop's prologue on an H100,
# gemm_bench_h100_xprime_small.json)
XPRIME_COLUMN_BLOCKS = 4
MAX_SPLITS = 8
MIN_KTILES_PER_SPLIT = 4   # K slices each split keeps (fewer leave the double buffer nothing to overlap)
# (BM, BN, warps along M, warps along N) tried in order: the first that makes TARGET_BLOCKS blocks without splitting K
WIDE_TILES = ((64, 128, 2, 2), (64, 64, 2, 2), (32, 64, 2, 2), (16, 64, 1, 4))
# else by rows M, with K split
TILES = ((16, (16, 64, 1, 4)), (32, (32, 64, 2, 2)), (64, (64, 64, 2, 2)), (1 << 30, (64, 128, 2, 2)))
FALLBACK_TILE = (64, 64, 2, 2)   # four stages even with SwiGLU's two halves of x
# for products big enough to give it 4 blocks per SM: fewer, larger blocks won at 2,048 rows (qkv 119 -> 102 us, gate_up
# 186 -> 156 us) and for the logits at 256 rows (731 -> 510 us), then with two stages only (48 KB of static shared
# memory); now 4 (3 with SwiGLU's two halves of x)
BIG_TILE, BIG_TILE_BLOCKS = (128, 128, 2, 4), 2 * TARGET_BLOCKS
# products with a long K (the o and down projections) at decode-batch rows: a 64x64 tile with K split until the grid
# covers the GPU beats thinner row tiles with K whole (H100, 256 rows: o 21.9 -> 16.0 us, down 36.0 -> 23.5 us, with the
# reduce launch; cuBLAS 16.8 / 15.7; gemm_bench_h100_splits_256.json)
LONG_K, LONG_K_ROWS, LONG_K_TILE, LONG_K_MAX_SPLITS = 2048, (128, 256), (64, 64, 2, 2), 4
# 64-wide K slices (half the barriers per K) where K is not split, measured faster on an H100 (gemm_bench_h100_bk64.json):
# the 128x128 tile with 3 stages at 2,048 rows (qkv 94.9 -> 92.6 us, gate_up 149.6 -> 143.2; o 54.8 -> 45.6 and down
# 92.4 -> 76.6, where it also beats the 64x128 tile the block count would pick) and for the logits at 256 rows
# (450 -> 371 us); the 64-row tiles at 256 rows with K 1,024 (qkv 23.1 -> 21.4, gate_up 35.3 -> 31.8)
DEEP_BK, DEEP_BIG_RING, DEEP_WIDE_ROWS, DEEP_BIG_ROWS = 64, 3, 256, 2048
# where wgmma_tiles applies: from WGMMA_MIN_ROWS rows (long K from WGMMA_LONG_K_ROWS), prompt-chunk tiles from
# WGMMA_PROMPT_ROWS, the logits' tile for WGMMA_WIDE_OUT outputs or more
WGMMA_MIN_ROWS, WGMMA_LONG_K_ROWS, WGMMA_PROMPT_ROWS, WGMMA_WIDE_OUT = 128, 256, 1024, 32768


# wgmma tiles (Hopper, kernels/wgmma.inc): N of the instruction, stage rows unpadded in 1,024-byte swizzle atoms (the
# ring's start is aligned at run time: ALIGN_SLACK more bytes), up to the whole SHARED_LIMIT
WGMMA_N, ALIGN_SLACK = (64, 128, 256), 1024


def row_bytes(bk: int, wgmma: bool = False) -> int:
  """A staged row: a bk-wide K slice of 16-bit elements padded by 8 (80 or 144 bytes, 16 mod 128: conflict-free
  fragments); unpadded for wgmma, whose 128-byte swizzle spreads the rows over the banks instead."""
  return bk * 2 if wgmma else (bk + 8) * 2


@dataclass(frozen=True)
class GemmTiles:
  bm: int
  bn: int
  wm: int
  wn: int
  splits: int
  ring: int = 0   # shared-memory stages; 0: as many as fit SHARED_BYTES, up to MAX_STAGES (others: timing experiments)
  bk: int = BK    # K slice depth: 32 or 64 (K must split into whole slices)
  wgmma: bool = False   # Hopper's warpgroup MMA (sm_90a): bk 64, wm = bm / 16, wn 1, bn in WGMMA_N
  xprime: bool | None = None   # the RMSNorm / SwiGLU prologue as its own pass (None: x_prime_pass decides)

  @classmethod
  def warpgroup(cls, bm: int, bn: int, splits: int = 1, ring: int = 0) -> GemmTiles:
    """wgmma tiles: a warpgroup per 64 rows, a warp per 16, each across all bn columns."""
    return cls(bm, bn, bm // 16, 1, splits, ring, 64, True)

  @property
  def threads(self) -> int: return 32 * self.wm * self.wn

  def stage_bytes(self, silu_mul: bool = False) -> int:
    """One stage: a K slice of x (both halves for SwiGLU) and of w."""
    return (self.bm * (2 if silu_mul else 1) + self.bn) * row_bytes(self.bk, self.wgmma)

  def stages(self, silu_mul: bool = False) -> int:
    limit = SHARED_LIMIT - ALIGN_SLACK if self.wgmma else SHARED_BYTES
    return self.ring or min(MAX_STAGES, (limit - 4 * self.bm) // self.stage_bytes(silu_mul))

  def shared_bytes(self, silu_mul: bool = False) -> int:
    """tv_gemm's dynamic shared memory: the stage ring and a float per row (kernels/gemm_tc.inc's TV_SMEM_NEEDED)."""
    return self.stages(silu_mul) * self.stage_bytes(silu_mul) + 4 * self.bm + (ALIGN_SLACK if self.wgmma else 0)

  def min_blocks(self, silu_mul: bool = False) -> int:
    """The kernel's __launch_bounds__ minimum of blocks per SM: as many as the shared memory allows, while each
    thread keeps MIN_REGISTERS (with wgmma: its bn / 2 accumulators and 64 more)."""
    by_registers = SM_REGISTERS // (max(MIN_REGISTERS, self.bn // 2 + 64 if self.wgmma else 0) * self.threads)
    return max(1, min(by_registers, SM_SHARED_BYTES // (self.shared_bytes(silu_mul) + 1024)))

  def wgmma_error(self) -> str | None:
    if not self.wgmma: return None
    if self.bk != 64 or self.wn != 1 or self.bm != 16 * self.wm or self.bm % 64 or self.bn not in WGMMA_N:
      return f"tiles {self}: wgmma takes bk 64, wn 1, wm = bm / 16, bm a multiple of 64 and bn in {WGMMA_N}"
    return None


def unsupported_reason(dtype: str, rows: int, in_features: int, out_features: int, bk: int = BK) -> str | None:
  if dtype not in ("float16", "bfloat16"): return f"dtype {dtype} (the tensor-core kernel takes float16 and bfloat16)"
  if rows < 1: return "no rows"
  if in_features % bk: return f"in_features {in_features} not a multiple of {bk}"
  return None


def wgmma_tiles(rows: int, in_features: int, out_features: int) -> GemmTiles | None:
  """Hopper's wgmma tiles where they beat mma.sync's on an H100 (gemm_bench_h100_wgmma*.json), None elsewhere: the
  128x128 tile with 3 stages (two blocks an SM) for prompt chunks and the logits, a 64x64 tile for the other
  decode-batch products and, for long K from 256 rows, a 128x64 tile with K split until the grid fills (below 256 rows
  mma.sync's 64x64 split tile is as fast)."""
  if in_features % 64 or rows < WGMMA_MIN_ROWS: return None
  if rows >= WGMMA_PROMPT_ROWS or out_features >= WGMMA_WIDE_OUT: return GemmTiles.warpgroup(128, 128, ring=3)
  if in_features < LONG_K: return GemmTiles.warpgroup(64, 64)
  if rows < WGMMA_LONG_K_ROWS: return None
  blocks, splits = cdiv(rows, 128) * cdiv(out_features, 64), 1
  while splits < LONG_K_MAX_SPLITS and blocks * splits < TARGET_BLOCKS and in_features % (128 * splits) == 0 \
      and in_features // (128 * splits) >= MIN_KTILES_PER_SPLIT:
    splits *= 2
  return GemmTiles.warpgroup(128, 64, splits)


def choose_tiles(rows: int, in_features: int, out_features: int, silu_mul: bool = False, wgmma: bool = False) -> GemmTiles:
  """Measured on an H100/H200 (bench/gemm_bench.py, docs/benchmarks.md): many small tiles beat fewer large ones while
  the weights dominate, and splitting K only pays when even the smallest tiles leave the GPU idle. Tiles that leave
  room for fewer than three shared-memory stages are skipped where a smaller one will do. `wgmma`: the device runs
  Hopper's warpgroup MMA (wgmma_tiles first)."""
  if wgmma and (tiles := wgmma_tiles(rows, in_features, out_features)) is not None: return tiles
  fits = lambda t: GemmTiles(*t, 1).stages(silu_mul) >= 3
  if in_features >= LONG_K and LONG_K_ROWS[0] <= rows <= LONG_K_ROWS[1] and fits(LONG_K_TILE):
    blocks, splits = cdiv(rows, LONG_K_TILE[0]) * cdiv(out_features, LONG_K_TILE[1]), 1
    while splits < LONG_K_MAX_SPLITS and blocks * splits < TARGET_BLOCKS and _whole_splits(in_features, 2 * splits): splits *= 2
    return GemmTiles(*LONG_K_TILE, splits)
  big_deep = _deep_slices(BIG_TILE, in_features, out_features, silu_mul, DEEP_BIG_RING)
  if big_deep and rows >= DEEP_BIG_ROWS and in_features >= LONG_K: return big_deep
  if fits(BIG_TILE) and rows >= BIG_TILE[0] and cdiv(rows, BIG_TILE[0]) * cdiv(out_features, BIG_TILE[1]) >= BIG_TILE_BLOCKS:
    return big_deep or GemmTiles(*BIG_TILE, 1)
  for bm, bn, wm, wn in WIDE_TILES:
    if bm <= rows and cdiv(rows, bm) * cdiv(out_features, bn) >= TARGET_BLOCKS and fits((bm, bn, wm, wn)):
      deep = rows >= DEEP_WIDE_ROWS and in_features < LONG_K and _deep_slices((bm, bn, wm, wn), in_features, out_features, silu_mul)
      return deep or GemmTiles(bm, bn, wm, wn, 1)
  bm, bn, wm, wn = next((t for limit, t in TILES if rows <= limit and fits(t)), FALLBACK_TILE)
  blocks = cdiv(rows, bm) * cdiv(out_features, bn)
  splits = 1
  # the float32 partials (written and read: 8 bytes per split, row and output) must stay below the weight bytes
  while (splits * 2 <= MAX_SPLITS and blocks * splits < TARGET_BLOCKS and _whole_splits(in_features, 2 * splits)
         and 4 * rows * splits * 2 <= in_features):
    splits *= 2
  return GemmTiles(bm, bn, wm, wn, splits)


def _whole_splits(k: int, splits: int) -> bool:
  """Whether K splits into `splits` runs of whole 32-wide slices, MIN_KTILES_PER_SPLIT or more each."""
  return k % (BK * splits) == 0 and k // (BK * splits) >= MIN_KTILES_PER_SPLIT


def x_prime_pass(out_features: int, bn: int) -> bool:
  """Whether a product with a prologue runs it as its own pass (tv_gemm_xprime) rather than in the loop."""
  return cdiv(out_features, bn) > XPRIME_COLUMN_BLOCKS


def _deep_slices(tile: tuple[int, int, int, int], k: int, o: int, silu_mul: bool, ring: int = 0) -> GemmTiles | None:
  """The tile with 64-wide K slices, or None where K is not a multiple of 64 or the SwiGLU halves would be staged in
  the loop (no x' pass: three stages of both halves do not fit)."""
  if k % DEEP_BK or (silu_mul and not x_prime_pass(o, tile[1])): return None
  tiles = GemmTiles(*tile, 1, ring, DEEP_BK)
  return tiles if tiles.stages() >= 3 else None


def gemm_plan(shape, tiles: GemmTiles | None = None, wgmma: bool = False) -> tuple[dict[str, int | str], tuple[Launch, ...]]:
  """Defines and launches (tv_gemm_xprime when the prologue runs as its own pass, tv_gemm, then tv_gemm_reduce when K
  is split) for a LinearShape; `wgmma`: the planner may pick Hopper's warpgroup MMA."""
  m, k, o = shape.rows, shape.in_features, shape.out_features
  t = tiles or choose_tiles(m, k, o, shape.silu_mul, wgmma)
  prologue = shape.norm_eps is not None or shape.silu_mul
  xprime = prologue and (x_prime_pass(o, t.bn) if t.xprime is None else t.xprime)
  staged_silu = shape.silu_mul and not xprime
  stages, smem = t.stages(staged_silu), t.shared_bytes(staged_silu)
  if t.bk not in (32, 64): raise ValueError(f"tiles {t}: K slices of {t.bk} (the kernel steps in 32 or 64)")
  if (reason := t.wgmma_error()) is not None: raise ValueError(reason)
  if k % (t.bk * t.splits): raise ValueError(f"tiles {t}: K = {k} does not split into {t.splits} runs of {t.bk}-wide slices")
  if stages < 2: raise ValueError(f"tiles {t} leave room for {stages} shared-memory stage(s); at least 2 are needed")
  if smem > SHARED_LIMIT: raise ValueError(f"tiles {t} need {smem} bytes of shared memory (a block gets {SHARED_LIMIT})")
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_M": m, "TV_K": k, "TV_NOUT": o, "TV_BM": t.bm,
                                   "TV_BN": t.bn, "TV_BK": t.bk, "TV_WM": t.wm, "TV_WN": t.wn, "TV_NT": t.threads,
                                   "TV_SPLITS": t.splits, "TV_STAGES": stages, "TV_SMEM_BYTES": smem,
                                   "TV_MIN_BLOCKS": t.min_blocks(staged_silu)}
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
  if t.wgmma: defines["TV_WGMMA"] = t.bn
  if xprime: defines["TV_XPRIME_PASS"] = 1
  if shape.out_float32: defines["TV_OUT_F32"] = 1
  for flag, name, numel, wanted in (("TV_BIAS", "bias", o, shape.bias), ("TV_RESIDUAL", "residual", m * o, shape.residual)):
    if wanted:
      defines[flag] = len(epilogue)
      epilogue.append(Param(name, "elem", False, numel))
  launches = [Launch("tv_gemm_xprime", (m, 1, 1), t.threads, tuple(pre))] if xprime else []
  launches.append(Launch("tv_gemm", (cdiv(o, t.bn), cdiv(m, t.bm), t.splits), t.threads, tuple(gemm), smem))
  if t.splits > 1: launches.append(Launch("tv_gemm_reduce", (cdiv(m * o, t.threads), 1, 1), t.threads, tuple(epilogue)))
  return defines, tuple(launches)


@functools.cache
def gemm_source(shape, tiles: GemmTiles | None = None, wgmma: bool = False) -> tuple[tuple[Launch, ...], str]:
  from tinyvllm.kernels.sources import kernel_source
  defines, launches = gemm_plan(shape, tiles, wgmma)
  return launches, kernel_source("cuda", "gemm_tc", defines)
