"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + sample index. best_of > n
samples best_of and returns the n of the highest cumulative logprob (vLLM's); use_beam_search runs a beam search of
width n per prompt (entrypoints/serving_beam_search.py)."""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tinyvllm.entrypoints import serving_beam_search as beam_search
from tinyvllm.entrypoints.common import (
  Prompt,
  ServerState,
  check_context,
  check_engine_limits,
  check_request_size,
  check_streaming,
  final_outputs,
  finite,
  generate_many,
  prompt_logprobs_json,
  request_priority,
  response_id,
  returns_token_ids,
  sampling_params,
  sse,
  stream_error,
  tokenize,
  unless_disconnected,
)
from tinyvllm.entrypoints.errors import bad_request
from tinyvllm.entrypoints.protocol import (
  CompletionChoice,
  CompletionLogprobs,
  CompletionRequest,
  CompletionResponse,
  CompletionResponseChoice,
  CompletionStreamResponse,
  Usage,
  chunk_event,
)
from tinyvllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import Tokenizer


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
  if isinstance(prompt, str): return [prompt]
  if not prompt: raise bad_request("prompt must not be an empty list", "prompt")
  return [prompt] if isinstance(prompt[0], int) else list(prompt)


def _prompt_logprobs(req: CompletionRequest) -> int | None:
  """vLLM's: prompt_logprobs as asked, else with echo the logprobs (the echoed prompt's tokens get theirs too)."""
  if req.prompt_logprobs is not None: return req.prompt_logprobs
  return req.logprobs if req.echo else None


def _prompts(state: ServerState, req: CompletionRequest, samples: int) -> list[Prompt]:
  given = _prompt_list(req.prompt)
  check_request_size(state, len(given), samples)
  return [tokenize(state, p, "prompt", req.add_special_tokens is not False) for p in given]


def _check_best_of(req: CompletionRequest) -> int:
  """The samples a prompt takes: best_of (>= n; not streamed when more), else n. length_penalty is beam search's."""
  n = req.n or 1
  beam_search.check_no_length_penalty(req)
  if req.best_of is None: return n
  if req.best_of < n: raise bad_request(f"best_of must be at least n ({n}), got {req.best_of}", "best_of")
  if req.best_of > n and req.stream:
    raise bad_request("best_of > n cannot be streamed: the best are known only at the end", "best_of")
  return req.best_of


def _prepare(state: ServerState, req: CompletionRequest) -> tuple[list[Prompt], list[SamplingParams]]:
  samples = _check_best_of(req)
  prompts = _prompts(state, req, samples)
  params = [sampling_params(req, check_context(state, p, req.max_tokens, "prompt"), req.logprobs, _prompt_logprobs(req),
                            defaults=state.sampling_defaults)
            for p in prompts]
  if samples > (req.n or 1):   # ranked by cumulative logprob: every sample's token logprobs (its own at least)
    params = [dataclasses.replace(sp, n=samples, logprobs=sp.logprobs if sp.logprobs is not None else 0) for sp in params]
  for p, sp in zip(prompts, params, strict=True): check_engine_limits(state, p, sp, "prompt")
  return prompts, params


def _best(out: RequestOutput, n: int) -> list[CompletionOutput]:
  """The n outputs to return: all of them, or (best_of > n) the n of the highest cumulative logprob, best first."""
  if len(out.outputs) == n: return out.outputs
  ranked = sorted(out.outputs, key=lambda o: o.cumulative_logprob or 0.0, reverse=True)[:n]
  return [dataclasses.replace(o, index=i) for i, o in enumerate(ranked)]


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
  state.require_ready()
  state.check_model(req.model)
  check_streaming(req)
  priority = request_priority(state, req)
  request_id, created, engine_id = response_id("cmpl", req), int(time.time()), f"cmpl-{uuid.uuid4().hex}"
  if req.use_beam_search:
    beam_search.check_fields(req)
    prompts = _prompts(state, req, req.n or 1)
    searches = [beam_search.beam_search_params(state, req, p) for p in prompts]
    work = beam_search.beam_search_outputs(state, req, prompts, searches, engine_id, priority)
  else:
    prompts, params = _prepare(state, req)
    if req.stream:
      return StreamingResponse(_stream(state, req, prompts, params, (request_id, engine_id), created), media_type="text/event-stream")
    work = final_outputs(state, prompts, params, engine_id, priority)
  finals = await unless_disconnected(request, work)
  if finals is None: return Response(status_code=499)  # nobody is listening
  n = req.n or 1
  returned = [_best(out, n) for out in finals]
  choices = [_choice(state, req, prompts[i], out, o, i * n + o.index) for i, out in enumerate(finals) for o in returned[i]]
  usage = _usage(prompts, sum(len(o.token_ids) for outputs in returned for o in outputs))
  body = CompletionResponse(id=request_id, created=created, model=state.served_model_name, choices=choices, usage=usage)
  return Response(body.model_dump_json(), media_type="application/json")


def _choice(state: ServerState, req: CompletionRequest, prompt: Prompt, out: RequestOutput, o: CompletionOutput,
            index: int) -> CompletionResponseChoice:
  """One whole choice; with echo its text (and logprobs) start with the prompt's."""
  tokenizer = state.require_engine().tokenizer
  echo = _echo_text(tokenizer, prompt) if req.echo else ""
  lps = None
  if req.logprobs is not None:
    token_ids, entries = _with_echo(req, prompt, out.prompt_logprobs, o.token_ids, o.logprobs or [])
    lps = _logprobs(tokenizer, token_ids, entries, 0)
  ids = returns_token_ids(state, req)
  return CompletionResponseChoice(index=index, text=echo + o.text, logprobs=lps, finish_reason=o.finish_reason,
                                  stop_reason=o.stop_reason, prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
                                  token_ids=list(o.token_ids) if ids else None, prompt_token_ids=prompt.token_ids if ids else None)


def _with_echo(req: CompletionRequest, prompt: Prompt, prompt_logprobs: PromptLogprobs | None, token_ids: list[int],
               entries: list[dict[int, Logprob]]) -> tuple[list[int], list[dict[int, Logprob] | None]]:
  """The tokens whose logprobs a choice reports: with echo, the prompt's first (the first of them has none)."""
  if not req.echo: return token_ids, list(entries)
  assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt.token_ids)
  return prompt.token_ids + token_ids, prompt_logprobs + list(entries)


def _usage(prompts: list[Prompt], completion_tokens: int) -> Usage:
  prompt_tokens = sum(len(p.token_ids) for p in prompts)
  return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


def _echo_text(tokenizer: Tokenizer | None, prompt: Prompt) -> str:
  if prompt.text is not None: return prompt.text
  return tokenizer.decode(prompt.token_ids) if tokenizer is not None else ""


def _token_text(tokenizer: Tokenizer | None, token_id: int, entry: Logprob | None) -> str:
  if entry is not None and entry.decoded_token is not None: return entry.decoded_token
  return tokenizer.token_bytes(token_id).decode(errors="replace") if tokenizer is not None else f"token_id:{token_id}"


def _logprobs(tokenizer: Tokenizer | None, token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
              offset: int) -> CompletionLogprobs:
  """OpenAI's legacy logprobs for these tokens; text_offset counts from `offset` (where they start in the choice's text).
  A token without logprobs (an echoed prompt's first) gets null ones."""
  out = CompletionLogprobs()
  for token_id, entries in zip(token_ids, logprobs, strict=False):
    text = _token_text(tokenizer, token_id, entries.get(token_id) if entries is not None else None)
    out.tokens.append(text)
    out.text_offset.append(offset)
    offset += len(text)
    if entries is None:
      out.token_logprobs.append(None)
      out.top_logprobs.append(None)
      continue
    out.token_logprobs.append(finite(entries[token_id].logprob))
    ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)
    out.top_logprobs.append({_token_text(tokenizer, t, lp): finite(lp.logprob) for t, lp in ranked})
  return out


class _ChoiceStream:
  """Per-choice state while streaming: the echo still to send (its first chunk carries it), finished, and the text
  offset for logprobs."""

  def __init__(self, echo: str):
    self.echo, self.echoed, self.offset, self.finished = echo, False, 0, False

  def chunk_text(self, o: CompletionOutput) -> str:
    text = o.delta_text if self.echoed else self.echo + o.delta_text
    self.echoed = True
    return text


def _delta_logprobs(tokenizer: Tokenizer | None, req: CompletionRequest, c: _ChoiceStream, prompt: Prompt, out: RequestOutput,
                    o: CompletionOutput) -> CompletionLogprobs:
  """The logprobs of a chunk's tokens: its new tokens', and first the echoed prompt's."""
  new = (o.logprobs or [])[-len(o.delta_token_ids):] if o.delta_token_ids else []
  token_ids, entries = (o.delta_token_ids, list(new)) if c.echoed else _with_echo(req, prompt, out.prompt_logprobs,
                                                                                  o.delta_token_ids, new)
  lps = _logprobs(tokenizer, token_ids, entries, c.offset)
  c.offset += sum(len(t) for t in lps.tokens)
  return lps


async def _stream(state: ServerState, req: CompletionRequest, prompts: list[Prompt], params: list[SamplingParams],
                  ids: tuple[str, str], created: int) -> AsyncIterator[str]:
  """Chunks per choice as its text grows ([usage chunk], [DONE]); `ids`: the response's and the engine requests' ids."""
  tokenizer, n, model = state.require_engine().tokenizer, req.n or 1, state.served_model_name
  (request_id, engine_id), choices, completion_tokens = ids, {}, 0
  with_ids = returns_token_ids(state, req)
  try:
    async for i, out in generate_many(state, prompts, params, engine_id, req.priority or 0):
      for o in out.outputs:
        index = i * n + o.index
        c = choices.setdefault(index, _ChoiceStream(_echo_text(tokenizer, prompts[i]) if req.echo else ""))
        if c.finished or not (o.delta_token_ids or o.finished): continue
        lps = _delta_logprobs(tokenizer, req, c, prompts[i], out, o) if req.logprobs is not None else None
        first = not c.echoed
        text = c.chunk_text(o)
        if o.finished: c.finished, completion_tokens = True, completion_tokens + len(o.token_ids)
        choice = CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                  token_ids=list(o.delta_token_ids) if with_ids else None,
                                  prompt_token_ids=prompts[i].token_ids if with_ids and first else None)
        chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])
        yield chunk_event(chunk, req.include_usage)
    if req.include_usage:
      chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=_usage(prompts, completion_tokens))
      yield chunk_event(chunk)
  except Exception as e:
    yield stream_error(e)
  yield sse("[DONE]")
