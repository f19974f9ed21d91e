"""What both generation endpoints share: the server's state, request checks, sampling parameters, running several
engine requests as one HTTP request, and watching for the client going away."""
from __future__ import annotations

import asyncio
import functools
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from tinyvllm.core.scheduling_policy import check_priority
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.engine.exceptions import EngineDeadError
from tinyvllm.engine.input_processor import PromptError
from tinyvllm.entrypoints.chat_settings import ChatSettings
from tinyvllm.entrypoints.errors import APIError, bad_request
from tinyvllm.entrypoints.logger import RequestLogger
from tinyvllm.entrypoints.metrics import ServerMetrics
from tinyvllm.entrypoints.output_controls import REQUEST_NAMES, output_constraint, token_controls
from tinyvllm.entrypoints.protocol import PromptLogprob, SamplingRequest
from tinyvllm.outputs import PromptLogprobs, RequestOutput
from tinyvllm.sampling_params import BeamSearchParams, SamplingParams, SamplingParamsError
from tinyvllm.tokenizer import Tokenizer

T = TypeVar("T")
Source = Callable[[], AsyncIterator[RequestOutput]]   # one engine request's outputs (or a beam search's one)
LOGPROB_FLOOR = -9999.0   # JSON has no -inf


@dataclass
class ServerState:
  served_model_name: str
  model_path: str
  api_key: str | None = None
  engine: AsyncLLM | None = None
  load_error: str | None = None
  engine_error: str | None = None   # the engine core failed or died after it was ready
  created: int = field(default_factory=lambda: int(time.time()))
  draining: bool = False       # shutting down: in-flight requests may finish, new ones are refused
  metrics: ServerMetrics = field(init=False)
  in_flight: set[asyncio.Queue] = field(default_factory=set)   # one queue per running HTTP request
  other_model_names: tuple[str, ...] = ()    # further names requests may use (responses carry served_model_name)
  chat: ChatSettings = field(default_factory=ChatSettings)   # --chat-template, tool calling, the reasoning parser
  request_logger: RequestLogger | None = None
  max_seqs_per_request: int = 4096          # prompts x n one request may ask for (--max-seqs-per-request)
  metrics_dir: str | None = None            # one of several API servers: where their request metrics add up
  loading: asyncio.Task | None = None       # the engine's start, while it runs

  def __post_init__(self) -> None:
    self.metrics = ServerMetrics(lambda: self.engine.stats if self.engine is not None else None,
                                 lambda: self.engine.replica_stats() if self.engine is not None else [], self.metrics_dir)

  def require_ready(self) -> AsyncLLM:
    """The engine, for a new request (503 while loading or shutting down)."""
    if self.draining: raise APIError(503, "the server is shutting down", code="service_unavailable")
    return self.require_engine()

  def abort_in_flight(self) -> None:
    """End every in-flight request now (its stream gets an error event; a whole response, a 503)."""
    for queue in self.in_flight: queue.put_nowait((-1, APIError(503, "the server shut down before the request finished",
                                                                 code="service_unavailable")))

  def require_engine(self) -> AsyncLLM:
    if self.engine is None:
      message = f"the model failed to load: {self.load_error}" if self.load_error else "the model is still loading"
      raise APIError(503, message, code="service_unavailable")
    if self.engine_error is not None: raise engine_dead(self.engine_error)
    return self.engine

  @property
  def max_model_len(self) -> int: return self.require_engine().max_model_len

  @property
  def sampling_defaults(self) -> dict[str, Any]:
    """The model's generation_config.json defaults for request fields left unset."""
    return self.require_engine().default_sampling_params

  def tokenizer(self, purpose: str) -> Tokenizer:
    tokenizer = self.require_engine().tokenizer
    if tokenizer is None: raise bad_request(f"this model has no tokenizer: {purpose} needs one")
    return tokenizer

  def check_model(self, model: str | None) -> None:
    if model is not None and model != self.served_model_name and model not in self.other_model_names:
      raise APIError(404, f"the model {model!r} does not exist; this server serves {self.served_model_name!r}",
                     param="model", code="model_not_found")


def engine_dead(reason: str) -> APIError:
  return APIError(503, f"the engine has stopped: {reason}", code="service_unavailable")


@dataclass
class Prompt:
  text: str | None
  token_ids: list[int]

  def engine_prompt(self) -> dict[str, Any]: return {"prompt": self.text, "prompt_token_ids": self.token_ids}


def tokenize(state: ServerState, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> Prompt:
  """A prompt's token ids; a string gets the tokenizer's special tokens (BOS) unless add_special_tokens is false."""
  try:
    if isinstance(prompt, str) and not add_special_tokens: text, ids = prompt, state.tokenizer("a text prompt").encode(prompt, False)
    else: text, ids = state.require_engine().processor.tokenize_prompt(prompt)
  except PromptError as e: raise bad_request(str(e), param) from None
  if not ids: raise bad_request("the prompt is empty (no tokens)", param)
  return Prompt(text, ids)


def returns_token_ids(state: ServerState, req: SamplingRequest) -> bool:
  """vLLM's return_token_ids: token ids beside the text when asked, and always when there is no tokenizer (no text)."""
  return bool(req.return_token_ids) or state.require_engine().tokenizer is None


def check_streaming(req: SamplingRequest) -> None:
  """What a stream cannot carry, and stream_options without a stream (OpenAI and vLLM refuse both)."""
  if req.stream_options is not None and not req.stream:
    raise bad_request("stream_options is only allowed with stream: true", "stream_options")
  if req.stream and req.prompt_logprobs is not None:
    raise bad_request("prompt_logprobs are not available with stream: true", "prompt_logprobs")


def response_id(prefix: str, req: SamplingRequest) -> str:
  """The response's id: from the request's request_id (vLLM's extension) when it has one. Engine requests get their
  own ids, so two HTTP requests may share a request_id."""
  return f"{prefix}-{req.request_id if req.request_id is not None else uuid.uuid4().hex}"


def check_request_size(state: ServerState, num_prompts: int, n: int) -> None:
  """prompts x n within --max-seqs-per-request (the fair admission takes turns between requests, not sequences)."""
  if num_prompts * n <= state.max_seqs_per_request: return
  raise bad_request(f"the request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}); this server takes at "
                    f"most {state.max_seqs_per_request} a request (--max-seqs-per-request)", "n" if n > 1 else "prompt")


def check_context(state: ServerState, prompt: Prompt, max_tokens: int | None, param: str) -> int:
  """The request's max_tokens (the rest of the context when None), or OpenAI's context_length_exceeded."""
  limit, n = state.max_model_len, len(prompt.token_ids)
  wanted = max_tokens if max_tokens is not None else max(limit - n, 1)
  if n >= limit or n + wanted > limit:
    raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested {n + wanted} tokens "
                      f"({n} in the {param}, {wanted} in the completion). Please reduce the length of the {param} or "
                      "the completion.", param, code="context_length_exceeded")
  return wanted


_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                    rename: dict[str, str] | None = None, defaults: dict[str, Any] | None = None) -> SamplingParams:
  """The engine's SamplingParams; a bad value is a 400 naming the request's field (`rename`: engine name -> request name).
  Fields the request leaves unset take `defaults` (the model's generation_config.json, as vLLM's server), whose
  max_tokens caps the request's. The token controls and the output constraint: entrypoints/output_controls.py."""
  given = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
  given.update(token_controls(req), structured_outputs=output_constraint(req))
  model_defaults = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
  max_tokens = min(max_tokens, (defaults or {}).get("max_tokens", max_tokens))
  try:
    return SamplingParams(**{**model_defaults, **given}, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
  except SamplingParamsError as e:
    raise bad_request(str(e), {**REQUEST_NAMES, **(rename or {})}.get(e.param, e.param)) from None


def request_priority(state: ServerState, req: SamplingRequest) -> int:
  """The request's scheduling priority (vLLM's field: lower runs first), refused where the engine cannot honour it."""
  priority = req.priority or 0
  try: check_priority(priority, state.require_engine().config.scheduling_policy)
  except ValueError as e: raise bad_request(str(e), "priority") from None
  return priority


def check_engine_limits(state: ServerState, prompt: Prompt, params: SamplingParams, param: str,
                        rename: dict[str, str] | None = None) -> None:
  """What the engine itself refuses (a request bigger than the whole KV cache, stop strings without a tokenizer, more
  logprobs than --max-logprobs, ...)."""
  try: state.require_engine().validate(prompt.engine_prompt(), params)
  except PromptError as e: raise bad_request(str(e), param) from None
  except SamplingParamsError as e: raise bad_request(str(e), {**REQUEST_NAMES, **(rename or {})}.get(e.param, e.param)) from None


async def generate_many(state: ServerState, prompts: list[Prompt], params: list[SamplingParams],
                        request_id: str, priority: int = 0) -> AsyncIterator[tuple[int, RequestOutput]]:
  """One engine request per prompt, their outputs interleaved as (prompt index, output) until every one finishes.
  Closing this generator (the client went away) cancels the rest, which aborts them in the engine."""
  engine = state.require_engine()
  log_inputs(state, prompts, params, request_id)
  sources = [functools.partial(engine.generate, prompt.engine_prompt(), p, f"{request_id}-{i}", priority, group=request_id)
             for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))]
  async for item in run_many(state, sources): yield item


def log_inputs(state: ServerState, prompts: list[Prompt], params: list[SamplingParams] | list[BeamSearchParams],
               request_id: str) -> None:
  if state.request_logger is None: return
  for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
    state.request_logger.log_inputs(f"{request_id}-{i}", prompt.text, prompt.token_ids, p)


async def run_many(state: ServerState, sources: list[Source]) -> AsyncIterator[tuple[int, RequestOutput]]:
  """Every source's outputs interleaved as (source index, output) until each has given a finished one. Closing this
  generator cancels the sources (an engine request cancelled is aborted); a shutdown ends it with an error."""
  queue: asyncio.Queue = asyncio.Queue()

  async def pump(i: int) -> None:
    tracker = state.metrics.tracker()
    try:
      async for out in sources[i]():
        tracker.observe(out)
        queue.put_nowait((i, out))
    except EngineDeadError as e:
      queue.put_nowait((i, engine_dead(str(e))))
    except Exception as e:
      queue.put_nowait((i, e))
    finally:
      tracker.close()

  tasks = [asyncio.create_task(pump(i)) for i in range(len(sources))]
  state.in_flight.add(queue)
  try:
    remaining = len(sources)
    while remaining:
      i, item = await queue.get()
      if isinstance(item, BaseException): raise item
      remaining -= item.finished
      yield i, item
  finally:
    state.in_flight.discard(queue)
    for t in tasks: t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def finals(outputs: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
  """The finished output of each of `count` sources, in their order."""
  done: list[RequestOutput | None] = [None] * count
  async for i, out in outputs:
    if out.finished: done[i] = out
  return [f for f in done if f is not None]


async def final_outputs(state: ServerState, prompts: list[Prompt], params: list[SamplingParams],
                        request_id: str, priority: int = 0) -> list[RequestOutput]:
  return await finals(generate_many(state, prompts, params, request_id, priority), len(prompts))


async def _disconnected(request: Request) -> None:
  # the body has been read, so the next message the server sends us is http.disconnect
  while (await request.receive())["type"] != "http.disconnect": pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
  """`work`'s result, or None (with `work` cancelled, its engine requests aborted) if the client goes away first."""
  task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
  try:
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    for t in (task, watch):
      if not t.done(): t.cancel()
    await asyncio.gather(task, watch, return_exceptions=True)
  return task.result() if task in done else None


def sse(data: dict[str, Any] | str) -> str:
  return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def stream_error(e: Exception) -> str:
  """An error after the stream started (the status line is already sent): one error event."""
  err = e if isinstance(e, APIError) else APIError(500, f"{type(e).__name__}: {e}", code="internal_error")
  return sse(err.body())


def finite(logprob: float) -> float: return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def prompt_logprobs_json(entries: PromptLogprobs | None) -> list[dict[str, PromptLogprob] | None] | None:
  """vLLM's JSON shape of prompt logprobs: per prompt token null (the first) or {token id: {logprob, rank, decoded_token}}."""
  if entries is None: return None
  return [None if e is None else {str(t): PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
                                  for t, lp in e.items()} for e in entries]
