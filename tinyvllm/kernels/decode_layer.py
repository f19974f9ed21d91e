"""A whole decoder layer of a small decode step in one persistent kernel (kernels/decode_layer.inc, CUDA only).

At batch 1 a step of per-op kernels is ~7 dependent launches a layer, and each small kernel's launch, ramp-up and tail
cost more than its bytes (docs/benchmarks.md, "Batch 1"). This kernel runs one block per SM through the layer's five
phases (qkv, attention, o, gate_up, down) with grid barriers between them, streaming each block's slice of the next
phase's weights into shared memory one phase ahead. Every block must be resident at once (the barriers spin), so the
grid is the GPU's SM count and a block takes the shared memory of a whole SM; shapes whose slices do not fit use the
per-op kernels. Metal has no grid barrier with a forward-progress guarantee, so there the per-op kernels run.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinygrad import Tensor, dtypes

from tinyvllm.kernels.plan import CUDA_SHARED_OPT_IN, Launch, Param, cdiv, dtype_code
from tinyvllm.kernels.sources import kernel_source

if TYPE_CHECKING:
  from tinyvllm.layers.attention import AttentionMetadata
  from tinyvllm.model.llama import DecoderLayer

MAX_ROWS = 4          # decode rows (sequences) it takes: x' of 4 rows of the widest input fits beside the weight slices
MAX_GROUP = 4         # query heads per KV head (the attention phase holds G x 8 q values and accumulators a thread)
THREADS = 512
TILE_KEYS = 128       # keys an attention tile covers at least


@dataclass(frozen=True)
class DecodeLayerShape:
  dtype: str
  rows: int           # M: sequences, one new token each
  hidden: int
  heads: int
  kv_heads: int
  head_dim: int
  intermediate: int
  qk_norm: bool
  qkv_bias: bool
  eps: float
  block_size: int
  max_blocks: int     # block-table width (the context bucket L = max_blocks * block_size)
  num_slots: int
  kv_fp8: bool
  blocks: int         # the grid: the GPU's SM count
  threads: int = THREADS   # a block's (smaller in the CPU emulator's tests)
  experiment: tuple[tuple[str, int], ...] = ()   # extra defines (TV_PHASES, TV_GRID_SYNCS: bench/decode_layer_bench.py)

  @property
  def group(self) -> int: return self.heads // self.kv_heads

  @property
  def qkv_width(self) -> int: return (self.heads + 2 * self.kv_heads) * self.head_dim


@dataclass(frozen=True)
class DecodeLayerPlan:
  defines: dict[str, int | str]
  launch: Launch


def _slices(shape: DecodeLayerShape) -> dict[str, int]:
  """Rows of each product a block owns."""
  nb, s = shape.blocks, shape
  return {"TV_R_QKV": cdiv(s.qkv_width, nb), "TV_R_O": cdiv(s.hidden, nb), "TV_R_GU": cdiv(2 * s.intermediate, nb),
          "TV_R_DN": cdiv(s.hidden, nb)}


def _tiles(shape: DecodeLayerShape) -> tuple[int, int, int, int]:
  """(keys per pass of a tile's loads, tile, chunk, splits): a chunk of whole tiles, sized so that full contexts make
  about one attention item per block."""
  dv = shape.head_dim // 8
  keys_per_pass = (shape.threads // 32) * (32 // dv)
  kpass = max(1, TILE_KEYS // keys_per_pass)
  tile = keys_per_pass * kpass
  context = shape.max_blocks * shape.block_size
  chunk = tile * cdiv(shape.rows * shape.kv_heads * cdiv(context, tile), shape.blocks)
  return kpass, tile, chunk, cdiv(context, chunk)


def _align(n: int) -> int: return cdiv(n, 16) * 16


def shared_layout(shape: DecodeLayerShape) -> dict[str, int]:
  """Bytes of the shared-memory regions (kernels/decode_layer_ops.inc): A, B (weight slices), X (x'), S, Y."""
  s, r, nw = shape, _slices(shape), shape.threads // 32
  tile = _tiles(shape)[1]
  g, d = s.group, s.head_dim
  attention = (g + 1) * d + g * tile + cdiv(4 * (g + 1), 4) * 4 + 8 * (d // 8) + nw * g * d
  red_rows = max(*r.values(), nw)
  return {"TV_A_BYTES": _align(2 * max(r["TV_R_QKV"], r["TV_R_GU"]) * s.hidden),
          "TV_B_BYTES": _align(2 * max(r["TV_R_O"] * s.heads * d, r["TV_R_DN"] * s.intermediate)),
          "TV_X_BYTES": _align(4 * s.rows * max(s.hidden, s.heads * d, s.intermediate)),
          "TV_S_BYTES": _align(4 * max(attention, s.rows * s.hidden // 8)),
          "TV_Y_BYTES": _align(4 * (s.rows * red_rows + s.rows)), "TV_RED_ROWS": red_rows}


def shared_bytes(shape: DecodeLayerShape) -> int:
  layout = shared_layout(shape)
  return sum(v for k, v in layout.items() if k.endswith("_BYTES"))


def unsupported_reason(shape: DecodeLayerShape) -> str | None:
  s = shape
  if s.dtype not in ("float16", "bfloat16"): return f"dtype {s.dtype} (the layer kernel takes float16 and bfloat16)"
  if not 1 <= s.rows <= MAX_ROWS: return f"{s.rows} rows (the layer kernel takes 1 to {MAX_ROWS})"
  if s.heads % s.kv_heads or s.group > MAX_GROUP: return f"{s.heads} query heads over {s.kv_heads} KV heads (group above {MAX_GROUP})"
  dv = s.head_dim // 8
  if s.head_dim % 8 or dv > 32 or dv & (dv - 1): return f"head_dim {s.head_dim} (8 times a power of two up to 32)"
  if s.hidden % 8 or s.intermediate % 8: return f"hidden {s.hidden} / intermediate {s.intermediate} not multiples of 8"
  if s.blocks < 1: return "no multiprocessors"
  if (need := shared_bytes(s)) > CUDA_SHARED_OPT_IN:
    return f"the layer's weight slices need {need} bytes of shared memory a block (an SM gives {CUDA_SHARED_OPT_IN})"
  return None


def decode_layer_plan(shape: DecodeLayerShape) -> DecodeLayerPlan:
  if (reason := unsupported_reason(shape)) is not None: raise ValueError(f"decode layer kernel: {reason}")
  s = shape
  kpass, tile, chunk, splits = _tiles(s)
  layout = shared_layout(s)
  defines: dict[str, int | str] = {
    "TV_DTYPE": dtype_code(s.dtype), "TV_NT": s.threads, "TV_NB": s.blocks, "TV_M": s.rows, "TV_N": s.rows, "TV_HID": s.hidden,
    "TV_H": s.heads, "TV_KVH": s.kv_heads, "TV_D": s.head_dim, "TV_G": s.group, "TV_INTER": s.intermediate,
    "TV_EPS": f"{s.eps!r}f", "TV_KV_FP8": int(s.kv_fp8), "TV_BS": s.block_size, "TV_MAXB": s.max_blocks,
    "TV_NSLOTS": s.num_slots, "TV_KPASS": kpass, "TV_TILE": tile, "TV_CHUNK": chunk, "TV_NSPLIT": splits,
    "TV_SCALE_LOG2": f"{(1.0 / math.sqrt(s.head_dim)) * math.log2(math.e)!r}f", **_slices(s), **layout, **dict(s.experiment)}
  m, hd = s.rows, s.heads * s.head_dim
  params = [Param("h_out", "elem", True, m * s.hidden), Param("k_cache", "kv", True, s.num_slots * s.kv_heads * s.head_dim),
            Param("v_cache", "kv", True, s.num_slots * s.kv_heads * s.head_dim), Param("qkv", "elem", True, m * s.qkv_width),
            Param("part_o", "float", True, m * s.heads * splits * s.head_dim),
            Param("part_ml", "float", True, 2 * m * s.heads * splits), Param("h_mid", "elem", True, m * s.hidden),
            Param("gu", "elem", True, 2 * m * s.intermediate), Param("sync", "uint", True, 2),
            Param("h_in", "elem", False, m * s.hidden), Param("input_norm", "elem", False, s.hidden),
            Param("w_qkv", "elem", False, s.qkv_width * s.hidden), Param("w_o", "elem", False, s.hidden * hd),
            Param("post_norm", "elem", False, s.hidden), Param("w_gu", "elem", False, 2 * s.intermediate * s.hidden),
            Param("w_down", "elem", False, s.hidden * s.intermediate),
            Param("rope_cos", "float", False, m * s.head_dim // 2), Param("rope_sin", "float", False, m * s.head_dim // 2),
            Param("slot_mapping", "int", False, m), Param("block_tables", "int", False, m * s.max_blocks),
            Param("context_lens", "int", False, m), Param("query_start", "int", False, m + 1)]
  if s.qk_norm:
    defines["TV_QK_NORM"] = len(params)
    params += [Param("q_norm", "elem", False, s.head_dim), Param("k_norm", "elem", False, s.head_dim)]
  if s.qkv_bias:
    defines["TV_QKV_BIAS"] = len(params)
    params.append(Param("qkv_bias", "elem", False, s.qkv_width))
  launch = Launch("tv_decode_layer", (s.blocks, 1, 1), s.threads, tuple(params), shared_bytes(s), cooperative=True)
  return DecodeLayerPlan(defines, launch)


@functools.cache
def decode_layer_source(shape: DecodeLayerShape) -> tuple[DecodeLayerPlan, str]:
  plan = decode_layer_plan(shape)
  return plan, kernel_source("cuda", "decode_layer", plan.defines)


def layer_arguments(layer: DecoderLayer, h: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                    meta: AttentionMetadata, sync: Tensor) -> dict[str, Tensor]:
  """The kernel's inputs and written buffers by parameter name (the scratch ones are left to run_decode_layer)."""
  named = {"h_in": h, "k_cache": k_cache, "v_cache": v_cache, "sync": sync, "input_norm": layer.input_norm,
           "w_qkv": layer.qkv_proj, "w_o": layer.o_proj, "post_norm": layer.post_attention_norm, "w_gu": layer.gate_up_proj,
           "w_down": layer.down_proj, "rope_cos": cos, "rope_sin": sin, "slot_mapping": meta.slot_mapping,
           "block_tables": meta.block_tables, "context_lens": meta.context_lens, "query_start": meta.query_start,
           "q_norm": layer.q_norm, "k_norm": layer.k_norm, "qkv_bias": layer.qkv_bias}
  return {k: t if k in ("k_cache", "v_cache", "sync") else t.contiguous() for k, t in named.items() if t is not None}


def run_decode_layer(shape: DecodeLayerShape, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
  """Launch the layer on `tensors` (by parameter name; the scratch ones are made here). Returns every tensor after it."""
  from tinyvllm.kernels.tinygrad_program import run_kernel
  plan, source = decode_layer_source(shape)
  device = tensors["h_in"].device
  kinds = {"float": dtypes.float32, "elem": tensors["h_in"].dtype}
  args = [tensors[p.name] if p.name in tensors else Tensor.empty(p.numel, dtype=kinds[p.kind], device=device)
          for p in plan.launch.params]
  return dict(zip((p.name for p in plan.launch.params), run_kernel(plan.launch, source, args), strict=True))
