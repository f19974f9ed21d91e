"""GGUF tensor types: decoding llama.cpp's quantization blocks (ggml-quants.c) to float32 with numpy, and the formats
whose blocks are exactly tinyvllm's packed form (backend/quantized.py) as unpacked codes and per-group scales. Types
with no decoder here (the i-quants below IQ4, TQ1_0 / TQ2_0, MXFP4) are decoded by llama.cpp's gguf package where it is
installed (library_format).

Every block runs along a row (ne[0], the input columns of a linear). The layouts (fp16 d / dmin are IEEE halves):
- Q8_0: 32 values, 34 bytes: d, 32 int8 q. w = q * d.
- Q4_0: 32 values, 18 bytes: d, 16 bytes of nibbles (byte j: value j low, value j + 16 high). w = (q - 8) * d.
- Q4_1: 32 values, 20 bytes: d, m, nibbles as Q4_0. w = q * d + m.
- Q5_0: 32 values, 22 bytes: d, 4 bytes qh (bit j: value j's fifth bit), nibbles as Q4_0. w = (q - 16) * d.
- Q5_1: 32 values, 24 bytes: d, m, qh, nibbles. w = q * d + m.
- Q2_K: 256 values, 84 bytes: 16 bytes of scales (low nibble) and mins (high) for 16 groups of 16, 64 bytes of 2-bit q
  (value 128h + 32s + l: bits 2s of byte 32h + l), d, dmin. w = d * sc * q - dmin * m.
- Q3_K: 256 values, 110 bytes: 32 bytes hmask (bit b of byte l: value 32b + l's high bit, set meaning no offset), 2-bit
  low parts as Q2_K's, 12 bytes of 6-bit scales for 16 groups of 16 (stored less 32), d. w = d * (sc - 32) * q, q =
  low - 4 (high bit clear) or low.
- Q4_K: 256 values, 144 bytes: d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of nibbles
  (each 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high). w = d * sc * q - dmin * m.
- Q5_K: 256 values, 176 bytes: d, dmin, scales and mins as Q4_K's, 32 bytes qh (bit k of byte l: the fifth bit of
  sub-block k's value l), 128 bytes of nibbles as Q4_K's. w = d * sc * q - dmin * m.
- Q6_K: 256 values, 210 bytes: 128 bytes of low nibbles (ql), 64 bytes of high 2-bit pairs (qh), 16 int8 scales (one per
  16 values), d. w = d * sc * (q - 32).
- IQ4_NL: 32 values, 18 bytes: d, nibbles as Q4_0 indexing a table of 16 non-uniform int8 levels. w = d * level[q].
- IQ4_XS: 256 values, 136 bytes: d, scales_h (u16: bits 2i, 2i + 1 the top of sub-block i's scale), 4 bytes scales_l
  (nibble i: the low four bits), 128 bytes of nibbles (16 a sub-block of 32, as Q4_0's). w = d * (ls - 32) * level[q].
"""
from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tinyvllm.model.quantization.unpacked import UnpackedWeight
from tinyvllm.model.safetensors_file import bf16_as_float32

# ggml's type ids (ggml.h), for naming what a file holds
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
              20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
              29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30
IQ4_NL, IQ4_XS = 20, 23
# the IQ4 formats' 16 levels (ggml-common.h's kvalues_iq4nl): int8, so a code is one of tinyvllm's 8-bit codes
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def type_name(ggml_type: int) -> str: return TYPE_NAMES.get(ggml_type, f"unknown type {ggml_type}")


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
  """The fp16 at byte `start` of each block, as float32 [n, 1]."""
  return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
  """[n, 16] bytes -> [n, 32] values: the low nibbles (values 0-15), then the high ones (16-31)."""
  return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _plain(dtype: str) -> Callable[[np.ndarray], np.ndarray]:
  def decode(raw: np.ndarray) -> np.ndarray:
    flat = raw.view(dtype)
    return bf16_as_float32(flat) if dtype == "<u2" else flat.astype(np.float32)
  return decode


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
  return blocks[:, 2:].view(np.int8).astype(np.float32) * _half(blocks, 0)


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
  return (_nibbles(blocks[:, 2:]).astype(np.float32) - 8) * _half(blocks, 0)


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
  return _nibbles(blocks[:, 4:]).astype(np.float32) * _half(blocks, 0) + _half(blocks, 2)


def _q5_codes(blocks: np.ndarray, at: int) -> np.ndarray:
  """Q5_0 / Q5_1: [n, 32] codes 0-31 from the 4 bytes of fifth bits at `at` and the 16 bytes of nibbles after them."""
  high = (blocks[:, at:at + 4].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
  return (_nibbles(blocks[:, at + 4:at + 20]) | (high.astype(np.uint8) << 4)).astype(np.uint8)


def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
  return (_q5_codes(blocks, 2).astype(np.float32) - 16) * _half(blocks, 0)


def dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
  return _q5_codes(blocks, 4).astype(np.float32) * _half(blocks, 0) + _half(blocks, 2)


def k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 mins (ggml's get_scale_min_k4): sub-blocks 0-3 in the low 6 bits
  of bytes 0-3 (scales) and 4-7 (mins); 4-7 in bytes 8-11's nibbles, their top 2 bits in the top bits of bytes 0-7."""
  q = packed.astype(np.uint8)
  scales = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)], axis=1)
  mins = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
  return scales.astype(np.float32), mins.astype(np.float32)


def _k_codes(blocks: np.ndarray, five: bool) -> np.ndarray:
  """Q4_K / Q5_K: [n, 8, 32] codes of the 8 sub-blocks (sub-block 2c in the low nibbles of bytes 32c.., 2c + 1 in the
  high ones; Q5_K's fifth bit of sub-block k's value l is bit k of qh byte l)."""
  n, at = blocks.shape[0], 48 if five else 16
  qs = blocks[:, at:at + 128].reshape(n, 4, 32)
  q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(n, 8, 32)
  if five: q = q | (((blocks[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
  return q.astype(np.uint8)


def _dequantize_k(blocks: np.ndarray, five: bool) -> np.ndarray:
  n = blocks.shape[0]
  d, dmin = _half(blocks, 0), _half(blocks, 2)
  scales, mins = k_scales_mins(blocks[:, 4:16])
  q = _k_codes(blocks, five).astype(np.float32)
  return (d[:, :, None] * scales[:, :, None] * q - dmin[:, :, None] * mins[:, :, None]).reshape(n, 256)


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray: return _dequantize_k(blocks, five=False)


def dequantize_q5_k(blocks: np.ndarray) -> np.ndarray: return _dequantize_k(blocks, five=True)


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
  """Q2_K / Q3_K's 64 bytes -> [n, 16, 16] 2-bit parts: value 128h + 32s + l is bits 2s, 2s + 1 of byte 32h + l."""
  n = qs.shape[0]
  return ((qs.reshape(n, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3).reshape(n, 16, 16)


def _q2_k_parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Q2_K: [n, 16, 16] codes 0-3, [n, 16] group scales d * sc and offsets -dmin * m."""
  sc = blocks[:, 0:16]
  return (_two_bit_codes(blocks[:, 16:80]), _half(blocks, 80) * (sc & 0xF).astype(np.float32),
          -(_half(blocks, 82) * (sc >> 4).astype(np.float32)))


def _q3_k_parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q3_K: [n, 16, 16] codes q + 4 (0-7) and [n, 16] group scales d * (sc - 32)."""
  n = blocks.shape[0]
  high = ((blocks[:, 0:32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(n, 16, 16)
  packed = blocks[:, 96:108]
  low4 = np.concatenate([packed[:, 0:8] & 0xF, packed[:, 0:8] >> 4], axis=1)               # groups 0-7, then 8-15
  top2 = ((packed[:, 8:12][:, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 3).reshape(n, 16)
  scales = (low4 | (top2 << 4)).astype(np.float32) - 32
  return _two_bit_codes(blocks[:, 32:96]) + 4 * high, _half(blocks, 108) * scales


def dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
  codes, scales, offsets = _q2_k_parts(blocks)
  return (codes.astype(np.float32) * scales[:, :, None] + offsets[:, :, None]).reshape(-1, 256)


def dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
  codes, scales = _q3_k_parts(blocks)
  return ((codes.astype(np.float32) - 4) * scales[:, :, None]).reshape(-1, 256)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
  n = blocks.shape[0]
  ql, qh = blocks[:, 0:128].reshape(n, 2, 64), blocks[:, 128:192].reshape(n, 2, 32)
  scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
  d = _half(blocks, 208)
  low = [ql[:, :, 0:32] & 0xF, ql[:, :, 32:64] & 0xF, ql[:, :, 0:32] >> 4, ql[:, :, 32:64] >> 4]
  # each half of 128 values: four runs of 32, run r taking bits 2r..2r+1 of qh as its top two bits
  q = np.concatenate([low[r] | (((qh >> (2 * r)) & 3) << 4) for r in range(4)], axis=2).astype(np.float32) - 32
  return (q.reshape(n, 16, 16) * scales[:, :, None] * d[:, :, None]).reshape(n, 256)


def _iq4_parts(blocks: np.ndarray, xs: bool) -> tuple[np.ndarray, np.ndarray]:
  """IQ4_NL / IQ4_XS: [n, groups, 32] int8 levels and [n, groups] scales (d, or IQ4_XS's d * (ls - 32) a sub-block)."""
  n, d = blocks.shape[0], _half(blocks, 0)
  if not xs: return IQ4_LEVELS[_nibbles(blocks[:, 2:18])].reshape(n, 1, 32), d
  qs = blocks[:, 8:136].reshape(n, 8, 16)
  sub = np.arange(8)
  high = blocks[:, 2:4].copy().view("<u2").astype(np.int32) >> (2 * sub)[None, :] & 3
  low = blocks[:, 4:8][:, sub // 2].astype(np.int32) >> (4 * (sub % 2))[None, :] & 0xF
  return IQ4_LEVELS[np.concatenate([qs & 0xF, qs >> 4], axis=2)], d * ((low | high << 4) - 32).astype(np.float32)


def _dequantize_iq4(blocks: np.ndarray, xs: bool) -> np.ndarray:
  levels, scales = _iq4_parts(blocks, xs)
  return (levels.astype(np.float32) * scales[:, :, None]).reshape(blocks.shape[0], -1)


@dataclass(frozen=True)
class BlockFormat:
  name: str
  block: int       # values a block
  nbytes: int      # bytes a block
  decode: Callable[[np.ndarray], np.ndarray]   # [blocks, nbytes] uint8 -> [blocks, block] float32 (plain: raw -> flat)
  plain: bool = False
  library: bool = False   # decoded by the gguf package (library_format)


BLOCK_FORMATS = {
  F32: BlockFormat("F32", 1, 4, _plain("<f4"), plain=True),
  F16: BlockFormat("F16", 1, 2, _plain("<f2"), plain=True),
  BF16: BlockFormat("BF16", 1, 2, _plain("<u2"), plain=True),
  Q8_0: BlockFormat("Q8_0", 32, 34, dequantize_q8_0),
  Q4_0: BlockFormat("Q4_0", 32, 18, dequantize_q4_0),
  Q4_1: BlockFormat("Q4_1", 32, 20, dequantize_q4_1),
  Q5_0: BlockFormat("Q5_0", 32, 22, dequantize_q5_0),
  Q5_1: BlockFormat("Q5_1", 32, 24, dequantize_q5_1),
  Q2_K: BlockFormat("Q2_K", 256, 84, dequantize_q2_k),
  Q3_K: BlockFormat("Q3_K", 256, 110, dequantize_q3_k),
  Q4_K: BlockFormat("Q4_K", 256, 144, dequantize_q4_k),
  Q5_K: BlockFormat("Q5_K", 256, 176, dequantize_q5_k),
  Q6_K: BlockFormat("Q6_K", 256, 210, dequantize_q6_k),
  IQ4_NL: BlockFormat("IQ4_NL", 32, 18, lambda b: _dequantize_iq4(b, xs=False)),
  IQ4_XS: BlockFormat("IQ4_XS", 256, 136, lambda b: _dequantize_iq4(b, xs=True)),
}
# blocks that are exactly tinyvllm's packed form
PACKED_TYPES = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)


@functools.cache
def library_format(ggml_type: int) -> BlockFormat | None:
  """A type tinyvllm has no decoder of its own for, decoded by the gguf package (llama.cpp's own Python package, the
  `gguf` extra) where it has one: the i-quants IQ1_S-IQ3_S, TQ1_0 / TQ2_0, MXFP4. None: not installed, or not there."""
  try:
    import gguf
    qtype = gguf.GGMLQuantizationType(ggml_type)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), qtype)   # (NotImplementedError where it has no decoder)
  except (ImportError, ValueError, KeyError, NotImplementedError):
    return None
  decode = lambda b: gguf.quants.dequantize(b, qtype).reshape(b.shape[0], block).astype(np.float32)
  return BlockFormat(type_name(ggml_type), block, nbytes, decode, library=True)


def block_format(ggml_type: int) -> BlockFormat | None:
  """The decoder of a type: tinyvllm's own, else the gguf package's, else None."""
  return BLOCK_FORMATS.get(ggml_type) or library_format(ggml_type)


def unreadable(ggml_type: int) -> str:
  """Why a type cannot be read, and what reads it."""
  if importlib.util.find_spec("gguf") is None:
    return "which tinyvllm reads only through the gguf package (pip install gguf: the i-quants IQ1_S-IQ3_S, TQ1_0, TQ2_0, MXFP4)"
  return (f"which neither tinyvllm nor the gguf package reads (tinyvllm reads {', '.join(f.name for f in BLOCK_FORMATS.values())}, "
          "the gguf package the i-quants IQ1_S-IQ3_S, TQ1_0, TQ2_0 and MXFP4)")


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
  """A tensor's bytes (GGUFFile.raw) -> float32 in `shape` (numpy order)."""
  fmt = block_format(ggml_type)
  assert fmt is not None, type_name(ggml_type)
  if fmt.plain: return fmt.decode(raw).reshape(shape)
  return fmt.decode(raw.reshape(-1, fmt.nbytes)).reshape(shape)


def unpack(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> UnpackedWeight:
  """The codes and per-group scales of a matrix [rows, cols] of a packed type (32 columns a group; Q6_K's 16). Exact:
  a K-quant's group scale d * sc (and Q4_K's offset -dmin * m) is a float16 times a small integer, which float32
  holds, so code * scale + shift is ggml's d * sc * q - dmin * m with the same one rounding."""
  if ggml_type in (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): return _unpack_k(raw, ggml_type, shape)
  rows, cols = shape
  fmt = BLOCK_FORMATS[ggml_type]
  if ggml_type in (IQ4_NL, IQ4_XS):   # the levels as 8-bit codes about 128 (as Q8_0's), groups of 32
    levels, scales = _iq4_parts(raw.reshape(-1, fmt.nbytes), xs=ggml_type == IQ4_XS)
    return UnpackedWeight((levels.view(np.uint8) ^ np.uint8(0x80)).reshape(rows, cols), scales.reshape(rows, -1), None, None, 32, 8)
  if ggml_type in (Q5_0, Q5_1):   # 5-bit codes held as 8-bit ones: about 16 (Q5_0), or from 0 plus the min (Q5_1)
    b = raw.reshape(rows * cols // 32, fmt.nbytes)
    codes, scales = _q5_codes(b, 2 if ggml_type == Q5_0 else 4).reshape(rows, cols), _half(b, 0).reshape(rows, -1)
    if ggml_type == Q5_0: return UnpackedWeight(codes, scales, np.full(scales.shape, 16, np.uint8), None, 32, 8)
    return UnpackedWeight(codes, scales, np.zeros(scales.shape, np.uint8), None, 32, 8, _half(b, 2).reshape(rows, -1))
  blocks = raw.reshape(rows, cols // 32, fmt.nbytes)
  scales = blocks[:, :, 0:2].copy().view(np.float16).reshape(rows, -1)
  if ggml_type == Q8_0:   # int8 q as unsigned codes about 128: (q + 128) - 128
    codes = (blocks[:, :, 2:] ^ np.uint8(0x80)).reshape(rows, cols)
    return UnpackedWeight(codes, scales, None, None, 32, 8)
  qs = blocks[:, :, 4:] if ggml_type == Q4_1 else blocks[:, :, 2:]
  codes = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(rows, cols)
  if ggml_type == Q4_0: return UnpackedWeight(codes, scales, None, None, 32, 4)
  mins = blocks[:, :, 2:4].copy().view(np.float16).reshape(rows, -1)
  return UnpackedWeight(codes, scales, np.zeros(scales.shape, np.uint8), None, 32, 4, mins)


def _unpack_k(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> UnpackedWeight:
  """Q4_K / Q5_K: 4-bit / 5-bit codes (the latter held as 8-bit ones), groups of 32 with scale d * sc and offset
  -dmin * m (zero point 0); Q6_K: 6-bit codes q held as 8-bit ones about a zero point of 32, groups of 16 with scale
  d * sc; Q2_K and Q3_K: 2- and 3-bit codes held as 8-bit ones in groups of 16 (Q2_K with offsets -dmin * m, Q3_K's
  about a zero point of 4)."""
  rows, cols = shape
  fmt = BLOCK_FORMATS[ggml_type]
  b = raw.reshape(rows * cols // 256, fmt.nbytes)
  n = b.shape[0]
  if ggml_type == Q2_K:   # (the kernels' 4-bit codes take groups of 32 and up: these groups of 16 hold 8-bit ones)
    codes, scale, offset = _q2_k_parts(b)
    return UnpackedWeight(codes.reshape(rows, cols), scale.reshape(rows, -1), np.zeros((rows, cols // 16), np.uint8), None,
                          16, 8, offset.reshape(rows, -1))
  if ggml_type == Q3_K:
    codes, scale = _q3_k_parts(b)
    return UnpackedWeight(codes.reshape(rows, cols).astype(np.uint8), scale.reshape(rows, -1),
                          np.full((rows, cols // 16), 4, np.uint8), None, 16, 8)
  if ggml_type in (Q4_K, Q5_K):
    scales, mins = k_scales_mins(b[:, 4:16])
    codes = _k_codes(b, five=ggml_type == Q5_K).reshape(rows, cols)
    scale = (_half(b, 0) * scales).reshape(rows, -1)
    offset = -(_half(b, 2) * mins).reshape(rows, -1)
    return UnpackedWeight(codes, scale, np.zeros(scale.shape, np.uint8), None, 32, 4 if ggml_type == Q4_K else 8, offset)
  ql, qh = b[:, 0:128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
  low = [ql[:, :, 0:32] & 0xF, ql[:, :, 32:64] & 0xF, ql[:, :, 0:32] >> 4, ql[:, :, 32:64] >> 4]
  codes = np.concatenate([low[r] | (((qh >> (2 * r)) & 3) << 4) for r in range(4)], axis=2).reshape(rows, cols)
  scale = (b[:, 192:208].view(np.int8).astype(np.float32) * _half(b, 208)).reshape(rows, -1)
  return UnpackedWeight(codes.astype(np.uint8), scale, np.full(scale.shape, 32, np.uint8), None, 16, 8)
