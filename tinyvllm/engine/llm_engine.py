"""LLMEngine: add_request / step / abort_request over the scheduler, model runner and output processor."""
from __future__ import annotations

import random
import sys
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.config import ConfigError, EngineConfig, ModelConfig
from tinyvllm.core.contiguous_allocator import ContiguousAllocator
from tinyvllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from tinyvllm.core.sequence import Request, Sequence, SequenceStatus
from tinyvllm.core.static_scheduler import StaticScheduler
from tinyvllm.device import select_device
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.model.hub import resolve_model
from tinyvllm.model.loader import load_model, resolve_dtype
from tinyvllm.model.presets import PRESETS
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import Tokenizer, load_tokenizer
from tinyvllm.worker.kv_cache import KVCache
from tinyvllm.worker.model_runner import ModelRunner

PromptType = str | list[int] | dict
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class PromptError(ValueError):
  """A prompt cannot be served as given (empty, too long for the context, not tokenizable)."""


@dataclass
class LoadedModel:
  config: ModelConfig
  folder: Path | None


def locate_model(cfg: EngineConfig) -> LoadedModel:
  """A dummy preset name needs no folder; anything else is a local folder or a hub id."""
  if cfg.load_format == "dummy" and cfg.model in PRESETS:
    return LoadedModel(ModelConfig.from_dict(PRESETS[cfg.model], f"preset {cfg.model}"), None)
  folder = resolve_model(cfg.model)
  return LoadedModel(ModelConfig.from_folder(folder), folder)


def log(message: str) -> None: print(f"[tinyvllm] {message}", file=sys.stderr, flush=True)


class LLMEngine:
  def __init__(self, config: EngineConfig):
    self.config = config
    self.device = select_device(config.device)
    located = locate_model(config)
    self.model_config = mc = located.config
    self.max_model_len = self._max_model_len(config, mc)
    self.tokenizer = self._tokenizer(config, located.folder)
    self.dtype = resolve_dtype(config.dtype, mc, self.device)
    log(f"backend {self.device}, dtype {self.dtype.name}, model {mc.architecture} from {located.folder or config.model}")
    self.model = load_model(mc, located.folder, config.load_format, self.dtype, self.device, self.max_model_len, config.seed)
    allocator = ContiguousAllocator(config.max_num_seqs, self.max_model_len)
    self.kv_cache = KVCache(mc, allocator.num_blocks, allocator.block_size, self.dtype, self.device)
    log(f"contiguous KV cache: {config.max_num_seqs} rows x {self.max_model_len} tokens ({self.kv_cache.nbytes / 2**20:.1f} MiB)")
    self.scheduler = StaticScheduler(allocator, config.max_num_seqs)
    self.runner = ModelRunner(self.model, self.kv_cache)
    eos = frozenset(mc.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else frozenset())
    self.output_processor = OutputProcessor(self.tokenizer, eos, self.max_model_len)
    self.requests: dict[str, Request] = {}
    self._seed_rng = random.Random(config.seed)

  @staticmethod
  def _max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    if config.max_model_len is None: return mc.max_position_embeddings
    if config.max_model_len > mc.max_position_embeddings:
      raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's context of {mc.max_position_embeddings} tokens")
    return config.max_model_len

  @staticmethod
  def _tokenizer(config: EngineConfig, folder: Path | None) -> Tokenizer | None:
    """--tokenizer, else the model folder's own; a folder without tokenizer files serves token-id prompts only."""
    if config.tokenizer: return load_tokenizer(resolve_model(config.tokenizer))
    if folder is None or not any((folder / f).exists() for f in TOKENIZER_FILES):
      log("no tokenizer: prompts must be token ids")
      return None
    return load_tokenizer(folder)

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
    if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
      raise PromptError(f"prompt has {n} tokens and max_tokens is {params.max_tokens}: {n + params.max_tokens} exceeds "
                        f"the model's context of {self.max_model_len} tokens")
    if params.stop_strings and self.tokenizer is None: raise PromptError("stop strings need a tokenizer")

  def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> Request:
    params = params or SamplingParams()
    if request_id in self.requests: raise ValueError(f"request id {request_id!r} is already in use")
    text, prompt_ids = self.tokenize_prompt(prompt)
    self.check_request(prompt_ids, params)
    base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
    seqs = [Sequence(request_id, prompt_ids, params, seed=hash((base_seed, i)) if i else base_seed, index=i)
            for i in range(params.n)]
    request = Request(request_id, text, prompt_ids, params, seqs)
    self.requests[request_id] = request
    for seq in seqs:
      self.output_processor.register(seq)
      self.scheduler.add(seq)
    return request

  def abort_request(self, request_id: str) -> None:
    request = self.requests.pop(request_id, None)
    if request is None: return
    for seq in request.seqs:
      if not seq.is_finished: seq.status = SequenceStatus.FINISHED_ABORTED
      self._release(seq)

  def has_unfinished_requests(self) -> bool: return bool(self.requests)

  def _release(self, seq: Sequence) -> None:
    self.scheduler.finish(seq)
    self.output_processor.release(seq)

  def compute_logits(self, prompt_ids: list[int]) -> np.ndarray:
    """The model's next-token logits after prompt_ids ([vocab], float32), using a free cache row for the pass."""
    seq = Sequence("score", list(prompt_ids), SamplingParams(max_tokens=1), seed=0)
    self.check_request(seq.prompt_token_ids, seq.params)
    allocator = self.scheduler.allocator
    if not allocator.can_allocate(seq): raise RuntimeError("no free KV cache space to score a prompt")
    allocator.allocate(seq)
    try:
      allocator.append_slots(seq, seq.num_tokens)
      return self.runner.logits(SchedulerOutput([ScheduledSequence(seq, seq.num_tokens)]))[0]
    finally:
      allocator.free(seq)

  # ---- the loop ----
  def step(self) -> list[RequestOutput]:
    sched = self.scheduler.schedule()
    if not sched: return []
    result = self.runner.execute(sched)
    for item in sched.scheduled: item.seq.num_computed_tokens += item.num_new_tokens
    touched: dict[str, Request] = {}
    for row, token in zip(result.seq_rows, result.token_ids):
      seq = sched.scheduled[row].seq
      self.output_processor.append_token(seq, token)
      touched[seq.request_id] = self.requests[seq.request_id]
    outputs = [self.output_processor.request_output(r) for r in touched.values()]
    for request in touched.values():
      for seq in request.seqs:
        if seq.is_finished: self.scheduler.finish(seq)
      if request.is_finished:
        for seq in request.seqs: self.output_processor.release(seq)
        del self.requests[request.request_id]
    return outputs

  def run_to_completion(self, request_ids: Seq[str]) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    while self.has_unfinished_requests():
      for out in self.step():
        if out.finished: finals[out.request_id] = out
    return {rid: finals[rid] for rid in request_ids if rid in finals}
