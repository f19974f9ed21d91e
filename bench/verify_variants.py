"""The batch-1 verification's GPU step (bench/spec_bench.py's graph_replays: k = 4, five rows) with the persistent
decode-layer kernel planned another way (bench-only: the plan patched here, never in the package), one variant a
process so that each compiles its own kernel:

  DEV=CUDA python3 bench/verify_variants.py [--threads N [--threads-from-rows R]] [--chunk-tiles T]
                                            [--decode-chunk-tiles T] [--swiglu-as-copy] [--ks 3,4]
--threads: blocks of N threads at every row count (from R rows on with --threads-from-rows); --chunk-tiles: an
attention item covers T tiles of keys (the package sizes its chunk for the context bucket), --decode-chunk-tiles the
same for decode steps (one row); --swiglu-as-copy: phase 5 copies x' from gate's half of gu (SWIGLU_COPY: wrong values,
for the time). Appends a line to $OUT/verify_variants.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def with_chunk_tiles(tiles: int, decode: bool = False) -> None:
  """Every launch of more than one row (of one row: decode) plans attention chunks of `tiles` tiles."""
  from tinyvllm.kernels import decode_layer
  from tinyvllm.kernels.plan import cdiv
  original = decode_layer._tiles
  def planned(shape):
    kpass, tile, chunk, splits = original(shape)
    if (shape.rows == 1) != decode: return kpass, tile, chunk, splits
    context = shape.max_blocks * shape.block_size
    return kpass, tile, tile * tiles, cdiv(context, tile * tiles)
  decode_layer._tiles = planned


# phase 5's x' as a copy of gate's half of gu: no read of up, no silu (the values are wrong; the time is what SwiGLU
# would leave phase 5 if phase 4's blocks wrote silu(gate) * up themselves)
SWIGLU = """    float g[TV_VEC], u[TV_VEC];
    tv_unpack16(TV_LDCG16(gu + (TV_I64)m * 2 * TV_INTER + k), g);
    tv_unpack16(TV_LDCG16(gu + (TV_I64)m * 2 * TV_INTER + TV_INTER + k), u);
    TV_UNROLL for (int j = 0; j < TV_VEC; j++) g[j] = tv_silu(g[j]) * u[j];
    TV_ST16(xs + m * TV_INTER + k, tv_pack16(g));"""
SWIGLU_COPY = "    TV_ST16(xs + m * TV_INTER + k, TV_LDCG16(gu + (TV_I64)m * 2 * TV_INTER + k));"


def with_swiglu_as_copy() -> None:
  """The layer kernel's phase 5 takes x' as a copy of gate's half of gu (SWIGLU_COPY)."""
  from tinyvllm.kernels import decode_layer
  original = decode_layer.decode_layer_source
  def source(shape, target):
    plan, text = original(shape, target)
    assert SWIGLU in text
    return plan, text.replace(SWIGLU, SWIGLU_COPY)
  decode_layer.decode_layer_source = source


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--threads", type=int)
  p.add_argument("--threads-from-rows", type=int, default=1)
  p.add_argument("--chunk-tiles", type=int)
  p.add_argument("--decode-chunk-tiles", type=int)
  p.add_argument("--swiglu-as-copy", action="store_true")
  p.add_argument("--ks", default="4")
  args = p.parse_args()
  from bench.layer_threads import with_threads
  from bench.spec_bench import graph_replays
  if args.threads: with_threads(args.threads, args.threads_from_rows)
  if args.chunk_tiles: with_chunk_tiles(args.chunk_tiles)
  if args.decode_chunk_tiles: with_chunk_tiles(args.decode_chunk_tiles, decode=True)
  if args.swiglu_as_copy: with_swiglu_as_copy()
  variant = {"threads": args.threads, "threads_from_rows": args.threads_from_rows,
             "chunk_tiles": args.chunk_tiles, "decode_chunk_tiles": args.decode_chunk_tiles, "swiglu_as_copy": args.swiglu_as_copy}
  for row in graph_replays("qwen3-0.6b", [int(k) for k in args.ks.split(",")]):
    if out := os.environ.get("OUT"):
      with Path(out, "verify_variants.jsonl").open("a") as f: f.write(json.dumps({**variant, **row}) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
