"""After each step: detokenize the sampled tokens incrementally, decide stop verdicts (the scheduler applies them),
build RequestOutputs.

Stop rules (vLLM's order): EOS (unless ignore_eos) or a stop_token_id ends the sequence with "stop" and its text leaves
that token out; then max_tokens or the context limit ends it with "length"; a stop string found in the new text ends it
with "stop" and the text is cut before it (kept with include_stop_str_in_output). While a sequence runs, text that could
still turn out to be the start of a stop string is held back from the deltas.

Prompt logprobs (SamplingParams.prompt_logprobs) are the request's: scored by the steps that compute its prompt
(worker/logprobs.py), kept here in prompt order, each token once, and handed out with every RequestOutput.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.core.sequence import Request, Sequence, SequenceStatus, StopVerdict
from tinyvllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from tinyvllm.tokenizer import IncrementalDetokenizer, Tokenizer
from tinyvllm.worker.logprobs import ScoredPromptChunk


@dataclass
class TextState:
  detokenizer: IncrementalDetokenizer | None
  text: str = ""
  emitted_chars: int = 0
  emitted_tokens: int = 0
  logprobs: SampleLogprobs | None = None
  cumulative_logprob: float = 0.0


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


class OutputProcessor:
  def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], max_model_len: int):
    self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len
    self.states: dict[int, TextState] = {}
    self.prompt_logprobs: dict[str, PromptLogprobs] = {}   # request id -> its prompt logprobs so far

  def register(self, seq: Sequence) -> None:
    det = None
    if self.tokenizer is not None:
      det = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens)
    self.states[seq.seq_id] = TextState(det)
    if seq.index == 0 and seq.params.prompt_logprobs is not None: self.prompt_logprobs[seq.request_id] = [None]

  def release(self, seq: Sequence) -> None:
    self.states.pop(seq.seq_id, None)
    if seq.index == 0: self.prompt_logprobs.pop(seq.request_id, None)

  def logprob_entries(self, token: int, logprob: float, rank: int, top_ids: np.ndarray, top_logprobs: np.ndarray) -> dict[int, Logprob]:
    """A token's own entry and the top-k alternatives (ranks 1..k), each with its text."""
    entries = {int(t): Logprob(float(v), r + 1) for r, (t, v) in enumerate(zip(top_ids, top_logprobs, strict=True))}
    entries.setdefault(token, Logprob(float(logprob), int(rank)))
    if self.tokenizer is not None:
      for token_id, entry in entries.items(): entry.decoded_token = self.tokenizer.token_bytes(token_id).decode(errors="replace")
    return entries

  def add_prompt_logprobs(self, chunk: ScoredPromptChunk) -> None:
    """Keep a step's scores of a request's prompt tokens: the tokens not scored before, in order (a chunk computed again
    after a preemption scores them again). Scores for a request that ended meanwhile are dropped."""
    entries = self.prompt_logprobs.get(chunk.seq.request_id)
    if entries is None: return
    k, lp = chunk.seq.params.prompt_logprobs or 0, chunk.logprobs
    for i, token in enumerate(chunk.token_ids):
      if chunk.first + i < len(entries): continue
      assert chunk.first + i == len(entries), f"prompt token {chunk.first + i} scored before token {len(entries)}"
      entries.append(self.logprob_entries(token, lp.logprob[i], lp.rank[i], lp.top_ids[i][:k], lp.top_logprobs[i][:k]))

  def process_token(self, seq: Sequence, token: int, logprobs: dict[int, Logprob] | None = None) -> StopVerdict | None:
    """Account for the sampled token the scheduler has just appended (its text, its logprobs, if asked for) and say
    whether it ends the sequence; the scheduler applies the verdict."""
    params, state = seq.params, self.states[seq.seq_id]
    if logprobs is not None:
      if state.logprobs is None: state.logprobs = []
      state.logprobs.append(logprobs)
      state.cumulative_logprob += logprobs[token].logprob
    verdict = self._token_stop(seq, token)
    if verdict is None and ((params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens)
                            or seq.num_known_tokens >= self.max_model_len):
      verdict = StopVerdict(SequenceStatus.FINISHED_LENGTH)
    stopped_by_token = verdict is not None and verdict.status is SequenceStatus.FINISHED_STOPPED
    if state.detokenizer is None or (stopped_by_token and not params.include_stop_str_in_output): return verdict
    old_len = len(state.text)
    state.text += state.detokenizer.add([token])
    if (hit := find_stop(state.text, old_len, params.stop_strings)) is not None:
      idx, stop = hit
      state.text = state.text[:idx + (len(stop) if params.include_stop_str_in_output else 0)]
      return StopVerdict(SequenceStatus.FINISHED_STOPPED, stop)
    if verdict is not None: state.text += state.detokenizer.flush()  # bytes of a character the last token left incomplete
    return verdict

  def _token_stop(self, seq: Sequence, token: int) -> StopVerdict | None:
    params = seq.params
    if token in self.eos_token_ids and not params.ignore_eos: return StopVerdict(SequenceStatus.FINISHED_STOPPED)
    if token in params.stop_token_ids: return StopVerdict(SequenceStatus.FINISHED_STOPPED, token)
    return None

  def completion(self, seq: Sequence) -> CompletionOutput:
    """The sequence's output so far, with what became final since the last call as the delta."""
    state = self.states[seq.seq_id]
    final_chars = len(state.text)
    if not seq.is_finished: final_chars -= partial_stop_len(state.text, seq.params.stop_strings)
    final_chars = max(final_chars, state.emitted_chars)
    delta_text, state.emitted_chars = state.text[state.emitted_chars:final_chars], final_chars
    delta_tokens, state.emitted_tokens = seq.output_token_ids[state.emitted_tokens:], len(seq.output_token_ids)
    text = state.text if seq.is_finished else state.text[:final_chars]
    logprobs = None if seq.params.logprobs is None else list(state.logprobs or [])
    cumulative = None if seq.params.logprobs is None else state.cumulative_logprob
    return CompletionOutput(seq.index, text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason, cumulative,
                            logprobs, delta_text=delta_text, delta_token_ids=delta_tokens)

  def request_output(self, request: Request) -> RequestOutput:
    outputs = [self.completion(seq) for seq in request.seqs]
    prompt_logprobs = self.prompt_logprobs.get(request.request_id)
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, request.is_finished,
                         request.seqs[0].num_cached_tokens or 0, request_metrics(request),
                         list(prompt_logprobs) if prompt_logprobs is not None else None)


def request_metrics(request: Request) -> RequestMetrics:
  """The request's times from its sequences' (the scheduler records them)."""
  seqs = request.seqs
  scheduled = seqs[0].first_scheduled_time
  first_tokens = [s.first_token_time for s in seqs if s.first_token_time is not None]
  last_tokens = [s.last_token_time for s in seqs if s.last_token_time is not None]
  finished = [s.finished_time for s in seqs if s.finished_time is not None]
  return RequestMetrics(
    arrival_time=request.arrival_time, last_token_time=max(last_tokens, default=request.arrival_time),
    first_scheduled_time=scheduled, first_token_time=min(first_tokens, default=None),
    time_in_queue=None if scheduled is None else scheduled - request.arrival_time,
    finished_time=max(finished) if request.is_finished and finished else None)
