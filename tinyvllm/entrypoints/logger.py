"""The request log (vLLM's RequestLogger, `--enable-log-requests`): one line per engine request as it is received."""
from __future__ import annotations

from collections.abc import Callable

from tinyvllm.sampling_params import BeamSearchParams, SamplingParams


class RequestLogger:
  def __init__(self, log: Callable[[str], None], max_log_len: int | None = None):
    self.log, self.max_log_len = log, max_log_len

  def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams | BeamSearchParams) -> None:
    """The prompt (its first max_log_len characters and ids, when set), the sampling parameters, the prompt's ids."""
    if self.max_log_len is not None:
      prompt = prompt[:self.max_log_len] if prompt is not None else None
      prompt_token_ids = prompt_token_ids[:self.max_log_len]
    self.log(f"Received request {request_id}: prompt: {prompt!r}, params: {params}, prompt_token_ids: {prompt_token_ids}")
