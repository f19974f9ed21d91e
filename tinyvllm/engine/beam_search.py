"""Beam search on the engine (vLLM's LLM.beam_search and the server's beam search): each step, one one-token request for
each live beam of every prompt, all of them batched, asking for the top 2 x beam_width logprobs; the search itself
(tinyvllm/beam_search.py) picks the next beams from them.

A beam's tokens are its parent's and one more, so the prefix cache hands each request the full KV blocks of its
parent's tokens: the step's beams share their common prefix's blocks (reference counted) and compute only the tokens
past the last full block. Without prefix caching (or with the contiguous cache) every step computes each beam whole.
"""
from __future__ import annotations

from tinyvllm.beam_search import BeamSearchInstance
from tinyvllm.engine.input_processor import InputProcessor, PromptType
from tinyvllm.outputs import Logprob, RequestOutput
from tinyvllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, SamplingParamsError


def step_params(params: BeamSearchParams) -> SamplingParams:
  """The one-token request that computes a beam's candidates (its sampled token joins them when not among the top)."""
  return SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=params.num_candidates,
                        output_kind=RequestOutputKind.FINAL_ONLY)


def start_search(processor: InputProcessor, prompt: PromptType, params: BeamSearchParams) -> tuple[str | None, BeamSearchInstance]:
  """A prompt's search, once it is known to fit: its beams' last step within the context and the KV cache, its
  candidates within max_logprobs (PromptError or SamplingParamsError naming beam_width otherwise). Returns the
  prompt's text (if it has one) and the search."""
  text, ids = processor.tokenize_prompt(prompt)
  try:
    processor.check_request(ids, SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens,
                                                logprobs=params.num_candidates))
  except SamplingParamsError as e:
    if e.param != "logprobs": raise
    raise SamplingParamsError("beam_width", f"beam_width={params.beam_width} takes the top {params.num_candidates} logprobs "
                              f"of each step, more than max_logprobs ({processor.max_logprobs})") from None
  return text, BeamSearchInstance(ids, params, processor.eos_token_ids)


def candidates(output: RequestOutput) -> dict[int, Logprob]:
  """A beam's candidates: the top logprobs (and the sampled token's) of its one-token request."""
  logprobs = output.outputs[0].logprobs
  assert logprobs, f"beam search step {output.request_id} returned no logprobs"
  return logprobs[0]
