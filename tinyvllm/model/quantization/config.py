"""Which weight quantization a model runs: the checkpoint's `quantization_config` (GPTQ, AWQ, FP8, compressed-tensors,
ModelOpt FP8 and NVFP4, FBGEMM FP8, bitsandbytes),
or --quantization quantizing a float checkpoint at load (int8, int4, fp8: round-to-nearest)."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from tinyvllm.config import ConfigError
from tinyvllm.model.quantization import bitsandbytes, compressed_tensors, modelopt, nvfp4

# read from a checkpoint's quantization_config
CHECKPOINT_METHODS = ("gptq", "awq", "fp8", "compressed-tensors", "modelopt", "bitsandbytes", "fbgemm_fp8")
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}   # vLLM's kernel choices for the same checkpoints
# vLLM's names for what a checkpoint's quant_method holds: "modelopt" is FP8 or, with quant_algo NVFP4, modelopt_fp4
SUBMETHODS = {"modelopt_fp4": "modelopt"}
# quantize a float checkpoint at load (experts_int8: only a mixture of experts' experts, int8 per channel, as vLLM's)
ON_THE_FLY_METHODS = ("int8", "int4", "fp8", "experts_int8")
INT4_GROUP = 128   # on-the-fly int4's group (a layer whose input the group does not divide: one scale per row)


@dataclass(frozen=True)
class QuantizationConfig:
  method: str
  bits: int = 8
  group_size: int = -1                 # input columns per scale; -1: per output channel
  desc_act: bool = False               # GPTQ act-order: each column's group given by the g_idx tensors
  zero_offset: int = 0                 # GPTQ v1 checkpoints store zero - 1
  block_size: tuple[int, int] | None = None   # FP8 weight_block_size [rows, columns]; None: one scale per tensor
  from_checkpoint: bool = True         # the checkpoint stores it (else: quantized at load from float weights)
  # the modules the checkpoint leaves float: names, or "re:" and a regular expression matched from the start
  # (compressed-tensors' ignore list; HF's modules_to_not_convert, any name holding one of them)
  ignore: tuple[str, ...] = ()
  # compressed-tensors: the storage format (pack-quantized, int-quantized, float-quantized), the scale strategy
  # (tensor, channel, group, block), zero points or none, and whether the checkpoint also quantizes activations (not
  # applied here: weight-only)
  storage: str = ""
  strategy: str = ""
  symmetric: bool = True
  activations: bool = False

  @property
  def packed_kind(self) -> str:
    """The packed form's kind (tinyvllm/backend/quantized.py): "fp8" codes or "int" ones."""
    return "fp8" if self.method == "fp8" or self.storage in ("float-quantized", compressed_tensors.NVFP4) else "int"

  def ignores(self, module: str) -> bool:
    """Whether the checkpoint leaves this linear (e.g. "model.layers.0.mlp.down_proj") float."""
    return compressed_tensors.ignores(self.ignore, module)

  def describe(self) -> str:
    grouping = (f"blocks of {self.block_size[0]}x{self.block_size[1]}" if self.block_size else
                "per tensor" if (self.method == "fp8" and self.from_checkpoint) or self.strategy == "tensor" else
                "per channel" if self.group_size < 0 else f"group {self.group_size}")
    kind = f", {self.storage}" if self.storage else ""
    return f"{self.method} ({self.bits}-bit{kind}, {grouping}{'' if self.from_checkpoint else ', quantized at load'})"


def _field(raw: dict[str, Any], name: str, source: str, default: Any = None) -> Any:
  value = raw.get(name, default)
  if value is None: raise ConfigError(f"{source}: quantization_config.{name} is missing")
  return value


def _bits(raw: dict[str, Any], source: str, allowed: tuple[int, ...]) -> int:
  bits = raw.get("bits", raw.get("w_bit"))
  if bits not in allowed:
    raise ConfigError(f"{source}: quantization_config.bits is {bits!r}; tinyvllm runs {' or '.join(map(str, allowed))}-bit "
                      f"{raw.get('quant_method', '').upper()} weights")
  return int(bits)


def _group(value: Any, source: str, name: str) -> int:
  if not isinstance(value, int) or (value != -1 and value < 1):
    raise ConfigError(f"{source}: quantization_config.{name} must be a positive integer or -1, got {value!r}")
  return value


def from_checkpoint(raw: dict[str, Any], source: str) -> QuantizationConfig:
  """The checkpoint's quantization_config, checked; raises naming the field that tinyvllm cannot run."""
  config = _method_config(raw, source)
  if config.method in ("compressed-tensors", "modelopt", "modelopt_fp4", "bitsandbytes"): return config
  return replace(config, ignore=_not_converted(raw.get("modules_to_not_convert"), source))


def _not_converted(keys: Any, source: str, field: str = "modules_to_not_convert") -> tuple[str, ...]:
  """HF's modules_to_not_convert (module names holding any of these stay float) as ignore patterns."""
  if keys is None: return ()
  if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
    raise ConfigError(f"{source}: quantization_config.{field} must be a list of module names, got {keys!r}")
  return tuple(f"re:.*{re.escape(k)}" for k in keys)


def _method_config(raw: dict[str, Any], source: str) -> QuantizationConfig:
  method = str(raw.get("quant_method", "")).lower()
  if method not in CHECKPOINT_METHODS:
    raise ConfigError(f"{source}: quantization_config.quant_method {raw.get('quant_method')!r} is not supported "
                      f"(tinyvllm reads {', '.join(CHECKPOINT_METHODS)} checkpoints)")
  if method == "compressed-tensors":
    ct = compressed_tensors.scheme(raw, source)
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
      raise ConfigError(f"{source}: quantization_config.ignore must be a list of module names, got {ignore!r}")
    return QuantizationConfig("compressed-tensors", ct.bits, ct.group_size, block_size=ct.block, storage=ct.format,
                              strategy=ct.strategy, symmetric=ct.symmetric, ignore=tuple(ignore), activations=ct.activations)
  if method == "modelopt":
    mo = modelopt.scheme(raw, source)
    if mo.strategy == "tensor_group":   # NVFP4
      return QuantizationConfig("modelopt_fp4", 4, nvfp4.BLOCK, storage=compressed_tensors.NVFP4, strategy=mo.strategy,
                                ignore=mo.ignore, activations=True)
    return QuantizationConfig("modelopt", 8, block_size=modelopt.BLOCK if mo.strategy == "block" else None,
                              storage="float-quantized", strategy=mo.strategy, ignore=mo.ignore, activations=mo.activations)
  if method == "fbgemm_fp8":   # FBGEMM's FP8 (Meta's Llama 3.1 FP8 releases): E4M3 rows, one scale each, dynamic activations
    return QuantizationConfig("fbgemm_fp8", 8, storage="float-quantized", strategy="channel", activations=True)
  if method == "bitsandbytes":
    bits, kind = bitsandbytes.scheme(raw, source)
    return QuantizationConfig("bitsandbytes", bits, -1 if bits == 8 else 64, storage=kind, activations=bits == 8,   # (LLM.int8)
                              ignore=_not_converted(raw.get("llm_int8_skip_modules"), source, "llm_int8_skip_modules"))
  if method == "gptq":
    version = str(raw.get("checkpoint_format", "gptq"))
    if version not in ("gptq", "gptq_v2"):
      raise ConfigError(f"{source}: quantization_config.checkpoint_format {version!r} is not supported (gptq or gptq_v2)")
    return QuantizationConfig("gptq", _bits(raw, source, (4, 8)), _group(_field(raw, "group_size", source, -1), source, "group_size"),
                              bool(raw.get("desc_act", False)), 1 if version == "gptq" else 0)
  if method == "awq":
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm": raise ConfigError(f"{source}: quantization_config.version {version!r} is not supported (AWQ's gemm layout is)")
    group = _group(raw.get("group_size", raw.get("q_group_size", 128)), source, "group_size")
    if not raw.get("zero_point", True):
      raise ConfigError(f"{source}: quantization_config.zero_point false is not supported (AWQ's GEMM layout has zero points)")
    return QuantizationConfig("awq", _bits(raw, source, (4,)), group)
  fmt = str(raw.get("fmt", "e4m3")).lower()
  if fmt != "e4m3": raise ConfigError(f"{source}: quantization_config.fmt {fmt!r} is not supported (E4M3 weights are)")
  block = raw.get("weight_block_size")
  if block is not None and (not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
    raise ConfigError(f"{source}: quantization_config.weight_block_size must be two positive integers, got {block!r}")
  return QuantizationConfig("fp8", 8, block_size=tuple(block) if block else None)


def resolve(requested: str | None, checkpoint: dict[str, Any] | None, source: str) -> QuantizationConfig | None:
  """The quantization the engine runs: the checkpoint's (--quantization, if given, must name it), or --quantization's
  on-the-fly method for a float checkpoint."""
  requested = ALIASES.get(requested, requested) if requested else requested
  if checkpoint:
    config = from_checkpoint(checkpoint, source)
    if requested is not None and requested not in (config.method, SUBMETHODS.get(config.method)):
      raise ConfigError(f"--quantization {requested} does not match the checkpoint's quantization_config.quant_method "
                        f"{config.method!r} ({source})")
    return config
  if requested is None: return None
  if requested == "gguf": raise ConfigError(f"--quantization gguf needs a GGUF model file (--model path/to/model.gguf), not {source}")
  if requested not in ON_THE_FLY_METHODS:
    raise ConfigError(f"--quantization {requested} needs a {requested.upper()} checkpoint (quantization_config in config.json); "
                      f"a float checkpoint can be quantized at load with {', '.join(ON_THE_FLY_METHODS)}")
  bits = 4 if requested == "int4" else 8
  return QuantizationConfig(requested, bits, INT4_GROUP if requested == "int4" else -1, from_checkpoint=False)
