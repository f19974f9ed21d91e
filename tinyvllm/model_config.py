"""The model's shape, read from an HF config.json (or a GGUF file's metadata, model/gguf/config.py): its architecture,
sizes, RoPE, MoE routing (moe_config.py) and quantization block, each field checked and a refused one named."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyvllm.config import ConfigError
from tinyvllm.moe_config import MOE_ARCHITECTURES, MoEConfig, moe_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
                           *MOE_ARCHITECTURES)
# architectures refused with a reason more useful than "unsupported"
REFUSED_ARCHITECTURES = {
  "Gemma2ForCausalLM": "Gemma 2 needs logit soft-capping and sliding-window attention, which tinyvllm does not implement "
                       "(Gemma 1, GemmaForCausalLM, is supported)",
  "Gemma3ForCausalLM": "Gemma 3 needs sliding-window attention, which tinyvllm does not implement (Gemma 1, GemmaForCausalLM, "
                       "is supported)",
  "Gemma3ForConditionalGeneration": "Gemma 3 needs sliding-window attention and a vision tower, which tinyvllm does not "
                                    "implement (Gemma 1, GemmaForCausalLM, is supported)",
}


@dataclass(frozen=True)
class RopeScaling:
  """Llama-3.1/3.2 frequency scaling (rope_type "llama3")."""
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnScaling:
  """YaRN (rope_type "yarn"; Qwen's long-context recipe): frequencies blended between the original and the interpolated
  (divided by factor) along a ramp between the dimensions beta_fast and beta_slow rotations pin, and cos/sin scaled by
  attention_factor."""
  factor: float
  original_max_position_embeddings: int
  attention_factor: float
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
  architecture: str
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  max_position_embeddings: int
  rms_norm_eps: float
  rope_theta: float
  tie_word_embeddings: bool
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  rope_scaling: RopeScaling | YarnScaling | None = None
  # each inverse frequency divided by its factor: linear scaling's one factor for every frequency (rope_type "linear"), or
  # a GGUF file's rope_freqs tensor (llama.cpp's form of Llama-3.1's scaling)
  rope_freq_factors: tuple[float, ...] | None = None
  torch_dtype: str = "float32"
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  hidden_act: str = "silu"           # the MLP's gated activation (HF's name): silu, or gelu_pytorch_tanh (Gemma)
  sliding_window: int | None = None  # Mistral's attention window; the engine takes it only where it can never apply
  norm_weight_offset: float = 0.0    # added to every RMSNorm weight at load (Gemma scales by 1 + weight)
  embed_scale: float = 1.0           # multiplies the embeddings (Gemma: sqrt(hidden_size), in the model's dtype)
  moe: MoEConfig | None = None       # the experts and their routing (Qwen3-MoE, Mixtral); None: every layer dense
  # the checkpoint's quantization_config as written (tinyvllm/model/quantization/config.py reads and checks it)
  quantization_config: dict[str, Any] | None = field(default=None, compare=False, hash=False)

  @property
  def q_size(self) -> int: return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int: return self.num_kv_heads * self.head_dim

  @staticmethod
  def from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and (refused := next((a for a in archs if a in REFUSED_ARCHITECTURES), None)):
      raise ConfigError(f"{source}: architecture {refused} is not supported: {REFUSED_ARCHITECTURES[refused]}")
    if arch is None:
      raise ConfigError(f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                        f"tinyvllm supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    if raw.get("use_sliding_window"):
      raise ConfigError(f"{source}: sliding-window attention (use_sliding_window=true) is not supported")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
               if k not in raw]
    if missing: raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
    heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads: raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    theta, scaling, linear = _rope(raw, source, int(raw.get("max_position_embeddings", 2048)))
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
    eos = raw.get("eos_token_id")
    return ModelConfig(
      architecture=arch, hidden_size=int(raw["hidden_size"]), intermediate_size=int(raw["intermediate_size"]),
      num_layers=int(raw["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv_heads,
      head_dim=head_dim, vocab_size=int(raw["vocab_size"]),
      max_position_embeddings=_context(int(raw.get("max_position_embeddings", 2048)), scaling, linear),
      rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
      rope_theta=theta, rope_scaling=scaling, rope_freq_factors=None if linear is None else (linear,) * (head_dim // 2),
      tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == "GemmaForCausalLM")),   # HF's default: tied for Gemma only
      qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
      o_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
      mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
      torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
      bos_token_id=raw.get("bos_token_id"), eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
      quantization_config=_quantization_config(raw, source), moe=moe_config(arch, raw, source, ConfigError),
      **_architecture_fields(arch, raw, source))

  @staticmethod
  def from_folder(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file(): raise ConfigError(f"{folder}: no config.json (is this a HuggingFace model folder?)")
    return ModelConfig.from_dict(_with_quant_config_file(_json_object(path), folder), str(path))


def _with_quant_config_file(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
  """config.json with its quantization config where a checkpoint keeps it elsewhere, as vLLM finds it: older
  llm-compressor's `compression_config`, or NVIDIA ModelOpt's `hf_quant_config.json` beside config.json."""
  if raw.get("quantization_config") is not None: return raw
  if raw.get("compression_config") is not None: return {**raw, "quantization_config": raw["compression_config"]}
  path = folder / "hf_quant_config.json"
  if not path.is_file(): return raw
  return {**raw, "quantization_config": {**_json_object(path), "quant_method": "modelopt"}}


def _json_object(path: Path) -> dict[str, Any]:
  try: value = json.loads(path.read_text())
  except json.JSONDecodeError as e: raise ConfigError(f"{path}: not valid JSON ({e})") from e
  if not isinstance(value, dict): raise ConfigError(f"{path}: must hold a JSON object, got {type(value).__name__}")
  return value


def _quantization_config(raw: dict[str, Any], source: str) -> dict[str, Any] | None:
  quant = raw.get("quantization_config")
  if quant is None or isinstance(quant, dict): return quant or None
  raise ConfigError(f"{source}: quantization_config must be an object, got {type(quant).__name__}")


def _architecture_fields(arch: str, raw: dict[str, Any], source: str) -> dict[str, Any]:
  """What sets Mistral and Gemma apart from the Llama shape: the activation, Mistral's window, Gemma's norms and scale."""
  if arch != "GemmaForCausalLM":
    act = raw.get("hidden_act", "silu")
    if act != "silu": raise ConfigError(f"{source}: hidden_act {act!r} is not supported for {arch} (silu is)")
    window = raw.get("sliding_window") if arch in ("MistralForCausalLM", "MixtralForCausalLM") else None
    return {"sliding_window": None if window is None else int(window)}
  if raw.get("use_bidirectional_attention"):
    raise ConfigError(f"{source}: use_bidirectional_attention=true is not supported (tinyvllm runs causal decoders)")
  # HF maps Gemma's legacy hidden_act "gelu" to the tanh approximation the checkpoints were trained with; an explicit
  # hidden_activation says which GELU is meant
  field_name = "hidden_activation" if raw.get("hidden_activation") else "hidden_act"
  act = raw.get(field_name) or "gelu_pytorch_tanh"
  if field_name == "hidden_act" and act == "gelu": act = "gelu_pytorch_tanh"
  if act != "gelu_pytorch_tanh":
    raise ConfigError(f"{source}: {field_name} {act!r} is not supported for {arch} (gelu_pytorch_tanh is)")
  return {"hidden_act": act, "norm_weight_offset": 1.0, "embed_scale": float(raw["hidden_size"]) ** 0.5}
def _rope(raw: dict[str, Any], source: str, max_positions: int) -> tuple[float, RopeScaling | YarnScaling | None, float | None]:
  """rope_theta, Llama-3.1's or YaRN's scaling and linear scaling's factor, from either the classic fields or
  transformers 5's `rope_parameters`."""
  params = dict(raw.get("rope_parameters") or {})
  scaling = raw.get("rope_scaling") or params
  theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
  rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
  if rope_type == "default": return theta, None, None
  if rope_type == "linear":   # positions divided by the factor: every frequency divided by it (HF's linear rope)
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
      raise ConfigError(f"{source}: linear rope scaling needs a positive factor, got {factor!r}")
    return theta, None, float(factor)
  if rope_type == "yarn": return theta, _yarn(scaling, source, max_positions), None
  if rope_type != "llama3":
    raise ConfigError(f"{source}: rope scaling type {rope_type!r} is not supported (default, linear, llama3 and yarn are)")
  return theta, RopeScaling(float(scaling["factor"]), float(scaling.get("low_freq_factor", 1.0)),
                            float(scaling.get("high_freq_factor", 4.0)), int(scaling["original_max_position_embeddings"])), None


def _yarn(scaling: dict[str, Any], source: str, max_positions: int) -> YarnScaling:
  """HF's YaRN parameters: the original context (default max_position_embeddings), the factor (default the ratio of the
  two), the attention factor (default 0.1 ln(factor) + 1, or the ratio of two such with mscale / mscale_all_dim)."""
  if scaling.get("partial_rotary_factor", 1.0) != 1.0: raise ConfigError(f"{source}: partial rotary embeddings are not supported")
  original = int(scaling.get("original_max_position_embeddings") or max_positions)
  factor = float(scaling.get("factor") or max_positions / original)
  if not factor > 0: raise ConfigError(f"{source}: yarn rope scaling needs a positive factor, got {scaling.get('factor')!r}")
  mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
  attention = scaling.get("attention_factor")
  if attention is None:
    both = scaling.get("mscale") and scaling.get("mscale_all_dim")
    attention = mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]) if both else mscale(1.0)
  return YarnScaling(factor, original, float(attention), float(scaling.get("beta_fast") or 32.0),
                     float(scaling.get("beta_slow") or 1.0), bool(scaling.get("truncate", True)))


def _context(max_positions: int, scaling: RopeScaling | YarnScaling | None, linear: float | None) -> int:
  """The positions the model takes, as vLLM derives them: max_position_embeddings, times a linear factor, or YaRN's
  factor times its original context (what the scaling is for; Llama-3.1's config already counts its own)."""
  if linear is not None: return int(max_positions * linear)
  if isinstance(scaling, YarnScaling): return max(max_positions, int(scaling.original_max_position_embeddings * scaling.factor))
  return max_positions
