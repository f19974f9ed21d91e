"""Configuration: the engine's settings and the environment (the model's shape: tinyvllm/model_config.py).

This is the one module of the runtime package that reads environment variables (the CLI layer reads its own): `DEV`
(tinygrad's device), `CC` (the C compiler tinygrad's CPU backend runs) and `CUDA_VISIBLE_DEVICES` (which GPUs
data-parallel replicas may be given; set for each replica's process as vLLM does). The hub's (`HF_HOME`, `HF_HUB_CACHE`,
`HF_TOKEN`, `HF_ENDPOINT`, `HF_HUB_OFFLINE`) are read by huggingface_hub itself.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# the reasoning parsers' markers (vLLM's --reasoning-parser names): the model reasons between them, each one token
REASONING_MARKERS = {"qwen3": ("<think>", "</think>")}

DTYPES = ("auto", "bfloat16", "float16", "float32")
ATTENTION_BACKENDS = ("auto", "portable", "cuda", "metal")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")   # vLLM's names; fp8 = fp8_e4m3
CUDAGRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "NONE")   # vLLM's names: which step layouts are captured
SCHEDULING_POLICIES = ("fcfs", "priority")   # vLLM's: first come first served, or by each request's priority
PREEMPTION_MODES = ("recompute", "swap")     # vLLM's: what happens to a preempted sequence's KV blocks
# weight quantization (vLLM's names): a checkpoint's format (gptq, awq, fp8, compressed-tensors, modelopt, modelopt_fp4,
# fbgemm_fp8, bitsandbytes; gptq_marlin and awq_marlin name the same checkpoints), or a float checkpoint quantized at load (int8,
# int4, fp8; experts_int8: only a mixture of experts' experts); gguf: a .gguf model file's own blocks
QUANTIZATION_METHODS = ("gptq", "awq", "fp8", "compressed-tensors", "modelopt", "modelopt_fp4", "fbgemm_fp8", "bitsandbytes",
                        "int8", "int4", "experts_int8", "gguf", "gptq_marlin", "awq_marlin")
SPECULATIVE_METHODS = ("ngram", "draft_model")   # vLLM's speculative_config methods tinyvllm runs
MAX_LOGPROBS = 20   # the most top-k alternatives the sampler returns per token (vLLM's default max_logprobs)
# the generation_config.json fields that become request defaults (vLLM's list); max_new_tokens is max_tokens
GENERATION_CONFIG_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


DISTRIBUTED_EXECUTOR_BACKENDS = (None, "uni", "mp", "ray")


class ConfigError(ValueError):
  """A model folder or an engine setting cannot be used; the message says which and why."""


@dataclass(frozen=True)
class SpeculativeConfig:
  """Speculative decoding (vLLM's speculative_config): up to num_speculative_tokens proposals per sequence and step,
  verified by the target model in one pass; `ngram` finds them in the sequence's own tokens (prompt lookup),
  `draft_model` runs a smaller model with the same tokenizer."""
  method: str
  num_speculative_tokens: int
  model: str | None = None                  # the draft model (draft_model): a folder, hub id or preset
  prompt_lookup_min: int = 5                # ngram: the shortest and longest suffix matched (vLLM's defaults: 5 and 5)
  prompt_lookup_max: int = 5
  disable_by_batch_size: int | None = None  # no proposals while this many or more requests run (vLLM's key)

  KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
          "draft_tensor_parallel_size")

  @staticmethod
  def from_dict(raw: dict[str, Any]) -> SpeculativeConfig:
    """vLLM's keys: method (ngram, or draft_model, implied by model), model, num_speculative_tokens, prompt_lookup_min
    and _max (one given: the other takes its value), disable_by_batch_size, draft_tensor_parallel_size (1)."""
    if not isinstance(raw, dict): raise ConfigError(f"speculative_config must be a JSON object, got {raw!r}")
    if unknown := sorted(set(raw) - set(SpeculativeConfig.KEYS)):
      raise ConfigError(f"speculative_config: {', '.join(unknown)} not supported (tinyvllm takes {', '.join(SpeculativeConfig.KEYS)})")
    if raw.get("draft_tensor_parallel_size", 1) != 1:
      raise ConfigError("speculative_config: draft_tensor_parallel_size must be 1 (tinyvllm runs on one device)")
    method = raw.get("method") or ("draft_model" if raw.get("model") else None)
    if method not in SPECULATIVE_METHODS:
      raise ConfigError(f"speculative_config: method {method!r} is not supported (tinyvllm runs {', '.join(SPECULATIVE_METHODS)}; "
                        "draft_model is implied by a model)")
    k = raw.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
      raise ConfigError(f"speculative_config: num_speculative_tokens must be an integer in [1, 16], got {k!r}")
    if method == "draft_model" and not isinstance(raw.get("model"), str):
      raise ConfigError("speculative_config: method draft_model needs a model (a folder, hub id or preset)")
    lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    lo, hi = (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)
    if method == "ngram" and not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
      raise ConfigError(f"speculative_config: prompt_lookup_min ({lo!r}) and prompt_lookup_max ({hi!r}) must be integers "
                        "with 1 <= min <= max")
    off = raw.get("disable_by_batch_size")
    if off is not None and (not isinstance(off, int) or isinstance(off, bool) or off < 1):
      raise ConfigError(f"speculative_config: disable_by_batch_size must be an integer >= 1, got {off!r}")
    return SpeculativeConfig(method, k, raw.get("model"), lo, hi, off)


@dataclass
class EngineConfig:
  """Everything the engine needs besides the model's own config (vLLM's flag names)."""
  model: str
  dtype: str = "auto"
  device: str | None = None
  max_model_len: int | None = None
  load_format: str = "auto"
  quantization: str | None = None               # QUANTIZATION_METHODS; None: the checkpoint's own, if any
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
  scheduling_policy: str = "fcfs"               # fcfs | priority (each request's priority, lower first; core/scheduling_policy.py)
  # a preempted sequence's KV blocks: freed and recomputed later, or swapped out to swap_space GiB of host memory and
  # back (None: vLLM's way of saying the default, recompute)
  preemption_mode: str = "recompute"
  swap_space: float = 4                         # GiB (vLLM's default 4), used by preemption_mode swap
  # attention: hand-written kernels (cuda / metal) or tinygrad ops (portable); auto picks by device
  attention_backend: str = "auto"
  # step sizes captured at start-up (vLLM's capture sizes), bucketed to powers of two: decode steps of that many
  # sequences (up to max_num_seqs) and, on the hand-written kernels, steps with prompt chunks of that many tokens (up to
  # max_num_batched_tokens; at every query-run bucket). None: every bucket up to the larger of the two on a GPU, none
  # on the CPU; []: none (each layout is then captured when first met)
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
  # tensor parallelism on CUDA GPUs that reach each other's memory all-reduces with a kernel reading it (vLLM's custom
  # all-reduce); disabled, or elsewhere, with copies between the devices and adds
  disable_custom_all_reduce: bool = False
  # tinygrad's scheduling and codegen of each step built (its kernels' ASTs, rendered sources and binaries) kept in
  # tinygrad's disk cache (cache.db), so that a second start skips them (platform/compile_cache.py,
  # install_disk_caches); tinygrad's CACHELEVEL=0 turns it off too
  compile_cache: bool = True
  # hub ids (vLLM's names): downloaded through huggingface_hub into download_dir, default HF's cache (HF_HOME /
  # HF_HUB_CACHE), shared with every HF tool; revision: a branch, tag or commit; tokenizer_revision: the tokenizer's
  # (default: revision); hf_token: a token, or True for the stored one (default: HF_TOKEN or the stored one)
  download_dir: str | None = None
  revision: str | None = None
  tokenizer_revision: str | None = None
  hf_token: bool | str | None = None
  # schedule step n+1 while step n runs, its in-flight tokens taken on the device; None: on for CUDA (where the copy of
  # the samples to the host can wait on an event), off elsewhere
  async_scheduling: bool | None = None
  skip_tokenizer_init: bool = False             # no tokenizer: prompts are token ids, outputs carry ids and no text
  max_logprobs: int = MAX_LOGPROBS              # the most logprobs / prompt_logprobs one request may ask for
  # request sampling defaults: "auto" takes the model folder's generation_config.json, "vllm" none (SamplingParams'
  # own defaults), a folder that folder's file; override_generation_config's fields go on top
  generation_config: str = "auto"
  override_generation_config: dict[str, Any] = field(default_factory=dict)
  disable_log_stats: bool = False               # no periodic throughput / cache line in the log
  speculative_config: SpeculativeConfig | None = None   # speculative decoding (a dict is read as vLLM's keys)
  # custom logits processors (vLLM's): tinyvllm.layers.logits_processor.LogitsProcessor subclasses or their qualified
  # names ("package.module.Class"); an engine with any runs its steps eagerly
  logits_processors: list[Any] = field(default_factory=list)
  # structured output (vLLM's structured_outputs_config): backend auto or guidance (llguidance, the one there is),
  # disable_any_whitespace (JSON without the optional whitespace, for every request), disable_fallback (nothing to
  # fall back to: accepted)
  structured_outputs_config: dict[str, Any] = field(default_factory=dict)
  # the model reasons first (vLLM's --reasoning-parser: qwen3, <think>...</think>): structured output constrains what
  # follows the reasoning, not the reasoning itself (a prompt that closed the reasoning block: from the first token)
  reasoning_parser: str | None = None
  # parallelism (vLLM's): the weights, KV heads and KV cache split over tensor_parallel_size devices of one host
  # (tinygrad multi-device tensors, one scheduler); data_parallel_size engine replicas behind one server, each on its
  # own device(s); distributed_executor_backend places the replicas: mp (processes on this host) or ray (Ray actors on
  # the cluster's GPUs); None: mp; uni: this process (one replica only)
  tensor_parallel_size: int = 1
  data_parallel_size: int = 1
  distributed_executor_backend: str | None = None
  extra: dict[str, Any] = field(default_factory=dict)

  def __post_init__(self) -> None:
    checks = [
      (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
      (self.load_format in ("auto", "safetensors", "dummy"), f"load_format must be auto, safetensors or dummy, got {self.load_format!r}"),
      (self.max_model_len is None or self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}"),
      (self.quantization is None or self.quantization in QUANTIZATION_METHODS,
       f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}"),
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
       f"cuda_graph_sizes must be step sizes >= 1, got {self.cuda_graph_sizes}"),
      (self.attention_backend in ATTENTION_BACKENDS,
       f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"),
      (isinstance(self.cudagraph_mode, str) and self.cudagraph_mode.upper() in CUDAGRAPH_MODES,
       f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got {self.cudagraph_mode!r}"),
      (self.decode_layer_max_context is None or self.decode_layer_max_context >= 1,
       f"decode_layer_max_context must be >= 1, got {self.decode_layer_max_context}"),
      (self.hf_token is None or isinstance(self.hf_token, (bool, str)),
       f"hf_token must be a token string or True (the stored token), got {type(self.hf_token).__name__}"),
      (isinstance(self.max_logprobs, int) and 0 <= self.max_logprobs <= MAX_LOGPROBS,
       f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the sampler returns at most {MAX_LOGPROBS} alternatives a token), "
       f"got {self.max_logprobs!r}"),
      (isinstance(self.generation_config, str) and bool(self.generation_config),
       f"generation_config must be auto, vllm or a folder, got {self.generation_config!r}"),
    ]
    for ok, message in checks:
      if not ok: raise ConfigError(message)
    self._check_scheduling()
    self._check_parallelism()
    self._check_generation_override()
    if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
      self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
    if self.speculative_config is not None and self.scheduler == "static":
      raise ConfigError("speculative decoding needs the continuous scheduler (the static baseline decodes one token a step)")
    if self.speculative_config is not None and self.async_scheduling:
      raise ConfigError("speculative decoding runs with synchronous scheduling: the proposals for a step come from the "
                        "tokens of the step before it (leave async_scheduling unset or false)")
    if self.logits_processors is None: self.logits_processors = []
    if not isinstance(self.logits_processors, list) or not all(isinstance(p, (str, type)) for p in self.logits_processors):
      raise ConfigError(f"logits_processors must be a list of LogitsProcessor classes or qualified class names, got "
                        f"{self.logits_processors!r}")
    if self.logits_processors and self.speculative_config is not None:
      raise ConfigError("logits_processors do not run with speculative decoding (a verification's rows are not a batch "
                        "of requests): leave out one of them")
    self._check_structured_outputs_config()
    if self.device in ("auto", ""): self.device = None   # vLLM's "auto": detect it
    if self.device is None: self.device = os.environ.get("DEV") or None   # tinygrad's own variable
    self.cudagraph_mode = self.cudagraph_mode.upper()
    if self.enforce_eager: self.cudagraph_mode = "NONE"
    if self.max_num_batched_tokens is None: self.max_num_batched_tokens = max(2048, self.max_num_seqs)
    if self.max_num_batched_tokens < self.max_num_seqs:
      raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                        "so that every running sequence can decode in each step")

  def _check_scheduling(self) -> None:
    """The scheduling policy and the preemption mode, and the scheduler and cache they need."""
    if self.preemption_mode is None: self.preemption_mode = "recompute"
    checks = [
      (self.scheduling_policy in SCHEDULING_POLICIES,
       f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"),
      (self.preemption_mode in PREEMPTION_MODES,
       f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}"),
      (isinstance(self.swap_space, (int, float)) and not isinstance(self.swap_space, bool) and self.swap_space >= 0,
       f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}"),
      (self.scheduling_policy == "fcfs" or self.scheduler == "continuous",
       "scheduling_policy=priority needs the continuous scheduler (the static one admits whole batches first come, first served)"),
      (self.preemption_mode == "recompute" or (self.scheduler == "continuous" and self.kv_cache == "paged"),
       "preemption_mode=swap needs the continuous scheduler and the paged KV cache (the static scheduler never preempts, "
       "and the contiguous baseline's rows are not swapped)"),
      (self.preemption_mode == "recompute" or self.swap_space > 0, "preemption_mode=swap needs swap_space > 0 GiB"),
    ]
    for ok, message in checks:
      if not ok: raise ConfigError(message)

  def _check_parallelism(self) -> None:
    for name in ("tensor_parallel_size", "data_parallel_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
      raise ConfigError(f"distributed_executor_backend must be one of {', '.join(map(str, DISTRIBUTED_EXECUTOR_BACKENDS[1:]))}, "
                        f"got {self.distributed_executor_backend!r}")
    if self.distributed_executor_backend == "uni" and self.data_parallel_size > 1:
      raise ConfigError(f"distributed_executor_backend uni runs one engine in this process; data_parallel_size "
                        f"{self.data_parallel_size} needs mp or ray")

  def _check_structured_outputs_config(self) -> None:
    if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_MARKERS:
      raise ConfigError(f"reasoning_parser {self.reasoning_parser!r} is not available (tinyvllm has {', '.join(REASONING_MARKERS)})")
    config = self.structured_outputs_config
    if not isinstance(config, dict): raise ConfigError(f"structured_outputs_config must be a JSON object, got {config!r}")
    for key, value in config.items():
      if key == "backend" and value not in ("auto", "guidance"):
        raise ConfigError(f"structured_outputs_config: backend {value!r} is not available (tinyvllm runs guidance: llguidance)")
      if key in ("disable_any_whitespace", "disable_fallback") and not isinstance(value, bool):
        raise ConfigError(f"structured_outputs_config: {key} must be true or false, got {value!r}")
      if key not in ("backend", "disable_any_whitespace", "disable_fallback"):
        raise ConfigError(f"structured_outputs_config: {key} is not supported (tinyvllm takes backend, disable_any_whitespace, "
                          "disable_fallback)")

  def _check_generation_override(self) -> None:
    override = self.override_generation_config
    if not isinstance(override, dict):
      raise ConfigError(f"override_generation_config must be a dict of generation_config.json fields, got {override!r}")
    if unknown := sorted(set(override) - set(GENERATION_CONFIG_FIELDS)):
      raise ConfigError(f"override_generation_config: {', '.join(unknown)} not among the sampling fields it can set "
                        f"({', '.join(GENERATION_CONFIG_FIELDS)})")

  def kernel_options(self) -> KernelOptions:
    return KernelOptions(self.decode_layer_kernel, self.decode_layer_max_context, not self.disable_custom_all_reduce)

  def hub_settings(self) -> HubSettings:
    return HubSettings(self.download_dir, self.hf_token)


@dataclass(frozen=True)
class KernelOptions:
  """The hand-written kernels' engine-level choices."""
  decode_layer: bool = True                    # the persistent decode-layer kernel where the device's table bounds it
  decode_layer_max_context: int | None = None  # its context bound for every row count (None: the tuning table's)
  custom_all_reduce: bool = True               # tensor parallelism's peer all-reduce kernel where the GPUs allow it


@dataclass(frozen=True)
class HubSettings:
  """How hub ids are fetched; the endpoint, offline mode and the default token and cache come from huggingface_hub's
  own environment variables."""
  cache_dir: str | None = None       # None: HF's cache
  token: bool | str | None = None    # None: HF_TOKEN or the stored token; True: the stored one


def cpu_c_compiler() -> str:
  """The C compiler tinygrad's CPU backend runs (its `CC`, default clang)."""
  return os.environ.get("CC", "clang")


def cuda_visible_devices() -> list[str] | None:
  """CUDA_VISIBLE_DEVICES's entries (None: it is not set, every GPU is visible)."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  return None if visible is None else [d.strip() for d in visible.split(",") if d.strip()]


@contextlib.contextmanager
def environment_for_children(env: dict[str, str]) -> Iterator[None]:
  """os.environ with `env` set while inside, for a child process spawned there (vLLM gives each data-parallel engine
  its GPUs so, through CUDA_VISIBLE_DEVICES); restored after."""
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None: os.environ.pop(k, None)
      else: os.environ[k] = v
