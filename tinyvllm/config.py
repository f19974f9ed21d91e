"""Configuration: the model's shape (read from an HF config.json), the engine's settings, and the environment.

This is the one module of the runtime package that reads environment variables (the CLI layer reads its own): `DEV`
(tinygrad's device), `CC` (the C compiler tinygrad's CPU backend runs), `TINYVLLM_CACHE`, `HF_ENDPOINT`, `HF_TOKEN`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPES = ("auto", "bfloat16", "float16", "float32")
ATTENTION_BACKENDS = ("auto", "portable", "cuda", "metal")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")   # vLLM's names; fp8 = fp8_e4m3
CUDAGRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "NONE")   # vLLM's names: which step layouts are captured


class ConfigError(ValueError):
  """A model folder or an engine setting cannot be used; the message says which and why."""


@dataclass(frozen=True)
class RopeScaling:
  """Llama-3.1/3.2 frequency scaling (rope_type "llama3")."""
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


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
  rope_scaling: RopeScaling | None = None
  torch_dtype: str = "float32"
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  @property
  def q_size(self) -> int: return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int: return self.num_kv_heads * self.head_dim

  @staticmethod
  def from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
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
    theta, scaling = _rope(raw, source)
    eos = raw.get("eos_token_id")
    return ModelConfig(
      architecture=arch, hidden_size=int(raw["hidden_size"]), intermediate_size=int(raw["intermediate_size"]),
      num_layers=int(raw["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv_heads,
      head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads), vocab_size=int(raw["vocab_size"]),
      max_position_embeddings=int(raw.get("max_position_embeddings", 2048)), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
      rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
      qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
      o_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
      mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=arch == "Qwen3ForCausalLM",
      torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
      bos_token_id=raw.get("bos_token_id"), eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]))

  @staticmethod
  def from_folder(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file(): raise ConfigError(f"{folder}: no config.json (is this a HuggingFace model folder?)")
    try: raw = json.loads(path.read_text())
    except json.JSONDecodeError as e: raise ConfigError(f"{path}: not valid JSON ({e})") from e
    return ModelConfig.from_dict(raw, str(path))


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
  """rope_theta and scaling, from either the classic fields or transformers 5's `rope_parameters`."""
  params = dict(raw.get("rope_parameters") or {})
  scaling = raw.get("rope_scaling") or params
  theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
  rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
  if rope_type == "default": return theta, None
  if rope_type != "llama3": raise ConfigError(f"{source}: rope scaling type {rope_type!r} is not supported (default and llama3 are)")
  return theta, RopeScaling(float(scaling["factor"]), float(scaling.get("low_freq_factor", 1.0)),
                            float(scaling.get("high_freq_factor", 4.0)), int(scaling["original_max_position_embeddings"]))


@dataclass
class EngineConfig:
  """Everything the engine needs besides the model's own config (vLLM's flag names)."""
  model: str
  dtype: str = "auto"
  device: str | None = None
  max_model_len: int | None = None
  load_format: str = "auto"
  tokenizer: str | None = None
  seed: int = 0
  # the KV cache
  kv_cache: str = "paged"                       # paged | contiguous (the baseline)
  block_size: int = 16
  kv_cache_memory: float | None = None          # GiB for the KV cache
  kv_cache_dtype: str = "auto"                  # auto (the model's dtype) | fp8 / fp8_e4m3 (E4M3 codes, scale 1)
  gpu_memory_utilization: float = 0.9           # fraction of device memory for weights + cache, where it can be read
  num_gpu_blocks: int | None = None             # exact number of blocks (overrides the two above)
  enable_prefix_caching: bool = True
  # the scheduler
  scheduler: str = "continuous"                 # continuous | static (the baseline)
  max_num_seqs: int = 256
  max_num_batched_tokens: int | None = None     # default: max(2048, max_num_seqs)
  enable_chunked_prefill: bool = True
  long_prefill_token_threshold: int = 0
  # attention: hand-written kernels (cuda / metal) or tinygrad ops (portable); auto picks by device
  attention_backend: str = "auto"
  # decode batch sizes captured at start-up (bucketed to powers of two); None: every bucket up to max_num_seqs on a GPU,
  # none on the CPU; []: none (each layout is then captured when first met)
  cuda_graph_sizes: list[int] | None = None
  # which step layouts run as TinyJit captures (CUDA graphs on CUDA): FULL every layout, FULL_DECODE_ONLY decode steps
  # only (steps with prompt chunks eager), NONE. On the CPU a layout with prompt chunks is captured when met the second
  # time (worker/model_runner.py says why). enforce_eager (vLLM's) is NONE.
  cudagraph_mode: str = "FULL"
  enforce_eager: bool = False
  # the persistent decode-layer kernel (CUDA, Hopper): on for the row counts its tuning table bounds; max_context
  # overrides the table's context bound for every row count
  decode_layer_kernel: bool = True
  decode_layer_max_context: int | None = None
  download_dir: str | None = None               # where hub models are downloaded (default: $TINYVLLM_CACHE/hub)
  # schedule step n+1 while step n runs, its in-flight tokens taken on the device; None: on for CUDA (where the copy of
  # the samples to the host can wait on an event), off elsewhere
  async_scheduling: bool | None = None
  extra: dict[str, Any] = field(default_factory=dict)

  def __post_init__(self) -> None:
    checks = [
      (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
      (self.load_format in ("auto", "safetensors", "dummy"), f"load_format must be auto, safetensors or dummy, got {self.load_format!r}"),
      (self.max_model_len is None or self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}"),
      (self.kv_cache in ("paged", "contiguous"), f"kv_cache must be paged or contiguous, got {self.kv_cache!r}"),
      (self.kv_cache_dtype in KV_CACHE_DTYPES,
       f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"),
      (self.scheduler in ("continuous", "static"), f"scheduler must be continuous or static, got {self.scheduler!r}"),
      (self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, f"block_size must be a power of two, got {self.block_size}"),
      (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
      (self.kv_cache_memory is None or self.kv_cache_memory > 0, f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}"),
      (0 < self.gpu_memory_utilization <= 1, f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"),
      (self.num_gpu_blocks is None or self.num_gpu_blocks >= 1, f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}"),
      (self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0"),
      (self.cuda_graph_sizes is None or all(b >= 1 for b in self.cuda_graph_sizes),
       f"cuda_graph_sizes must be batch sizes >= 1, got {self.cuda_graph_sizes}"),
      (self.attention_backend in ATTENTION_BACKENDS,
       f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"),
      (isinstance(self.cudagraph_mode, str) and self.cudagraph_mode.upper() in CUDAGRAPH_MODES,
       f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got {self.cudagraph_mode!r}"),
      (self.decode_layer_max_context is None or self.decode_layer_max_context >= 1,
       f"decode_layer_max_context must be >= 1, got {self.decode_layer_max_context}"),
    ]
    for ok, message in checks:
      if not ok: raise ConfigError(message)
    if self.device is None: self.device = os.environ.get("DEV") or None   # tinygrad's own variable
    self.cudagraph_mode = self.cudagraph_mode.upper()
    if self.enforce_eager: self.cudagraph_mode = "NONE"
    if self.max_num_batched_tokens is None: self.max_num_batched_tokens = max(2048, self.max_num_seqs)
    if self.max_num_batched_tokens < self.max_num_seqs:
      raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                        "so that every running sequence can decode in each step")

  def kernel_options(self) -> KernelOptions:
    return KernelOptions(self.decode_layer_kernel, self.decode_layer_max_context)

  def hub_settings(self) -> HubSettings:
    return HubSettings.from_environment(self.download_dir)


@dataclass(frozen=True)
class KernelOptions:
  """The hand-written kernels' engine-level choices."""
  decode_layer: bool = True                    # the persistent decode-layer kernel where the device's table bounds it
  decode_layer_max_context: int | None = None  # its context bound for every row count (None: the tuning table's)


@dataclass(frozen=True)
class HubSettings:
  """Where hub models are cached and how the hub is reached."""
  cache_dir: Path
  endpoint: str = "https://huggingface.co"
  token: str | None = None

  @staticmethod
  def from_environment(download_dir: str | None = None) -> HubSettings:
    default = Path(os.environ.get("TINYVLLM_CACHE", Path.home() / ".cache" / "tinyvllm")) / "hub"
    return HubSettings(Path(download_dir).expanduser() if download_dir else default,
                       os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/"), os.environ.get("HF_TOKEN") or None)


def cpu_c_compiler() -> str:
  """The C compiler tinygrad's CPU backend runs (its `CC`, default clang)."""
  return os.environ.get("CC", "clang")
