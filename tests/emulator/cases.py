"""Random paged-attention inputs for checking the kernels: a batch laid out exactly as worker/input_batch.py does it.

Each sequence is (context length, new tokens): a decode has 1 new token, a prefill of a fresh prompt has
new == context, a chunk of a longer prompt or a prompt after a cached prefix has 1 < new < context. Physical blocks
are drawn from a shuffled pool (holes, out of order), and `share` makes sequences start with the same physical blocks
as sequence 0 (a shared prefix, as prefix caching and forks do). Values are random (never zeros) and exactly
representable in the kernel dtype, so the float32 reference sees the kernel's inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tinyvllm.kernels.plan import AttentionShape
from tinyvllm.worker.input_batch import launch_order


def bucket(n: int, minimum: int = 1) -> int: return 1 << (max(n, minimum) - 1).bit_length()


FP8 = "fp8_e4m3"   # the FP8 KV cache's storage (uint8 codes), as a dtype name of these helpers


def e4m3_codes_to_f32(codes: np.ndarray) -> np.ndarray:
  c = np.asarray(codes, np.uint16)
  return ((c & 0x7F) << 7 | (c & 0x80) << 8).astype(np.uint16).view(np.float16).astype(np.float32) * np.float32(256)


def f32_to_e4m3_codes(x: np.ndarray) -> np.ndarray:
  """Nearest even, saturating to +-448, NaN -> 0x7f (torch.float8_e4m3fn's rounding; the tests check it against torch)."""
  u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.int64)
  sign, a = (u >> 24) & 0x80, u & 0x7FFFFFFF
  r = a + 0x7FFFF + ((a >> 20) & 1)
  normal = ((r >> 23) - 120) << 3 | (r >> 20) & 7
  small = np.where(a < 0x3C800000, a, 0).astype(np.uint32).view(np.float32)
  subnormal = np.rint(small * np.float32(512)).astype(np.int64)
  code = np.where(a > 0x7F800000, 0x7F, np.where(a >= 0x43E00000, 0x7E, np.where(a < 0x3C800000, subnormal, normal)))
  return (code | sign).astype(np.uint8)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
  """float32 values rounded to `dtype` (round to nearest even), as float32."""
  x = np.asarray(x, np.float32)
  if dtype == "float32": return x.copy()
  if dtype == FP8: return e4m3_codes_to_f32(f32_to_e4m3_codes(x))
  if dtype == "float16": return x.astype(np.float16).astype(np.float32)
  if dtype == "bfloat16": return bf16_bits_to_f32(f32_to_bf16_bits(x))
  raise ValueError(dtype)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
  u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
  r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
  return np.where(np.isnan(x), np.uint16(0x7FC0), r)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray: return (b.astype(np.uint32) << 16).view(np.float32)


def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
  """The storage the kernels read: float32 as is, 16-bit types as raw uint16 bits, FP8 as uint8 codes."""
  if dtype == "float32": return np.ascontiguousarray(x, np.float32)
  if dtype == FP8: return f32_to_e4m3_codes(x)
  if dtype == "float16": return np.ascontiguousarray(x.astype(np.float16)).view(np.uint16)
  return f32_to_bf16_bits(x)


def from_bits(b: np.ndarray, dtype: str) -> np.ndarray:
  if dtype == "float32": return b.astype(np.float32)
  if dtype == FP8: return e4m3_codes_to_f32(b)
  if dtype == "float16": return b.view(np.float16).astype(np.float32)
  return bf16_bits_to_f32(b)


@dataclass
class PagedCase:
  shape: AttentionShape
  seqs: list[tuple[int, int]]   # (context length, new tokens) of each real sequence
  q: np.ndarray                 # [N, H, D] float32 (representable in shape.dtype)
  k_cache: np.ndarray           # [slots, KVH * D] (representable in kv_dtype)
  v_cache: np.ndarray
  arrays: dict[str, np.ndarray]  # int32 metadata, named as in input_batch

  @property
  def total_tokens(self) -> int: return int(self.arrays["query_start"][-1])

  @property
  def kv_dtype(self) -> str: return FP8 if self.shape.kv_fp8 else self.shape.dtype


def make_case(rng: np.random.Generator, seqs: list[tuple[int, int]], *, heads: int, kv_heads: int, head_dim: int,
              block_size: int = 16, dtype: str = "float32", share: int = 0, pad_seqs: int = 0, extra_blocks: int = 7,
              scale: float = 1.0, kv_fp8: bool = False, min_bucket: int = 16, min_tokens: int = 1,
              min_query_run: int = 1) -> PagedCase:
  """`share`: sequences 1..share start with sequence 0's physical blocks (as many as both fill completely).
  `pad_seqs`: extra padding sequences beyond the power-of-two bucket's own padding. `kv_fp8`: FP8 caches.
  `min_bucket`: the smallest context bucket (block-table width times block size), as a backend's min_context_bucket.
  `min_tokens`, `min_query_run`: the fewest token rows and the shortest query run Tq (a prompt step's coarse buckets)."""
  assert all(1 <= new <= ctx for ctx, new in seqs), seqs
  s_real = len(seqs)
  s_pad = bucket(s_real + pad_seqs)
  n_real = sum(new for _, new in seqs)
  n = bucket(n_real, min_tokens)
  tq = max(bucket(max(new for _, new in seqs)), min_query_run)
  L = bucket(max(ctx for ctx, _ in seqs), min_bucket)
  L = -(-L // block_size) * block_size
  max_blocks = L // block_size
  need = [-(-ctx // block_size) for ctx, _ in seqs]
  pool = rng.permutation(sum(need) + extra_blocks).astype(np.int32)   # holes: extra_blocks never used
  tables, used = [], 0
  for i, k in enumerate(need):
    table = list(pool[used:used + k])
    used += k
    if 1 <= i <= share:
      full = min(seqs[0][0] - seqs[0][1], seqs[i][0] - seqs[i][1]) // block_size   # cached, complete blocks only
      table[:full] = tables[0][:full]
    tables.append(table)
  num_slots = (sum(need) + extra_blocks) * block_size
  a = {"slot_mapping": np.full(n, -1, np.int32), "output_index": np.zeros(n, np.int32),
       "block_tables": np.zeros((s_pad, max_blocks), np.int32), "query_index": np.zeros((s_pad, tq), np.int32),
       "query_pos": np.zeros((s_pad, tq), np.int32), "context_lens": np.zeros(s_pad, np.int32),
       "query_start": np.zeros(s_pad + 1, np.int32), "new_keys": np.zeros(s_pad, np.int32), "positions": np.zeros(n, np.int32)}
  start = 0
  for row, ((ctx, new), table) in enumerate(zip(seqs, tables, strict=True)):
    pos = np.arange(ctx - new, ctx, dtype=np.int32)
    a["positions"][start:start + new] = pos
    t = np.asarray(table, np.int64)
    a["slot_mapping"][start:start + new] = (t[pos // block_size] * block_size + pos % block_size).astype(np.int32)
    a["output_index"][start:start + new] = row * tq + np.arange(new)
    a["block_tables"][row, :len(table)] = table
    a["query_index"][row, :new], a["query_pos"][row, :new] = np.arange(start, start + new), pos
    a["context_lens"][row], a["new_keys"][row] = ctx, new
    start += new
    a["query_start"][row + 1:] = start
  a["row_order"] = launch_order(a["context_lens"])
  shape = AttentionShape(dtype, head_dim, heads, kv_heads, block_size, s_pad, n, tq, L, num_slots, kv_fp8)
  kv_dtype = FP8 if kv_fp8 else dtype
  q = round_to(rng.standard_normal((n, heads, head_dim)) * scale, dtype)
  kc = round_to(rng.standard_normal((num_slots, kv_heads * head_dim)) * scale, kv_dtype)
  vc = round_to(rng.standard_normal((num_slots, kv_heads * head_dim)), kv_dtype)
  return PagedCase(shape, list(seqs), q, kc, vc, a)


def as_decode_rows(case: PagedCase) -> PagedCase:
  """The case's new tokens as decode rows (Tq 1, a row a token, the rows of a sequence sharing its block table, its later
  rows seeing its earlier rows' keys: new_keys), as input_batch lays out a small verification of proposals
  (StepBuckets.decode_verify_tokens): as many rows as tokens, no padding."""
  a, n = case.arrays, case.total_tokens
  seq_of = np.repeat(np.arange(len(case.seqs)), [new for _, new in case.seqs])
  rows = {"slot_mapping": a["slot_mapping"][:n], "positions": a["positions"][:n], "output_index": np.arange(n, dtype=np.int32),
          "block_tables": a["block_tables"][seq_of], "query_index": np.arange(n, dtype=np.int32).reshape(n, 1),
          "query_pos": a["positions"][:n].reshape(n, 1).copy(), "context_lens": (a["positions"][:n] + 1).astype(np.int32),
          "new_keys": np.concatenate([np.arange(1, new + 1) for _, new in case.seqs]).astype(np.int32),
          "query_start": np.arange(n + 1, dtype=np.int32)}
  rows["row_order"] = launch_order(rows["context_lens"])
  return replace(case, shape=replace(case.shape, num_seqs=n, num_tokens=n, query_len=1), q=case.q[:n], arrays=rows)


def reference_attention(case: PagedCase) -> np.ndarray:
  """float64 numpy reference: [total real tokens, H * D] (independent of tinygrad; the tests also use the portable path)."""
  sh, a = case.shape, case.arrays
  g, d = sh.group, sh.head_dim
  out = np.zeros((case.total_tokens, sh.num_heads * d))
  for s, (ctx, new) in enumerate(case.seqs):
    table = a["block_tables"][s]
    slots = table[np.arange(ctx) // sh.block_size] * sh.block_size + np.arange(ctx) % sh.block_size
    keys = case.k_cache[slots].reshape(ctx, sh.num_kv_heads, d).astype(np.float64)
    vals = case.v_cache[slots].reshape(ctx, sh.num_kv_heads, d).astype(np.float64)
    q0 = int(a["query_start"][s])
    for i in range(new):
      p = ctx - new + i
      for h in range(sh.num_heads):
        sc = keys[:p + 1, h // g] @ case.q[q0 + i, h].astype(np.float64) / np.sqrt(d)
        w = np.exp(sc - sc.max())
        out[q0 + i, h * d:(h + 1) * d] = (w / w.sum()) @ vals[:p + 1, h // g]
  return out


def metadata_tensors(case: PagedCase, device: str | None = None):
  """The case's metadata as an AttentionMetadata of int32 tensors (for the portable path and the tinygrad backends)."""
  from tinygrad import Tensor

  from tinyvllm.backend.metadata import AttentionMetadata
  a, sh = case.arrays, case.shape
  t = {k: Tensor(np.ascontiguousarray(v), device=device).realize() for k, v in a.items()}
  return AttentionMetadata(t["slot_mapping"], t["block_tables"], t["query_index"], t["query_pos"], t["output_index"],
                           t["context_lens"], t["query_start"], t["new_keys"], t["row_order"], sh.block_size, sh.context_len)


def portable_attention(case: PagedCase, device: str | None = None) -> np.ndarray:
  """The portable tinygrad path (layers/attention.paged_attention) on the case, in float32: [N, H * D]."""
  from tinygrad import Tensor

  from tinyvllm.layers.attention import paged_attention
  meta = metadata_tensors(case, device)
  q = Tensor(np.ascontiguousarray(case.q), device=device)
  kc, vc = (Tensor(to_bits(x, case.kv_dtype) if case.shape.kv_fp8 else np.ascontiguousarray(x), device=device)
            for x in (case.k_cache, case.v_cache))
  return paged_attention(q, kc, vc, meta).numpy()


def linear_inputs(rng: np.random.Generator, shape) -> dict[str, np.ndarray]:
  """Random operands of a fused product (a kernels.linear.LinearShape), rounded to its dtype: x (2K columns with
  silu_mul), w, and bias / norm / residual where the shape has them."""
  m, k, o = shape.rows, shape.in_features, shape.out_features
  a = {"x": rng.standard_normal((m, 2 * k if shape.silu_mul else k)), "w": rng.standard_normal((o, k)) * 0.1}
  if shape.bias: a["bias"] = rng.standard_normal(o)
  if shape.norm_eps is not None: a["norm"] = 1 + 0.3 * rng.standard_normal(k)
  if shape.residual: a["residual"] = rng.standard_normal((m, o))
  return {key: round_to(v.astype(np.float32), shape.dtype) for key, v in a.items()}


def portable_linear_reference(a: dict[str, np.ndarray], shape) -> np.ndarray:
  """The portable form (layers/linear.py, tinygrad ops in HF's order) on the same operands, float32 on the CPU."""
  from tinygrad import Tensor

  from tinyvllm.layers.linear import portable_linear
  t = {key: Tensor(v) for key, v in a.items()}
  return portable_linear(t["x"], t["w"], t.get("bias"), norm=t.get("norm"), eps=shape.norm_eps or 1e-6,
                         silu_mul=shape.silu_mul, residual=t.get("residual"), out_float32=shape.out_float32).numpy()


def packed_weight(rng: np.random.Generator, form: str, out: int, k: int, group: int, magnitude: float = 0.1,
                  device: str | None = None):
  """A random weight of about `magnitude` in the packed form (tinyvllm/backend/quantized.py), float32 on the CPU: int8 /
  int4 codes with random float16 scales, zero points about the middle and additive offsets (GPTQ/AWQ-like, GGUF Q4_1's
  min) through the loaders' upload, or FP8 ("fp8") by round-to-nearest. On `device` (default: tinygrad's)."""
  from tinygrad import Tensor, dtypes

  from tinyvllm.layers.quantized import quantize_rtn
  from tinyvllm.model.quantization.unpacked import UnpackedWeight, upload
  if form == "fp8":
    return quantize_rtn(Tensor(rng.standard_normal((out, k)).astype(np.float32) * magnitude, device=device), "fp8", group)
  bits, groups = int(form.removeprefix("int")), (out, k // group)
  scales = (rng.random(groups) + 0.5) * magnitude / 2 ** (bits - 2)
  w = UnpackedWeight(rng.integers(0, 2 ** bits, (out, k)).astype(np.uint8), scales.astype(np.float16),
                     (2 ** (bits - 1) + rng.integers(-(2 ** (bits - 3)), 2 ** (bits - 3) + 1, groups)).astype(np.uint8), None,
                     group, bits,
                     (rng.standard_normal(groups) * magnitude * 0.1).astype(np.float32))
  return upload(w, form, "int", dtypes.float32, device)


@dataclass
class LayerCase:
  """Decoder layers' inputs for a decode step (one new token per sequence): weights and activations rounded to `dtype`,
  RoPE tables of the tokens' positions, the paged metadata of `paged` and each layer's own caches (layer 0's are
  `paged`'s)."""
  paged: PagedCase
  dims: dict[str, int | bool]   # hidden, intermediate, heads, kv_heads, head_dim, qk_norm, qkv_bias
  h_in: np.ndarray              # [N, hidden]
  # per layer: input_norm, w_qkv, w_o, post_norm, w_gu, w_down (+ q_norm, k_norm, qkv_bias); a w_* may be a packed
  # QuantizedWeight (float32, CPU)
  weights: list[dict]
  caches: list[tuple[np.ndarray, np.ndarray]]   # per layer: k_cache, v_cache [slots, KVH * D] (representable in kv_dtype)
  cos: np.ndarray               # [N, head_dim / 2] float32
  sin: np.ndarray
  dtype: str
  eps: float = 1e-6

  @property
  def rows(self) -> int: return len(self.paged.arrays["slot_mapping"])


def make_layer_case(rng: np.random.Generator, contexts: list[int], *, hidden: int, intermediate: int, heads: int, kv_heads: int,
                    head_dim: int, qk_norm: bool, qkv_bias: bool, dtype: str = "bfloat16", kv_fp8: bool = False,
                    block_size: int = 16, theta: float = 10000.0, layers: int = 1, min_bucket: int = 16,
                    weights: tuple[tuple[str, int], ...] = (), new_tokens: list[int] | None = None) -> LayerCase:
  """`weights`: each product's (form, group) as kernels.decode_layer.DecodeLayerShape.weights has them (default: all in
  `dtype`); a packed one is a random QuantizedWeight (packed_weight). `new_tokens`: each sequence's (default 1: a
  decode step; more: a verification's tokens, in the multi-query layout, as_decode_rows makes them decode rows)."""
  seqs = [(c, 1 if new_tokens is None else new) for c, new in zip(contexts, new_tokens or contexts, strict=True)]
  paged = make_case(rng, seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                    dtype=dtype, kv_fp8=kv_fp8, min_bucket=min_bucket)
  n, qkv_width = len(paged.arrays["slot_mapping"]), (heads + 2 * kv_heads) * head_dim
  r = lambda *shape, scale=1.0, offset=0.0, to=dtype: round_to(offset + rng.standard_normal(shape).astype(np.float32) * scale, to)

  def layer_weights() -> dict[str, np.ndarray]:
    w = {"input_norm": r(hidden, scale=0.3, offset=1), "w_qkv": r(qkv_width, hidden, scale=hidden ** -0.5),
         "w_o": r(hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5), "post_norm": r(hidden, scale=0.3, offset=1),
         "w_gu": r(2 * intermediate, hidden, scale=hidden ** -0.5), "w_down": r(hidden, intermediate, scale=intermediate ** -0.5)}
    if qk_norm: w.update(q_norm=r(head_dim, scale=0.3, offset=1), k_norm=r(head_dim, scale=0.3, offset=1))
    if qkv_bias: w["qkv_bias"] = r(qkv_width, scale=0.3)
    for product, (form, group) in zip(("qkv", "o", "gu", "down"), weights or (("elem", 0),) * 4, strict=True):
      if form != "elem":
        out, k = w[f"w_{product}"].shape
        w[f"w_{product}"] = packed_weight(rng, form, out, k, group, magnitude=k ** -0.5)
    return w
  caches = [(paged.k_cache, paged.v_cache)] + [(r(*paged.k_cache.shape, to=paged.kv_dtype), r(*paged.v_cache.shape, to=paged.kv_dtype))
                                               for _ in range(layers - 1)]
  angles = paged.arrays["positions"][:, None].astype(np.float64) * theta ** (-np.arange(0, head_dim, 2) / head_dim)
  dims = dict(hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads, head_dim=head_dim, qk_norm=qk_norm,
              qkv_bias=qkv_bias)
  return LayerCase(paged, dims, r(n, hidden), [layer_weights() for _ in range(layers)], caches,
                   np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32), dtype)


def layer_as_decode_rows(case: LayerCase) -> LayerCase:
  """A verification's layer case (make_layer_case with new_tokens) with its tokens as decode rows (as_decode_rows)."""
  n = case.paged.total_tokens
  return replace(case, paged=as_decode_rows(case.paged), h_in=case.h_in[:n], cos=case.cos[:n], sin=case.sin[:n])


def layer_tensors(case: LayerCase, device: str | None = None, dtype: str = "float32", backend=None):
  """(model, layers, inputs) for TransformerLM.decoder_layers: the weights in `dtype` on `device`, the caches as the
  engine keeps them (the activations' dtype, or FP8 codes), h_in, cos, sin, the caches [(k, v) a layer], the metadata.
  The model runs its ops on `backend` (default: the portable one, the reference)."""
  from tinygrad import Tensor, dtypes

  from tinyvllm.backend.weights import DecoderLayerWeights
  from tinyvllm.layers.portable import PortableBackend
  from tinyvllm.model.llama import ModelWeights, TransformerLM
  from tinyvllm.model_config import ModelConfig
  tdtype = {"float32": dtypes.float32, "float16": dtypes.float16, "bfloat16": dtypes.bfloat16}[dtype]
  put = lambda v: Tensor(np.ascontiguousarray(v), device=device).cast(tdtype).contiguous().realize()
  layers = []
  for weights in case.weights:
    w = {k: put(v) if isinstance(v, np.ndarray) else _packed_to(v, device, tdtype) for k, v in weights.items()}
    layers.append(DecoderLayerWeights(w["input_norm"], w["w_qkv"], w.get("qkv_bias"), w.get("q_norm"), w.get("k_norm"), w["w_o"],
                                      None, w["post_norm"], w["w_gu"], None, w["w_down"], None))
  d = case.dims
  config = ModelConfig("Qwen3ForCausalLM", d["hidden"], d["intermediate"], len(layers), d["heads"], d["kv_heads"], d["head_dim"],
                       8, 1 << 16, case.eps, 10000.0, False, qkv_bias=d["qkv_bias"], qk_norm=d["qk_norm"])
  dummy = Tensor.zeros(1, 1, device=device).contiguous()
  model = TransformerLM(config, ModelWeights(dummy, layers, dummy, dummy, dummy, dummy), backend or PortableBackend())
  fp8 = case.paged.shape.kv_fp8
  cache = lambda c: (Tensor(to_bits(c, FP8), device=device) if fp8 else put(c)).contiguous().realize()
  caches = [(cache(k), cache(v)) for k, v in case.caches]
  inputs = (put(case.h_in), Tensor(case.cos, device=device), Tensor(case.sin, device=device), caches,
            metadata_tensors(case.paged, device))
  return model, layers, inputs


def _packed_to(w, device: str | None, dtype):
  """A packed weight's buffers on `device`, dequantizing to `dtype`."""
  from dataclasses import replace
  move = lambda t: None if t is None else t.to(device).contiguous().realize()
  return replace(w, dtype=dtype, codes=move(w.codes), scales=move(w.scales), shifts=move(w.shifts), g_idx=move(w.g_idx),
                 perm=move(w.perm))


def layer_outputs(case: LayerCase, h, caches) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
  """The layers' results as float32 numpy: h of the real tokens, each layer's caches (FP8 codes decoded)."""
  from tinygrad import dtypes
  decode = (lambda t: from_bits(t.numpy(), FP8)) if case.paged.shape.kv_fp8 else (lambda t: t.cast(dtypes.float32).numpy())
  return h.cast(dtypes.float32).numpy()[:case.paged.total_tokens], [(decode(k), decode(v)) for k, v in caches]
