"""The loader's source of quantized linears: a checkpoint's packed ones (GPTQ, AWQ, FP8, compressed-tensors, ModelOpt,
FBGEMM FP8, bitsandbytes 8-bit) uploaded in the packed form of tinyvllm/backend/quantized.py, bitsandbytes' 4-bit ones dequantized,
or float ones quantized at load (int8, int4, fp8). Every other tensor (embeddings, LM head, norms, biases, the linears
a checkpoint leaves float) comes from the plain source unchanged."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tinygrad import Tensor
from tinygrad.dtype import DType

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.config import ConfigError
from tinyvllm.layers.quantized import quantize_rtn
from tinyvllm.model.quantization import bitsandbytes, nvfp4
from tinyvllm.model.quantization.checkpoint_formats import Reader, read_parts
from tinyvllm.model.quantization.compressed_tensors import NVFP4
from tinyvllm.model.quantization.config import INT4_GROUP, QuantizationConfig
from tinyvllm.model.quantization.unpacked import label, stack, upload
from tinyvllm.model.safetensors_file import Checkpoint

# a weight tensor's dtypes that hold codes rather than float values (FP8, NVFP4 bytes, int8 rows, bitsandbytes' packing)
PACKED_DTYPES = ("F8_E4M3", "U8", "I8", "I32")
Source = Callable[[list[str], tuple[int, ...], str], "Tensor | QuantizedWeight"]


def _check_rows(prefixes: list[str], rows: int, out: int) -> None:
  if rows != out: raise ConfigError(f"{label(prefixes)}: quantized weights have {rows} output rows, the config implies {out}")


class QuantizedSource:
  """Wraps the plain source: kind "linear" tensors come back quantized. `notices` collects what start-up should say
  (a layer whose input the int4 group does not divide, activation scales left unused)."""

  def __init__(self, plain: Source, qc: QuantizationConfig, checkpoint: Checkpoint | None, dtype: DType, device: str,
               used: set[str]):
    self.plain, self.qc, self.checkpoint, self.dtype, self.device, self.used = plain, qc, checkpoint, dtype, device, used
    self._notices: list[str] = []
    self._per_row: dict[str, int] = {}   # int4: projections whose input the group does not divide -> that input
    self._float: list[str] = []          # linears the checkpoint leaves float (QuantizationConfig.ignore)
    if qc.storage == NVFP4: self._notice(f"{qc.method}: {nvfp4.NOTICE}")
    if qc.activations:
      self._notice(f"{qc.method}: the checkpoint's activation quantization is not applied: activations "
                   "stay in the compute dtype (weight-only)")

  def __call__(self, names: list[str], shape: tuple[int, ...], kind: str) -> Tensor | QuantizedWeight:
    """A linear's weight, a sparse layer's experts' (kind "experts": every expert's rows stacked, as one weight), or
    an untied LM head the checkpoint quantized (GPTQ's lm_head true, a compressed-tensors scheme not ignoring it)."""
    if kind == "lm_head" and self._quantized_in_checkpoint(names[0].removesuffix(".weight")):
      self._notice(f"{self.qc.method}: the LM head is quantized in the checkpoint and runs packed")
      return self._linear(names, shape, kind)
    if kind not in ("linear", "experts"): return self.plain(names, shape, kind)
    return self._linear(names, shape, kind)

  def _quantized_in_checkpoint(self, prefix: str) -> bool:
    """Whether the checkpoint holds this module quantized: tensors beside (or instead of) a float weight, or a
    weight of packed codes."""
    if not self.qc.from_checkpoint or self.checkpoint is None or self.qc.ignores(prefix): return False
    weight = f"{prefix}.weight"
    if weight in self.checkpoint and self.checkpoint.dtype(weight) in PACKED_DTYPES: return True
    return any(n.startswith(f"{prefix}.") and n not in (weight, f"{prefix}.bias") for n in self.checkpoint.names())

  def _linear(self, names: list[str], shape: tuple[int, ...], kind: str) -> Tensor | QuantizedWeight:
    out, cols = shape
    if not self.qc.from_checkpoint:
      if self.qc.method == "experts_int8" and kind != "experts": return self.plain(names, shape, kind)
      return self._quantize(self.plain(names, shape, kind), cols, names)
    if self.checkpoint is None: raise ConfigError(f"{self.qc.method} weights need a checkpoint (not --load-format dummy)")
    prefixes = [n.removesuffix(".weight") for n in names]
    if (left := [p for p in prefixes if self.qc.ignores(p)]):
      if len(left) < len(prefixes):
        raise ConfigError(f"{label(prefixes)}: the checkpoint's quantization_config leaves {label(left)} float beside "
                          "quantized parts, which one fused product cannot take")
      self._float += left
      return self.plain(names, shape, kind)
    if self.qc.method == "bitsandbytes" and self.qc.bits == 4: return self._dequantized(prefixes, shape)
    parts = read_parts(self.checkpoint, prefixes, self.qc, cols, self.used)
    if kind == "experts" and any(p.g_idx is not None for p in parts):   # checked before stacking, which refuses unequal g_idx
      raise ConfigError(f"{names[0].rsplit('.experts.', 1)[0]}.experts: act-order (desc_act / g_idx) experts are not supported: "
                        "each expert would read its input in an order of its own")
    w = stack(parts, prefixes)
    _check_rows(prefixes, w.codes.shape[0], out)
    self._unused_scales(prefixes)
    return upload(w, self.qc.method, self.qc.packed_kind, self.dtype, self.device)

  def _dequantized(self, prefixes: list[str], shape: tuple[int, ...]) -> Tensor:
    """bitsandbytes' 4-bit levels (no packed form holds them exactly), as float weights in the compute dtype."""
    out, cols = shape
    parts = [bitsandbytes.dequantize_4bit(Reader(self.checkpoint, p, self.qc.method, self.used), cols) for p in prefixes]
    w = parts[0] if len(parts) == 1 else np.concatenate(parts)
    _check_rows(prefixes, w.shape[0], out)
    self._notice(f"bitsandbytes: {self.qc.storage} weights are dequantized at load to {self.dtype.name} (no kernel reads "
                 "their 4-bit levels packed): they take the compute dtype's memory")
    return Tensor(w, device=self.device).cast(self.dtype).contiguous().realize()

  def _unused_scales(self, prefixes: list[str]) -> None:
    """Static activation scales (activations stay in the compute dtype here: weight-only): read past, and said at
    start-up. (The KV cache's scales are model/kv_scales.py's.)"""
    for p in prefixes:
      for name in (f"{p}.input_scale", f"{p}.input_global_scale", f"{p}.input_zero_point", f"{p}.input_scale_ub"):
        if name not in self.checkpoint or name in self.used: continue
        self.used.add(name)
        self._notice(f"the checkpoint's {name.rsplit('.', 1)[1]} tensors are not used: activations stay in the compute dtype")

  def _quantize(self, weight: Tensor, cols: int, names: list[str]) -> QuantizedWeight:
    group = cols
    if self.qc.method == "int4":
      group = INT4_GROUP if cols % INT4_GROUP == 0 else cols
      if group != INT4_GROUP: self._per_row[names[0].rsplit(".", 2)[-2]] = cols
    q = quantize_rtn(weight, self.qc.method, group)
    Tensor.realize(*q.tensors())   # now, so that the float weights are never all held at once
    return q

  def _notice(self, text: str) -> None:
    if text not in self._notices: self._notices.append(text)

  @property
  def notices(self) -> list[str]:
    """What start-up says about the weights."""
    per_row = ", ".join(f"{name} ({cols})" for name, cols in self._per_row.items())
    left = [f"{len(self._float)} linears left float by the checkpoint's quantization_config: "
            f"{', '.join(self._float[:4])}{', ...' if len(self._float) > 4 else ''}"] if self._float else []
    return self._notices + left + ([f"int4: one scale per output row where the input is not a multiple of the group "
                                    f"{INT4_GROUP}: {per_row}"] if per_row else [])
