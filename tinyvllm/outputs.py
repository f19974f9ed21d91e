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
class RequestOutput:
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  outputs: list[CompletionOutput]
  finished: bool
  num_cached_tokens: int = 0
  prompt_logprobs: PromptLogprobs | None = None   # with SamplingParams.prompt_logprobs (vLLM's)
