"""The loader's source of quantized linears: a checkpoint's packed ones (GPTQ, AWQ, FP8) uploaded in the packed form of
tinyvllm/backend/quantized.py, or float ones quantized at load (int8, int4, fp8). Every other tensor (embeddings, LM
head, norms, biases) comes from the plain source unchanged."""
from __future__ import annotations

from collections.abc import Callable

from tinygrad import Tensor
from tinygrad.dtype import DType

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.config import ConfigError
from tinyvllm.layers.quantized import quantize_rtn
from tinyvllm.model.quantization.checkpoint_formats import read_linear
from tinyvllm.model.quantization.config import INT4_GROUP, QuantizationConfig
from tinyvllm.model.quantization.unpacked import upload
from tinyvllm.model.safetensors_file import Checkpoint

Source = Callable[[list[str], tuple[int, ...], str], "Tensor | QuantizedWeight"]


class QuantizedSource:
  """Wraps the plain source: kind "linear" tensors come back quantized. `notices` collects what start-up should say
  (a layer whose input the int4 group does not divide, activation scales left unused)."""

  def __init__(self, plain: Source, qc: QuantizationConfig, checkpoint: Checkpoint | None, dtype: DType, device: str,
               used: set[str]):
    self.plain, self.qc, self.checkpoint, self.dtype, self.device, self.used = plain, qc, checkpoint, dtype, device, used
    self._notices: list[str] = []
    self._per_row: dict[str, int] = {}   # int4: projections whose input the group does not divide -> that input

  def __call__(self, names: list[str], shape: tuple[int, ...], kind: str) -> Tensor | QuantizedWeight:
    if kind != "linear": return self.plain(names, shape, kind)
    out, cols = shape
    if not self.qc.from_checkpoint: return self._quantize(self.plain(names, shape, kind), cols, names)
    if self.checkpoint is None: raise ConfigError(f"{self.qc.method} weights need a checkpoint (not --load-format dummy)")
    prefixes = [n.removesuffix(".weight") for n in names]
    w = read_linear(self.checkpoint, prefixes, self.qc, cols, self.used)
    if w.codes.shape[0] != out:
      raise ConfigError(f"{' + '.join(prefixes)}: quantized weights have {w.codes.shape[0]} output rows, the config implies {out}")
    for p in prefixes:   # static activation scales: activations stay in the compute dtype here (weight-only)
      if f"{p}.input_scale" in self.checkpoint:
        self.used.add(f"{p}.input_scale")
        self._notice("the checkpoint's input_scale tensors are not used: activations stay in the compute dtype")
    return upload(w, self.qc.method, "fp8" if self.qc.method == "fp8" else "int", self.dtype, self.device)

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
    return self._notices + ([f"int4: one scale per output row where the input is not a multiple of the group {INT4_GROUP}: "
                             f"{per_row}"] if per_row else [])
