"""Launch plans for the hand-written kernels: every compile-time constant, grid and buffer of one specialisation.

Pure functions of the static shape, the device target (tinyvllm/platform/target.py) and its tuning table
(tinyvllm/kernels/tuning.py), so the tinygrad adapter, the CPU emulator tests and the GPU check all derive the same
numbers from the same static shapes. A plan's `defines` are prepended to the kernel source as #defines; its
`launches` say which kernel runs on which grid with which buffers, in order.

Static inputs only: S (padded sequences), N (padded flat tokens), Tq (padded longest query run), L (context bucket,
a multiple of the block size) and the model's head shapes. Per-step values (context lengths, block tables, query
offsets, slots) come from the int32 metadata tensors at run time, so a plan never changes within a JIT capture.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tinyvllm.kernels.tuning import tuning_for
from tinyvllm.platform.target import DeviceTarget

DTYPE_CODES = {"float": 0, "float32": 0, "half": 1, "float16": 1, "bfloat16": 2}
ELEM_BYTES = {0: 4, 1: 2, 2: 2}
THREADS = 128                 # threads per block of the attention kernels (4 SIMD groups of 32)
# the decode kernels' static shared memory stays within the smaller dialect's (Metal's 32 KB), so one specialisation is
# the same text on both
NEUTRAL_SHARED_BYTES = 32 * 1024
ROW_GROUPS, COL_GROUPS = 16, 8   # prefill thread layout: THREADS = ROW_GROUPS * COL_GROUPS
PREFILL_TILES = ((64, 32), (32, 32), (32, 16), (16, 16), (16, 8))   # (rows M, keys BK) tried in order
TC_PREFILL_ROWS, TC_PREFILL_KEYS = 64, 64   # tensor-core prefill: 4 warps of 16 query rows, keys per tile
TC_DECODE_KEY_WARPS = 4                      # ... taking a decode step: 4 warps over the keys of one 16-row tile,
TC_DECODE_STAGES = 2                         # its K/V tiles in a ring of two (the next tile's copies in flight;
                                             # 16-bit caches only: an FP8 cache's tiles are converted, not copied)
TC_PREFILL_MAX_HEAD_DIM = 128               # its O accumulators take head_dim / 2 registers a thread


# packed (quantized) weight codes -> (the kernels' TV_WQ, bits a code): tinyvllm/backend/quantized.py's forms
PACKED_WEIGHTS = {"int8": (1, 8), "int4": (2, 4), "fp8": (3, 8)}


def cdiv(a: int, b: int) -> int: return -(-a // b)


def dtype_code(name: str) -> int:
  if name not in DTYPE_CODES: raise ValueError(f"unsupported dtype {name!r} (float32, float16 and bfloat16 are)")
  return DTYPE_CODES[name]


@dataclass(frozen=True)
class Param:
  name: str
  kind: str        # "elem" (the activation dtype), "kv" (the cache's: elem or FP8 codes), "float" (float32), "int" (int32),
                   # "uint" (uint32)
  written: bool
  numel: int


@dataclass(frozen=True)
class Launch:
  kernel: str                      # function name in the source
  grid: tuple[int, int, int]       # blocks (CUDA grid / Metal threadgroups per grid)
  threads: int                     # threads per block (1-D)
  params: tuple[Param, ...]        # in the kernel's argument order
  shared_bytes: int = 0            # dynamic shared memory per block (CUDA `extern __shared__`), set at launch
  cooperative: bool = False        # all blocks resident at once (a persistent kernel with grid barriers); the grid must
                                   # not exceed what the GPU holds at once


@dataclass(frozen=True)
class AttentionShape:
  """The static shape one fused attention call is specialised for."""
  dtype: str
  head_dim: int
  num_heads: int
  num_kv_heads: int
  block_size: int
  num_seqs: int        # S (padded)
  num_tokens: int      # N (padded flat tokens)
  query_len: int       # Tq (padded longest query run; 1 = pure decode)
  context_len: int     # L (multiple of block_size)
  num_slots: int       # rows of the cache tensors
  kv_fp8: bool = False  # the caches hold FP8 E4M3 codes (else `dtype` values)

  @property
  def group(self) -> int: return self.num_heads // self.num_kv_heads

  @property
  def max_blocks(self) -> int: return self.context_len // self.block_size


def _common(shape: AttentionShape) -> dict[str, int | str]:
  return {"TV_DTYPE": dtype_code(shape.dtype), "TV_NT": THREADS, "TV_D": shape.head_dim, "TV_G": shape.group,
          "TV_KVH": shape.num_kv_heads, "TV_H": shape.num_heads, "TV_BS": shape.block_size, "TV_S": shape.num_seqs,
          "TV_N": shape.num_tokens, "TV_MAXB": shape.max_blocks, "TV_KV_FP8": int(shape.kv_fp8),
          "TV_SCALE_LOG2": f"{(1.0 / math.sqrt(shape.head_dim)) * math.log2(math.e)!r}f"}


def unsupported_reason(shape: AttentionShape, target: DeviceTarget) -> str | None:
  """Why the fused kernels cannot take this shape (None: they can). The adapter then uses the portable path."""
  if shape.dtype not in DTYPE_CODES: return f"dtype {shape.dtype} (float32, float16 and bfloat16 are supported)"
  if shape.kv_fp8 and dtype_code(shape.dtype) == 0: return "an FP8 KV cache with float32 activations"
  if shape.num_kv_heads < 1 or shape.num_heads % shape.num_kv_heads: return "heads not a multiple of kv heads"
  if shape.group > 32: return f"GQA group {shape.group} > 32"
  vec = 16 // ELEM_BYTES[dtype_code(shape.dtype)]
  if shape.head_dim % vec: return f"head_dim {shape.head_dim} is not a multiple of {vec} (16-byte vectors)"
  vpr = shape.head_dim // vec
  if vpr & (vpr - 1) or vpr > THREADS: return f"head_dim {shape.head_dim}: {vpr} vectors per row is not a power of two <= {THREADS}"
  if shape.context_len % shape.block_size: return "context bucket not a multiple of the block size"
  if prefill_tile(shape, target) is None: return f"no prefill tile fits {target.static_shared_bytes} bytes of shared memory"
  return None


# ---------------------------------------------------------------- decode (Tq == 1)

@dataclass(frozen=True)
class DecodePlan:
  shape: AttentionShape
  vec: int        # elements per KV vector (TV_KVEC, decode_kv_vec): 16 bytes, or 8 bytes of FP8 codes
  vpr: int        # KV vectors per head row
  lpk: int        # lanes per key in the score phase
  nvl: int        # KV vectors per lane
  kpp: int        # keys per pass of the block
  unroll: int     # passes per tile (keys loaded per thread before use)
  tile: int       # keys per online-softmax tile
  njg: int        # key groups in the V phase
  kpt: int        # keys per thread in the V phase
  splits: int     # split-K blocks per (sequence, KV head)
  chunk: int      # keys per split
  defines: dict[str, int | str] = field(compare=False)
  launches: tuple[Launch, ...] = field(compare=False)
  algorithm: str = "decode"   # "decode_staged": K/V through a shared-memory ring (CUDA)

  @property
  def shared_bytes(self) -> int: return decode_shared_bytes(self.shape, self.tile, self.njg)


def decode_shared_bytes(shape: AttentionShape, tile: int, njg: int) -> int:
  return 4 * (2 * shape.group * tile + 3 * shape.group + njg * shape.head_dim)


# FP8 decode: 16-code KV vectors up to this GQA group. Their q slices and V accumulators take 32 G registers a thread:
# G 2 at head_dim 128 takes 158 (8-code vectors: 128), G 4 takes 229-241 (166), 2 blocks an SM instead of 3 (unmeasured)
KV16_MAX_GROUP = 2


def decode_kv_vec(shape: AttentionShape) -> int:
  """Elements per KV vector of the decode kernel: a 16-byte vector of the activations' dtype; with an FP8 cache 16
  codes (16 bytes) where head_dim is a multiple of 16 and the group at most KV16_MAX_GROUP, else 8 codes (8 bytes)."""
  if shape.kv_fp8 and shape.head_dim % 16 == 0 and shape.group <= KV16_MAX_GROUP: return 16
  return 16 // ELEM_BYTES[dtype_code(shape.dtype)]


def decode_tile(shape: AttentionShape) -> int:
  """Keys per tile. 16-bit caches: 8 (G > 4: 4) passes of 16-byte loads, tiles of 32 to 128 keys. FP8 caches: twice
  the keys, as many bytes in flight (the loop is bound by bytes in flight over memory latency): with 16-code vectors
  twice the keys a pass and as many passes, with 8-code ones twice the passes (with the 16-bit tile they ran only 5%
  faster end to end)."""
  lpk = min(shape.head_dim // (16 // ELEM_BYTES[dtype_code(shape.dtype)]), 32)
  kpp = THREADS // lpk
  tile = kpp * max(max(1, 32 // kpp), min(8 if shape.group <= 4 else 4, 64 // kpp))
  return 2 * tile if shape.kv_fp8 else tile


def decode_splits(shape: AttentionShape, tile: int, target_blocks: int) -> tuple[int, int]:
  """(splits, keys per split): enough blocks in flight when S * KVH is small, each split a whole number of tiles."""
  max_splits = cdiv(shape.context_len, tile)
  want = cdiv(target_blocks, shape.num_seqs * shape.num_kv_heads)
  return split_chunks(shape.context_len, max(1, min(max_splits, want)), tile)


def split_chunks(context_len: int, splits: int, tile: int) -> tuple[int, int]:
  """(splits, chunk) for about `splits` pieces of `context_len` keys, each piece a whole number of tiles."""
  chunk = cdiv(cdiv(context_len, splits), tile) * tile
  return cdiv(context_len, chunk), chunk


def kv_row_bytes(shape: AttentionShape) -> int:
  return shape.head_dim * (1 if shape.kv_fp8 else ELEM_BYTES[dtype_code(shape.dtype)])


def decode_ring_bytes(shape: AttentionShape, tile: int, stages: int) -> int:
  """The staged decode's dynamic shared memory: K and V rows of a tile per stage."""
  return stages * 2 * tile * kv_row_bytes(shape)


def default_decode_stages(shape: AttentionShape, target: DeviceTarget) -> int:
  """The tuning table's ring stages for FP8 caches where cp.async runs (CUDA sm_80+), rows copy in 16-byte pieces and
  the ring fits its limit; else 0 (the register path, as for 16-bit caches, whose 64 KB ring costs a block an SM)."""
  tuning = tuning_for(target.kind).attention
  stages = tuning.fp8_decode_stages
  staged = target.tensor_cores and shape.kv_fp8 and stages > 0 and kv_row_bytes(shape) % 16 == 0 and \
    decode_ring_bytes(shape, decode_tile_for(shape), stages) <= tuning.decode_ring_limit_bytes
  return stages if staged else 0


def decode_tile_for(shape: AttentionShape) -> int:
  """The decode tile, halved while its scores would overflow the neutral shared memory (FP8 with a large group and a
  small head)."""
  vpr = shape.head_dim // decode_kv_vec(shape)
  kpp, njg, tile = THREADS // min(vpr, 32), THREADS // vpr, decode_tile(shape)
  while tile > 32 and (tile // 2) % kpp == 0 and decode_shared_bytes(shape, tile, njg) > NEUTRAL_SHARED_BYTES: tile //= 2
  return tile


def decode_plan(shape: AttentionShape, target: DeviceTarget, splits: int | None = None, stages: int | None = None) -> DecodePlan:
  """The decode specialisation. `splits`: the split count (None: enough blocks for the tuning table's target);
  `stages`: K/V tiles through a ring of that many shared-memory stages with cp.async, CUDA (None: the default policy,
  0: registers)."""
  vec = decode_kv_vec(shape)
  vpr = shape.head_dim // vec
  lpk = min(vpr, 32)
  nvl = vpr // lpk
  kpp = THREADS // lpk
  njg = THREADS // vpr
  tile = decode_tile_for(shape)
  unroll = tile // kpp
  kpt = -(-tile // njg)
  stages = default_decode_stages(shape, target) if stages is None else stages
  target_blocks = tuning_for(target.kind).attention.decode_target_blocks
  splits, chunk = decode_splits(shape, tile, target_blocks) if splits is None else split_chunks(shape.context_len, splits, tile)
  d = {**_common(shape), "TV_KVEC": vec, "TV_LPK": lpk, "TV_NVL": nvl, "TV_KPP": kpp, "TV_U": unroll, "TV_TILE": tile,
       "TV_VPR": vpr, "TV_NJG": njg, "TV_KPT": kpt, "TV_NSPLIT": splits, "TV_CHUNK": chunk, "TV_KV_STAGES": stages}
  ring = decode_ring_bytes(shape, tile, stages)
  if stages and (stages == 1 or kv_row_bytes(shape) % 16 or ring + decode_shared_bytes(shape, tile, njg) > target.max_shared_bytes):
    raise ValueError(f"a decode ring of {stages} stages ({ring} bytes) needs 2 or more stages, KV rows of a multiple of "
                     f"16 bytes ({kv_row_bytes(shape)}) and at most {target.max_shared_bytes} bytes with the static shared memory")
  s, h, hd = shape.num_seqs, shape.num_heads, shape.head_dim
  out, *ins = _attention_params(shape)
  part_o, part_ml = Param("part_o", "float", True, s * h * splits * hd), Param("part_ml", "float", True, s * h * splits * 2)
  if splits == 1:
    launches: tuple[Launch, ...] = (Launch("tv_paged_decode", (1, shape.num_kv_heads, s), THREADS, (out, *ins), ring),)
  elif target.dialect == "cuda":   # the last split block of each (sequence, KV head) merges: one launch
    d["TV_MERGE_IN_SPLIT"] = 1
    # arrivals: counters the kernel leaves zero (a buffer of zeros kept across launches), so read-only to the graph
    launches = (Launch("tv_paged_decode_split", (splits, shape.num_kv_heads, s), THREADS,
                       (part_o, part_ml, *ins, out, Param("arrivals", "uint", False, s * shape.num_kv_heads)), ring),)
  else:
    launches = (Launch("tv_paged_decode_split", (splits, shape.num_kv_heads, s), THREADS, (part_o, part_ml, *ins), ring),
                Launch("tv_paged_decode_reduce", (shape.num_kv_heads, s, 1), THREADS,
                       (out, Param("part_o", "float", False, part_o.numel), Param("part_ml", "float", False, part_ml.numel),
                        ins[4], ins[5])))
  return DecodePlan(shape, vec, vpr, lpk, nvl, kpp, unroll, tile, njg, kpt, splits, chunk, d, launches,
                    "decode_staged" if stages else "decode")


# ---------------------------------------------------------------- prefill / mixed (Tq > 1)

@dataclass(frozen=True)
class PrefillPlan:
  shape: AttentionShape
  algorithm: str  # "prefill" (FMA, both dialects) or "prefill_tc" (tensor cores, CUDA)
  rows: int       # query rows per block (tokens * group, padded)
  keys: int       # keys per tile
  tokens: int     # query tokens per block
  q_tiles: int    # blocks along the query run
  defines: dict[str, int | str] = field(compare=False)
  launches: tuple[Launch, ...] = field(compare=False)
  shared_bytes: int = 0   # static shared memory per block


def _attention_params(shape: AttentionShape) -> tuple[Param, ...]:
  """out, q, the caches and the int32 metadata (block tables, context lengths, query starts, the rows' launch order): the
  decode and prefill kernels' shared argument list."""
  s, h, n, hd = shape.num_seqs, shape.num_heads, shape.num_tokens, shape.head_dim
  return (Param("out", "elem", True, n * h * hd), Param("q", "elem", False, n * h * hd),
          Param("k_cache", "kv", False, shape.num_slots * shape.num_kv_heads * hd),
          Param("v_cache", "kv", False, shape.num_slots * shape.num_kv_heads * hd),
          Param("block_tables", "int", False, s * shape.max_blocks), Param("context_lens", "int", False, s),
          Param("query_start", "int", False, s + 1), Param("row_order", "int", False, s))


def prefill_shared_bytes(rows: int, keys: int, words: int) -> int:
  return 4 * (rows * (words + 1) + keys * (words + 1) + keys * words + rows * (keys + 1))


def prefill_tile(shape: AttentionShape, target: DeviceTarget) -> tuple[int, int] | None:
  """The largest (rows, keys) tile whose shared memory fits and that holds at least one token's G heads."""
  epw = 1 if dtype_code(shape.dtype) == 0 else 2
  words = shape.head_dim // epw
  for rows, keys in PREFILL_TILES:
    if rows >= shape.group and prefill_shared_bytes(rows, keys, words) <= target.static_shared_bytes - 512: return rows, keys
  return None


def prefill_plan(shape: AttentionShape, target: DeviceTarget) -> PrefillPlan:
  """The tensor-core kernel (paged_prefill_tc.inc) where it runs (CUDA sm_80+, 16-bit, head_dim a multiple of 16 up to
  128), else the FMA one (paged_prefill.inc)."""
  if target.tensor_cores and tc_prefill_unsupported_reason(shape) is None: return tc_prefill_plan(shape)
  tile = prefill_tile(shape, target)
  assert tile is not None, unsupported_reason(shape, target)
  rows, keys = tile
  epw = 1 if dtype_code(shape.dtype) == 0 else 2
  words = shape.head_dim // epw
  tokens = rows // shape.group
  q_tiles = -(-shape.query_len // tokens)
  rpt, cpt, wpt = rows // ROW_GROUPS, keys // COL_GROUPS, -(-words // COL_GROUPS)
  d = {**_common(shape), "TV_M": rows, "TV_BK": keys, "TV_BQ": tokens, "TV_NQT": q_tiles, "TV_RG": ROW_GROUPS,
       "TV_CG": COL_GROUPS, "TV_RPT": rpt, "TV_CPT": cpt, "TV_WPT": wpt, "TV_DW": words, "TV_QSTR": words + 1}
  launch = Launch("tv_paged_prefill", (q_tiles, shape.num_kv_heads, shape.num_seqs), THREADS, _attention_params(shape))
  return PrefillPlan(shape, "prefill", rows, keys, tokens, q_tiles, d, (launch,), prefill_shared_bytes(rows, keys, words))


def tc_prefill_unsupported_reason(shape: AttentionShape) -> str | None:
  if dtype_code(shape.dtype) == 0: return "float32 activations"
  if shape.head_dim % 16 or shape.head_dim > TC_PREFILL_MAX_HEAD_DIM:
    return f"head_dim {shape.head_dim} (a multiple of 16 up to {TC_PREFILL_MAX_HEAD_DIM})"
  if shape.group > TC_PREFILL_ROWS // 4: return f"GQA group {shape.group} > {TC_PREFILL_ROWS // 4}"
  return None


def decode_on_tensor_cores(shape: AttentionShape, target: DeviceTarget) -> bool:
  """Whether a decode step runs on the tensor-core prefill kernel (a block's rows are one token's G query heads, a block
  takes a sequence's KV head over its whole context): where the tuning table measured it faster than the decode kernel,
  whose threads each hold all G query rows (large groups halve its blocks an SM), and where the batch alone fills the GPU
  (it has no split-K). Never for FP8 caches, whose codes it converts through registers."""
  tuning = tuning_for(target.kind).attention
  return (shape.query_len == 1 and target.tensor_cores and not shape.kv_fp8 and tuning.tc_decode_min_group > 0
          and shape.group >= tuning.tc_decode_min_group and shape.num_seqs * shape.num_kv_heads >= tuning.tc_decode_min_blocks
          and tc_prefill_unsupported_reason(shape) is None)


def tc_prefill_plan(shape: AttentionShape, key_warps: int = 1) -> PrefillPlan:
  """The tensor-core kernel's plan; `key_warps` > 1 (decode steps): its four warps split each key tile into that many
  groups, each over the same 64 / key_warps rows (a decode token's query heads), instead of splitting 64 rows."""
  rows, keys = TC_PREFILL_ROWS // key_warps, TC_PREFILL_KEYS
  tokens = rows // shape.group
  q_tiles = cdiv(shape.query_len, tokens)
  stages = TC_DECODE_STAGES if key_warps > 1 and not shape.kv_fp8 else 1
  d = {**_common(shape), "TV_BK": keys, "TV_BQ": tokens, "TV_NQT": q_tiles, "TV_KW": key_warps, "TV_TC_STAGES": stages}
  shared = stages * 2 * keys * (shape.head_dim + 8) * ELEM_BYTES[dtype_code(shape.dtype)]   # K and V tiles, padded rows
  launch = Launch("tv_paged_prefill_tc", (q_tiles, shape.num_kv_heads, shape.num_seqs), THREADS, _attention_params(shape), shared)
  return PrefillPlan(shape, "prefill_tc", rows, keys, tokens, q_tiles, d, (launch,), shared)


# ---------------------------------------------------------------- KV write

@dataclass(frozen=True)
class WritePlan:
  dtype: str
  row: int             # elements per cache row (kv_heads * head_dim)
  num_tokens: int
  num_slots: int
  threads: int
  defines: dict[str, int | str] = field(compare=False)
  launches: tuple[Launch, ...] = field(compare=False)


def write_unsupported_reason(dtype: str, row: int, kv_fp8: bool = False) -> str | None:
  if dtype not in DTYPE_CODES: return f"dtype {dtype}"
  if kv_fp8 and dtype_code(dtype) == 0: return "an FP8 KV cache with float32 activations"
  vec = 16 // ELEM_BYTES[dtype_code(dtype)]
  return None if row % vec == 0 else f"row of {row} elements is not a whole number of 16-byte vectors"


def write_plan(dtype: str, row: int, num_tokens: int, num_slots: int, kv_fp8: bool = False) -> WritePlan:
  """`dtype`: the new K/V rows'; the caches hold the same, or FP8 codes with `kv_fp8`."""
  code = dtype_code(dtype)
  vectors = row // (16 // ELEM_BYTES[code])
  threads = min(THREADS, max(32, -(-vectors // 32) * 32))
  d: dict[str, int | str] = {"TV_DTYPE": code, "TV_NT": threads, "TV_ROW": row, "TV_N": num_tokens, "TV_NSLOTS": num_slots,
                             "TV_KV_FP8": int(kv_fp8)}
  params = (Param("k_cache", "kv", True, num_slots * row), Param("v_cache", "kv", True, num_slots * row),
            Param("k", "elem", False, num_tokens * row), Param("v", "elem", False, num_tokens * row),
            Param("slot_mapping", "int", False, num_tokens))
  return WritePlan(dtype, row, num_tokens, num_slots, threads, d, (Launch("tv_kv_write", (num_tokens, 1, 1), threads, params),))
