"""NVIDIA Model Optimizer's FP8 and NVFP4 checkpoints (vLLM's `modelopt` and `modelopt_fp4` quantization), as its
unified HF export writes them: the scheme from `hf_quant_config.json` ({"quantization": {"quant_algo",
"exclude_modules", "kv_cache_quant_algo"}}) or from config.json's quantization_config ({"quant_method": "modelopt",
"quant_algo", "ignore", "kv_cache_scheme"}).

The FP8 layouts, per linear: `weight` float8_e4m3fn [out, in] and `weight_scale` float32 of
- FP8: one scale for the tensor (shape [] or [1]), beside a static activation scale `input_scale`;
- FP8_PER_CHANNEL_PER_TOKEN: one a row, [out] (or [out, 1]); activations quantized per token when they run;
- FP8_PB_WO: one a block of 128 x 128, [out / 128, 1, in / 128, 1] (or [out / 128, in / 128]), weight-only.
w = e4m3(weight) * scale. NVFP4 (vLLM's `modelopt_fp4`): E2M1 values in blocks of 16 columns with FP8 block scales and
a global `weight_scale_2` (layout in nvfp4.py), the block its config's `group_size` (16, the only one NVFP4 has).
Activation quantization is not applied (weight-only, as tinyvllm runs every FP8 checkpoint;
start-up says so); the exclude list's wildcards (fnmatch, as ModelOpt writes them: "lm_head", "model.layers.0.mlp*")
leave modules float. The KV cache's `k_scale` / `v_scale` (kv_cache_quant_algo FP8) apply to an FP8 KV cache
(model/kv_scales.py).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from tinyvllm.config import ConfigError
from tinyvllm.model.quantization import nvfp4

# quant_algo -> what one weight scale covers (the strategies checkpoint_formats.read_scaled_fp8 reads)
ALGORITHMS = {"FP8": "tensor", "FP8_PER_CHANNEL_PER_TOKEN": "channel", "FP8_PB_WO": "block", "NVFP4": "tensor_group"}
BLOCK = (128, 128)


@dataclass(frozen=True)
class ModelOptScheme:
  strategy: str
  ignore: tuple[str, ...]   # as QuantizationConfig.ignore: "re:" regular expressions
  activations: bool         # the checkpoint also quantizes activations (not applied here)


def scheme(raw: dict[str, Any], source: str) -> ModelOptScheme:
  """The checkpoint's FP8 or NVFP4 scheme, checked; raises naming the field tinyvllm cannot run."""
  nested = raw.get("quantization")
  if nested is not None and not isinstance(nested, dict):
    raise ConfigError(f"{source}: quantization_config.quantization must be an object, got {type(nested).__name__}")
  fields, where = (nested, "quantization_config.quantization") if nested is not None else (raw, "quantization_config")
  algorithm = str(fields.get("quant_algo") or "").upper()
  if algorithm not in ALGORITHMS:
    raise ConfigError(f"{source}: {where}.quant_algo {fields.get('quant_algo')!r} is not supported (tinyvllm runs ModelOpt's "
                      f"{', '.join(ALGORITHMS)} checkpoints)")
  excluded = fields.get("exclude_modules" if nested is not None else "ignore") or []
  if not isinstance(excluded, list) or not all(isinstance(e, str) and e for e in excluded):
    raise ConfigError(f"{source}: {where}.{'exclude_modules' if nested is not None else 'ignore'} must be a list of module "
                      f"names or wildcards, got {excluded!r}")
  if algorithm == "NVFP4" and fields.get("group_size", nvfp4.BLOCK) != nvfp4.BLOCK:
    raise ConfigError(f"{source}: {where}.group_size {fields.get('group_size')!r} is not supported (NVFP4's blocks are "
                      f"{nvfp4.BLOCK} columns)")
  return ModelOptScheme(ALGORITHMS[algorithm], ignore_patterns(excluded), algorithm != "FP8_PB_WO")


def ignore_patterns(excluded: list[str]) -> tuple[str, ...]:
  """ModelOpt's wildcards as "re:" patterns: a module the wildcard matches, or one inside a module it names."""
  return tuple(p for e in excluded for p in (f"re:{fnmatch.translate(e)}", f"re:{re.escape(e)}\\."))
