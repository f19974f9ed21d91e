"""The model loader's TensorSource over a GGUF file: HF tensor names mapped to llama.cpp's, the attention q/k rows put
back in HF's order, Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q2_K-Q6_K linears uploaded in the packed form of backend/quantized.py (a
linear whose parts mix them in a common one), everything else dequantized at load to the compute dtype."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import numpy as np
from tinygrad import Tensor
from tinygrad.dtype import DType

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.config import ConfigError
from tinyvllm.model.gguf import blocks
from tinyvllm.model.gguf.config import PERMUTED_ARCHITECTURES
from tinyvllm.model.gguf.reader import GGUFFile, TensorInfo
from tinyvllm.model.quantization.unpacked import common_form, stack, upload
from tinyvllm.model_config import ModelConfig

GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.bias": "attn_q.bias",
               "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
               "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_name(hf_name: str) -> str | None:
  """llama.cpp's name for an HF llama / qwen2 / qwen3 tensor name (None: GGUF files have no such tensor)."""
  if hf_name in GLOBAL_NAMES: return GLOBAL_NAMES[hf_name]
  m = LAYER.fullmatch(hf_name)
  if m is None or m.group(2) not in LAYER_NAMES: return None
  return f"blk.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"


def unpermute_rows(a: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's convert_hf_to_gguf permute of attn_q / attn_k rows: it stores each head's rows as interleaved
  pairs (rotary GPT-J style, row 2i + j = HF row j * head_dim / 2 + i); HF's rotate-half layout wants them back.
  Works on any per-row array (codes, block scales, float rows) since blocks run along rows."""
  rows = a.shape[0]
  return a.reshape(heads, rows // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


class GGUFSource:
  """(names, shape, kind) -> the tensor on the device; `used` collects the GGUF names read, `types` what each stored
  type was read as (for the start-up notice)."""

  def __init__(self, f: GGUFFile, cfg: ModelConfig, dtype: DType, device: str):
    self.f, self.cfg, self.dtype, self.device = f, cfg, dtype, device
    self.used: set[str] = set()
    self.packed: Counter[tuple[str, str]] = Counter()   # (linears | output layer, GGUF type) kept packed
    self.dequantized: Counter[str] = Counter()  # quantized tensors dequantized at load, by GGUF type

  def _heads(self, name: str) -> int | None:
    """The head count whose rows llama.cpp permuted in this tensor (None: not permuted)."""
    if self.f.get("general.architecture") not in PERMUTED_ARCHITECTURES: return None
    if name.endswith(".attn_q.weight"): return self.cfg.num_heads
    if name.endswith(".attn_k.weight"): return self.cfg.num_kv_heads
    return None

  def _info(self, hf_name: str) -> TensorInfo:
    name = gguf_name(hf_name)
    if name is None or name not in self.f: raise KeyError(hf_name if name is None else f"{name} ({hf_name})")
    return self.f.tensors[name]

  def __call__(self, names: list[str], shape: tuple[int, ...], kind: str) -> Tensor | QuantizedWeight:
    infos = [self._info(n) for n in names]
    self.used.update(i.name for i in infos)
    rows = sum(i.shape[0] for i in infos)
    got = (rows, *infos[0].shape[1:])
    if any(i.shape[1:] != infos[0].shape[1:] for i in infos) or got != shape:
      raise ConfigError(f"{self.f.path}: tensor {' + '.join(i.name for i in infos)} has shape {got}, the metadata implies {shape}")
    if kind in ("linear", "lm_head") and all(i.ggml_type in blocks.PACKED_TYPES for i in infos):
      return self._packed(infos, "output layer" if kind == "lm_head" else "linears")
    parts, role = [], "linear" if kind == "linear" else "embedding"
    for i in infos:
      a = blocks.dequantize(self.f.raw(i.name), i.ggml_type, i.shape)
      if not blocks.BLOCK_FORMATS[i.ggml_type].plain: self.dequantized[f"{i.type_name} {role}"] += 1
      parts.append(a if (heads := self._heads(i.name)) is None else unpermute_rows(a, heads))
    arr = parts[0] if len(parts) == 1 else np.concatenate(parts)
    t = Tensor(np.ascontiguousarray(arr), device=self.device)
    return (t if t.dtype == self.dtype else t.cast(self.dtype)).contiguous()

  def _packed(self, infos: list[TensorInfo], role: str) -> QuantizedWeight:
    """One linear from its parts' blocks, packed (parts of different types in a common form: unpacked.common_form)."""
    parts = []
    for i in infos:
      p = blocks.unpack(self.f.raw(i.name), i.ggml_type, i.shape)
      if (heads := self._heads(i.name)) is not None:
        fix = lambda a: None if a is None else unpermute_rows(a, heads)
        p = replace(p, codes=fix(p.codes), scales=fix(p.scales), zeros=fix(p.zeros), offsets=fix(p.offsets))
      parts.append(p)
    parts = common_form(parts)
    names = "+".join(sorted({i.type_name for i in infos}))
    label = names if "+" not in names else f"{names} as {parts[0].bits}-bit codes in groups of {parts[0].group_size}"
    self.packed[(role, label)] += len(infos)
    w = upload(stack(parts, [i.name for i in infos]), f"gguf {names}", "int", self.dtype, self.device)
    Tensor.realize(*w.tensors())
    return w

  def notices(self) -> list[str]:
    """What start-up says about the weights: the packed formats and what was dequantized at load."""
    out = []
    for role in sorted({r for r, _ in self.packed}, reverse=True):   # linears, then the output layer
      kept = ", ".join(f"{n} x{c}" for (r, n), c in sorted(self.packed.items()) if r == role)
      out.append(f"gguf: {role} kept packed: {kept}")
    if self.dequantized:
      out.append(f"gguf: dequantized at load to {self.dtype.name} (embeddings always; a linear whose parts mix a "
                 "quantized type with a plain one): "
                 + ", ".join(f"{n} x{c}" for n, c in sorted(self.dequantized.items())))
    return out
