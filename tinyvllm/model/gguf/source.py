"""The model loader's TensorSource over a GGUF file: HF tensor names mapped to llama.cpp's, the attention q/k rows put
back in HF's order, Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q2_K-Q6_K / IQ4_NL / IQ4_XS linears uploaded in the packed form
of backend/quantized.py (a linear whose parts mix them in a common one), everything else dequantized at load to the
compute dtype."""
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
from tinyvllm.model.quantization.unpacked import UnpackedWeight, common_form, stack, upload
from tinyvllm.model_config import ModelConfig

GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.bias": "attn_q.bias",
               "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
               "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
               "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}
LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# a sparse layer's experts: HF's per-expert names (Qwen3-MoE's, Mixtral's) -> the layer's 3-D tensor of every expert
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_TENSORS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                  "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


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
    if kind == "experts": return self._experts(names, shape)
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
      if not blocks.block_format(i.ggml_type).plain: self.dequantized[f"{i.type_name} {role}"] += 1
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
    return self._upload(stack(parts, [i.name for i in infos]), infos, role)

  def _upload(self, w: UnpackedWeight, infos: list[TensorInfo], role: str) -> QuantizedWeight:
    names = "+".join(sorted({i.type_name for i in infos}))
    label = names if "+" not in names else f"{names} as {w.bits}-bit codes in groups of {w.group_size}"
    self.packed[(role, label)] += len(infos)
    q = upload(w, f"gguf {names}", "int", self.dtype, self.device)
    Tensor.realize(*q.tensors())
    return q

  def _experts(self, names: list[str], shape: tuple[int, ...]) -> Tensor | QuantizedWeight:
    """A sparse layer's experts from its 3-D tensors ([experts, rows, cols]: ffn_gate_exps, ffn_up_exps or
    ffn_down_exps), every expert's rows stacked in the order the loader names them (expert by expert, gate rows then up
    rows): packed where the types allow, else dequantized."""
    parsed = [EXPERT.fullmatch(n) for n in names]
    if any(m is None or m.group(3) not in EXPERT_TENSORS for m in parsed): raise KeyError(names[0])
    projections = list(dict.fromkeys(m.group(3) for m in parsed))
    experts, layer = len(names) // len(projections), parsed[0].group(1)
    expected = [(str(e), p) for e in range(experts) for p in projections]
    if [(m.group(2), m.group(3)) for m in parsed] != expected: raise KeyError(f"{names[0]} (experts out of order)")
    infos = []
    for p in projections:
      name = f"blk.{layer}.{EXPERT_TENSORS[p]}.weight"
      if name not in self.f: raise KeyError(f"{name} ({names[0]})")
      infos.append(self.f.tensors[name])
    self.used.update(i.name for i in infos)
    if any(len(i.shape) != 3 or i.shape[0] != experts or i.shape[1:] != infos[0].shape[1:] for i in infos) or (
        experts * len(infos) * infos[0].shape[1], infos[0].shape[2]) != shape:
      raise ConfigError(f"{self.f.path}: tensor {' + '.join(i.name for i in infos)} has shape "
                        f"{' + '.join(str(i.shape) for i in infos)}, the metadata implies {experts} experts of {shape}")
    rows = lambda i: (experts * i.shape[1], i.shape[2])
    if all(i.ggml_type in blocks.PACKED_TYPES for i in infos):
      parts = common_form([blocks.unpack(self.f.raw(i.name), i.ggml_type, rows(i)) for i in infos])
      by_expert = lambda field: None if getattr(parts[0], field) is None else _by_expert([getattr(p, field) for p in parts], experts)
      w = replace(parts[0], codes=by_expert("codes"), scales=by_expert("scales"), zeros=by_expert("zeros"),
                  offsets=by_expert("offsets"))
      return self._upload(w, infos, "experts")
    for i in infos:
      if not blocks.block_format(i.ggml_type).plain: self.dequantized[f"{i.type_name} experts"] += 1
    arr = _by_expert([blocks.dequantize(self.f.raw(i.name), i.ggml_type, rows(i)) for i in infos], experts)
    t = Tensor(np.ascontiguousarray(arr), device=self.device)
    return (t if t.dtype == self.dtype else t.cast(self.dtype)).contiguous()

  def notices(self) -> list[str]:
    """What start-up says about the weights: the packed formats and what was dequantized at load."""
    out = []
    for role in sorted({r for r, _ in self.packed}, key=("linears", "experts", "output layer").index):
      kept = ", ".join(f"{n} x{c}" for (r, n), c in sorted(self.packed.items()) if r == role)
      out.append(f"gguf: {role} kept packed: {kept}")
    if self.dequantized:
      out.append(f"gguf: dequantized at load to {self.dtype.name} (embeddings always; types with no packed form, the "
                 "i-quants below IQ4 among them; a linear whose parts mix a quantized type with a plain one): "
                 + ", ".join(f"{n} x{c}" for n, c in sorted(self.dequantized.items())))
    return out


def _by_expert(parts: list[np.ndarray], experts: int) -> np.ndarray:
  """Per-row arrays of an experts' tensor each ([experts * rows, ...]) interleaved expert by expert: expert e's rows of
  the first, then its rows of the second (gate then up), ..."""
  return np.concatenate([p.reshape(experts, -1, *p.shape[1:]) for p in parts], axis=1).reshape(-1, *parts[0].shape[1:])
