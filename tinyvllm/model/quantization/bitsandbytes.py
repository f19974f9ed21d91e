"""bitsandbytes checkpoints (vLLM's `bitsandbytes` quantization: HF's load_in_4bit / load_in_8bit models saved with
save_pretrained, e.g. unsloth's *-bnb-4bit), from bitsandbytes' own serialization:
- 8-bit (LLM.int8): `weight` int8 [out, in] in row order (`weight_format` 0, "row", where present) and `SCB` float32
  [out], each row's absolute maximum: w = weight * SCB / 127. Run packed, as int8 codes per channel; the outlier
  decomposition (llm_int8_threshold) quantizes activations, which are not quantized here (weight-only).
- 4-bit (NF4 / FP4): `weight` uint8 [ceil(n / 2), 1], the flattened [out, in] weight's 4-bit codes two a byte, the
  first in the high nibble; `weight.quant_map` float32 [16], the levels codes index; `weight.absmax` a scale per block
  of `blocksize` consecutive values, float32, or with double quantization (`weight.nested_absmax`,
  `weight.nested_quant_map`) uint8 codes into the nested map, times a nested scale per block of `nested_blocksize`
  codes, plus `nested_offset`; `weight.quant_state.bitsandbytes__nf4` (or __fp4) the JSON of quant_type, blocksize,
  dtype, shape and the nested fields, as uint8 bytes. w = quant_map[code] * absmax[block]. The levels are not an
  integer grid nor FP8 values, so no packed form holds them exactly: they are dequantized at load (as the checkpoint's
  compute dtype holds them), and start-up says so.
Modules in llm_int8_skip_modules (names holding one of them, as HF matches them) stay float.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from tinyvllm.config import ConfigError
from tinyvllm.model.quantization.unpacked import TensorReader, UnpackedWeight

ROW_FORMAT = 0   # bitsandbytes' weight_format codes: 0 row (the only layout saved by current versions), 1-3 GPU tiles


def scheme(raw: dict[str, Any], source: str) -> tuple[int, str]:
  """(bits, the 4-bit quant type or "int8") of a bitsandbytes quantization_config, checked."""
  if raw.get("load_in_8bit"):
    if raw.get("llm_int8_has_fp16_weight"):
      raise ConfigError(f"{source}: quantization_config.llm_int8_has_fp16_weight true is not supported (int8 weights are)")
    return 8, "int8"
  if not raw.get("load_in_4bit"):
    raise ConfigError(f"{source}: quantization_config has neither load_in_4bit nor load_in_8bit set (bitsandbytes)")
  kind = str(raw.get("bnb_4bit_quant_type", "fp4")).lower()
  if kind not in ("nf4", "fp4"):
    raise ConfigError(f"{source}: quantization_config.bnb_4bit_quant_type {kind!r} is not supported (nf4 or fp4)")
  storage = str(raw.get("bnb_4bit_quant_storage", "uint8"))
  if storage != "uint8":
    raise ConfigError(f"{source}: quantization_config.bnb_4bit_quant_storage {storage!r} is not supported (uint8 is)")
  return 4, kind


def read_int8(r: TensorReader, cols: int) -> UnpackedWeight:
  """An LLM.int8 linear as int8 codes per channel: code = weight + 128 about 128, scale SCB / 127."""
  weight = r.get("weight", ("I8",))
  out = weight.shape[0]
  r.check("weight", weight, (out, cols))
  if r.has("weight_format"):
    fmt = int(np.asarray(r.get("weight_format", ("U8", "I8", "I32", "I64"))).reshape(-1)[0])
    if fmt != ROW_FORMAT:
      raise ConfigError(f"BITSANDBYTES tensor {r.prefix}.weight_format is {fmt}: a GPU tile layout, not row order (save it "
                        "with a current bitsandbytes)")
  scb = r.get("SCB", ("F32",)).reshape(-1)
  r.check("SCB", scb, (out,))
  codes = (weight.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
  return UnpackedWeight(codes, (scb / 127).astype(np.float32).reshape(out, 1), None, None, cols, 8)


def dequantize_4bit(r: TensorReader, cols: int) -> np.ndarray:
  """A 4-bit linear's weights, float32 [out, cols] (out from its quant_state)."""
  state = _quant_state(r)
  shape = state.get("shape")
  if not isinstance(shape, list) or len(shape) != 2 or shape[1] != cols:
    raise ConfigError(f"BITSANDBYTES tensor {r.prefix}.weight's quant_state shape is {shape}, expected [rows, {cols}]")
  out = int(shape[0])
  n, block = out * cols, int(state["blocksize"])
  packed = r.get("weight", ("U8",)).reshape(-1)
  r.check("weight", packed, (-(-n // 2),))
  codes = np.stack([packed >> 4, packed & 15], axis=1).reshape(-1)[:n]   # the first value in the high nibble
  levels = r.get("weight.quant_map", ("F32",)).reshape(-1)
  r.check("weight.quant_map", levels, (16,))
  absmax = _absmax(r, state, -(-n // block))
  return (levels[codes] * np.repeat(absmax, block)[:n]).astype(np.float32).reshape(out, cols)


def _quant_state(r: TensorReader) -> dict[str, Any]:
  for kind in ("nf4", "fp4"):
    if r.has(f"weight.quant_state.bitsandbytes__{kind}"):
      raw = r.get(f"weight.quant_state.bitsandbytes__{kind}", ("U8",))
      try: return json.loads(bytes(np.asarray(raw).reshape(-1)).decode("utf-8"))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"BITSANDBYTES tensor {r.prefix}.weight.quant_state.bitsandbytes__{kind} is not JSON ({e})") from e
  raise ConfigError(f"BITSANDBYTES checkpoint is missing tensor {r.prefix}.weight.quant_state.bitsandbytes__nf4 (or __fp4)")


def _absmax(r: TensorReader, state: dict[str, Any], blocks: int) -> np.ndarray:
  """Each block's scale: stored, or (double quantization) its 8-bit code's nested level times the nested scale, plus the
  offset."""
  if "nested_blocksize" not in state:
    absmax = r.get("weight.absmax", ("F32",)).reshape(-1)
    r.check("weight.absmax", absmax, (blocks,))
    return absmax
  codes = r.get("weight.absmax", ("U8",)).reshape(-1)
  r.check("weight.absmax", codes, (blocks,))
  nested_block = int(state["nested_blocksize"])
  nested_levels = r.get("weight.nested_quant_map", ("F32",)).reshape(-1)
  r.check("weight.nested_quant_map", nested_levels, (256,))
  nested = r.get("weight.nested_absmax", ("F32",)).reshape(-1)
  r.check("weight.nested_absmax", nested, (-(-blocks // nested_block),))
  return nested_levels[codes] * np.repeat(nested, nested_block)[:blocks] + np.float32(state["nested_offset"])
