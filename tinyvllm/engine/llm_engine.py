"""LLMEngine: add_request / step / abort_request (vLLM's), the offline engine: an EngineCore in this process, and the
frontend's input and output processing around it (the same the server's API process runs around its core process)."""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.core.scheduling_policy import check_priority
from tinyvllm.core.sequence import Request
from tinyvllm.engine.core import EngineCore
from tinyvllm.engine.core_setup import log
from tinyvllm.engine.input_processor import (
  FrontendFiles,
  InputProcessor,
  PromptError,
  PromptType,
  load_frontend_files,
  model_folder,
)
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.stats_logger import StatsLogger
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import freeze_long_lived_objects

__all__ = ["LLMEngine", "PromptError", "PromptType", "log"]


def check_one_replica(config: EngineConfig) -> None:
  """The offline engine is one replica: data parallelism is the server's (vLLM's offline one is a separate launcher)."""
  dp = config.data_parallel_size
  if dp > 1:
    raise ConfigError(f"data_parallel_size {dp}: the offline engine (LLM, generate, chat, bench) runs one engine in this "
                      f"process; serve the model with `tinyvllm serve MODEL --data-parallel-size {dp}` ({dp} replicas behind "
                      "one endpoint), or start one LLM per device")


class LLMEngine:
  def __init__(self, config: EngineConfig, check_frontend_files: Callable[[FrontendFiles], None] | None = None):
    """check_frontend_files: called with the tokenizer and sampling defaults before the weights load; what it raises
    stops the engine there (the command line refuses a model without a tokenizer so, in a second, not after the load)."""
    start = time.perf_counter()
    check_one_replica(config)
    self.config = config
    # the frontend's files first: a missing or mismatched tokenizer is found before the weights load (seconds to minutes)
    files = load_frontend_files(config, model_folder(config))
    if check_frontend_files is not None: check_frontend_files(files)
    self.tokenizer, self.default_sampling_params = files.tokenizer, files.default_sampling_params
    self.core = EngineCore(config, log_stats=not config.disable_log_stats)
    self.processor = InputProcessor(self.core.info(), self.tokenizer, config.max_logprobs, config.scheduling_policy,
                                    config.logits_processors)
    self.output_processor = OutputProcessor(self.tokenizer)
    self.stats_logger = None if config.disable_log_stats else StatsLogger(log)
    freeze_long_lived_objects()   # the frontend too (its tokenizer's tables): no collection walks them during the steps
    log(f"engine ready in {time.perf_counter() - start:.1f} s")

  # ---- what the core holds (tests and benchmarks look inside)
  @property
  def model_config(self): return self.core.model_config
  @property
  def max_model_len(self) -> int: return self.core.max_model_len
  @property
  def device(self) -> str: return self.core.device
  @property
  def model(self): return self.core.model
  @property
  def allocator(self): return self.core.allocator
  @property
  def kv_cache(self): return self.core.kv_cache
  @property
  def kv_dtype(self): return self.core.kv_dtype
  @property
  def scheduler(self): return self.core.scheduler
  @property
  def runner(self): return self.core.runner
  @property
  def async_scheduling(self) -> bool: return self.core.async_scheduling
  @property
  def warm_up_seconds(self) -> float: return self.core.warm_up_seconds
  @property
  def requests(self) -> dict[str, Request]:
    """The core's requests (their Sequences), by id."""
    return self.core.requests

  # ---- requests
  def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]: return self.processor.tokenize_prompt(prompt)

  def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
    """Refuse, before anything is allocated, what could never run."""
    self.processor.check_request(prompt_ids, params)

  def check_priority(self, priority: int) -> None:
    """A request's priority is honoured under scheduling_policy priority only (as in vLLM)."""
    check_priority(priority, self.config.scheduling_policy)

  def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, priority: int = 0) -> None:
    """priority: with scheduling_policy priority, lower values are served first (and preempt higher ones)."""
    if request_id in self.output_processor.states or request_id in self.core.requests:
      raise ValueError(f"request id {request_id!r} is already in use")
    text, request = self.processor.process(request_id, prompt, params or SamplingParams(), priority)
    self.core.add_request(request)
    self.output_processor.add_request(request, text)

  def abort_request(self, request_id: str) -> None:
    """Stop a request wherever it is and free everything it holds."""
    self.output_processor.abort_request(request_id)
    self.core.abort_requests([request_id])

  def has_unfinished_requests(self) -> bool:
    return self.output_processor.has_unfinished_requests() or self.core.has_unfinished_requests()

  def reset_prefix_cache(self) -> None:
    """Forget every cached prefix block (blocks in use stay where they are)."""
    self.core.reset_prefix_cache()

  def compute_logits(self, prompt_ids: list[int]) -> np.ndarray:
    """The model's next-token logits after prompt_ids ([vocab], float32); runs on free cache space, outside the queue."""
    self.check_request(list(prompt_ids), SamplingParams(max_tokens=1))
    return self.core.compute_logits(list(prompt_ids))

  # ---- the loop
  def step(self) -> list[RequestOutput]:
    """Run one core step; return the outputs of the requests that progressed in the step that finished (with
    asynchronous scheduling, the previous one: engine/core.py)."""
    core_outputs = self.core.step()
    processed = self.output_processor.process_outputs(core_outputs.outputs)
    if processed.samples_to_stop: self.core.stop_samples(processed.samples_to_stop)
    if self.stats_logger is not None and core_outputs.scheduler_stats is not None: self.stats_logger.observe(core_outputs.scheduler_stats)
    return processed.request_outputs

