"""Beam search (vLLM's vllm/beam_search.py): one prompt's beams, their scores, and a step of the search.

A search keeps its live beams (one, the prompt, at first; beam_width after a step) and its complete ones. A step takes
each live beam's candidates, its next token's top logprobs, and extends the beam by each: a candidate that is EOS
(unless ignore_eos) completes the beam, and the beam_width best of the others by score live on. After the last step
the beam_width best of the complete and live beams are the result, best first.

The engine computes the candidates (tinyvllm/engine/beam_search.py) as vLLM's LLM.beam_search does: a one-token
request for each live beam, asking for the top logprobs, the step's beams of every prompt batched together.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from tinyvllm.outputs import CompletionOutput, Logprob, RequestOutput
from tinyvllm.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
  """One beam: its tokens (the prompt's first), per generated token the logprobs of the candidates it was chosen among,
  and its cumulative logprob. text, finish_reason and stop_reason are set when the beam is returned."""
  tokens: list[int]
  logprobs: list[dict[int, Logprob]]
  cum_logprob: float = 0.0
  text: str | None = None
  finish_reason: str | None = None      # "stop" (it ended with EOS) or "length"
  stop_reason: int | str | None = None  # None: EOS (as in generate's outputs)


@dataclass
class BeamSearchOutput:
  """A prompt's result: its beam_width best beams, best first."""
  sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | Collection[int] | None,
                          length_penalty: float = 1.0) -> float:
  """vLLM's (after HF transformers'): cumulative logprob / len ** length_penalty, len counting the prompt's tokens and
  not a final EOS."""
  eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
  seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
  return cumulative_logprob / (seq_len ** length_penalty)


class BeamSearchInstance:
  """One prompt's search."""

  def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Collection[int]):
    self.params, self.eos = params, frozenset(eos_token_ids)
    self.prompt_token_ids = list(prompt_token_ids)
    self.num_prompt_tokens = len(prompt_token_ids)
    self.beams = [BeamSearchSequence(list(prompt_token_ids), [])]
    self.completed: list[BeamSearchSequence] = []

  def score(self, beam: BeamSearchSequence) -> float:
    return get_beam_search_score(beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty)

  def advance(self, candidates: list[dict[int, Logprob]]) -> None:
    """One step: candidates[i] are live beam i's next tokens with their logprobs."""
    extended = []
    for beam, entries in zip(self.beams, candidates, strict=True):
      for token, entry in entries.items():
        child = BeamSearchSequence([*beam.tokens, token], [*beam.logprobs, entries], beam.cum_logprob + entry.logprob)
        if token in self.eos and not self.params.ignore_eos:
          child.finish_reason = "stop"
          self.completed.append(child)
        else:
          extended.append(child)
    # (stable sorts: ties keep their order) only the beam_width best complete beams can be in the result
    self.beams = sorted(extended, key=self.score, reverse=True)[:self.params.beam_width]
    self.completed = sorted(self.completed, key=self.score, reverse=True)[:self.params.beam_width]

  def best(self, decode: Callable[[list[int]], str] | None) -> list[BeamSearchSequence]:
    """The result: the beam_width best of the complete and live beams, best first, with their text (None without a
    tokenizer): the generated tokens', a final EOS left out unless include_stop_str_in_output."""
    best = sorted(self.completed + self.beams, key=self.score, reverse=True)[:self.params.beam_width]
    for beam in best:
      beam.finish_reason = beam.finish_reason or "length"
      if decode is not None: beam.text = decode(self._text_tokens(beam))
    return best

  def output_token_ids(self, beam: BeamSearchSequence) -> list[int]: return beam.tokens[self.num_prompt_tokens:]

  def _text_tokens(self, beam: BeamSearchSequence) -> list[int]:
    tokens = self.output_token_ids(beam)
    return tokens[:-1] if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output else tokens

  def request_output(self, request_id: str, prompt: str | None, decode: Callable[[list[int]], str] | None) -> RequestOutput:
    """The result as a finished RequestOutput (the server's form): one CompletionOutput a beam, best first."""
    outputs = []
    for i, beam in enumerate(self.best(decode)):
      token_ids = self.output_token_ids(beam)
      outputs.append(CompletionOutput(i, beam.text or "", token_ids, beam.finish_reason, beam.stop_reason, beam.cum_logprob,
                                      beam.logprobs, delta_text=beam.text or "", delta_token_ids=list(token_ids)))
    return RequestOutput(request_id, prompt, self.prompt_token_ids, outputs, finished=True)
