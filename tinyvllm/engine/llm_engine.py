"""LLMEngine: add_request / step / abort_request over the scheduler, model runner and output processor."""
from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.backend.interface import FP8_KV_CACHE
from tinyvllm.config import ConfigError, EngineConfig, ModelConfig
from tinyvllm.core.async_scheduling import make_scheduler
from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.contiguous_allocator import ContiguousAllocator
from tinyvllm.core.scheduler import SchedulerConfig
from tinyvllm.core.scheduler_output import SchedulerOutput
from tinyvllm.core.sequence import Request, Sequence
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.kernels.selection import BackendRequest, select_backend
from tinyvllm.layers.fp8 import FP8_STORAGE
from tinyvllm.model.hub import resolve_model
from tinyvllm.model.loader import NAME_OF_DTYPE, load_model, resolve_dtype
from tinyvllm.model.presets import PRESETS
from tinyvllm.outputs import Logprob, RequestOutput
from tinyvllm.platform import tinygrad_compat as compat
from tinyvllm.platform.device import check_dtype, is_cpu, select_device
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm.tokenizer import Tokenizer, load_tokenizer
from tinyvllm.worker.cache_sizing import num_kv_blocks
from tinyvllm.worker.host_io import reads_back_asynchronously
from tinyvllm.worker.input_batch import bucket
from tinyvllm.worker.kv_cache import KVCache
from tinyvllm.worker.model_runner import LaunchedStep, ModelRunner, StepResult, freeze_long_lived_objects

PromptType = str | list[int] | dict
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class PromptError(ValueError):
  """A request cannot be served as given (empty, too long for the context or the cache, not tokenizable)."""


@dataclass
class InFlightStep:
  sched: SchedulerOutput
  launched: LaunchedStep


@dataclass
class LocatedModel:
  config: ModelConfig
  folder: Path | None


def locate_model(cfg: EngineConfig) -> LocatedModel:
  """A dummy preset name needs no folder; anything else is a local folder or a hub id."""
  if cfg.load_format == "dummy" and cfg.model in PRESETS:
    return LocatedModel(ModelConfig.from_dict(PRESETS[cfg.model], f"preset {cfg.model}"), None)
  folder = resolve_model(cfg.model, cfg.hub_settings())
  return LocatedModel(ModelConfig.from_folder(folder), folder)


def log(message: str) -> None: print(f"[tinyvllm] {message}", file=sys.stderr, flush=True)


class LLMEngine:
  def __init__(self, config: EngineConfig):
    start = time.perf_counter()
    self.config = config
    compat.check()   # a tinygrad that lacks an internal we use fails here, not mid-step
    compat.install()
    self.device = select_device(config.device)
    compat.check(self.device)
    located = locate_model(config)
    self.model_config = mc = located.config
    self.max_model_len = self._max_model_len(config, mc)
    self.tokenizer = self._tokenizer(config, located.folder)
    self.dtype = resolve_dtype(config.dtype, mc, self.device)
    check_dtype(self.device, self.dtype)
    self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else FP8_STORAGE
    log(f"backend {self.device}, dtype {self.dtype.name}, model {mc.architecture} from {located.folder or config.model}")
    request = BackendRequest(NAME_OF_DTYPE[self.dtype], "auto" if config.kv_cache_dtype == "auto" else FP8_KV_CACHE, mc.head_dim,
                             config.block_size)
    backend = select_backend(config.attention_backend, self.device, request, config.kernel_options())   # before loading
    log(f"attention backend {backend.describe()}")
    self.model = load_model(mc, located.folder, config.load_format, self.dtype, self.device, self.max_model_len, backend,
                            config.seed)
    self.allocator = self._allocator()
    self.kv_cache = KVCache(mc, self.allocator.num_blocks, self.allocator.block_size, self.kv_dtype, self.device)
    sched_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens or 0, config.enable_chunked_prefill,
                                   config.long_prefill_token_threshold)
    if not config.enable_chunked_prefill and sched_config.max_num_batched_tokens < self.max_model_len:
      raise ConfigError(f"without chunked prefill, max_num_batched_tokens ({sched_config.max_num_batched_tokens}) must be "
                        f">= max_model_len ({self.max_model_len})")
    self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                             else reads_back_asynchronously(self.device))
    self.scheduler = make_scheduler(config.scheduler, self.async_scheduling, self.allocator, sched_config)
    log(f"{config.scheduler} scheduler, max {config.max_num_seqs} sequences, {sched_config.max_num_batched_tokens} tokens a step"
        f"{', asynchronous scheduling' if self.async_scheduling else ''}")
    self.runner = ModelRunner(self.model, self.kv_cache, config.max_num_seqs, self.max_model_len, config.cudagraph_mode,
                              capture_repeated_prompt_layouts=is_cpu(self.device))
    self._in_flight: InFlightStep | None = None
    eos = frozenset(mc.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else frozenset())
    self.output_processor = OutputProcessor(self.tokenizer, eos, self.max_model_len)
    self.requests: dict[str, Request] = {}
    self._seed_rng = random.Random(config.seed)
    self._warm_up(config)
    freeze_long_lived_objects()
    log(f"engine ready in {time.perf_counter() - start:.1f} s")

  def _warm_up(self, config: EngineConfig) -> None:
    sizes = config.cuda_graph_sizes
    if sizes is None: sizes = [] if is_cpu(self.device) else [1 << i for i in range(bucket(config.max_num_seqs).bit_length())]
    t = time.perf_counter()
    captured = self.runner.warm_up(sizes)
    self.warm_up_seconds = time.perf_counter() - t
    if captured: log(f"captured {captured} decode batch sizes in {self.warm_up_seconds:.1f} s (other step shapes are captured "
                     "when first met)")

  @staticmethod
  def _max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    if config.max_model_len is None: return mc.max_position_embeddings
    if config.max_model_len > mc.max_position_embeddings:
      raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's context of {mc.max_position_embeddings} tokens")
    return config.max_model_len

  @staticmethod
  def _tokenizer(config: EngineConfig, folder: Path | None) -> Tokenizer | None:
    """--tokenizer, else the model folder's own; a folder without tokenizer files serves token-id prompts only."""
    if config.tokenizer: return load_tokenizer(resolve_model(config.tokenizer, config.hub_settings()))
    if folder is None or not any((folder / f).exists() for f in TOKENIZER_FILES):
      log("no tokenizer: prompts must be token ids")
      return None
    return load_tokenizer(folder)

  def _allocator(self) -> BlockManager | ContiguousAllocator:
    cfg, per_token = self.config, KVCache.bytes_per_token(self.model_config, self.kv_dtype)
    if cfg.kv_cache == "contiguous":
      rows = min(cfg.max_num_seqs, num_kv_blocks(cfg, self.device, per_token * self.max_model_len, self.max_model_len,
                                                 self.max_model_len))
      log(f"contiguous KV cache: {rows} rows x {self.max_model_len} tokens ({rows * self.max_model_len * per_token / 2**20:.1f} MiB)")
      return ContiguousAllocator(rows, self.max_model_len)
    blocks = num_kv_blocks(cfg, self.device, per_token * cfg.block_size, cfg.block_size, self.max_model_len)
    kind = "FP8 E4M3" if cfg.kv_cache_dtype != "auto" else self.kv_dtype.name
    log(f"paged {kind} KV cache: {blocks} blocks of {cfg.block_size} tokens ({blocks * cfg.block_size * per_token / 2**20:.1f} MiB), "
        f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}")
    return BlockManager(blocks, cfg.block_size, cfg.enable_prefix_caching)

  # ---- requests ----
  def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
    if isinstance(prompt, dict):
      if "prompt_token_ids" in prompt: return prompt.get("prompt"), self.tokenize_prompt(list(prompt["prompt_token_ids"]))[1]
      if "prompt" not in prompt: raise PromptError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
      prompt = prompt["prompt"]
    if isinstance(prompt, str):
      if self.tokenizer is None: raise PromptError("this model has no tokenizer: pass token ids, or --tokenizer")
      return prompt, self.tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
      bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
      if bad: raise PromptError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {self.model_config.vocab_size})")
      return None, list(prompt)
    raise PromptError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

  def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
    """Refuse, before anything is allocated, what could never run."""
    if not prompt_ids: raise PromptError("the prompt is empty (no tokens)")
    n = len(prompt_ids)
    if n >= self.max_model_len:
      raise PromptError(f"prompt has {n} tokens, the model's context is {self.max_model_len}: no room to generate")
    max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
    if n + max_tokens > self.max_model_len:
      raise PromptError(f"prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} exceeds "
                        f"the model's context of {self.max_model_len} tokens")
    need = self._blocks_needed(n, max_tokens, params.n)
    if need > self.allocator.num_blocks:
      raise PromptError(f"request needs {need} KV cache blocks ({n} prompt + {max_tokens} new tokens, n={params.n}) "
                        f"but the whole cache holds {self.allocator.num_blocks}")
    if params.stop_strings and self.tokenizer is None: raise PromptError("stop strings need a tokenizer")

  def _blocks_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
    if isinstance(self.allocator, ContiguousAllocator): return n
    blocks = self.allocator.blocks_for
    return blocks(prompt_len) + n * (blocks(prompt_len + max_tokens) - blocks(prompt_len) + 1)

  def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> Request:
    params = params or SamplingParams()
    if request_id in self.requests: raise ValueError(f"request id {request_id!r} is already in use")
    text, prompt_ids = self.tokenize_prompt(prompt)
    self.check_request(prompt_ids, params)
    if params.max_tokens is None: params.max_tokens = self.max_model_len - len(prompt_ids)
    base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
    seqs = [Sequence(request_id, prompt_ids, params, seed=hash((base_seed, i)) if i else base_seed, index=i)
            for i in range(params.n)]
    request = Request(request_id, text, prompt_ids, params, seqs)
    self.requests[request_id] = request
    for seq in seqs: self.output_processor.register(seq)
    self.scheduler.add(seqs)
    return request

  def abort_request(self, request_id: str) -> None:
    """Stop a request wherever it is and free everything it holds."""
    request = self.requests.pop(request_id, None)
    if request is None: return
    self.scheduler.abort(request.seqs)
    for seq in request.seqs: self.output_processor.release(seq)

  def has_unfinished_requests(self) -> bool: return bool(self.requests) or self._in_flight is not None

  def reset_prefix_cache(self) -> None:
    """Forget every cached prefix block (blocks in use stay where they are)."""
    self.scheduler.reset_prefix_cache()

  def compute_logits(self, prompt_ids: list[int]) -> np.ndarray:
    """The model's next-token logits after prompt_ids ([vocab], float32); runs on free cache space, outside the queue."""
    self.check_request(list(prompt_ids), SamplingParams(max_tokens=1))
    with self.scheduler.scoring(prompt_ids) as sched: return self.runner.logits(sched)[0]

  # ---- the loop
  def step(self) -> list[RequestOutput]:
    """Schedule and launch one step; return the outputs of the requests that progressed in the step that finished.

    With asynchronous scheduling the finished step is the previous one: this step was scheduled and launched while
    it ran, its tokens still in flight counted as placeholders (core/async_scheduling.py) and read on the device."""
    outputs = []
    if self._in_flight is not None and not self._in_flight.launched.chains: outputs = self._finish_in_flight()
    sched = self.scheduler.schedule()
    launched = InFlightStep(sched, self.runner.launch(sched)) if sched else None
    if self._in_flight is not None: outputs += self._finish_in_flight()
    self._in_flight = launched
    if launched is not None and not self.async_scheduling: outputs += self._finish_in_flight()
    return outputs

  def _finish_in_flight(self) -> list[RequestOutput]:
    """Wait for the step in flight, land its tokens, and retire what finished."""
    flight, self._in_flight = self._in_flight, None
    assert flight is not None
    result = flight.launched.result()
    judge = lambda seq, token, row: self.output_processor.process_token(seq, token, self._logprobs(result, row, seq))
    landed = self.scheduler.update_from_output(flight.sched, result.token_ids, judge)
    touched = {seq.request_id: self.requests[seq.request_id] for seq in landed}
    outputs = [self.output_processor.request_output(r) for r in touched.values()
               if r.params.output_kind is not RequestOutputKind.FINAL_ONLY or r.is_finished]
    for request in touched.values():
      if request.is_finished: self._retire(request)
    return outputs

  def _logprobs(self, result: StepResult, row: int, seq: Sequence) -> dict[int, Logprob] | None:
    if result.logprobs is None or seq.params.logprobs is None: return None
    lp, k = result.logprobs, seq.params.logprobs
    entries = {int(t): Logprob(float(v), r + 1) for r, (t, v) in enumerate(zip(lp.top_ids[row][:k], lp.top_logprobs[row][:k],
                                                                               strict=True))}
    token = result.token_ids[row]
    entries.setdefault(token, Logprob(float(lp.logprob[row]), int(lp.rank[row])))
    if self.tokenizer is not None:
      for token_id, entry in entries.items(): entry.decoded_token = self.tokenizer.token_bytes(token_id).decode(errors="replace")
    return entries

  def _retire(self, request: Request) -> None:
    for seq in request.seqs: self.output_processor.release(seq)
    del self.requests[request.request_id]
