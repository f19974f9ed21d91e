"""Tensor-core matrix products (csrc/cuda/gemm_tc.inc, CUDA sm_80+): the model's projections for decode batches above
the skinny kernel's rows and for prefill chunks, with the same fused RMSNorm / SwiGLU / bias / residual as the skinny
one.

tinygrad's generated GEMMs for these shapes (without a beam search) use tensor cores but few blocks and unvectorised
loads. The planner picks a block tile for the rows, then splits K (grid z, float32 partials + a reduce kernel) until
the grid covers the GPU, as long as the partial sums cost less traffic than the weights; on Hopper it picks wgmma
tiles where they win. Its measured choices are the `gemm` section of the tuning table (tinyvllm/kernels/tuning.py).
tv_gemm's ring of K slices is dynamic shared memory: its Launch carries the bytes (`shared_bytes`). Packed (quantized)
weights stage their codes in the ring and are dequantized into one w tile in shared memory, slice by slice.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from tinyvllm.kernels.plan import PACKED_WEIGHTS, Launch, Param, cdiv, dtype_code
from tinyvllm.kernels.tuning import GemmTuning, Tile, tuning_for
from tinyvllm.platform.target import DeviceTarget

BK = 32                    # the K slice the planner's tiles step in (a tile may ask for 64: half the barriers)
# the kernel's __launch_bounds__ leaves each thread at least MIN_REGISTERS (the 128x128 tile's warps hold 64
# accumulators each); each resident block takes 1 KB of an SM's shared memory more than it asks
MIN_REGISTERS, BLOCK_SHARED_OVERHEAD = 128, 1024
# wgmma tiles (Hopper, csrc/cuda/wgmma.inc): N of the instruction, stage rows unpadded in 1,024-byte swizzle atoms (the
# ring's start is aligned at run time: ALIGN_SLACK more bytes), up to the block's whole shared memory
WGMMA_N, ALIGN_SLACK = (64, 128, 256), 1024
TALL_ROWS = (64, 128, 256)   # long_k_tiles' row block heights (one to four warpgroups)


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
  ring: int = 0   # shared-memory stages; 0: as many as fit the tuning table's budget, up to its max_stages
  bk: int = BK    # K slice depth: 32 or 64 (K must split into whole slices)
  wgmma: bool = False   # Hopper's warpgroup MMA (sm_90a): bk 64, wm = bm / 16, wn 1, bn in WGMMA_N
  xprime: bool | None = None   # the RMSNorm / SwiGLU prologue as its own pass (None: x_prime_pass decides)
  raster: int | None = None    # row blocks that walk the columns together (None: the tuning table's raster_row_blocks)

  @classmethod
  def warpgroup(cls, bm: int, bn: int, splits: int = 1, ring: int = 0) -> GemmTiles:
    """wgmma tiles: a warpgroup per 64 rows, a warp per 16, each across all bn columns."""
    return cls(bm, bn, bm // 16, 1, splits, ring, 64, True)

  @property
  def threads(self) -> int: return 32 * self.wm * self.wn

  def stage_bytes(self, silu_mul: bool = False) -> int:
    """One stage: a K slice of x (both halves for SwiGLU) and of w."""
    return (self.bm * (2 if silu_mul else 1) + self.bn) * row_bytes(self.bk, self.wgmma)

  def stages(self, target: DeviceTarget, silu_mul: bool = False) -> int:
    tuning = tuning_for(target.kind).gemm
    limit = target.max_shared_bytes - ALIGN_SLACK if self.wgmma else tuning.shared_bytes
    return self.ring or min(tuning.max_stages, (limit - 4 * self.bm) // self.stage_bytes(silu_mul))

  def shared_bytes(self, target: DeviceTarget, silu_mul: bool = False) -> int:
    """tv_gemm's dynamic shared memory: the stage ring and a float per row (csrc/cuda/gemm_tc_ops.inc's TV_SMEM_NEEDED)."""
    return self.stages(target, silu_mul) * self.stage_bytes(silu_mul) + 4 * self.bm + (ALIGN_SLACK if self.wgmma else 0)

  def min_blocks(self, target: DeviceTarget, silu_mul: bool = False) -> int:
    """The kernel's __launch_bounds__ minimum of blocks per SM: as many as the shared memory allows, while each
    thread keeps MIN_REGISTERS (with wgmma: its bn / 2 accumulators and 64 more)."""
    by_registers = target.sm_registers // (max(MIN_REGISTERS, self.bn // 2 + 64 if self.wgmma else 0) * self.threads)
    return max(1, min(by_registers, target.sm_shared_bytes // (self.shared_bytes(target, silu_mul) + BLOCK_SHARED_OVERHEAD)))

  def wgmma_error(self) -> str | None:
    if not self.wgmma: return None
    if self.bk != 64 or self.wn != 1 or self.bm != 16 * self.wm or self.bm % 64 or self.bn not in WGMMA_N:
      return f"tiles {self}: wgmma takes bk 64, wn 1, wm = bm / 16, bm a multiple of 64 and bn in {WGMMA_N}"
    return None


def unsupported_reason(dtype: str, rows: int, in_features: int, out_features: int, target: DeviceTarget, bk: int = BK) -> str | None:
  if not target.tensor_cores: return f"device {target.arch or target.device} (the tensor-core kernel needs CUDA sm_80 or newer)"
  if dtype not in ("float16", "bfloat16"): return f"dtype {dtype} (the tensor-core kernel takes float16 and bfloat16)"
  if rows < 1: return "no rows"
  if in_features % bk: return f"in_features {in_features} not a multiple of {bk}"
  return None


def packed_reason(shape) -> str | None:
  """Why the kernel cannot stream a LinearShape's packed weight (its rows' codes in 16-byte chunks; a K slice of 32 or
  64 is always whole chunks of 4- or 8-bit codes), or None."""
  if shape.weight == "elem": return None
  if shape.weight not in PACKED_WEIGHTS: return f"{shape.weight} weights"
  bits = PACKED_WEIGHTS[shape.weight][1]
  if shape.group % 8 or shape.in_features % shape.group: return f"group {shape.group} (a multiple of 8 dividing K)"
  if shape.in_features * bits % 128: return f"{shape.weight} rows of {shape.in_features} codes (whole 16-byte chunks)"
  if shape.group % (128 // bits): return f"group {shape.group} (whole 16-byte chunks of codes, {128 // bits} columns, a group)"
  return None


def wgmma_tiles(rows: int, in_features: int, out_features: int, t: GemmTuning, packed: bool = False) -> GemmTiles | None:
  """Hopper's wgmma tiles where they beat mma.sync's, None elsewhere: the 128x128 tile with 3 stages (two blocks an
  SM) for prompt chunks and wide outputs (the logits), four warpgroups over 256 rows (as many stages as fit, the
  pipelined loop) for 16-bit weights from wgmma_tall_prompt_rows and, for long K from wgmma_long_k_rows, a 128x64 tile
  with K split until the grid fills (below it mma.sync's split tile is as fast). Short K at decode batches:
  short_k_tiles."""
  if in_features % 64 or rows < t.wgmma_min_rows: return None
  if rows >= t.wgmma_tall_prompt_rows and out_features < t.wgmma_wide_out and not packed: return GemmTiles.warpgroup(256, 128)
  if rows >= t.wgmma_prompt_rows or out_features >= t.wgmma_wide_out: return GemmTiles.warpgroup(128, 128, ring=3)
  if in_features < t.long_k or rows < t.wgmma_long_k_rows: return None
  blocks, splits = cdiv(rows, 128) * cdiv(out_features, 64), 1
  while splits < t.long_k_max_splits and blocks * splits < t.target_blocks and _may_split(in_features, 2 * splits, t, 64):
    splits *= 2
  return GemmTiles.warpgroup(128, 64, splits)


def long_k_tiles(rows: int, in_features: int, out_features: int, t: GemmTuning, multiprocessors: int) -> GemmTiles | None:
  """Wide long-K products at decode batches on Hopper (Qwen3-30B-A3B's qkv, 2,048 -> 5,120, and o, 4,096 -> 2,048):
  one wgmma row block as tall as the rows (64, 128 or 256) by 64 columns, K split in two while the grid gives fewer
  than long_k_tall_fill of the SMs a block and the float32 partials (written and read) stay within the weights' bytes.
  H100, 256 / 128 / 64 rows: qkv (80 column blocks, not split) 34.1 / 30.6 / 26.2 µs against 47.1 / 45.5 / 34.7 for
  the 128x64 tile split to fill 256 blocks and mma.sync's split 64x64; o (split in four) 27.0 / 20.4 / 16.4 against
  29.4 / 25.6 / 18.1. None elsewhere (packed weights keep short_k_tiles' and wgmma_tiles' choices)."""
  if in_features % 64 or in_features < t.long_k or out_features < t.long_k_tall_min_out: return None
  if not t.long_k_tall_rows <= rows <= TALL_ROWS[-1]: return None
  blocks, splits = cdiv(out_features, 64), 1
  while (splits < t.long_k_max_splits and blocks * splits < t.long_k_tall_fill * multiprocessors
         and _partials_fit(rows, in_features, 2 * splits) and _may_split(in_features, 2 * splits, t, 64)):
    splits *= 2
  return GemmTiles.warpgroup(next(bm for bm in TALL_ROWS if bm >= rows), 64, splits)


def short_k_tiles(rows: int, in_features: int, out_features: int, packed: bool, t: GemmTuning,
                  multiprocessors: int) -> GemmTiles | None:
  """wgmma tiles for short-K products (qkv, gate_up) at decode batches: up to short_k_split_rows a 64x64 tile with K
  split in two (one row block leaves most SMs idle), above that the tallest tile whose grid still gives most SMs a
  block and whose row blocks are mostly rows. Fewer row blocks pay for every weight (a packed one's column block is
  dequantized once a row block, a plain one's re-read from L2), but a grid of a wave and a half idles a third of the
  second wave (H200, int4 gate_up at 256 rows: 128x64 tiles, 192 blocks, 28.9 µs; 256x64, 96 blocks, 27.1; bf16
  24.2 -> 23.4). None where this does not apply (long K, prompt chunks, wide outputs)."""
  if in_features % 64 or in_features >= t.long_k or out_features >= t.wgmma_wide_out: return None
  if not (t.packed_min_rows < rows if packed else t.short_k_min_rows <= rows) or rows >= t.wgmma_prompt_rows: return None
  if rows <= t.short_k_split_rows: return GemmTiles.warpgroup(64, 64, 2 if _may_split(in_features, 2, t, 64) else 1)
  fills = lambda bm: cdiv(rows, bm) * cdiv(out_features, 64) >= t.short_k_min_fill * multiprocessors
  padded = lambda bm: cdiv(rows, bm) * bm * (1 - t.short_k_max_padding) > rows
  return GemmTiles.warpgroup(next((bm for bm in t.short_k_tile_rows if fills(bm) and not padded(bm)), 64), 64)


def choose_tiles(rows: int, in_features: int, out_features: int, target: DeviceTarget, silu_mul: bool = False,
                 packed: bool = False) -> GemmTiles:
  """The tuning table's choice (measured with bench/gemm_bench.py): many small tiles beat fewer large ones while the
  weights dominate, and splitting K only pays when even the smallest tiles leave the GPU idle. Tiles that leave room
  for fewer than three shared-memory stages are skipped where a smaller one will do. On Hopper, short_k_tiles
  (`packed`: quantized weights, from fewer rows) and wgmma_tiles first."""
  t = tuning_for(target.kind).gemm
  if target.wgmma and (tiles := short_k_tiles(rows, in_features, out_features, packed, t, target.multiprocessors)):
    return tiles
  if target.wgmma and not packed and (tiles := long_k_tiles(rows, in_features, out_features, t, target.multiprocessors)):
    return tiles
  if target.wgmma and (tiles := wgmma_tiles(rows, in_features, out_features, t, packed)) is not None: return tiles
  fits = lambda tile: GemmTiles(*tile, 1).stages(target, silu_mul) >= 3
  if in_features >= t.long_k and t.long_k_rows[0] <= rows <= t.long_k_rows[1] and fits(t.long_k_tile):
    blocks, splits = cdiv(rows, t.long_k_tile[0]) * cdiv(out_features, t.long_k_tile[1]), 1
    while splits < t.long_k_max_splits and blocks * splits < t.target_blocks and _may_split(in_features, 2 * splits, t):
      splits *= 2
    return GemmTiles(*t.long_k_tile, splits)
  big_deep = _deep_slices(t.big_tile, in_features, out_features, silu_mul, target, t.deep_big_ring)
  if big_deep and rows >= t.deep_big_rows and in_features >= t.long_k: return big_deep
  if fits(t.big_tile) and rows >= t.big_tile[0] and cdiv(rows, t.big_tile[0]) * cdiv(out_features, t.big_tile[1]) >= t.big_tile_blocks:
    return big_deep or GemmTiles(*t.big_tile, 1)
  for tile in t.wide_tiles:
    bm, bn = tile[0], tile[1]
    if bm <= rows and cdiv(rows, bm) * cdiv(out_features, bn) >= t.target_blocks and fits(tile):
      deep = rows >= t.deep_wide_rows and in_features < t.long_k and _deep_slices(tile, in_features, out_features, silu_mul, target)
      return deep or GemmTiles(*tile, 1)
  bm, bn, wm, wn = next((tile for limit, tile in t.row_tiles if rows <= limit and fits(tile)), t.fallback_tile)
  blocks = cdiv(rows, bm) * cdiv(out_features, bn)
  splits = 1
  while (splits * 2 <= t.max_splits and blocks * splits < t.target_blocks and _may_split(in_features, 2 * splits, t)
         and _partials_fit(rows, in_features, 2 * splits)):
    splits *= 2
  return GemmTiles(bm, bn, wm, wn, splits)


def _partials_fit(rows: int, k: int, splits: int) -> bool:
  """Whether the float32 partials of K split `splits` ways (written and read: 8 bytes per split, row and output) stay
  within the weight's bytes (2 per K and output)."""
  return 4 * rows * splits <= k


def _may_split(k: int, splits: int, t: GemmTuning, bk: int = BK) -> bool:
  """Whether K may split into `splits` runs of whole bk-wide slices, min_ktiles_per_split or more each. Small weights
  split too: in a model's step their slices come from HBM, and a few blocks walking a long K wait on each slice in turn
  (Qwen3-30B-A3B's router, 2,048 -> 128, in a decode step's graph on an H200, bench/graph_kernels.py: 25.7 µs whole at
  256 rows, 9.8 split four ways with its reduce; 54.5 whole and 11.0 split eight ways at 16 rows)."""
  return k % (bk * splits) == 0 and k // (bk * splits) >= t.min_ktiles_per_split


def x_prime_pass(out_features: int, bn: int, t: GemmTuning) -> bool:
  """Whether a product with a prologue runs it as its own pass (tv_gemm_xprime) rather than in the loop (each column
  block would redo it on its copy of every slice)."""
  return cdiv(out_features, bn) > t.xprime_column_blocks


def _deep_slices(tile: Tile, k: int, o: int, silu_mul: bool, target: DeviceTarget, ring: int = 0) -> GemmTiles | None:
  """The tile with 64-wide K slices, or None where K is not a multiple of 64 or the SwiGLU halves would be staged in
  the loop (no x' pass: three stages of both halves do not fit)."""
  t = tuning_for(target.kind).gemm
  if k % t.deep_bk or (silu_mul and not x_prime_pass(o, tile[1], t)): return None
  tiles = GemmTiles(*tile, 1, ring, t.deep_bk)
  return tiles if tiles.stages(target) >= 3 else None


def packed_ring(t: GemmTiles, bits: int, stages: int, target: DeviceTarget) -> tuple[int, int]:
  """(stages, shared bytes) of a packed weight's ring: x and the codes a stage, two w tiles the dequantized slices go
  to; as many stages as the plain weight's ring has, fewer where the blocks an SM it plans for would not fit."""
  rb = row_bytes(t.bk, t.wgmma)
  need = lambda n: n * (t.bm * rb + t.bn * t.bk * bits // 8) + 2 * t.bn * rb + 4 * t.bm + (ALIGN_SLACK if t.wgmma else 0)
  limit = min(target.max_shared_bytes, target.sm_shared_bytes // t.min_blocks(target) - BLOCK_SHARED_OVERHEAD)
  while stages > 2 and need(stages) > limit: stages -= 1
  return stages, need(stages)


def gemm_plan(shape, target: DeviceTarget, tiles: GemmTiles | None = None) -> tuple[dict[str, int | str], tuple[Launch, ...]]:
  """Defines and launches (tv_gemm_xprime when the prologue runs as its own pass, tv_gemm, then tv_gemm_reduce when K
  is split) for a LinearShape, with the given tiles (None: the planner's)."""
  m, k, o = shape.rows, shape.in_features, shape.out_features
  prologue, packed = shape.norm_eps is not None or shape.silu_mul, shape.weight != "elem"
  t = tiles or choose_tiles(m, k, o, target, shape.silu_mul, packed)
  # (a packed weight's loop dequantizes w: its x' always comes from the prologue's own pass)
  xprime = prologue and (packed or (x_prime_pass(o, t.bn, tuning_for(target.kind).gemm) if t.xprime is None else t.xprime))
  staged_silu = shape.silu_mul and not xprime
  stages, smem = t.stages(target, staged_silu), t.shared_bytes(target, staged_silu)
  if packed:
    if (reason := packed_reason(shape)) is not None: raise ValueError(f"packed weights: {reason}")
    code, bits = PACKED_WEIGHTS[shape.weight]
    stages, smem = packed_ring(t, bits, stages, target)
  if t.bk not in (32, 64): raise ValueError(f"tiles {t}: K slices of {t.bk} (the kernel steps in 32 or 64)")
  if (reason := t.wgmma_error()) is not None: raise ValueError(reason)
  if k % (t.bk * t.splits): raise ValueError(f"tiles {t}: K = {k} does not split into {t.splits} runs of {t.bk}-wide slices")
  if stages < 2: raise ValueError(f"tiles {t} leave room for {stages} shared-memory stage(s); at least 2 are needed")
  if smem > target.max_shared_bytes:
    raise ValueError(f"tiles {t} need {smem} bytes of shared memory (a block gets {target.max_shared_bytes})")
  defines: dict[str, int | str] = {"TV_DTYPE": dtype_code(shape.dtype), "TV_M": m, "TV_K": k, "TV_NOUT": o, "TV_BM": t.bm,
                                   "TV_BN": t.bn, "TV_BK": t.bk, "TV_WM": t.wm, "TV_WN": t.wn, "TV_NT": t.threads,
                                   "TV_SPLITS": t.splits, "TV_STAGES": stages, "TV_SMEM_BYTES": smem,
                                   "TV_MIN_BLOCKS": t.min_blocks(target, staged_silu)}
  y = Param("y", "float" if shape.out_float32 else "elem", True, m * o)
  part = Param("part", "float", True, t.splits * m * o)
  x = Param("x", "elem", False, m * k * (2 if shape.silu_mul else 1))
  w = ([Param("w", "uint", False, o * k * bits // 32), Param("wscale", "float", False, o * (k // shape.group)),
        Param("wshift", "float", False, o * (k // shape.group))] if packed else [Param("w", "elem", False, o * k)])
  gemm = [part if t.splits > 1 else y, Param("xp", "elem", False, m * k) if xprime else x, *w]
  epilogue = [y, Param("part", "float", False, t.splits * m * o)] if t.splits > 1 else gemm
  pre = [Param("xp", "elem", True, m * k), x]
  if shape.norm_eps is not None:
    defines["TV_PRO_NORM"], defines["TV_EPS"] = len(pre if xprime else gemm), f"{shape.norm_eps!r}f"
    (pre if xprime else gemm).append(Param("g", "elem", False, k))
  if shape.silu_mul: defines["TV_PRO_SILU"] = 1
  if t.wgmma: defines["TV_WGMMA"] = t.bn
  if (raster := tuning_for(target.kind).gemm.raster_row_blocks if t.raster is None else t.raster) > 1 and m > t.bm:
    defines["TV_RASTER"] = raster
  if packed: defines.update({"TV_WQ": code, "TV_WGROUP": shape.group})
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
def gemm_source(shape, target: DeviceTarget, tiles: GemmTiles | None = None) -> tuple[tuple[Launch, ...], str]:
  from tinyvllm.kernels.sources import kernel_source
  defines, launches = gemm_plan(shape, target, tiles)
  return launches, kernel_source("cuda", "gemm_tc", defines)
