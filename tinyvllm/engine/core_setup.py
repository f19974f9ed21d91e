"""Building what the EngineCore runs from an EngineConfig: the device, the model (located, its backend chosen, loaded),
the KV cache and its allocator, the scheduler, the model runner and its start-up captures."""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from tinygrad.dtype import DType

from tinyvllm.backend.interface import FP8_KV_CACHE, ComputeBackend
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.core.async_scheduling import make_scheduler
from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.contiguous_allocator import ContiguousAllocator
from tinyvllm.core.scheduler import SchedulerBase, SchedulerConfig
from tinyvllm.engine.draft_model import DraftModelSpeculator
from tinyvllm.engine.speculator import NgramSpeculator
from tinyvllm.kernels.selection import BackendRequest, select_backend
from tinyvllm.layers.fp8 import FP8_STORAGE
from tinyvllm.layers.tensor_parallel import TensorParallelGroup, group_devices
from tinyvllm.model.gguf.config import gguf_model_config
from tinyvllm.model.gguf.hub import gguf_model_file
from tinyvllm.model.gguf.loader import load_gguf_model
from tinyvllm.model.gguf.reader import GGUFFile
from tinyvllm.model.hub import resolve_model
from tinyvllm.model.llama import TransformerLM
from tinyvllm.model.loader import NAME_OF_DTYPE, load_model, resolve_dtype
from tinyvllm.model.presets import PRESETS
from tinyvllm.model.quantization.config import resolve as resolve_quantization
from tinyvllm.model.sharding import check_shardable, local_config
from tinyvllm.model_config import ModelConfig
from tinyvllm.platform import compile_cache
from tinyvllm.platform import tinygrad_compat as compat
from tinyvllm.platform.device import check_dtype, is_cpu, opens, select_device
from tinyvllm.worker.cache_sizing import num_kv_blocks, num_swap_blocks
from tinyvllm.worker.host_io import reads_back_asynchronously
from tinyvllm.worker.input_batch import bucket
from tinyvllm.worker.kv_cache import KVCache
from tinyvllm.worker.logits_processors import LogitsProcessors, processor_class
from tinyvllm.worker.model_runner import ModelRunner

_log_label = ["tinyvllm"]   # one of several API server processes says which


def log(message: str) -> None: print(f"[{_log_label[0]}] {message}", file=sys.stderr, flush=True)


def set_log_label(label: str) -> None:
  """What this process's log lines start with (one of several API servers: 'tinyvllm api server 1')."""
  _log_label[0] = label


@dataclass
class LocatedModel:
  config: ModelConfig
  folder: Path | None
  gguf: GGUFFile | None = None   # a .gguf model file: config, weights and tokenizer all come from it


def locate_model(cfg: EngineConfig) -> LocatedModel:
  """A dummy preset name needs no folder; a GGUF model (a .gguf file, or REPO_ID:QUANT_TYPE on the hub) holds
  everything; anything else is a local folder or a hub id."""
  if cfg.load_format == "dummy" and cfg.model in PRESETS:
    return LocatedModel(ModelConfig.from_dict(PRESETS[cfg.model], f"preset {cfg.model}"), None)
  if (path := gguf_model_file(cfg.model, cfg.hub_settings(), cfg.revision)) is not None:
    if cfg.load_format == "safetensors": raise ConfigError(f"--load-format safetensors cannot read the GGUF file {cfg.model!r}")
    gguf = GGUFFile(path)
    return LocatedModel(gguf_model_config(gguf), None, gguf)
  folder = resolve_model(cfg.model, cfg.hub_settings(), cfg.revision, weights=cfg.load_format != "dummy")
  return LocatedModel(ModelConfig.from_folder(folder), folder)


@dataclass
class EngineParts:
  device: str
  model_config: ModelConfig
  model_folder: Path | None
  max_model_len: int
  dtype: DType
  kv_dtype: DType
  model: TransformerLM
  allocator: BlockManager | ContiguousAllocator
  kv_cache: KVCache
  scheduler: SchedulerBase
  runner: ModelRunner
  async_scheduling: bool
  warm_up_seconds: float
  speculator: NgramSpeculator | DraftModelSpeculator | None = None


@dataclass
class DraftModel:
  """Draft-model speculation's model, loaded before the KV cache is sized (its cache shares the target's blocks)."""
  config: ModelConfig
  model: TransformerLM


def build_engine_parts(config: EngineConfig) -> EngineParts:
  compat.check()   # a tinygrad that lacks an internal we use fails here, not mid-step
  compat.install()
  compile_cache.install_disk_caches(config.compile_cache)
  device = select_device(config.device)
  compat.check(device)
  located = locate_model(config)
  mc = located.config
  max_model_len = check_max_model_len(config, mc)
  dtype = resolve_dtype(config.dtype, mc, device)
  check_dtype(device, dtype)
  kv_dtype = dtype if config.kv_cache_dtype == "auto" else FP8_STORAGE
  log(f"backend {device}, dtype {dtype.name}, model {mc.architecture} from {located.folder or config.model}")
  request = BackendRequest(NAME_OF_DTYPE[dtype], "auto" if config.kv_cache_dtype == "auto" else FP8_KV_CACHE, mc.head_dim,
                           config.block_size, mc.hidden_act)
  backend = select_backend(config.attention_backend, device, request, config.kernel_options())   # before loading
  log(f"attention backend {backend.describe()}")
  group = tensor_parallel_group(config, mc, device)
  model = (load_weights(config, mc, located.folder, dtype, device, max_model_len, backend, group) if located.gguf is None
           or config.load_format == "dummy" else load_gguf_weights(config, mc, located.gguf, dtype, device, max_model_len, backend,
                                                                   group))
  draft = load_draft(config, mc, dtype, device, max_model_len)
  shard = mc if group is None else local_config(mc, group.size)   # what one device holds of the KV cache
  allocator = make_allocator(config, shard, device, kv_dtype, max_model_len, draft.config if draft is not None else None)
  swap_blocks = num_swap_blocks(config, KVCache.bytes_per_token(mc, kv_dtype) * config.block_size)
  kv_cache = KVCache(shard, allocator.num_blocks, allocator.block_size, kv_dtype, device if group is None else group.devices,
                     swap_blocks)
  sched_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens or 0, config.enable_chunked_prefill,
                                 config.long_prefill_token_threshold, config.scheduling_policy, config.preemption_mode,
                                 swap_blocks)
  if not config.enable_chunked_prefill and sched_config.max_num_batched_tokens < max_model_len:
    raise ConfigError(f"without chunked prefill, max_num_batched_tokens ({sched_config.max_num_batched_tokens}) must be "
                      f">= max_model_len ({max_model_len})")
  spec = config.speculative_config
  async_scheduling = config.async_scheduling if config.async_scheduling is not None else reads_back_asynchronously(device)
  if spec is not None and async_scheduling and config.async_scheduling is None:
    log("speculative decoding: scheduling is synchronous (each step's proposals follow the tokens of the step before)")
    async_scheduling = False
  scheduler = make_scheduler(config.scheduler, async_scheduling, allocator, sched_config)
  log(f"{config.scheduler} scheduler ({config.scheduling_policy}), max {config.max_num_seqs} sequences, "
      f"{sched_config.max_num_batched_tokens} tokens a step{', asynchronous scheduling' if async_scheduling else ''}, "
      f"preemption by {config.preemption_mode}"
      + (f" ({swap_blocks} blocks of swap space, {config.swap_space} GiB)" if swap_blocks else ""))
  runner = ModelRunner(model, kv_cache, config.max_num_seqs, max_model_len, config.cudagraph_mode,
                       capture_repeated_prompt_layouts=is_cpu(device),
                       num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
                       logits_processors=logits_processors(config, device))
  warm_up_seconds = warm_up(config, runner, device, sched_config.max_num_batched_tokens)
  speculator = make_speculator(config, max_model_len, draft, allocator, kv_dtype, device, sched_config.max_num_batched_tokens)
  return EngineParts(device, mc, located.folder, max_model_len, dtype, kv_dtype, model, allocator, kv_cache, scheduler, runner,
                     async_scheduling, warm_up_seconds, speculator)


def tensor_parallel_group(config: EngineConfig, mc: ModelConfig, device: str) -> TensorParallelGroup | None:
  """The devices tensor parallelism splits the model over (None: one device), after checking that it can."""
  tp = config.tensor_parallel_size
  if tp == 1: return None
  check_shardable(mc, tp)
  refusals = [(config.preemption_mode == "swap", "--preemption-mode swap"),
              (config.speculative_config is not None and config.speculative_config.method == "draft_model", "a draft model")]
  for refused, what in refusals:
    if refused: raise ConfigError(f"tensor parallelism with {what} is not supported yet (tensor_parallel_size {tp})")
  devices = group_devices(device, tp)
  missing = [d for d in devices if not opens(d)]
  if missing: raise ConfigError(f"tensor_parallel_size {tp} needs devices {', '.join(devices)}; {', '.join(missing)} cannot be opened")
  log(f"tensor parallel over {tp} devices ({', '.join(devices)}): {mc.num_heads // tp} query heads, "
      f"{max(1, mc.num_kv_heads // tp)} KV heads and {mc.intermediate_size // tp} MLP columns each")
  return TensorParallelGroup(devices)


def logits_processors(config: EngineConfig, device: str) -> LogitsProcessors | None:
  """The custom logits processors, built (None: none configured); steps then run eagerly."""
  if not config.logits_processors: return None
  try: classes = [processor_class(spec) for spec in config.logits_processors]
  except ValueError as e: raise ConfigError(str(e)) from None
  log(f"logits processors: {', '.join(c.__qualname__ for c in classes)} (every step runs eagerly)")
  return LogitsProcessors(classes, config, device)


def make_speculator(config: EngineConfig, max_model_len: int, draft: DraftModel | None, allocator, kv_dtype: DType,
                    device: str, max_num_batched_tokens: int) -> NgramSpeculator | DraftModelSpeculator | None:
  """The proposer speculative_config asks for; a draft model gets its KV cache (the target's blocks) and its runner."""
  spec = config.speculative_config
  if spec is None: return None
  stops = f", off from {spec.disable_by_batch_size} running requests" if spec.disable_by_batch_size else ""
  if draft is None:
    log(f"speculative decoding: ngram, {spec.num_speculative_tokens} proposals a step, suffixes of "
        f"{spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens{stops}")
    return NgramSpeculator(spec, max_model_len)
  kv_cache = KVCache(draft.config, allocator.num_blocks, allocator.block_size, kv_dtype, device)
  runner = ModelRunner(draft.model, kv_cache, config.max_num_seqs, max_model_len, config.cudagraph_mode,
                       capture_repeated_prompt_layouts=is_cpu(device))
  warm_up(config, runner, device, max_num_batched_tokens)
  log(f"speculative decoding: draft model {spec.model} ({draft.config.num_layers} layers, KV cache "
      f"{kv_cache.nbytes / 2**20:.1f} MiB), {spec.num_speculative_tokens} proposals a step{stops}")
  return DraftModelSpeculator(spec, max_model_len, runner, max_num_batched_tokens)


def load_draft(config: EngineConfig, mc: ModelConfig, dtype: DType, device: str, max_model_len: int) -> DraftModel | None:
  """The draft model of draft-model speculation, in the target's dtype; it must share the target's vocabulary and cover
  its context."""
  spec = config.speculative_config
  if spec is None or spec.method != "draft_model": return None
  assert spec.model is not None
  draft_config = replace(config, model=spec.model, quantization=None, tokenizer=None, revision=None, speculative_config=None)
  located = locate_model(draft_config)
  dmc = located.config
  if dmc.vocab_size != mc.vocab_size:
    raise ConfigError(f"speculative_config: the draft model {spec.model} has a vocabulary of {dmc.vocab_size} tokens, the "
                      f"target {mc.vocab_size}: a draft must share the target's tokenizer")
  if dmc.max_position_embeddings < max_model_len:
    raise ConfigError(f"speculative_config: the draft model {spec.model} has a context of {dmc.max_position_embeddings} tokens, "
                      f"shorter than max_model_len ({max_model_len}): pass --max-model-len {dmc.max_position_embeddings} (or less)")
  request = BackendRequest(NAME_OF_DTYPE[dtype], "auto" if config.kv_cache_dtype == "auto" else FP8_KV_CACHE, dmc.head_dim,
                           config.block_size, dmc.hidden_act)
  backend = select_backend(config.attention_backend, device, request, config.kernel_options())
  model = (load_weights(draft_config, dmc, located.folder, dtype, device, max_model_len, backend) if located.gguf is None
           or config.load_format == "dummy" else load_gguf_weights(draft_config, dmc, located.gguf, dtype, device, max_model_len, backend))
  return DraftModel(dmc, model)


def load_weights(config: EngineConfig, mc: ModelConfig, folder: Path | None, dtype: DType, device: str, max_model_len: int,
                 backend: ComputeBackend, group: TensorParallelGroup | None = None) -> TransformerLM:
  """The model, its linears quantized as the checkpoint or --quantization says; logs the format and the weights' bytes."""
  quantization = resolve_quantization(config.quantization, mc.quantization_config, str(folder or config.model))
  if quantization is not None and quantization.method == "experts_int8" and mc.moe is None:
    raise ConfigError(f"--quantization experts_int8 quantizes a mixture of experts' experts, and {mc.architecture} has none "
                      "(int8 quantizes every linear)")
  loaded = load_model(mc, folder, config.load_format, dtype, device, max_model_len, backend, config.seed, quantization, group,
                      kv_fp8=config.kv_cache_dtype != "auto")
  if quantization is not None:
    weights = loaded.model.weights
    log(f"weights: {quantization.describe()} linears, {weights.nbytes() / 2**20:.1f} MiB in all "
        f"({weights.unquantized_bytes() / 2**20:.1f} MiB unquantized in {dtype.name})")
  for notice in loaded.notices: log(notice)
  return loaded.model


def load_gguf_weights(config: EngineConfig, mc: ModelConfig, gguf: GGUFFile, dtype: DType, device: str, max_model_len: int,
                      backend: ComputeBackend, group: TensorParallelGroup | None = None) -> TransformerLM:
  """The model from a GGUF file (split over `group`), its quantized linears kept packed; logs the formats and the
  weights' bytes."""
  if config.quantization not in (None, "gguf"):
    raise ConfigError(f"--quantization {config.quantization} does not apply to a GGUF file ({gguf.path}): its weights are "
                      "already quantized (pass --quantization gguf or none)")
  loaded = load_gguf_model(mc, gguf, dtype, device, max_model_len, backend, group)
  weights = loaded.model.weights
  for notice in loaded.notices: log(notice)
  log(f"weights: {weights.nbytes() / 2**20:.1f} MiB in all ({weights.unquantized_bytes() / 2**20:.1f} MiB unquantized in {dtype.name})")
  return loaded.model


def warm_up(config: EngineConfig, runner: ModelRunner, device: str, max_num_batched_tokens: int) -> float:
  """Capture the step layouts of the configured sizes; returns the seconds it took."""
  sizes = config.cuda_graph_sizes
  if sizes is None:
    top = bucket(max(config.max_num_seqs, max_num_batched_tokens))
    sizes = [] if is_cpu(device) else [1 << i for i in range(top.bit_length())]
  before = {kind: replace(stats) for kind, stats in compile_cache.disk_cache_stats.items()}
  done = runner.warm_up(sizes, max_num_batched_tokens)
  if done.decode or done.prompt:
    contexts = runner.buckets.min_context
    read, wrote = ({kind: getattr(stats, field) - getattr(before[kind], field) for kind, stats in compile_cache.disk_cache_stats.items()}
                   for field in ("hits", "stores"))
    cached = (f"; compile cache: read {read['schedule']} schedules and {read['program']} kernels, wrote {wrote['schedule']} "
              f"and {wrote['program']}" if config.compile_cache else "")
    log(f"captured {done.decode} decode steps and {done.prompt} prompt-step layouts in {done.seconds:.1f} s "
        f"(contexts up to {contexts} tokens; a longer context's layouts are captured when first met{cached})")
  return done.seconds


def check_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
  if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
    raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's context of {mc.max_position_embeddings} tokens")
  max_model_len = config.max_model_len or mc.max_position_embeddings
  # attention is never windowed here: a window shorter than the context would change what the model attends to
  if mc.sliding_window is not None and max_model_len > mc.sliding_window:
    raise ConfigError(f"the model's sliding_window ({mc.sliding_window} tokens) is shorter than max_model_len ({max_model_len}), "
                      f"and sliding-window attention is not implemented: pass --max-model-len {mc.sliding_window} (or less)")
  return max_model_len


def make_allocator(cfg: EngineConfig, mc: ModelConfig, device: str, kv_dtype: DType, max_model_len: int,
                   draft: ModelConfig | None = None) -> BlockManager | ContiguousAllocator:
  """The cache's blocks, sized for the target's K/V and, with a draft model, the draft's (its cache has the same blocks)."""
  per_token = KVCache.bytes_per_token(mc, kv_dtype) + (KVCache.bytes_per_token(draft, kv_dtype) if draft is not None else 0)
  if cfg.kv_cache == "contiguous":
    rows = min(cfg.max_num_seqs, num_kv_blocks(cfg, device, per_token * max_model_len, max_model_len, max_model_len))
    log(f"contiguous KV cache: {rows} rows x {max_model_len} tokens ({rows * max_model_len * per_token / 2**20:.1f} MiB)")
    return ContiguousAllocator(rows, max_model_len)
  blocks = num_kv_blocks(cfg, device, per_token * cfg.block_size, cfg.block_size, max_model_len)
  kind = "FP8 E4M3" if cfg.kv_cache_dtype != "auto" else kv_dtype.name
  log(f"paged {kind} KV cache: {blocks} blocks of {cfg.block_size} tokens ({blocks * cfg.block_size * per_token / 2**20:.1f} MiB), "
      f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}")
  return BlockManager(blocks, cfg.block_size, cfg.enable_prefix_caching)
