"""Tuning tables: the measured choices of the kernel planners, as data per device kind.

`tuning/default.json` holds every value (measured on an H100 and an H200, docs/kernels.md "Tuning tables" says with
which benchmark); `tuning/<kind>.json` (the kind is the CUDA architecture, e.g. `sm_90`, or `metal`) overrides the
entries measured for that kind, section by section. The persistent decode-layer kernel runs only for the row counts a
kind's table gives a context bound for (Hopper's, today).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

Tile = tuple[int, int, int, int]   # (rows BM, columns BN, warps along M, warps along N)


@dataclass(frozen=True)
class AttentionTuning:
  decode_target_blocks: int       # split the context until S * KV heads * splits reaches this
  fp8_decode_stages: int          # shared-memory ring stages of the FP8 CUDA decode (0: registers)
  decode_ring_limit_bytes: int    # the largest ring it takes
  tc_decode_min_group: int        # decode steps of 16-bit caches with GQA groups from this size (0: none) and at least
  tc_decode_min_blocks: int       # this many (sequence, KV head) pairs run on the tensor-core prefill kernel


@dataclass(frozen=True)
class LinearTuning:
  skinny_max_rows: int            # above this the tensor-core GEMM runs the product (where it can)
  skinny_wide_out: int            # outputs this wide (the logits) stream their weight once up to skinny_wide_max_rows
  skinny_wide_max_rows: int       # (H100, Qwen3-0.6B's logits at 5 rows: 121 µs against the GEMM's 162; at 8, 160 / 163)
  # from this many rows (0: never) those wide products take their sums from tensor cores where they can (sm_90: from
  # one row, and up to 16 rows, past the GEMM's 141 µs at 16; linear.tensor_core_layout has the numbers)
  skinny_tc_min_rows: int


@dataclass(frozen=True)
class GemmTuning:
  target_blocks: int              # blocks a grid should reach (K split until it does)
  shared_bytes: int               # shared memory a block's mma.sync stage ring may take
  max_stages: int
  xprime_column_blocks: int       # the RMSNorm / SwiGLU prologue runs as its own pass above this many column blocks
  max_splits: int
  min_ktiles_per_split: int
  wide_tiles: tuple[Tile, ...]    # tried in order: the first that makes target_blocks without splitting K
  row_tiles: tuple[tuple[int, Tile], ...]   # else by rows (up to the first number), with K split
  fallback_tile: Tile
  big_tile: Tile                  # for products that give it big_tile_blocks blocks
  big_tile_blocks: int
  long_k: int                     # from this K, long-K products at long_k_rows take long_k_tile with K split
  long_k_rows: tuple[int, int]
  long_k_tile: Tile
  long_k_max_splits: int
  # on Hopper, long-K products at least long_k_tall_min_out wide from long_k_tall_rows up to 256 rows: one wgmma row
  # block as tall as the rows, K split while the grid gives fewer than long_k_tall_fill of the SMs a block
  long_k_tall_rows: int
  long_k_tall_min_out: int
  long_k_tall_fill: float
  deep_bk: int                    # 64-wide K slices where K is not split: the big tile from deep_big_rows rows, the
  deep_big_ring: int              # wide tiles from deep_wide_rows
  deep_wide_rows: int
  deep_big_rows: int
  wgmma_min_rows: int             # Hopper's wgmma tiles: from this many rows (long K from wgmma_long_k_rows), the
  wgmma_long_k_rows: int          # 128x128 tile for prompt chunks (wgmma_prompt_rows) and wide outputs (the logits)
  wgmma_prompt_rows: int
  wgmma_tall_prompt_rows: int     # from this many rows (16-bit weights, outputs below wgmma_wide_out) the 256x128 tile
  wgmma_wide_out: int
  # short-K products (K below long_k: qkv, gate_up) at decode batches on Hopper: wgmma from short_k_min_rows rows
  # (packed weights from above packed_min_rows); up to short_k_split_rows a 64x64 tile with K split in two, above
  # the tallest of short_k_tile_rows whose grid gives short_k_min_fill of the SMs a block and pads its row blocks
  # by at most short_k_max_padding
  short_k_min_rows: int
  packed_min_rows: int
  short_k_split_rows: int
  short_k_tile_rows: tuple[int, ...]
  short_k_min_fill: float
  short_k_max_padding: float
  raster_row_blocks: int          # runs of this many row blocks walk the columns together (L2 reuse of the weight)


@dataclass(frozen=True)
class MoETuning:
  grouped_row_tiles: tuple[tuple[int, Tile], ...]   # the grouped expert products' mma.sync tile by the pairs an expert
                                                    # has on average (up to the first number); its row blocks pad each
                                                    # expert's run
  grouped_wgmma_rows: int         # from this average, Hopper's wgmma 128x128 tile (three stages)
  # decode steps of 16-bit experts up to this many tokens (at most moe.MAX_TOKENS) run on the decode kernels; larger
  # ones take the grouped GEMM where it runs
  decode_kernel_max_tokens: int


@dataclass(frozen=True)
class DecodeLayerTuning:
  max_context_by_rows: tuple[tuple[int, int], ...]   # (rows, the longest context bucket it takes at that many rows)
  hbm_bytes_per_sm_cycle: int     # one SM's share of HBM bandwidth: the pace of the copies of blocks without attention
  pace_chunk_bytes: int
  # a product runs on tensor cores where a block owns at least this many of its rows (fewer fill only part of the
  # mma's 16: Qwen3-0.6B's o and down, 8 a block, ran slower there and slowed the attention phase after them)
  tensor_core_min_rows: int
  # (rows, a block's threads) where not the kernel's default: past four rows 512 threads' step is slower than 384
  # threads' (a 5-row verification 0.98 against 0.90 ms on nvidia-h200), with or without their spills and L1 room
  threads_by_rows: tuple[tuple[int, int], ...]
  # from this many rows on (0: never) a block owns gate_up's rows in pairs and writes silu(gate) * up itself, halving
  # the down phase's reads (a 5-row verification on nvidia-h200 0.90 -> 0.87-0.88 ms); where blocks have 512 threads'
  # 128 registers, the pairing's extra ones spilled and one- and four-row steps took 6.5-11% longer
  paired_gate_up_min_rows: int

  def max_context(self, rows: int) -> int: return dict(self.max_context_by_rows).get(rows, 0)

  def threads(self, rows: int, default: int) -> int: return dict(self.threads_by_rows).get(rows, default)

  def pairs_gate_up(self, rows: int) -> bool: return 0 < self.paired_gate_up_min_rows <= rows


@dataclass(frozen=True)
class Tuning:
  kind: str
  attention: AttentionTuning
  linear: LinearTuning
  gemm: GemmTuning
  moe: MoETuning
  decode_layer: DecodeLayerTuning


def _frozen(value: Any) -> Any:
  """JSON lists as tuples (the tables are hashable: plans are cached on them), `{"1": 8192}` maps as (1, 8192) pairs."""
  if isinstance(value, list): return tuple(_frozen(v) for v in value)
  if isinstance(value, dict): return tuple(sorted((int(k), _frozen(v)) for k, v in value.items()))
  return value


def _table(name: str) -> dict[str, dict[str, Any]]:
  path = resources.files("tinyvllm.kernels") / "tuning" / f"{name}.json"
  return json.loads(path.read_text()) if path.is_file() else {}


@functools.cache
def tuning_for(kind: str) -> Tuning:
  """The default table with the kind's own entries over it."""
  table, own = _table("default"), _table(kind)
  sections = {"attention": AttentionTuning, "linear": LinearTuning, "gemm": GemmTuning, "moe": MoETuning,
              "decode_layer": DecodeLayerTuning}
  unknown = set(own) - set(sections)
  if unknown: raise ValueError(f"tuning table {kind}.json has unknown section(s) {sorted(unknown)}")
  built = {}
  for name, cls in sections.items():
    values = {**table[name], **own.get(name, {})}
    names = {f.name for f in dataclasses.fields(cls)}
    if set(values) != names: raise ValueError(f"tuning section {name!r} ({kind}): expected {sorted(names)}, got {sorted(values)}")
    built[name] = cls(**{k: _frozen(v) for k, v in values.items()})
  return Tuning(kind, **built)
