"""GPTQ, AWQ, FP8, compressed-tensors, ModelOpt, FBGEMM FP8 and bitsandbytes 8-bit (layouts in compressed_tensors.py,
modelopt.py, nvfp4.py, bitsandbytes.py) checkpoints' linear weights, read into one unpacked form (numpy, before upload): codes [out, in],
scales and zero points [out, groups], each column's group where it is not a contiguous run.

The layouts, from the formats' own descriptions:
- GPTQ (AutoGPTQ / GPTQModel, Hugging Face): `qweight` int32 [in * bits / 32, out], each int32 holding 32 / bits
  consecutive input rows, the first in the lowest bits; `qzeros` int32 [groups, out * bits / 32] packed the same way
  along the output; `scales` float16 [groups, out]; `g_idx` int32 [in], each input row's group. checkpoint_format
  "gptq" (v1) stores each zero point minus one.
- AWQ (AutoAWQ, GEMM version, 4-bit): `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8], packed along
  the output in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column ORDER[i] of its eight); `scales` float16
  [groups, out]; w = (q - zero) * scale.
- FP8 (Qwen / DeepSeek style): `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32 [ceil(out / rows),
  ceil(in / cols)] for weight_block_size [rows, cols], or a per-tensor `weight_scale`; w = e4m3(weight) * scale.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.config import ConfigError
from tinyvllm.model.quantization import bitsandbytes
from tinyvllm.model.quantization.compressed_tensors import NVFP4
from tinyvllm.model.quantization.config import QuantizationConfig
from tinyvllm.model.quantization.nvfp4 import read_nvfp4
from tinyvllm.model.quantization.unpacked import UnpackedWeight, unpack_bits
from tinyvllm.model.safetensors_file import Checkpoint, bf16_as_float32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class Reader:
  """Reads a checkpoint's tensors for one linear (prefix "model.layers.0.self_attn.q_proj"), recording what it read."""

  def __init__(self, checkpoint: Checkpoint, prefix: str, method: str, used: set[str]):
    self.checkpoint, self.prefix, self.method, self.used = checkpoint, prefix, method, used

  def has(self, suffix: str) -> bool: return f"{self.prefix}.{suffix}" in self.checkpoint

  def get(self, suffix: str, dtypes: tuple[str, ...]) -> np.ndarray:
    name = f"{self.prefix}.{suffix}"
    if name not in self.checkpoint: raise ConfigError(f"{self.method.upper()} checkpoint is missing tensor {name}")
    if (stored := self.checkpoint.dtype(name)) not in dtypes:
      raise ConfigError(f"{self.method.upper()} tensor {name} is {stored}, expected {' or '.join(dtypes)}")
    self.used.add(name)
    return np.asarray(self.checkpoint.array(name))

  def check(self, suffix: str, a: np.ndarray, shape: tuple[int, ...]) -> None:
    if a.shape != shape: raise ConfigError(f"{self.method.upper()} tensor {self.prefix}.{suffix} has shape {a.shape}, expected {shape}")


def _group_size(qc: QuantizationConfig, cols: int, r: Reader) -> int:
  group = cols if qc.group_size == -1 else qc.group_size
  if cols % group:
    raise ConfigError(f"quantization_config.group_size {group} does not divide {r.prefix}'s input dimension {cols}")
  return group


def _g_idx(r: Reader, name: str, cols: int, group: int) -> np.ndarray | None:
  """Each column's group (act-order), checked; None where it is absent or the plain runs of `group` columns."""
  if not r.has(name): return None
  g_idx = r.get(name, ("I32", "I64")).astype(np.int32)
  r.check(name, g_idx, (cols,))
  if g_idx.min() < 0 or g_idx.max() >= cols // group:
    raise ConfigError(f"{r.method.upper()} tensor {r.prefix}.{name} names groups outside 0..{cols // group - 1}")
  return None if np.array_equal(g_idx, np.arange(cols) // group) else g_idx


def _tensor_scale(r: Reader, name: str, out: int) -> np.ndarray:
  """One scale for the whole tensor, as [out, 1]."""
  scale = bf16_as_float32(r.get(name, ("F32", "F16", "BF16"))).reshape(-1)
  if scale.size != 1: raise ConfigError(f"{r.method.upper()} tensor {r.prefix}.{name} holds {scale.size} values, expected one (per tensor)")
  return np.full((out, 1), scale[0], np.float32)


def _block_scales(r: Reader, name: str, out: int, cols: int, block: tuple[int, int]) -> np.ndarray:
  """A scale per [rows, columns] block, repeated over each block's rows: [out, ceil(cols / columns)]."""
  rows, columns = block
  scale = bf16_as_float32(r.get(name, ("F32", "F16", "BF16"))).astype(np.float32)
  r.check(name, scale, (-(-out // rows), -(-cols // columns)))
  return np.repeat(scale, rows, axis=0)[:out].copy()


def read_gptq(r: Reader, qc: QuantizationConfig, cols: int) -> UnpackedWeight:
  qweight = r.get("qweight", ("I32",))
  per = 32 // qc.bits
  out, group = qweight.shape[1], _group_size(qc, cols, r)
  r.check("qweight", qweight, (cols // per, out))
  groups = cols // group
  scales, qzeros = r.get("scales", ("F16", "F32", "BF16")), r.get("qzeros", ("I32",))
  r.check("scales", scales, (groups, out))
  r.check("qzeros", qzeros, (groups, -(-out // per)))
  zeros = unpack_bits(qzeros, qc.bits, axis=-1)[:, :out].astype(np.int32) + qc.zero_offset
  if qc.desc_act and not r.has("g_idx"): raise ConfigError(f"GPTQ checkpoint with desc_act true is missing tensor {r.prefix}.g_idx")
  return UnpackedWeight(np.ascontiguousarray(unpack_bits(qweight, qc.bits, axis=0).T), bf16_as_float32(scales).T.copy(),
                        zeros.astype(np.uint8).T.copy(), _g_idx(r, "g_idx", cols, group), group, qc.bits)


def read_awq(r: Reader, qc: QuantizationConfig, cols: int) -> UnpackedWeight:
  qweight = r.get("qweight", ("I32",))
  out, group = qweight.shape[1] * 8, _group_size(qc, cols, r)
  r.check("qweight", qweight, (cols, out // 8))
  scales, qzeros = r.get("scales", ("F16", "F32", "BF16")), r.get("qzeros", ("I32",))
  r.check("scales", scales, (cols // group, out))
  r.check("qzeros", qzeros, (cols // group, out // 8))
  reorder = np.argsort(AWQ_ORDER)   # nibble i holds column AWQ_ORDER[i]: column k is nibble reorder[k]
  def unpack(packed: np.ndarray) -> np.ndarray:
    nibbles = unpack_bits(packed, 4, axis=-1).reshape(packed.shape[0], -1, 8)
    return nibbles[:, :, reorder].reshape(packed.shape[0], -1)
  return UnpackedWeight(np.ascontiguousarray(unpack(qweight).T), bf16_as_float32(scales).T.copy(), unpack(qzeros).T.copy(), None, group, 4)


def read_fp8(r: Reader, qc: QuantizationConfig, cols: int) -> UnpackedWeight:
  codes = r.get("weight", ("F8_E4M3",))
  out = codes.shape[0]
  r.check("weight", codes, (out, cols))
  if qc.block_size is None: return UnpackedWeight(codes.copy(), _tensor_scale(r, "weight_scale", out), None, None, cols, 8)
  scales = _block_scales(r, "weight_scale_inv", out, cols, qc.block_size)
  return UnpackedWeight(codes.copy(), scales, None, None, qc.block_size[1], 8)


def read_compressed(r: Reader, qc: QuantizationConfig, cols: int) -> UnpackedWeight:
  """One linear's codes, scales and zero points (their unsigned form: code = q + 2^(bits - 1)); NVFP4's as E4M3 codes."""
  if qc.storage == NVFP4: return read_nvfp4(r, "compressed-tensors", cols)
  if qc.storage == "pack-quantized":
    packed = r.get("weight_packed", ("I32",))
    out, per = packed.shape[0], 32 // qc.bits
    r.check("weight_packed", packed, (out, -(-cols // per)))
    shape = r.get("weight_shape", ("I32", "I64")).reshape(-1)
    if shape.tolist() != [out, cols]:
      raise ConfigError(f"compressed-tensors tensor {r.prefix}.weight_shape is {shape.tolist()}, expected {[out, cols]}")
    codes = unpack_bits(packed, qc.bits, 1)[:, :cols]
  else:
    stored = r.get("weight", ("F8_E4M3",) if qc.storage == "float-quantized" else ("I8",))
    out = stored.shape[0]
    r.check("weight", stored, (out, cols))
    codes = stored.copy() if qc.storage == "float-quantized" else (stored.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
  group, scales = _ct_scales(r, qc, out, cols)
  return UnpackedWeight(np.ascontiguousarray(codes), scales, _ct_zero_points(r, qc, out, scales.shape[1]),
                        _g_idx(r, "weight_g_idx", cols, group), group, qc.bits)


def _ct_scales(r: Reader, qc: QuantizationConfig, out: int, cols: int) -> tuple[int, np.ndarray]:
  """(the group size, float scales [out, groups]) for the scheme's strategy."""
  if qc.strategy == "tensor": return cols, _tensor_scale(r, "weight_scale", out)
  if qc.strategy == "block": return qc.block_size[1], _block_scales(r, "weight_scale", out, cols, qc.block_size)
  group = _group_size(qc, cols, r)
  scale = bf16_as_float32(r.get("weight_scale", ("F32", "F16", "BF16")))
  r.check("weight_scale", scale, (out, cols // group))
  return group, scale.copy()


def _ct_zero_points(r: Reader, qc: QuantizationConfig, out: int, groups: int) -> np.ndarray | None:
  """Asymmetric integer schemes' zero points [out, groups] (unsigned, as the codes); None: symmetric."""
  if qc.symmetric: return None
  if qc.storage == "int-quantized":
    zero = r.get("weight_zero_point", ("I8",))
    r.check("weight_zero_point", zero, (out, groups))
    return (zero.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
  zero = r.get("weight_zero_point", ("I32",))
  r.check("weight_zero_point", zero, (-(-out // (32 // qc.bits)), groups))
  return np.ascontiguousarray(unpack_bits(zero, qc.bits, 0)[:out])


def read_scaled_fp8(r: Reader, qc: QuantizationConfig, cols: int) -> UnpackedWeight:
  """A ModelOpt FP8 linear (layouts in modelopt.py; E4M3 codes, scales per tensor, row or 128 x 128 block) or an FBGEMM
  FP8 one (`weight` E4M3 [out, in], `weight_scale` float32 [out, 1]: per row)."""
  codes = r.get("weight", ("F8_E4M3",))
  out = codes.shape[0]
  r.check("weight", codes, (out, cols))
  if qc.strategy == "tensor": return UnpackedWeight(codes.copy(), _tensor_scale(r, "weight_scale", out), None, None, cols, 8)
  stored = bf16_as_float32(r.get("weight_scale", ("F32", "F16", "BF16"))).astype(np.float32)
  scale = stored.reshape(stored.shape[0] if stored.ndim else 1, -1)   # [out] / [blocks, 1, blocks, 1]: two dimensions
  if qc.strategy == "channel":
    r.check("weight_scale", scale, (out, 1))
    return UnpackedWeight(codes.copy(), scale.copy(), None, None, cols, 8)
  rows, columns = qc.block_size
  r.check("weight_scale", scale, (-(-out // rows), -(-cols // columns)))
  return UnpackedWeight(codes.copy(), np.repeat(scale, rows, axis=0)[:out].copy(), None, None, columns, 8)


READERS = {"gptq": read_gptq, "awq": read_awq, "fp8": read_fp8, "compressed-tensors": read_compressed, "modelopt": read_scaled_fp8,
           "fbgemm_fp8": read_scaled_fp8, "modelopt_fp4": lambda r, qc, cols: read_nvfp4(r, "modelopt_fp4", cols),
           "bitsandbytes": lambda r, qc, cols: bitsandbytes.read_int8(r, cols)}   # (its 4-bit levels: source.py dequantizes them)


def read_parts(checkpoint: Checkpoint, prefixes: list[str], qc: QuantizationConfig, cols: int, used: set[str]) -> list[UnpackedWeight]:
  """Each part of one linear (q/k/v, gate/up, a sparse layer's experts) as the checkpoint holds it."""
  return [READERS[qc.method](Reader(checkpoint, p, qc.method, used), qc, cols) for p in prefixes]
