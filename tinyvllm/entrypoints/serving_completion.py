"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + sample index."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tinyvllm.entrypoints.common import (
  Prompt,
  ServerState,
  check_context,
  check_engine_limits,
  final_outputs,
  finite,
  generate_many,
  sampling_params,
  sse,
  stream_error,
  tokenize,
  unless_disconnected,
)
from tinyvllm.entrypoints.errors import bad_request
from tinyvllm.entrypoints.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage, chunk_json
from tinyvllm.outputs import CompletionOutput, Logprob
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import Tokenizer


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
  if isinstance(prompt, str): return [prompt]
  if not prompt: raise bad_request("prompt must not be an empty list", "prompt")
  return [prompt] if isinstance(prompt[0], int) else list(prompt)


def _check_supported(req: CompletionRequest) -> None:
  if req.suffix: raise bad_request("suffix is not supported", "suffix")
  if req.best_of is not None and req.best_of != (req.n or 1): raise bad_request("best_of other than n is not supported", "best_of")
  if req.echo and req.logprobs is not None:
    raise bad_request("echo with logprobs needs prompt logprobs, which this server does not compute", "echo")


def _prepare(state: ServerState, req: CompletionRequest) -> tuple[list[Prompt], list[SamplingParams]]:
  prompts = [tokenize(state, p, "prompt") for p in _prompt_list(req.prompt)]
  params = [sampling_params(req, check_context(state, p, req.max_tokens, "prompt"), req.logprobs, defaults=state.sampling_defaults)
            for p in prompts]
  for p, sp in zip(prompts, params, strict=True): check_engine_limits(state, p, sp, "prompt")
  return prompts, params


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
  state.require_ready()
  state.check_model(req.model)
  _check_supported(req)
  prompts, params = _prepare(state, req)
  request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
  if req.stream:
    return StreamingResponse(_stream(state, req, prompts, params, request_id, created), media_type="text/event-stream")
  finals = await unless_disconnected(request, final_outputs(state, prompts, params, request_id))
  if finals is None: return Response(status_code=499)  # nobody is listening
  tokenizer, n = state.require_engine().tokenizer, req.n or 1
  choices = []
  for i, out in enumerate(finals):
    echo = _echo_text(tokenizer, prompts[i]) if req.echo else ""
    for o in out.outputs:
      lps = _logprobs(tokenizer, o.token_ids, o.logprobs, len(echo)) if req.logprobs is not None else None
      choices.append(CompletionChoice(index=i * n + o.index, text=echo + o.text, logprobs=lps, finish_reason=o.finish_reason,
                                      stop_reason=o.stop_reason))
  usage = _usage(prompts, sum(len(o.token_ids) for out in finals for o in out.outputs))
  body = CompletionResponse(id=request_id, created=created, model=state.served_model_name, choices=choices, usage=usage)
  return JSONResponse(body.model_dump())


def _usage(prompts: list[Prompt], completion_tokens: int) -> Usage:
  prompt_tokens = sum(len(p.token_ids) for p in prompts)
  return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


def _echo_text(tokenizer: Tokenizer | None, prompt: Prompt) -> str:
  if prompt.text is not None: return prompt.text
  return tokenizer.decode(prompt.token_ids) if tokenizer is not None else ""


def _token_text(tokenizer: Tokenizer | None, token_id: int, entry: Logprob | None) -> str:
  if entry is not None and entry.decoded_token is not None: return entry.decoded_token
  return tokenizer.token_bytes(token_id).decode(errors="replace") if tokenizer is not None else f"token_id:{token_id}"


def _logprobs(tokenizer: Tokenizer | None, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
              offset: int) -> CompletionLogprobs:
  """OpenAI's legacy logprobs for these tokens; text_offset counts from `offset` (where they start in the choice's text)."""
  out = CompletionLogprobs()
  for token_id, entries in zip(token_ids, logprobs or [], strict=False):
    text = _token_text(tokenizer, token_id, entries.get(token_id))
    out.tokens.append(text)
    out.token_logprobs.append(finite(entries[token_id].logprob))
    ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)
    out.top_logprobs.append({_token_text(tokenizer, t, lp): finite(lp.logprob) for t, lp in ranked})
    out.text_offset.append(offset)
    offset += len(text)
  return out


class _ChoiceStream:
  """Per-choice state while streaming: started (echo sent), finished, and the text offset for logprobs."""

  def __init__(self, echo: str):
    self.echo, self.offset, self.finished = echo, len(echo), False

  def chunk_text(self, o: CompletionOutput) -> str:
    text = self.echo + o.delta_text
    self.echo = ""
    return text


async def _stream(state: ServerState, req: CompletionRequest, prompts: list[Prompt], params: list[SamplingParams],
                  request_id: str, created: int) -> AsyncIterator[str]:
  tokenizer, n, model = state.require_engine().tokenizer, req.n or 1, state.served_model_name
  choices: dict[int, _ChoiceStream] = {}
  completion_tokens = 0
  try:
    async for i, out in generate_many(state, prompts, params, request_id):
      for o in out.outputs:
        index = i * n + o.index
        c = choices.setdefault(index, _ChoiceStream(_echo_text(tokenizer, prompts[i]) if req.echo else ""))
        if c.finished or not (o.delta_token_ids or o.finished): continue
        text, lps = c.chunk_text(o), None
        if req.logprobs is not None:
          lps = _logprobs(tokenizer, o.delta_token_ids, (o.logprobs or [])[-len(o.delta_token_ids):] if o.delta_token_ids else [],
                          c.offset)
          c.offset += sum(len(t) for t in lps.tokens)
        if o.finished: c.finished, completion_tokens = True, completion_tokens + len(o.token_ids)
        choice = CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=o.finish_reason, stop_reason=o.stop_reason)
        chunk = CompletionResponse(id=request_id, created=created, model=model, choices=[choice])
        yield sse(chunk_json(chunk, req.include_usage))
    if req.include_usage:
      chunk = CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=_usage(prompts, completion_tokens))
      yield sse(chunk.model_dump())
  except Exception as e:
    yield stream_error(e)
  yield sse("[DONE]")
