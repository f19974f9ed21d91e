"""Beam search in POST /v1/completions and /v1/chat/completions (vLLM's `use_beam_search`): n is the beam width, and
each prompt's n choices are its beams, best first (AsyncLLM.beam_search). It takes max_tokens (max_completion_tokens),
temperature (unset: the model's default, else 1.0, as vLLM's), length_penalty, ignore_eos, include_stop_str_in_output,
skip_special_tokens and (completions) echo; a sampling field it has no use for is refused rather than ignored, and so
are streaming (the beams are known only at the end) and tools."""
from __future__ import annotations

from collections.abc import AsyncIterator

from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.engine.input_processor import PromptError
from tinyvllm.entrypoints.common import Prompt, ServerState, check_context, finals, log_inputs, run_many
from tinyvllm.entrypoints.errors import bad_request
from tinyvllm.entrypoints.protocol import SamplingRequest
from tinyvllm.entrypoints.unsupported import equals
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import BeamSearchParams, SamplingParamsError

# the sampling fields beam search does not use (its candidates are the raw logprobs' top ones), with the values that ask
# for nothing (None always does)
NOT_FOR_BEAM_SEARCH = {"top_p": (1,), "top_k": (0, -1), "min_p": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
                       "repetition_penalty": (1,), "stop": ("", []), "stop_token_ids": ([],), "seed": (), "logprobs": (),
                       "prompt_logprobs": (), "logit_bias": ({},), "allowed_token_ids": (), "bad_words": ([],), "min_tokens": (0,),
                       "vllm_xargs": ({},), "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (),
                       "guided_grammar": (), "guided_whitespace_pattern": (), "response_format": ()}
TAKES = "n (the beam width), max_tokens, temperature, length_penalty, ignore_eos, include_stop_str_in_output"


# the chat endpoint's own fields beam search does not use, with the values that ask for nothing
NOT_FOR_CHAT_BEAM_SEARCH = {"logprobs": (False,), "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",)}


def check_no_length_penalty(req: SamplingRequest) -> None:
  """A request without use_beam_search: length_penalty (beam search's) asks for nothing else."""
  if req.length_penalty is not None and not equals(req.length_penalty, 1):
    raise bad_request("length_penalty applies to beam search only (use_beam_search: true)", "length_penalty")


def check_fields(req: SamplingRequest, chat: bool = False) -> None:
  """What beam search cannot honour: streaming, best_of other than n, a sampling field (or tools) it does not use."""
  if req.stream: raise bad_request("use_beam_search is not available with stream: true (the beams are known at the end)",
                                   "use_beam_search")
  best_of = getattr(req, "best_of", None)
  if best_of is not None and best_of != (req.n or 1):
    raise bad_request(f"with use_beam_search, n is the beam width: best_of must be unset or equal to n, got {best_of}", "best_of")
  unused = {**NOT_FOR_BEAM_SEARCH, **(NOT_FOR_CHAT_BEAM_SEARCH if chat else {})}
  for name, neutral in unused.items():
    value = getattr(req, name, None)
    if name == "response_format" and getattr(value, "type", None) == "text": continue
    if value is not None and not any(equals(value, v) for v in neutral):
      raise bad_request(f"{name} does not apply to beam search, which takes {TAKES}", name)


def beam_search_params(state: ServerState, req: SamplingRequest, prompt: Prompt, max_tokens: int | None = None,
                       param: str = "prompt") -> BeamSearchParams:
  """A prompt's search, checked against the engine (context, KV cache, max_logprobs); a 400 naming the field. `param`:
  what a context overflow is the fault of (the prompt, the chat's messages)."""
  defaults = state.sampling_defaults
  max_tokens = check_context(state, prompt, max_tokens if max_tokens is not None else req.max_tokens, param)
  max_tokens = min(max_tokens, defaults.get("max_tokens", max_tokens))   # (the model's caps the request's, as in sampling)
  temperature = req.temperature if req.temperature is not None else defaults.get("temperature", 1.0)
  try:
    params = BeamSearchParams(beam_width=req.n or 1, max_tokens=max_tokens, ignore_eos=bool(req.ignore_eos), temperature=temperature,
                              length_penalty=req.length_penalty if req.length_penalty is not None else 1.0,
                              include_stop_str_in_output=bool(req.include_stop_str_in_output))
    state.require_engine().validate_beam_search(prompt.engine_prompt(), params)
  except SamplingParamsError as e:
    if e.param == "beam_width": raise bad_request(f"n is the beam width with use_beam_search: {e}", "n") from None
    raise bad_request(str(e), e.param) from None
  except PromptError as e: raise bad_request(str(e), param) from None
  return params


async def beam_search_outputs(state: ServerState, req: SamplingRequest, prompts: list[Prompt], params: list[BeamSearchParams],
                              request_id: str, priority: int) -> list[RequestOutput]:
  """Every prompt's search, run together; one finished RequestOutput a prompt, its beams as outputs."""
  engine = state.require_engine()
  log_inputs(state, prompts, params, request_id)
  skip_special_tokens = req.skip_special_tokens is not False

  def source(i: int):
    return lambda: _searched(engine, prompts[i], params[i], f"{request_id}-{i}", priority, request_id, skip_special_tokens)
  return await finals(run_many(state, [source(i) for i in range(len(prompts))]), len(prompts))


async def _searched(engine: AsyncLLM, prompt: Prompt, params: BeamSearchParams, request_id: str, priority: int, group: str,
                    skip_special_tokens: bool) -> AsyncIterator[RequestOutput]:
  yield await engine.beam_search(prompt.engine_prompt(), params, request_id, priority, group, skip_special_tokens)
