"""What crosses between the frontend (tokenization, detokenization, stop strings, RequestOutputs) and the EngineCore
(scheduler, runner, KV cache), in vLLM v1's names: EngineCoreRequest in, EngineCoreOutputs out, one batch a step.

Plain dataclasses: the offline LLMEngine hands them across in-process, the server's core process sends them over
ZeroMQ as msgpack (engine/serialization.py). Token-level stops (EOS, stop_token_ids, max_tokens, the context) are the
core's; stop strings are the frontend's, which then tells the core to stop the sample. Logprobs cross raw (ids and
floats): the frontend decodes their text.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tinyvllm.core.spec_decoding_stats import SpecDecodingStats
from tinyvllm.sampling_params import SamplingParams


class RequestType(enum.Enum):
  """The frame tag of a message to the core process."""
  ADD = b"A"             # EngineCoreRequest
  ABORT = b"X"           # list of request ids: end them wherever they are
  STOP_SAMPLES = b"S"    # list of SampleRef: the frontend found a stop string in these samples
  SHUTDOWN = b"Q"


class OutputType(enum.Enum):
  """The frame tag of a message from the core process."""
  READY = b"R"           # EngineCoreInfo: the model is loaded, requests may come
  OUTPUTS = b"O"         # EngineCoreOutputs
  FAILED = b"F"          # a message: loading failed, or the loop crashed; the process exits


@dataclass
class EngineCoreRequest:
  """A request the frontend has tokenized and validated (max_tokens set, limits checked against EngineCoreInfo)."""
  request_id: str
  prompt_token_ids: list[int]
  sampling_params: SamplingParams
  eos_token_ids: list[int]          # what ends a sample (unless ignore_eos): the model's and the tokenizer's EOS ids
  arrival_time: float               # time.time() when the frontend received it
  priority: int = 0                 # for the scheduler's priority policy (lower runs first, as vLLM's)
  group: str | None = None          # the API request it came with: admission takes turns between groups
  client_index: int = 0             # which API server sent it (--api-server-count): its outputs go back there


@dataclass(frozen=True)
class SampleRef:
  request_id: str
  index: int                        # which of the request's n samples


@dataclass
class LogprobsLists:
  """Raw logprobs of some tokens: per token its logprob and rank, and the top-k ids and logprobs (k as asked)."""
  logprobs: list[float]
  ranks: list[int]
  top_ids: list[list[int]]
  top_logprobs: list[list[float]]


@dataclass
class PromptLogprobsChunk:
  """A step's scores of prompt tokens first .. first + len(token_ids) - 1 (a chunk recomputed after a preemption
  scores its tokens again: the frontend keeps each token's first)."""
  first: int
  token_ids: list[int]
  logprobs: LogprobsLists


@dataclass
class EngineCoreOutput:
  """What one sample of a request got in a step: its new tokens, the finish the core decided, the times the scheduler
  recorded (time.time(); None until they happen)."""
  request_id: str
  index: int
  new_token_ids: list[int]
  new_logprobs: LogprobsLists | None = None
  prompt_logprobs: PromptLogprobsChunk | None = None
  finish_reason: str | None = None          # "stop" (EOS or a stop token) or "length"
  stop_reason: int | None = None            # the stop token id (None for EOS)
  num_cached_tokens: int = 0                # prompt tokens the prefix cache covered at the first admission
  first_scheduled_time: float | None = None
  first_token_time: float | None = None
  last_token_time: float | None = None
  finished_time: float | None = None
  num_draft_tokens: int = 0                 # speculative decoding: the sample's proposals verified so far
  num_accepted_tokens: int = 0              # ... and accepted

  @property
  def finished(self) -> bool: return self.finish_reason is not None


@dataclass
class SwapStats:
  """The swap space (preemption_mode swap): swapped requests, its blocks, and totals since start."""
  num_swapped_reqs: int = 0
  blocks_used: int = 0
  blocks_total: int = 0
  swapped_out_blocks: int = 0
  swapped_in_blocks: int = 0
  fallbacks: int = 0                        # preemptions recomputed because the swap space was full

  @property
  def usage(self) -> float: return self.blocks_used / max(self.blocks_total, 1)


@dataclass
class SchedulerStats:
  """The core's state after a step (for /metrics and the stats line); counters are totals since start."""
  num_running_reqs: int = 0
  num_waiting_reqs: int = 0
  kv_cache_blocks_used: int = 0
  kv_cache_blocks_total: int = 0
  prefix_caching: bool = False
  prefix_cache_queries: int = 0             # prompt tokens looked up
  prefix_cache_hits: int = 0                # prompt tokens found
  num_preemptions: int = 0
  step_prompt_tokens: int = 0               # prompt tokens this step computed
  step_generation_tokens: int = 0           # generated tokens that reached the host with this step's outputs
  swap: SwapStats | None = None             # None without a swap space
  spec_decoding: SpecDecodingStats | None = None   # None without speculative decoding

  @property
  def kv_cache_usage(self) -> float: return self.kv_cache_blocks_used / max(self.kv_cache_blocks_total, 1)

  @property
  def prefix_cache_hit_rate(self) -> float:
    return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class EngineCoreOutputs:
  """One step's outputs, batched, and the stats after it. `rejected`: requests the core refused, with the reason."""
  outputs: list[EngineCoreOutput] = field(default_factory=list)
  scheduler_stats: SchedulerStats | None = None
  timestamp: float = 0.0
  rejected: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class EngineCoreInfo:
  """What the frontend needs from the core to tokenize and validate requests, reported once the model is loaded."""
  max_model_len: int
  vocab_size: int
  eos_token_ids: list[int]                  # the model config's
  num_kv_blocks: int                        # paged: blocks; contiguous: rows of max_model_len tokens
  block_size: int
  paged: bool
  model_folder: str | None                  # the resolved model folder (None: a dummy preset)
