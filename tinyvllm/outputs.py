"""What generation returns (vLLM's RequestOutput / CompletionOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
  """One token's log probability under the model's raw distribution (vLLM's Logprob)."""
  logprob: float
  rank: int                       # 1 = the most probable token
  decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]   # per generated token: its own entry plus the top-k alternatives
# per prompt token: None for the first (nothing comes before it), then its own entry plus the top-k alternatives
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
  index: int
  text: str
  token_ids: list[int]
  finish_reason: str | None = None         # "stop" | "length" | None while running
  stop_reason: int | str | None = None     # the stop string or stop token id that ended it (None for EOS)
  cumulative_logprob: float | None = None
  logprobs: SampleLogprobs | None = None
  delta_text: str = ""                     # text that became final in the step that produced this output
  delta_token_ids: list[int] = field(default_factory=list)

  @property
  def finished(self) -> bool: return self.finish_reason is not None


@dataclass
class RequestMetrics:
  """When a request reached each point (vLLM's RequestMetrics; wall-clock seconds, time.time()). For n > 1 samples:
  the first sample's scheduling, the earliest first token, the latest token, the last sample's end."""
  arrival_time: float
  last_token_time: float                    # the arrival time until a token is generated
  first_scheduled_time: float | None = None
  first_token_time: float | None = None
  time_in_queue: float | None = None        # first_scheduled_time - arrival_time
  finished_time: float | None = None
  # speculative decoding, over the request's samples: proposals verified and accepted (emitted tokens are the outputs')
  num_draft_tokens: int = 0
  num_accepted_tokens: int = 0

  @property
  def acceptance_rate(self) -> float | None:
    return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclass
class RequestOutput:
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  outputs: list[CompletionOutput]
  finished: bool
  num_cached_tokens: int = 0                # prompt tokens found in the prefix cache when the request was admitted
  metrics: RequestMetrics | None = None
  prompt_logprobs: PromptLogprobs | None = None   # with SamplingParams.prompt_logprobs (vLLM's)
