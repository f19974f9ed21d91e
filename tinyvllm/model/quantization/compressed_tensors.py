"""llm-compressor's compressed-tensors checkpoints (vLLM's `compressed-tensors` quantization): the config's one weight
scheme for every Linear, checked, and its `ignore` list; checkpoint_formats.read_compressed reads each linear's tensors.

The layouts, from compressed-tensors' published format:
- pack-quantized (W4A16, W8A16: integer weights): `weight_packed` int32 [out, ceil(in * bits / 32)], 32 / bits input
  columns a word from the lowest bits, each code stored as q + 2^(bits - 1) (q signed); `weight_shape` [2] the
  unpacked shape; `weight_scale` [out, groups] ([out, 1] per channel); asymmetric schemes' `weight_zero_point` int32
  [ceil(out * bits / 32), groups], packed the same way along the output; actorder "group": `weight_g_idx` [in], each
  column's group. w = (q - zero_point) * scale.
- int-quantized (W8A8 int8): `weight` int8 [out, in], `weight_scale` as above, `weight_zero_point` int8 [out, groups].
- float-quantized (FP8 W8A8 / W8A16): `weight` float8_e4m3fn [out, in]; `weight_scale` per tensor [1], per channel
  [out, 1], per group [out, in / group] or per block [ceil(out / rows), ceil(in / cols)]. w = e4m3(weight) * scale.
- nvfp4-pack-quantized (NVFP4 W4A4 / W4A16): E2M1 values two a byte with FP8 block scales of 16 columns and a global
  scale (layout in nvfp4.py); weights type float, num_bits 4, strategy tensor_group, group_size 16.
Linears the config's `ignore` list names (a module name, or `re:` and a regular expression matched from the start, as
compressed-tensors matches them) stay float. Activation schemes (`input_activations`) are not applied: activations stay
in the compute dtype (weight-only), and start-up says so. A `kv_cache_scheme`'s static k_scale / v_scale (on the
attention modules) apply to an FP8 KV cache (model/kv_scales.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tinyvllm.config import ConfigError
from tinyvllm.model.quantization import nvfp4

NVFP4 = "nvfp4-pack-quantized"
# the storage formats read here: the weight's type each holds
FORMATS = {"pack-quantized": "int", "int-quantized": "int", "float-quantized": "float", NVFP4: "float"}
STRATEGIES = {"int": ("tensor", "channel", "group"), "float": ("tensor", "channel", "group", "block")}


@dataclass(frozen=True)
class WeightScheme:
  format: str                         # FORMATS' names
  bits: int
  strategy: str                       # STRATEGIES': what one scale covers
  group_size: int                     # the group strategy's input columns; -1 otherwise
  block: tuple[int, int] | None       # the block strategy's [rows, columns]
  symmetric: bool                     # False: integer zero points stored beside the scales
  activations: bool                   # the checkpoint also quantizes activations (not applied here)


def scheme(raw: dict[str, Any], source: str) -> WeightScheme:
  """The weight scheme every Linear takes (checked), with its storage format and whether activations are quantized."""
  where = f"{source}: quantization_config"
  if raw.get("transform_config"):   # (rotations the weights were stored under, to be undone at run time)
    raise ConfigError(f"{where}.transform_config is not supported (tinyvllm reads compressed-tensors weight schemes)")
  sparsity = raw.get("sparsity_config") or {}
  if sparsity.get("format", "dense") != "dense":
    raise ConfigError(f"{where}.sparsity_config format {sparsity.get('format')!r} is not supported (dense weights are)")
  if raw.get("quantization_status", "compressed") != "compressed":
    raise ConfigError(f"{where}.quantization_status {raw.get('quantization_status')!r} is not supported (compressed is)")
  groups = raw.get("config_groups")
  if not isinstance(groups, dict) or not groups: raise ConfigError(f"{where}.config_groups is missing")
  schemes = [_group_scheme(g, raw.get("format"), f"{where}.config_groups.{name}") for name, g in groups.items()]
  if any(s != schemes[0] for s in schemes[1:]):
    raise ConfigError(f"{where}.config_groups hold different weight schemes (mixed precision), which tinyvllm does not run")
  return schemes[0]


def _group_scheme(group: Any, default_format: Any, where: str) -> WeightScheme:
  if not isinstance(group, dict): raise ConfigError(f"{where} must be an object")
  if group.get("targets") != ["Linear"]:
    raise ConfigError(f"{where}.targets {group.get('targets')!r} is not supported (a scheme for every Linear is)")
  if group.get("output_activations"): raise ConfigError(f"{where}.output_activations is not supported")
  weights, fmt = group.get("weights"), group.get("format") or default_format
  if not isinstance(weights, dict): raise ConfigError(f"{where}.weights is missing")
  if fmt not in FORMATS:
    raise ConfigError(f"{where}: format {fmt!r} is not supported (tinyvllm reads {', '.join(FORMATS)})")
  kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
  if kind != FORMATS[fmt]: raise ConfigError(f"{where}.weights.type {kind!r} does not match format {fmt!r}")
  allowed = (4, 8) if fmt == "pack-quantized" else (4,) if fmt == NVFP4 else (8,)
  if bits not in allowed:
    raise ConfigError(f"{where}.weights.num_bits is {bits!r}; {fmt} weights run with {' or '.join(map(str, allowed))} bits")
  if fmt != NVFP4 and strategy not in STRATEGIES[kind]:
    raise ConfigError(f"{where}.weights.strategy {strategy!r} is not supported for {kind} weights "
                      f"({', '.join(STRATEGIES[kind])})")
  if weights.get("dynamic"): raise ConfigError(f"{where}.weights.dynamic true is not supported (stored scales are)")
  symmetric = bool(weights.get("symmetric", True))
  if kind == "float" and not symmetric: raise ConfigError(f"{where}.weights.symmetric false is not supported for float weights")
  if fmt == NVFP4: return _nvfp4_scheme(group, weights, where)
  group_size, block = weights.get("group_size"), None
  if strategy == "group" and (not isinstance(group_size, int) or group_size < 1):
    raise ConfigError(f"{where}.weights.group_size must be a positive integer for the group strategy, got {group_size!r}")
  if strategy == "block": block = _block(weights.get("block_structure"), f"{where}.weights.block_structure")
  return WeightScheme(fmt, int(bits), strategy, group_size if strategy == "group" else -1, block, symmetric,
                      bool(group.get("input_activations")))


def _nvfp4_scheme(group: dict[str, Any], weights: dict[str, Any], where: str) -> WeightScheme:
  """NVFP4's one weight scheme: FP8 scales a block of 16 columns under a global scale (strategy tensor_group)."""
  if weights.get("strategy") != "tensor_group" or weights.get("group_size") != nvfp4.BLOCK:
    raise ConfigError(f"{where}.weights: {NVFP4} weights take strategy 'tensor_group' with group_size {nvfp4.BLOCK}, got "
                      f"{weights.get('strategy')!r} with {weights.get('group_size')!r}")
  return WeightScheme(NVFP4, 4, "tensor_group", nvfp4.BLOCK, None, True, bool(group.get("input_activations")))


def _block(value: Any, where: str) -> tuple[int, int]:
  if isinstance(value, str) and re.fullmatch(r"\d+x\d+", value): value = [int(v) for v in value.split("x")]
  if not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, int) and v > 0 for v in value):
    raise ConfigError(f"{where} must be two positive integers, got {value!r}")
  return value[0], value[1]


def ignores(patterns: tuple[str, ...], module: str) -> bool:
  """Whether the config's ignore list leaves `module` (e.g. "model.layers.0.mlp.down_proj") float."""
  return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in patterns)
