"""The decoder layers of a small decode step in one persistent kernel (csrc/cuda/decode_layer.inc, CUDA only).

At batch 1 a step of per-op kernels is ~7 dependent launches a layer, and each small kernel's launch, ramp-up and tail
cost more than its bytes (docs/benchmarks.md, "Batch 1"). This kernel runs one block per SM through every layer's five
phases (qkv, attention, o, gate_up, down) with grid barriers between them, streaming each block's slice of the next
phase's weights into shared memory one phase ahead (the next layer's qkv slice during this layer's down phase). Every
block must be resident at once (the barriers spin), so the grid is the GPU's SM count and a block takes the shared
memory of a whole SM; shapes whose slices do not fit use the per-op kernels. A launch takes up to MAX_LAYERS layers
(each layer's buffers are kernel arguments: CUDA's 4 KB of them bound the count). Metal has no grid barrier with a
forward-progress guarantee, so there the per-op kernels run. It uses Hopper's bulk copies (sm_90). Each product's
weights may be packed (quantized: int8, int4, FP8 codes with per-group scales), staged as codes and dequantized in
registers.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from tinygrad import Tensor, dtypes

from tinyvllm.backend.metadata import AttentionMetadata
from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.backend.weights import DecoderLayerWeights, Weight
from tinyvllm.kernels.plan import PACKED_WEIGHTS, Launch, Param, cdiv, dtype_code
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import run_kernel
from tinyvllm.kernels.tuning import tuning_for
from tinyvllm.layers.fp8 import is_fp8
from tinyvllm.platform.target import DeviceTarget

MAX_ROWS = 8          # decode rows it takes (sequences, or a verification's tokens): x' of 8 rows of Qwen3-0.6B's widest
                      # input fits beside its weight slices
MAX_LAYERS = 32       # layers a launch takes at most (fewer where a layer's pointers would pass ARGUMENT_POINTERS)
ARGUMENT_POINTERS = 512   # CUDA's 4 KB of kernel arguments
STEP_PARAMS = 16          # the step's own buffers, before the layers'
MAX_GROUP = 4         # query heads per KV head (the attention phase holds G x 8 q values and accumulators a thread)
THREADS = 512
TILE_KEYS = 128       # keys an attention tile covers at least


LAYER_PARAMS = ("k_cache", "v_cache", "input_norm", "w_qkv", "w_o", "post_norm", "w_gu", "w_down")
PRODUCTS = ("qkv", "o", "gu", "down")   # the layer's four products, in DecodeLayerShape.weights' order
PACKED_FORMATS = {"elem": (0, 16), **PACKED_WEIGHTS}   # weight form -> (TV_WQ_*, bits a weight)
ELEM = ("elem", 0)   # a product whose weight is in the activations' dtype


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
  layers: int = 1          # decoder layers a launch runs, one after the other
  # each product's weight form (PACKED_FORMATS) and scale group (input columns), in PRODUCTS' order
  weights: tuple[tuple[str, int], ...] = (ELEM,) * 4
  # a block owns gate_up's rows in pairs (gate row i, up row I + i) and writes silu(gate) * up itself, so that the down
  # phase reads [rows][I] instead of [rows][2 I] (16-bit gate_up weights only: _gu_pairs)
  paired_gate_up: bool = False

  @property
  def layer_params(self) -> tuple[str, ...]:
    """Each layer's buffers, in the kernel's table order (decode_layer.inc's TV_P_* slots): a packed product's scales
    and (integer codes) shifts after the rest."""
    packed = tuple(f"w_{p}_{part}" for p, (form, _) in zip(PRODUCTS, self.weights, strict=True) if form != "elem"
                   for part in (("scale",) if form == "fp8" else ("scale", "shift")))
    return (LAYER_PARAMS + (("q_norm", "k_norm") if self.qk_norm else ()) + (("qkv_bias",) if self.qkv_bias else ()) + packed)

  @property
  def group(self) -> int: return self.heads // self.kv_heads

  @property
  def qkv_width(self) -> int: return (self.heads + 2 * self.kv_heads) * self.head_dim

  def product_dims(self) -> dict[str, tuple[int, int]]:
    """Each product's (rows, input columns)."""
    return {"qkv": (self.qkv_width, self.hidden), "o": (self.hidden, self.heads * self.head_dim),
            "gu": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}


@dataclass(frozen=True)
class DecodeLayerPlan:
  defines: dict[str, int | str]
  launch: Launch


def _gu_pairs(shape: DecodeLayerShape) -> int:
  """gate_up's row pairs a block owns where the launch pairs them (DecodeLayerShape.paired_gate_up), else 0: only where
  gate_up's weight is in the activations' dtype, since a packed slice's scale windows take one run of rows."""
  paired = shape.paired_gate_up and shape.weights[PRODUCTS.index("gu")][0] == "elem"
  return cdiv(shape.intermediate, shape.blocks) if paired else 0


def _slices(shape: DecodeLayerShape) -> dict[str, int]:
  """Rows of each product a block owns (gate_up's: 2 TV_GU_PAIRS rows where paired, its first half gate rows)."""
  nb, s = shape.blocks, shape
  pairs = _gu_pairs(s)
  return {"TV_R_QKV": cdiv(s.qkv_width, nb), "TV_R_O": cdiv(s.hidden, nb),
          "TV_R_GU": 2 * pairs if pairs else cdiv(2 * s.intermediate, nb), "TV_R_DN": cdiv(s.hidden, nb)}


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


META_TABLE_BYTES = 8192   # block tables up to this size are copied into shared memory once for all layers


def _caches_tables(shape: DecodeLayerShape) -> bool: return 4 * shape.rows * shape.max_blocks <= META_TABLE_BYTES


def _meta_ints(shape: DecodeLayerShape) -> int:
  """The step's metadata kept in shared memory: context lengths, query starts, slots, new keys (and the block tables if
  small)."""
  return 4 * shape.rows + 1 + (shape.rows * shape.max_blocks if _caches_tables(shape) else 0)


def _slice_bytes(shape: DecodeLayerShape, product: str, rows: int) -> int:
  """Bytes of a block's slice of `rows` rows of a product in its buffer: the codes, then the scales' and shifts' windows
  (decode_layer_ops.inc, TV_DL_SCALE_BYTES)."""
  form, group = shape.weights[PRODUCTS.index(product)]
  k, bits = shape.product_dims()[product][1], PACKED_FORMATS[form][1]
  if form == "elem": return rows * k * bits // 8
  return rows * k * bits // 8 + (_align(rows * (k // group) * 4) + 16) * (1 if form == "fp8" else 2)


def _tensor_core_sums(shape: DecodeLayerShape) -> int:
  """Partial sums an x' row of a product on tensor cores leaves in the scratch region (decode_layer_products.inc's
  tv_dl_gemv_tc: a block's rows times the parts K is split into, the warps shared among its 16-row tiles), the most of
  any product that could run there (the tuning table's row bound aside: the region is sized for either choice)."""
  r, nw, most = _slices(shape), shape.threads // 32, 0
  for product, rows, (form, _) in zip(PRODUCTS, ("TV_R_QKV", "TV_R_O", "TV_R_GU", "TV_R_DN"), shape.weights, strict=True):
    if form == "elem" and shape.product_dims()[product][1] % 64 == 0:
      most = max(most, r[rows] * max(1, nw // cdiv(r[rows], 16)))
  return most


def shared_layout(shape: DecodeLayerShape) -> dict[str, int]:
  """Bytes of the shared-memory regions (csrc/cuda/decode_layer_ops.inc): A, B (weight slices), X (x'), S, Y, T (the
  buffers' mbarriers and a flag, the layers' pointers, the step's metadata)."""
  s, r, nw = shape, _slices(shape), shape.threads // 32
  g, d = s.group, s.head_dim
  m = s.rows   # new keys a row may have (decode_layer_attend.inc's scratch)
  attention = (g + m) * d + 2 * nw * g + cdiv(g + m, 4) * 4 + m * 8 * (d // 8) + max(nw * g, 3 + m) * d
  red_rows, keep_rows = max(*r.values(), nw), max(r["TV_R_O"], r["TV_R_DN"])
  slice_bytes = lambda product, rows: _slice_bytes(s, product, r[rows])
  return {"TV_A_BYTES": _align(max(slice_bytes("qkv", "TV_R_QKV"), slice_bytes("gu", "TV_R_GU"))),
          "TV_B_BYTES": _align(max(slice_bytes("o", "TV_R_O"), slice_bytes("down", "TV_R_DN"))),
          "TV_X_BYTES": _align(2 * s.rows * max(s.hidden, s.heads * d, s.intermediate)),
          "TV_S_BYTES": _align(4 * max(attention, s.rows * s.hidden // 8, s.rows * _tensor_core_sums(s))),
          "TV_Y_BYTES": _align(4 * (s.rows * red_rows + s.rows + s.rows * keep_rows)),
          "TV_T_BYTES": _align(24 + 8 * s.layers * len(s.layer_params) + 4 * _meta_ints(s)), "TV_RED_ROWS": red_rows,
          "TV_R_KEEP": keep_rows}


def shared_bytes(shape: DecodeLayerShape) -> int:
  layout = shared_layout(shape)
  return sum(v for k, v in layout.items() if k.endswith("_BYTES"))


def unsupported_reason(shape: DecodeLayerShape, target: DeviceTarget) -> str | None:
  s = shape
  if not (target.wgmma and target.grid_sync):
    return f"device {target.arch or target.device} (the layer kernel needs a grid barrier and Hopper's bulk copies)"
  if s.dtype not in ("float16", "bfloat16"): return f"dtype {s.dtype} (the layer kernel takes float16 and bfloat16)"
  if not 1 <= s.rows <= MAX_ROWS: return f"{s.rows} rows (the layer kernel takes 1 to {MAX_ROWS})"
  if not 1 <= s.layers <= (most := max_layers(s)): return f"{s.layers} layers in one launch (it takes 1 to {most})"
  if (reason := _packed_reason(s)) is not None: return reason
  if s.heads % s.kv_heads or s.group > MAX_GROUP: return f"{s.heads} query heads over {s.kv_heads} KV heads (group above {MAX_GROUP})"
  dv = s.head_dim // 8
  if s.head_dim % 8 or dv > 32 or dv & (dv - 1): return f"head_dim {s.head_dim} (8 times a power of two up to 32)"
  if s.hidden % 8 or s.intermediate % 8: return f"hidden {s.hidden} / intermediate {s.intermediate} not multiples of 8"
  if s.blocks < 1: return "no multiprocessors"
  if (need := shared_bytes(s)) > target.max_shared_bytes:
    return f"the layer's weight slices need {need} bytes of shared memory a block (an SM gives {target.max_shared_bytes})"
  return None


def max_layers(shape: DecodeLayerShape) -> int:
  """Layers one launch takes: up to MAX_LAYERS, as many as CUDA's kernel arguments hold the pointers of."""
  return min(MAX_LAYERS, (ARGUMENT_POINTERS - STEP_PARAMS) // len(shape.layer_params))


def _packed_reason(shape: DecodeLayerShape) -> str | None:
  """Why a product's packed weight does not fit the kernel's slices, or None."""
  for product, (form, group) in zip(PRODUCTS, shape.weights, strict=True):
    rows, k = shape.product_dims()[product]
    if form not in PACKED_FORMATS: return f"{form} weights ({product})"
    if form == "elem": continue
    bits = PACKED_FORMATS[form][1]
    if group <= 0 or group % 8 or k % group: return f"{product} scale group {group} (a multiple of 8 dividing {k})"
    if k * bits % 128: return f"{product}'s {k} {form} columns are not whole 16-byte rows of codes"
    if rows * (k // group) % 4: return f"{product}'s {rows} x {k // group} scales are not whole 16-byte units"
  return None


def _layer_param(shape: DecodeLayerShape, name: str) -> Param:
  s, hd = shape, shape.heads * shape.head_dim
  product = name[2:].removesuffix("_scale").removesuffix("_shift")
  if name.startswith("w_") and (form := s.weights[PRODUCTS.index(product)])[0] != "elem":
    rows, k = s.product_dims()[product]
    if name.endswith(("_scale", "_shift")): return Param(name, "float", False, rows * (k // form[1]))
    return Param(name, "uint", False, rows * k * PACKED_FORMATS[form[0]][1] // 32)
  numel = {"k_cache": s.num_slots * s.kv_heads * s.head_dim, "v_cache": s.num_slots * s.kv_heads * s.head_dim,
           "input_norm": s.hidden, "w_qkv": s.qkv_width * s.hidden, "w_o": s.hidden * hd, "post_norm": s.hidden,
           "w_gu": 2 * s.intermediate * s.hidden, "w_down": s.hidden * s.intermediate, "q_norm": s.head_dim,
           "k_norm": s.head_dim, "qkv_bias": s.qkv_width}[name]
  return Param(name, "kv" if name.endswith("cache") else "elem", name.endswith("cache"), numel)


ARG_TYPES = {"kv": "TV_KV_ELEM", "elem": "TV_ELEM", "float": "float", "uint": "uint"}


def _layer_defines(shape: DecodeLayerShape, first_index: int) -> dict[str, int | str]:
  """The generated kernel text for the per-layer arguments (`name_l`, in table order), the table's fill and each
  product's weight form (TV_WQ_*, TV_WG_*) and scale / shift slots (TV_P_*_S, TV_P_*_Z: the codes' slot where absent)."""
  names = [f"{name}_{li}" for li in range(shape.layers) for name in shape.layer_params]
  params = [_layer_param(shape, n.rsplit("_", 1)[0]) for n in names]
  args = "".join(f", {'TV_ARG' if p.written else 'TV_ARG_RO'}({ARG_TYPES[p.kind]}, {n}, {first_index + i})"
                 for i, (n, p) in enumerate(zip(names, params, strict=True)))
  defines: dict[str, int | str] = {"TV_L": shape.layers, "TV_LP": len(shape.layer_params), "TV_LAYER_ARGS": args,
                                   "TV_FILL_TABLE": " ".join(f"tv_tab[{i}] = (void*){n};" for i, n in enumerate(names))}
  if shape.qkv_bias: defines["TV_P_QKV_BIAS"] = shape.layer_params.index("qkv_bias")
  defines["TV_PACKED_WEIGHTS"] = 1   # common.inc's dequantization: every product's template may take packed codes
  slot = lambda name, fallback: shape.layer_params.index(name if name in shape.layer_params else fallback)
  for product, (form, group) in zip(PRODUCTS, shape.weights, strict=True):
    tag, codes = product.upper(), f"w_{product}"
    defines.update({f"TV_WQ_{tag}": PACKED_FORMATS[form][0], f"TV_WG_{tag}": group or shape.product_dims()[product][1],
                    f"TV_P_{tag}_S": slot(f"{codes}_scale", codes), f"TV_P_{tag}_Z": slot(f"{codes}_shift", codes)})
  return defines


def decode_layer_plan(shape: DecodeLayerShape, target: DeviceTarget) -> DecodeLayerPlan:
  if (reason := unsupported_reason(shape, target)) is not None: raise ValueError(f"decode layer kernel: {reason}")
  s, tuned = shape, tuning_for(target.kind).decode_layer
  kpass, tile, chunk, splits = _tiles(s)
  layout = shared_layout(s)
  defines: dict[str, int | str] = {
    "TV_DTYPE": dtype_code(s.dtype), "TV_NT": s.threads, "TV_NB": s.blocks, "TV_M": s.rows, "TV_N": s.rows, "TV_HID": s.hidden,
    "TV_H": s.heads, "TV_KVH": s.kv_heads, "TV_D": s.head_dim, "TV_G": s.group, "TV_INTER": s.intermediate,
    "TV_EPS": f"{s.eps!r}f", "TV_KV_FP8": int(s.kv_fp8), "TV_BS": s.block_size, "TV_MAXB": s.max_blocks,
    "TV_NSLOTS": s.num_slots, "TV_KPASS": kpass, "TV_TILE": tile, "TV_CHUNK": chunk, "TV_NSPLIT": splits,
    "TV_PACE_CHUNK": tuned.pace_chunk_bytes, "TV_PACE_GAP": tuned.pace_chunk_bytes // tuned.hbm_bytes_per_sm_cycle,
    "TV_TC_MIN_ROWS": tuned.tensor_core_min_rows,
    "TV_SCALE_LOG2": f"{(1.0 / math.sqrt(s.head_dim)) * math.log2(math.e)!r}f", **_slices(s), **layout,
    "TV_GU_PAIRS": _gu_pairs(s),
    "TV_META_INTS": _meta_ints(s), "TV_CACHE_TABLES": int(_caches_tables(s))}
  if s.qk_norm: defines["TV_QK_NORM"] = 1
  m = s.rows
  params = [Param("h_out", "elem", True, m * s.hidden), Param("qkv", "elem", True, m * s.qkv_width),
            Param("part_o", "float", True, m * s.heads * splits * s.head_dim),
            Param("part_ml", "float", True, 2 * m * s.heads * splits), Param("h_mid", "elem", True, m * s.hidden),
            Param("gu", "elem", True, (1 if _gu_pairs(s) else 2) * m * s.intermediate), Param("sync", "uint", True, 2),
            Param("h_in", "elem", False, m * s.hidden), Param("rope_cos", "float", False, m * s.head_dim // 2),
            Param("rope_sin", "float", False, m * s.head_dim // 2), Param("slot_mapping", "int", False, m),
            Param("block_tables", "int", False, m * s.max_blocks), Param("context_lens", "int", False, m),
            Param("query_start", "int", False, m + 1), Param("new_keys", "int", False, m),
            Param("attn", "elem", True, m * s.heads * s.head_dim)]
  defines.update(_layer_defines(s, len(params)))
  for li in range(s.layers):
    params += [replace(_layer_param(s, name), name=f"{name}_{li}") for name in s.layer_params]
  launch = Launch("tv_decode_layer", (s.blocks, 1, 1), s.threads, tuple(params), shared_bytes(s), cooperative=True)
  return DecodeLayerPlan(defines, launch)


@functools.cache
def decode_layer_source(shape: DecodeLayerShape, target: DeviceTarget) -> tuple[DecodeLayerPlan, str]:
  plan = decode_layer_plan(shape, target)
  return plan, kernel_source("cuda", "decode_layer", plan.defines)


def layer_arguments(layers: list[DecoderLayerWeights], h: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                    meta: AttentionMetadata, sync: Tensor) -> dict[str, Tensor]:
  """The kernel's inputs and written buffers by parameter name (the scratch ones are left to run_decode_layer)."""
  named = {"h_in": h, "sync": sync, "rope_cos": cos, "rope_sin": sin, "slot_mapping": meta.slot_mapping,
           "block_tables": meta.block_tables, "context_lens": meta.context_lens, "query_start": meta.query_start,
           "new_keys": meta.new_keys}
  for li, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=True)):
    named.update({f"k_cache_{li}": k_cache, f"v_cache_{li}": v_cache, f"input_norm_{li}": layer.input_norm,
                  f"post_norm_{li}": layer.post_attention_norm, f"q_norm_{li}": layer.q_norm, f"k_norm_{li}": layer.k_norm,
                  f"qkv_bias_{li}": layer.qkv_bias})
    for product, weight in zip(PRODUCTS, layer.linears(), strict=True):
      named.update(_weight_arguments(f"w_{product}", li, weight))
  written = {"sync", *(f"{c}_cache_{li}" for li in range(len(layers)) for c in "kv")}
  return {k: t if k in written else t.contiguous() for k, t in named.items() if t is not None}


def _weight_arguments(name: str, li: int, weight: Weight) -> dict[str, Tensor | None]:
  """A product's buffers: the weight, or a packed one's codes, scales and shifts (flat)."""
  if not isinstance(weight, QuantizedWeight): return {f"{name}_{li}": weight}
  flat = lambda t: None if t is None else t.reshape(-1)
  return {f"{name}_{li}": flat(weight.codes), f"{name}_scale_{li}": flat(weight.scales), f"{name}_shift_{li}": flat(weight.shifts)}


def weight_form(weight: Weight) -> tuple[str, int]:
  """A product's entry in DecodeLayerShape.weights."""
  if not isinstance(weight, QuantizedWeight): return ELEM
  return (weight.code_format, weight.group_size)


def run_decode_layer(shape: DecodeLayerShape, target: DeviceTarget, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
  """Launch the layer on `tensors` (by parameter name; the scratch ones are made here). Returns every tensor after it."""
  plan, source = decode_layer_source(shape, target)
  device = tensors["h_in"].device
  kinds = {"float": dtypes.float32, "uint": dtypes.uint32, "elem": tensors["h_in"].dtype}
  args = [tensors[p.name] if p.name in tensors else Tensor.empty(p.numel, dtype=kinds[p.kind], device=device)
          for p in plan.launch.params]
  return dict(zip((p.name for p in plan.launch.params), run_kernel(plan.launch, source, args), strict=True))


def step_shape(layers: list[DecoderLayerWeights], h: Tensor, cos: Tensor, k_cache: Tensor, v_cache: Tensor,
               meta: AttentionMetadata, eps: float, target: DeviceTarget, max_context: int) -> tuple[DecodeLayerShape | None, str | None]:
  """The kernel's shape for a step's first launch (layer_launches gives every launch's), or (None, None) for a step it
  is not meant for (not a decode of at most MAX_ROWS rows within `max_context`: the per-op kernels are the design
  there), or (None, why) for a model whose layers it cannot take."""
  rows = h.shape[0]
  if not meta.is_decode or rows != meta.block_tables.shape[0] or meta.block_tables.shape[1] * meta.block_size > max_context:
    return None, None
  head_dim, kv_fp8, layer = 2 * cos.shape[1], is_fp8(k_cache), layers[0]
  dtype = {dtypes.float16: "float16", dtypes.bfloat16: "bfloat16"}.get(h.dtype)
  reason = next((r for bad, r in (
    (any(x.moe is not None for x in layers), "mixture-of-experts layers"),
    (any(x.signature() != layer.signature() for x in layers), "layers of different shapes"),
    (any(isinstance(w, QuantizedWeight) and (w.g_idx is not None or w.perm is not None) for x in layers for w in x.linears()),
     "act-order (g_idx) weights"),
    (any(b is not None for b in (layer.o_bias, layer.gate_up_bias, layer.down_bias)), "o / MLP biases"),
    (dtype is None or layer.qkv_proj.dtype != h.dtype, f"activations {h.dtype.name}, weights {layer.qkv_proj.dtype.name}"),
    (v_cache.dtype != k_cache.dtype or (not kv_fp8 and k_cache.dtype != h.dtype), "cache dtype"),
    (cos.dtype != dtypes.float32, "RoPE tables not float32"),
    (any(t.dtype != dtypes.int32 for t in (meta.slot_mapping, meta.block_tables, meta.context_lens, meta.new_keys)),
     "metadata not int32"),
    (k_cache.shape[1] % head_dim, "cache row is not a whole number of heads")) if bad), None)
  if reason is not None or dtype is None: return None, reason or "dtype"
  tuned = tuning_for(target.kind).decode_layer
  shape = DecodeLayerShape(dtype, rows, h.shape[1], layer.o_proj.shape[1] // head_dim, k_cache.shape[1] // head_dim, head_dim,
                           layer.down_proj.shape[1], layer.q_norm is not None, layer.qkv_bias is not None, eps, meta.block_size,
                           meta.block_tables.shape[1], k_cache.shape[0], kv_fp8, target.multiprocessors, tuned.threads(rows, THREADS),
                           paired_gate_up=tuned.pairs_gate_up(rows))
  launches = layer_launches(shape, layers)
  reason = next((r for _, launch in launches if (r := unsupported_reason(launch, target)) is not None), None)
  return (launches[0][1], None) if reason is None else (None, reason)


def layer_launches(shape: DecodeLayerShape, layers: list[DecoderLayerWeights]) -> list[tuple[int, DecodeLayerShape]]:
  """(first layer, shape) of each launch of a step: runs of consecutive layers whose products have the same weight forms
  (a GGUF file's mixes differ from layer to layer), each in as few launches of equal size as the kernel's arguments
  allow (one specialisation a run, and one for a shorter last launch)."""
  forms = [tuple(weight_form(w) for w in x.linears()) for x in layers]
  launches, first = [], 0
  while first < len(layers):
    end = next((i for i in range(first, len(layers)) if forms[i] != forms[first]), len(layers))
    run = replace(shape, weights=forms[first], layers=1)
    size = cdiv(end - first, cdiv(end - first, max_layers(run)))
    launches += [(at, replace(run, layers=min(size, end - at))) for at in range(first, end, size)]
    first = end
  return launches
