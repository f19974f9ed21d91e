"""The frontend's side of each step (vLLM v1's OutputProcessor): the core's token ids become text and RequestOutputs.

It keeps its own state per request (the core keeps the Sequences): incremental detokenization (never half a UTF-8
character), stop strings, logprobs with their text, prompt logprobs, and the RequestOutputs (every step with the delta
beside the whole, CUMULATIVE, or only at the end, FINAL_ONLY).

Stops (vLLM's order): the core ends a sample on EOS (unless ignore_eos) or a stop_token_id ("stop": its text leaves that
token out unless include_stop_str_in_output) and on max_tokens or the context ("length"); a stop string found in the new
text ends it here with "stop", the text cut before it (kept with include_stop_str_in_output), and the caller tells the
core to stop the sample (tokens it produced after that are dropped). While a sample runs, text that could still turn out
to be the start of a stop string is held back from the deltas.

Prompt logprobs (SamplingParams.prompt_logprobs) are the request's: scored by the steps that compute its prompt, kept here
in prompt order, each token once, and handed out with every RequestOutput.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from tinyvllm.engine.messages import EngineCoreOutput, EngineCoreRequest, LogprobsLists, PromptLogprobsChunk, SampleRef
from tinyvllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm.tokenizer import IncrementalDetokenizer, Tokenizer


def find_stop(text: str, new_from: int, stops: list[str]) -> tuple[int, str] | None:
  """The earliest stop string that ends inside text[new_from:], as (start index, stop string)."""
  best: tuple[int, str] | None = None
  for stop in stops:
    idx = text.find(stop, max(0, new_from - len(stop) + 1))
    if idx >= 0 and (best is None or idx < best[0]): best = (idx, stop)
  return best


def partial_stop_len(text: str, stops: list[str]) -> int:
  """How many trailing characters of text could be the beginning of a stop string (to hold back while streaming)."""
  longest = 0
  for stop in stops:
    for k in range(min(len(stop) - 1, len(text)), longest, -1):
      if text.endswith(stop[:k]):
        longest = k
        break
  return longest


@dataclass
class SampleState:
  """One of a request's n samples, as the frontend sees it."""
  index: int
  detokenizer: IncrementalDetokenizer | None
  token_ids: list[int] = field(default_factory=list)
  text: str = ""
  emitted_chars: int = 0
  emitted_tokens: int = 0
  logprobs: SampleLogprobs | None = None
  cumulative_logprob: float = 0.0
  finish_reason: str | None = None
  stop_reason: int | str | None = None
  first_scheduled_time: float | None = None
  first_token_time: float | None = None
  last_token_time: float | None = None
  finished_time: float | None = None
  num_draft_tokens: int = 0
  num_accepted_tokens: int = 0

  @property
  def finished(self) -> bool: return self.finish_reason is not None

  def record_times(self, out: EngineCoreOutput) -> None:
    """The times (and speculative decoding's counts) the core's scheduler recorded for this sample."""
    self.first_scheduled_time, self.first_token_time = out.first_scheduled_time, out.first_token_time
    self.last_token_time, self.finished_time = out.last_token_time, out.finished_time
    self.num_draft_tokens, self.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens

  def add_token(self, params: SamplingParams, token: int, logprobs: dict[int, Logprob] | None, finish_reason: str | None,
                stop_reason: int | None, eos_token_ids: frozenset[int] = frozenset()) -> None:
    """One new token: its logprobs, the core's finish, its text and the stop strings. A token that ended the sample as
    EOS or a stop token leaves its text out (unless include_stop_str_in_output); one that completed a structured
    output's grammar keeps it."""
    self.token_ids.append(token)
    if logprobs is not None:
      if self.logprobs is None: self.logprobs = []
      self.logprobs.append(logprobs)
      self.cumulative_logprob += logprobs[token].logprob
    self.finish_reason, self.stop_reason = finish_reason, stop_reason
    stopped_by_token = finish_reason == "stop" and (token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos))
    if self.detokenizer is None or (stopped_by_token and not params.include_stop_str_in_output): return
    old_len = len(self.text)
    self.text += self.detokenizer.add([token])
    # (as vLLM's: stop strings are looked for once the output has more than min_tokens tokens)
    if len(self.token_ids) > params.min_tokens and (hit := find_stop(self.text, old_len, params.stop_strings)) is not None:
      idx, stop = hit
      self.text = self.text[:idx + (len(stop) if params.include_stop_str_in_output else 0)]
      self.finish_reason, self.stop_reason = "stop", stop
      if self.finished_time is None: self.finished_time = time.time()
    elif finish_reason is not None:
      self.text += self.detokenizer.flush()  # bytes of a character the last token left incomplete


@dataclass
class RequestState:
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  params: SamplingParams
  arrival_time: float
  samples: list[SampleState]
  prompt_logprobs: PromptLogprobs | None = None   # so far
  num_cached_tokens: int = 0
  eos_token_ids: frozenset[int] = frozenset()     # what ends its samples as EOS (the core's stop)

  @property
  def finished(self) -> bool: return all(s.finished for s in self.samples)

  def record(self, out: EngineCoreOutput) -> None:
    """The facts of the request a first sample's output carries (its prefix-cache hit)."""
    if out.index == 0: self.num_cached_tokens = out.num_cached_tokens


@dataclass
class OutputProcessorOutput:
  request_outputs: list[RequestOutput]
  samples_to_stop: list[SampleRef]   # stopped here (a stop string): the core must stop them too


class OutputProcessor:
  def __init__(self, tokenizer: Tokenizer | None):
    self.tokenizer = tokenizer
    self.states: dict[str, RequestState] = {}

  def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
    params, ids = request.sampling_params, request.prompt_token_ids
    detokenizer = lambda: None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
    self.states[request.request_id] = RequestState(
      request.request_id, prompt, ids, params, request.arrival_time, [SampleState(i, detokenizer()) for i in range(params.n)],
      [None] if params.prompt_logprobs is not None else None, eos_token_ids=frozenset(request.eos_token_ids))

  def abort_request(self, request_id: str) -> None: self.states.pop(request_id, None)

  def has_unfinished_requests(self) -> bool: return bool(self.states)

  def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
    """Account for a step's outputs; the RequestOutputs due, and the samples a stop string ended."""
    touched: dict[str, RequestState] = {}
    to_stop: list[SampleRef] = []
    for out in outputs:
      state = self.states.get(out.request_id)
      if state is None: continue   # aborted or finished here meanwhile
      if out.prompt_logprobs is not None: self._add_prompt_logprobs(state, out.prompt_logprobs)
      sample = state.samples[out.index]
      if sample.finished or not out.new_token_ids: continue
      state.record(out)
      sample.record_times(out)
      self._process_tokens(state, sample, out)
      if sample.finished and not out.finished: to_stop.append(SampleRef(out.request_id, out.index))
      touched[out.request_id] = state
    request_outputs = []
    for state in touched.values():
      finished = state.finished
      if finished or state.params.output_kind is not RequestOutputKind.FINAL_ONLY: request_outputs.append(self.request_output(state))
      if finished: del self.states[state.request_id]
    return OutputProcessorOutput(request_outputs, to_stop)

  def _process_tokens(self, state: RequestState, sample: SampleState, out: EngineCoreOutput) -> None:
    last = len(out.new_token_ids) - 1
    for i, token in enumerate(out.new_token_ids):
      entries = None if out.new_logprobs is None else self._entries(out.new_logprobs, i, token)
      finish = (out.finish_reason, out.stop_reason) if i == last else (None, None)
      sample.add_token(state.params, token, entries, *finish, state.eos_token_ids)
      if sample.finished: return

  def _entries(self, lists: LogprobsLists, i: int, token: int) -> dict[int, Logprob]:
    return self.logprob_entries(token, lists.logprobs[i], lists.ranks[i], lists.top_ids[i], lists.top_logprobs[i])

  def logprob_entries(self, token: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float]) -> dict[int, Logprob]:
    """A token's own entry and the top-k alternatives (ranks 1..k), each with its text."""
    entries = {t: Logprob(v, r + 1) for r, (t, v) in enumerate(zip(top_ids, top_logprobs, strict=True))}
    entries.setdefault(token, Logprob(logprob, rank))
    if self.tokenizer is not None:
      for token_id, entry in entries.items(): entry.decoded_token = self.tokenizer.token_bytes(token_id).decode(errors="replace")
    return entries

  def _add_prompt_logprobs(self, state: RequestState, chunk: PromptLogprobsChunk) -> None:
    """Keep a step's scores of the request's prompt tokens: the tokens not scored before, in order (a chunk computed
    again after a preemption scores them again)."""
    entries = state.prompt_logprobs
    if entries is None: return
    for i, token in enumerate(chunk.token_ids):
      if chunk.first + i < len(entries): continue
      assert chunk.first + i == len(entries), f"prompt token {chunk.first + i} scored before token {len(entries)}"
      entries.append(self._entries(chunk.logprobs, i, token))

  def completion(self, state: RequestState, sample: SampleState) -> CompletionOutput:
    """The sample's output so far, with what became final since the last call as the delta."""
    final_chars = len(sample.text)
    if not sample.finished: final_chars -= partial_stop_len(sample.text, state.params.stop_strings)
    final_chars = max(final_chars, sample.emitted_chars)
    delta_text, sample.emitted_chars = sample.text[sample.emitted_chars:final_chars], final_chars
    delta_tokens, sample.emitted_tokens = sample.token_ids[sample.emitted_tokens:], len(sample.token_ids)
    text = sample.text if sample.finished else sample.text[:final_chars]
    wants_logprobs = state.params.logprobs is not None
    return CompletionOutput(sample.index, text, list(sample.token_ids), sample.finish_reason, sample.stop_reason,
                            sample.cumulative_logprob if wants_logprobs else None,
                            list(sample.logprobs or []) if wants_logprobs else None, delta_text=delta_text, delta_token_ids=delta_tokens)

  def request_output(self, state: RequestState) -> RequestOutput:
    outputs = [self.completion(state, sample) for sample in state.samples]
    prompt_logprobs = list(state.prompt_logprobs) if state.prompt_logprobs is not None else None
    return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, state.finished, state.num_cached_tokens,
                         request_metrics(state), prompt_logprobs)


def request_metrics(state: RequestState) -> RequestMetrics:
  """The request's times from its samples' (the core's scheduler records them)."""
  samples = state.samples
  scheduled = samples[0].first_scheduled_time
  first_tokens = [s.first_token_time for s in samples if s.first_token_time is not None]
  last_tokens = [s.last_token_time for s in samples if s.last_token_time is not None]
  finished = [s.finished_time for s in samples if s.finished_time is not None]
  return RequestMetrics(
    arrival_time=state.arrival_time, last_token_time=max(last_tokens, default=state.arrival_time),
    first_scheduled_time=scheduled, first_token_time=min(first_tokens, default=None),
    time_in_queue=None if scheduled is None else scheduled - state.arrival_time,
    finished_time=max(finished) if state.finished and finished else None,
    num_draft_tokens=sum(s.num_draft_tokens for s in samples), num_accepted_tokens=sum(s.num_accepted_tokens for s in samples))
