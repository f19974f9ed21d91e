"""NVFP4 checkpoints' linear weights (vLLM's `modelopt_fp4` and compressed-tensors' `nvfp4-pack-quantized`): FP4 E2M1
values in blocks of 16 input columns, each block's scale an FP8 E4M3 number, times one float32 global scale a tensor.

The layouts, from NVIDIA ModelOpt's unified HF export and compressed-tensors' published format:
- the values: ModelOpt's `weight` / compressed-tensors' `weight_packed`, uint8 [out, in / 2], two E2M1 codes a byte,
  the even column in the low nibble; a code's bit 3 is its sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3,
  4, 6;
- `weight_scale`: float8_e4m3fn [out, in / 16], one a block;
- the global scale, float32 (shape [] or [1]): ModelOpt's `weight_scale_2` multiplies, w = e2m1 * weight_scale *
  weight_scale_2; compressed-tensors' `weight_global_scale` divides, w = e2m1 * weight_scale / weight_global_scale.
Activations' scales (`input_scale`, `input_global_scale`) belong to NVFP4 activations, which are not applied here
(weight-only, as vLLM runs NVFP4 on GPUs without FP4 tensor cores).

Every E2M1 value is exactly an E4M3 one, so the weights run in the packed FP8 form (tinyvllm/backend/quantized.py): an
E4M3 code a weight and a float32 scale a block of 16 (the block's scale times the global one; parts of one fused
product, q/k/v or gate/up, each keep their own global scale). That holds the same values in 10 bits a weight where the
file takes 4.5, which start-up says.
"""
from __future__ import annotations

import functools

import numpy as np
from tinygrad import Tensor, dtypes

from tinyvllm.config import ConfigError
from tinyvllm.layers.fp8 import decode_e4m3
from tinyvllm.model.quantization.unpacked import TensorReader, UnpackedWeight
from tinyvllm.model.safetensors_file import bf16_as_float32

BLOCK = 16   # input columns a block scale covers
# E2M1 code -> the E4M3 byte of the same value: sign bit 7, exponent bits 3-6 (bias 7), mantissa bits 0-2
E4M3_OF_E2M1 = np.array([0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C], np.uint8)
E4M3_OF_E2M1 = np.concatenate([E4M3_OF_E2M1, E4M3_OF_E2M1 | 0x80])


@functools.cache
def e4m3_values() -> np.ndarray:
  """float32 [256]: each E4M3 (float8_e4m3fn) byte's value, by layers/fp8.py's decoder (0x7F and 0xFF: NaN)."""
  values = decode_e4m3(Tensor(np.arange(256, dtype=np.uint8)), dtypes.float32).numpy()
  values[[0x7F, 0xFF]] = np.nan
  return values


# by format: the tensor holding the values, the global scale's, and whether the global scale divides
NAMES = {"modelopt_fp4": ("weight", "weight_scale_2", False), "compressed-tensors": ("weight_packed", "weight_global_scale", True)}
NOTICE = ("NVFP4 weights run as E4M3 codes with a float32 scale a block of 16 (the same values: 10 bits a weight, where "
          "the file takes 4.5)")


def read_nvfp4(r: TensorReader, method: str, cols: int) -> UnpackedWeight:
  """One linear as E4M3 codes [out, in] and float32 scales [out, in / 16]."""
  values, global_name, divides = NAMES[method]
  if cols % BLOCK: raise ConfigError(f"NVFP4 linear {r.prefix} has {cols} input columns, not a multiple of its block of {BLOCK}")
  packed = r.get(values, ("U8",))
  out = packed.shape[0]
  r.check(values, packed, (out, cols // 2))
  codes = np.empty((out, cols), np.uint8)
  codes[:, 0::2], codes[:, 1::2] = E4M3_OF_E2M1[packed & 0xF], E4M3_OF_E2M1[packed >> 4]
  block_scales = r.get("weight_scale", ("F8_E4M3",))
  r.check("weight_scale", block_scales, (out, cols // BLOCK))
  stored = bf16_as_float32(r.get(global_name, ("F32", "F16", "BF16"))).reshape(-1)
  if stored.size != 1: raise ConfigError(f"NVFP4 tensor {r.prefix}.{global_name} holds {stored.size} values, expected one")
  if not np.isfinite(stored[0]) or stored[0] == 0:
    raise ConfigError(f"NVFP4 tensor {r.prefix}.{global_name} is {stored[0]}, not a finite non-zero scale")
  block = e4m3_values()[block_scales.view(np.uint8)]
  scales = block / np.float32(stored[0]) if divides else block * np.float32(stored[0])
  return UnpackedWeight(codes, scales.astype(np.float32), None, None, BLOCK, 8)
