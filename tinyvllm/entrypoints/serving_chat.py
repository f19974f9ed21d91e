"""POST /v1/chat/completions: the messages through the model's chat template, then one engine request with n samples."""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tinyvllm.entrypoints import serving_beam_search as beam_search
from tinyvllm.entrypoints.chat_output import ChatOutputParser, MessageDelta
from tinyvllm.entrypoints.chat_tools import ToolPlan, plan_tools
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
  unless_disconnected,
)
from tinyvllm.entrypoints.errors import bad_request
from tinyvllm.entrypoints.protocol import (
  ChatChoice,
  ChatChunkChoice,
  ChatCompletionChunk,
  ChatCompletionRequest,
  ChatCompletionResponse,
  ChatLogprobs,
  ChatTokenLogprob,
  TokenizeRequest,
  TopLogprob,
  Usage,
  chunk_event,
)
from tinyvllm.outputs import CompletionOutput, Logprob, RequestOutput
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams
from tinyvllm.tokenizer import Tokenizer, TokenizerError
from tinyvllm.tokenizer.chat_template import parse_tool_call_arguments

_RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tokenize", "documents",
                                     "tools", "chat_template"})
# between a forced call's JSON tokens: one space at most, as the calls are written (a JSON grammar's free whitespace lets a
# model write newlines and tabs without end, which a weak or random one does)
TOOL_CALL_WHITESPACE = "[ ]?"
UNTRUSTED_TEMPLATE = ("a chat_template was passed with the request, but the server does not render templates from requests "
                      "unless started with --trust-request-chat-template")


def render_chat(state: ServerState, req: ChatCompletionRequest | TokenizeRequest, tools: list[dict[str, Any]] | None) -> str:
  """The conversation as the chat template writes it: the model's, --chat-template's, or the request's own (vLLM's
  chat_template, with --trust-request-chat-template); `tools`, chat_template_kwargs (e.g. enable_thinking) and
  documents, for templates that render them, reach it."""
  tokenizer, template = state.tokenizer("chat"), state.chat.chat_template
  if req.chat_template is not None:
    if not state.chat.trust_request_chat_template: raise bad_request(UNTRUSTED_TEMPLATE, "chat_template")
    template = req.chat_template
  if not tokenizer.has_chat_template and template is None:
    raise bad_request("this model has no chat template: use /v1/completions (or start the server with --chat-template)", "messages")
  kwargs = req.chat_template_kwargs or {}
  if bad := sorted(_RESERVED_TEMPLATE_ARGS & kwargs.keys()):
    raise bad_request(f"chat_template_kwargs cannot set {', '.join(bad)}", "chat_template_kwargs")
  documents = getattr(req, "documents", None)
  kwargs = {**kwargs, **({"documents": documents} if documents is not None else {}), **({"tools": tools} if tools else {})}
  if req.continue_final_message and req.add_generation_prompt is not False:
    raise bad_request("continue_final_message needs add_generation_prompt: false (the first continues the last message, the "
                      "second starts a new one)", "continue_final_message")
  param = "chat_template" if req.chat_template is not None else "messages"
  try:
    messages = parse_tool_call_arguments([m.template_dict() for m in req.messages or []])
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt is not False,
                                         chat_template=template, continue_final_message=bool(req.continue_final_message), **kwargs)
  except TokenizerError as e:
    raise bad_request(str(e), param) from None
  assert isinstance(text, str)
  return text


def _prepare(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan) -> tuple[Prompt, int | None]:
  if req.top_logprobs and not req.logprobs: raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
  text = render_chat(state, req, plan.template_tools)
  # the template writes the special tokens; add_special_tokens adds the tokenizer's (BOS) in front as well
  prompt = Prompt(text, state.tokenizer("chat").encode(text, add_special_tokens=bool(req.add_special_tokens)))
  if not prompt.token_ids: raise bad_request("the chat template rendered no tokens", "messages")
  return prompt, (req.top_logprobs or 0) if req.logprobs else None


def _with_tools(state: ServerState, req: ChatCompletionRequest, params: SamplingParams, plan: ToolPlan) -> SamplingParams:
  """The grammar of a forced tool call, and the parser's markers kept in the text where the tokenizer makes them special
  tokens (unless the request says otherwise)."""
  changes: dict[str, Any] = {}
  if plan.schema is not None:
    if params.structured_outputs is not None:
      raise bad_request("tool_choice \"required\" or a named function constrains the output to tool calls; it cannot be "
                        "combined with another output constraint (response_format, structured_outputs)", "tool_choice")
    changes["structured_outputs"] = StructuredOutputsParams(json=plan.schema, whitespace_pattern=TOOL_CALL_WHITESPACE)
  tokenizer = state.tokenizer("chat")
  special = {tokenizer.added_tokens.get(m) for m in plan.markers} & tokenizer.special_token_ids
  if special and "skip_special_tokens" not in req.model_fields_set: changes["skip_special_tokens"] = False
  return dataclasses.replace(params, **changes) if changes else params


def _output_parser(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan, prompt: Prompt) -> ChatOutputParser:
  return ChatOutputParser(plan, state.chat.reasoning_parser, prompt.text or "", req.include_reasoning is not False)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
  state.require_ready()
  state.check_model(req.model)
  check_streaming(req)
  priority = request_priority(state, req)
  check_request_size(state, 1, req.n or 1)
  max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
  param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
  if max_tokens is not None and max_tokens < 1: raise bad_request(f"{param} must be >= 1, got {max_tokens}", param)
  if req.include_reasoning is False and state.chat.reasoning_parser is None:
    raise bad_request("include_reasoning: false needs a server started with --reasoning-parser (without one the reply is not "
                      "split into reasoning and content)", "include_reasoning")
  if req.use_beam_search: beam_search.check_fields(req, chat=True)
  else: beam_search.check_no_length_penalty(req)
  plan = plan_tools(req, state.chat)
  prompt, logprobs = _prepare(state, req, plan)
  if req.use_beam_search: return await _beam_search_reply(state, req, request, plan, prompt, max_tokens, param, priority)
  # a forced call's grammar is made from the tools' parameters: a schema the grammar engine refuses is the tools' fault
  rename = {"logprobs": "top_logprobs", "max_tokens": param, **({"structured_outputs": "tools"} if plan.forced else {})}
  params = sampling_params(req, check_context(state, prompt, max_tokens, "messages"), logprobs, req.prompt_logprobs, rename,
                           state.sampling_defaults)
  params = _with_tools(state, req, params, plan)
  check_engine_limits(state, prompt, params, "messages", rename)
  request_id, created, engine_id = response_id("chatcmpl", req), int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
  if req.stream:
    return StreamingResponse(_stream(state, req, prompt, params, (request_id, engine_id), created, plan),
                             media_type="text/event-stream")
  finals = await unless_disconnected(request, final_outputs(state, [prompt], [params], engine_id, priority))
  if finals is None: return Response(status_code=499)
  return _reply(state, req, plan, prompt, finals[0], request_id, created, logprobs)


async def _beam_search_reply(state: ServerState, req: ChatCompletionRequest, request: Request, plan: ToolPlan, prompt: Prompt,
                             max_tokens: int | None, param: str, priority: int) -> Response:
  """use_beam_search: the reply's n choices are the prompt's beams, best first (serving_beam_search.py)."""
  search = beam_search.beam_search_params(state, req, prompt, max_tokens, "messages")
  request_id, created, engine_id = response_id("chatcmpl", req), int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
  finals = await unless_disconnected(request, beam_search.beam_search_outputs(state, req, [prompt], [search], engine_id, priority))
  if finals is None: return Response(status_code=499)
  return _reply(state, req, plan, prompt, finals[0], request_id, created, None)


def _reply(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan, prompt: Prompt, out: RequestOutput, request_id: str,
           created: int, logprobs: int | None) -> Response:
  """The whole reply: a message per output (reasoning and tool calls parsed out), its logprobs, the usage."""
  tokenizer, ids = state.require_engine().tokenizer, returns_token_ids(state, req)
  parsers = [_output_parser(state, req, plan, prompt) for _ in out.outputs]
  choices = [ChatChoice(index=o.index, message=p.message(o.text), finish_reason=p.finish_reason(o.finish_reason),
                        stop_reason=o.stop_reason, logprobs=_logprobs(tokenizer, o.token_ids, o.logprobs, logprobs),
                        token_ids=list(o.token_ids) if ids else None)
             for o, p in zip(out.outputs, parsers, strict=True)]
  body = ChatCompletionResponse(id=request_id, created=created, model=state.served_model_name, choices=choices,
                                usage=_usage(prompt, sum(len(o.token_ids) for o in out.outputs)),
                                prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
                                prompt_token_ids=prompt.token_ids if ids else None)
  return Response(body.model_dump_json(), media_type="application/json")


def _usage(prompt: Prompt, completion_tokens: int) -> Usage:
  n = len(prompt.token_ids)
  return Usage(prompt_tokens=n, completion_tokens=completion_tokens, total_tokens=n + completion_tokens)


def _top(tokenizer: Tokenizer | None, token_id: int, entry: Logprob) -> TopLogprob:
  raw = tokenizer.token_bytes(token_id) if tokenizer is not None else b""
  text = entry.decoded_token if entry.decoded_token is not None else raw.decode(errors="replace")
  return TopLogprob(token=text, logprob=finite(entry.logprob), bytes=list(raw))


def _logprobs(tokenizer: Tokenizer | None, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
              top_k: int | None) -> ChatLogprobs | None:
  """logprobs.content: each token with its top_k alternatives (by rank)."""
  if top_k is None: return None
  content = []
  for token_id, entries in zip(token_ids, logprobs or [], strict=False):
    top = [_top(tokenizer, t, lp) for t, lp in sorted(entries.items(), key=lambda kv: kv[1].rank) if lp.rank <= top_k][:top_k]
    content.append(ChatTokenLogprob(**_top(tokenizer, token_id, entries[token_id]).model_dump(), top_logprobs=top))
  return ChatLogprobs(content=content)


def _delta_logprobs(tokenizer: Tokenizer | None, o: CompletionOutput, top_k: int | None) -> ChatLogprobs | None:
  if top_k is None or not o.delta_token_ids: return None
  return _logprobs(tokenizer, o.delta_token_ids, (o.logprobs or [])[-len(o.delta_token_ids):], top_k)


async def _stream(state: ServerState, req: ChatCompletionRequest, prompt: Prompt, params: SamplingParams, ids: tuple[str, str],
                  created: int, plan: ToolPlan) -> AsyncIterator[str]:
  """Role chunk per choice, delta chunks (content, reasoning_content, tool_calls), a closing chunk with finish_reason per
  choice, [usage chunk], [DONE]; `ids`: the response's and the engine request's ids."""
  tokenizer, model, usage_on = state.require_engine().tokenizer, state.served_model_name, req.include_usage
  top_k, (request_id, engine_id), with_ids = params.logprobs, ids, returns_token_ids(state, req)
  parsers = [_output_parser(state, req, plan, prompt) for _ in range(params.n)]

  def chunk(choice: ChatChunkChoice, prompt_ids: list[int] | None = None) -> str:
    body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice], prompt_token_ids=prompt_ids)
    return chunk_event(body, usage_on)

  for i in range(params.n):
    role = ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""}, token_ids=[] if with_ids else None)
    yield chunk(role, prompt.token_ids if with_ids and i == 0 else None)
  finished: set[int] = set()
  completion_tokens = 0
  try:
    async for _, out in generate_many(state, [prompt], [params], engine_id, req.priority or 0):
      for o in out.outputs:
        if o.index in finished: continue
        new_ids = list(o.delta_token_ids) if with_ids else None
        for choice in _delta_choices(o.index, parsers[o.index].feed(o.delta_text, o.finished), _delta_logprobs(tokenizer, o, top_k),
                                     new_ids):
          yield chunk(choice)
        if o.finished:
          finished.add(o.index)
          completion_tokens += len(o.token_ids)
          yield chunk(ChatChunkChoice(index=o.index, delta={}, finish_reason=parsers[o.index].finish_reason(o.finish_reason),
                                      stop_reason=o.stop_reason))
    if usage_on:
      last = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=_usage(prompt, completion_tokens))
      yield chunk_event(last)
  except Exception as e:
    yield stream_error(e)
  yield sse("[DONE]")


def _delta_choices(index: int, delta: MessageDelta, logprobs: ChatLogprobs | None, token_ids: list[int] | None) -> list[ChatChunkChoice]:
  """A step's chunks for one choice: its text, then each tool-call delta; the step's logprobs and token ids ride on the
  first (a step whose text is held back, e.g. a tool call being written, still sends them)."""
  deltas = delta.openai()
  if not deltas and (logprobs is not None or token_ids): deltas = [{"content": ""}]
  return [ChatChunkChoice(index=index, delta=d, logprobs=logprobs if i == 0 else None,
                          token_ids=(token_ids if i == 0 else []) if token_ids is not None else None) for i, d in enumerate(deltas)]
