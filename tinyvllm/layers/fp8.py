"""FP8 E4M3 KV-cache storage (`--kv-cache-dtype fp8`), the portable way: tinygrad ops on raw uint8 codes.

E4M3 in its "fn" form (torch.float8_e4m3fn, what vLLM's fp8 KV cache stores): 1 sign, 4 exponent (bias 7) and 3
mantissa bits, no infinities, 448 the largest finite value, NaN = 0x7f / 0xff. Values are stored with scale 1 (vLLM's
default when no scales are calibrated); larger magnitudes saturate to +-448, rounding is to nearest even. The caches
are uint8 tensors: tinygrad 0.14's own fp8 casts do not round-trip on the CPU backends, and plain bytes need nothing
from a backend. The hand-written kernels (tinyvllm/kernels/csrc/neutral/common.inc) implement the same encoding.
"""
from __future__ import annotations

from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

FP8_STORAGE = dtypes.uint8
FP8_MAX = 448.0   # the largest finite E4M3 value


def is_fp8(cache: Tensor) -> bool: return cache.dtype == FP8_STORAGE


def encode_e4m3(x: Tensor) -> Tensor:
  """float values -> uint8 E4M3 codes (nearest even, saturating, NaN -> 0x7f)."""
  u = x.float().bitcast(dtypes.uint32)
  sign = (u >> 24).bitwise_and(0x80)
  a = u.bitwise_and(0x7FFFFFFF)
  rounded = a + 0x7FFFF + (a >> 20).bitwise_and(1)                     # 3 mantissa bits, nearest even
  normal = (((rounded >> 23) - 120) << 3).bitwise_or((rounded >> 20).bitwise_and(7))
  subnormal = (a.bitcast(dtypes.float32) * 512.0).round().cast(dtypes.uint32)   # below 2^-6: multiples of 2^-9
  code = (a < 0x3C800000).where(subnormal, normal)
  code = (a >= 0x43E00000).where(0x7E, code)                          # >= 448 (and infinity): saturate
  code = (a > 0x7F800000).where(0x7F, code)
  return code.bitwise_or(sign).cast(FP8_STORAGE)


def decode_e4m3(codes: Tensor, dtype: DType) -> Tensor:
  """uint8 E4M3 codes -> values in `dtype`: |code| << 7 is the float16 of value / 256 (exact, subnormals included)."""
  c = codes.cast(dtypes.uint16)
  half_bits = (c.bitwise_and(0x7F) << 7).bitwise_or(c.bitwise_and(0x80) << 8)
  return (half_bits.bitcast(dtypes.float16).float() * 256.0).cast(dtype)
