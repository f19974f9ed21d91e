"""The OpenAI API's request and response shapes (with vLLM's extensions), as pydantic models.

Requests are parsed strictly (a string is not a number, 1 is not true). A request model's fields are what its endpoint
implements; its `refused` table (tinyvllm/entrypoints/unsupported.py) lists the fields of OpenAI's and vLLM's shapes
that it does not, and any other field is refused too.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tinyvllm.entrypoints.unsupported import CHAT, COMPLETION, STREAM_OPTIONS, STRUCTURED_OUTPUTS, TOKENIZE, Unsupported

MAX_N = 128          # OpenAI's own limit on n
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
MAX_PROMPT_LOGPROBS = 20   # SamplingParams' limit, as vLLM's default max_logprobs
# Every integer a request carries fits in 64 bits (it crosses to the engine core as msgpack); floats are finite.
Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)]


class StrictModel(BaseModel):
  model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
  refused: ClassVar[Mapping[str, Unsupported]] = {}


class StreamOptions(StrictModel):
  refused = STREAM_OPTIONS
  include_usage: bool | None = False


class JsonSchemaFormat(StrictModel):
  """OpenAI's response_format.json_schema (the schema is always enforced: strict or not, as vLLM does)."""
  name: str
  description: str | None = None
  schema_: dict[str, Any] | None = Field(None, alias="schema")
  strict: bool | None = None


class StructuralTag(StrictModel):
  """One structure of vLLM's structural_tag response format: its begin text, the JSON schema of what follows, its end."""
  begin: str
  schema_: dict[str, Any] = Field(alias="schema")
  end: str


class ResponseFormat(StrictModel):
  type: Literal["text", "json_object", "json_schema", "structural_tag"]
  json_schema: JsonSchemaFormat | None = None
  structures: list[StructuralTag] | None = None   # structural_tag: free text in which each trigger starts a structure
  triggers: list[str] | None = None


class StructuredOutputsRequest(StrictModel):
  """vLLM's structured_outputs extra body: exactly one of json, regex, choice, grammar, json_object."""
  refused = STRUCTURED_OUTPUTS
  json_: str | dict[str, Any] | None = Field(None, alias="json")
  regex: str | None = None
  choice: list[str] | None = None
  grammar: str | None = None
  json_object: bool | None = None
  structural_tag: str | None = None
  disable_any_whitespace: bool = False
  whitespace_pattern: str | None = None
  disable_additional_properties: bool = False
  disable_fallback: bool = False   # (one grammar engine: there is nothing to fall back to)


class SamplingRequest(StrictModel):
  """The fields both generation endpoints take; None means the engine's default."""
  model: str | None = None
  n: int | None = Field(1, ge=1, le=MAX_N)
  temperature: float | None = None
  top_p: float | None = None
  top_k: Int64 | None = None
  min_p: float | None = None
  seed: Seed | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  repetition_penalty: float | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[Int64] | None = None
  ignore_eos: bool | None = False
  include_stop_str_in_output: bool | None = False
  skip_special_tokens: bool | None = True
  prompt_logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)
  add_special_tokens: bool | None = None   # default: True for a prompt, False for messages (the template has them)
  user: str | None = None                  # the caller's end user: an identifier, which never changes the output
  request_id: str | None = None            # vLLM's: the response's id is made from it
  priority: Int64 | None = None            # vLLM's: with --scheduling-policy priority, lower values are served first
  stream: bool | None = False
  stream_options: StreamOptions | None = None
  return_token_ids: bool | None = None     # vLLM's: prompt and output token ids beside the text (always without a tokenizer)
  # token controls (OpenAI's logit_bias: token id strings to [-100, 100]; vLLM's others)
  logit_bias: dict[str, float] | None = None
  allowed_token_ids: list[Int64] | None = None
  bad_words: list[str] | None = None
  min_tokens: Int64 | None = None
  vllm_xargs: dict[str, Any] | None = None   # vLLM's: the request's extra_args (for the server's --logits-processors)
  # output constraints (entrypoints/output_controls.py): OpenAI's response_format, vLLM's structured_outputs and its older
  # guided_* fields
  response_format: ResponseFormat | None = None
  structured_outputs: StructuredOutputsRequest | None = None
  guided_json: str | dict[str, Any] | None = None
  guided_regex: str | None = None
  guided_choice: list[str] | None = None
  guided_grammar: str | None = None
  structural_tag: str | None = None   # (vLLM's before structured_outputs.structural_tag)
  guided_whitespace_pattern: str | None = None
  use_beam_search: bool | None = False   # vLLM's: n is the beam width (entrypoints/serving_beam_search.py)
  length_penalty: float | None = 1.0     # vLLM's, for beam search

  @property
  def include_usage(self) -> bool: return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
  refused = COMPLETION
  prompt: str | list[str] | list[Int64] | list[list[Int64]]
  max_tokens: Int64 | None = 16
  logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
  echo: bool | None = False
  best_of: int | None = Field(None, ge=1, le=MAX_N)   # sample best_of, return the n of the highest cumulative logprob


class TextPart(StrictModel):
  type: Literal["text"]
  text: str


class ChatMessage(BaseModel):
  # extra fields (name, reasoning_content, tool_calls, ...) reach the chat template as they are
  model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None = None

  @model_validator(mode="before")
  @classmethod
  def _text_parts_only(cls, data: Any) -> Any:
    """A part the served models cannot take (an image, audio, a file) is named, rather than failing as a malformed part."""
    parts = data.get("content") if isinstance(data, dict) else None
    for part in parts if isinstance(parts, list) else []:
      kind = part.get("type") if isinstance(part, dict) else None
      if isinstance(kind, str) and kind != "text":
        raise ValueError(f"content parts of type {kind!r} are not supported: the served model takes text only "
                         "(send text parts, {\"type\": \"text\", \"text\": ...})")
    return data

  def template_dict(self) -> dict[str, Any]:
    out = self.model_dump(exclude_none=True)
    if isinstance(self.content, list): out["content"] = "\n".join(p.text for p in self.content)
    return out


class FunctionDefinition(StrictModel):
  name: str = Field(min_length=1)
  description: str | None = None
  parameters: dict[str, Any] | None = None   # a JSON schema of the arguments object
  strict: bool | None = None                 # the arguments must match the schema: enforced by the grammar of required/named


class ChatTool(StrictModel):
  type: Literal["function"]
  function: FunctionDefinition


class FunctionName(StrictModel):
  name: str


class NamedToolChoice(StrictModel):
  type: Literal["function"]
  function: FunctionName


class ChatCompletionRequest(SamplingRequest):
  refused = CHAT
  messages: list[ChatMessage] = Field(min_length=1)
  max_tokens: Int64 | None = None
  max_completion_tokens: Int64 | None = None
  logprobs: bool | None = False
  top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
  add_generation_prompt: bool | None = True
  continue_final_message: bool | None = False    # vLLM's: the reply goes on writing the last message
  chat_template: str | None = None               # vLLM's: this template instead (--trust-request-chat-template)
  chat_template_kwargs: dict[str, Any] | None = None
  documents: list[dict[str, Any]] | None = None   # for templates that render retrieved documents (vLLM's)
  tools: list[ChatTool] | None = None
  tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None   # None: "auto" with tools (vLLM's)
  parallel_tool_calls: bool | None = True
  include_reasoning: bool | None = True           # vLLM's: false leaves the reasoning out (with --reasoning-parser)
  safety_identifier: str | None = None            # like user: an identifier, which never changes the output
  prompt_cache_key: str | None = None             # a cache-routing hint: every request shares the one prefix cache here


class TokenizeRequest(StrictModel):
  refused = TOKENIZE
  model: str | None = None
  prompt: str | None = None
  messages: list[ChatMessage] | None = Field(None, min_length=1)
  add_special_tokens: bool | None = None   # default: True for a prompt, False for messages (the template has them)
  add_generation_prompt: bool | None = True
  continue_final_message: bool | None = False
  chat_template: str | None = None
  chat_template_kwargs: dict[str, Any] | None = None
  tools: list[ChatTool] | None = None


class DetokenizeRequest(StrictModel):
  model: str | None = None
  tokens: list[Int64]


# ---- responses ----
class Usage(BaseModel):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int


class CompletionLogprobs(BaseModel):
  tokens: list[str] = Field(default_factory=list)
  token_logprobs: list[float | None] = Field(default_factory=list)
  top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
  text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
  """vLLM's Logprob as JSON."""
  logprob: float
  rank: int
  decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]   # per prompt token: null (the first), {token id: its logprob}


class CompletionChoice(BaseModel):
  index: int
  text: str
  logprobs: CompletionLogprobs | None = None
  finish_reason: str | None = None
  stop_reason: int | str | None = None
  token_ids: list[int] | None = None          # vLLM's return_token_ids: the output's (a stream chunk's: its new ones)
  prompt_token_ids: list[int] | None = None   # ... and the prompt's (in a stream: in the choice's first chunk)


class CompletionResponseChoice(CompletionChoice):
  prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
  id: str
  object: Literal["text_completion"] = "text_completion"
  created: int
  model: str
  choices: list[CompletionResponseChoice]
  usage: Usage


class CompletionStreamResponse(BaseModel):
  id: str
  object: Literal["text_completion"] = "text_completion"
  created: int
  model: str
  choices: list[CompletionChoice]
  usage: Usage | None = None


class TopLogprob(BaseModel):
  token: str
  logprob: float
  bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
  top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
  content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
  name: str
  arguments: str   # a JSON object, as a string


class ToolCall(BaseModel):
  id: str
  type: Literal["function"] = "function"
  function: FunctionCall


class AssistantMessage(BaseModel):
  role: Literal["assistant"] = "assistant"
  content: str | None
  reasoning_content: str | None = None   # vLLM's, with --reasoning-parser
  tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
  index: int
  message: AssistantMessage
  logprobs: ChatLogprobs | None = None
  finish_reason: str | None = None
  stop_reason: int | str | None = None
  token_ids: list[int] | None = None          # vLLM's return_token_ids


class ChatCompletionResponse(BaseModel):
  id: str
  object: Literal["chat.completion"] = "chat.completion"
  created: int
  model: str
  choices: list[ChatChoice]
  usage: Usage
  prompt_logprobs: PromptLogprobs | None = None   # vLLM's
  prompt_token_ids: list[int] | None = None       # vLLM's return_token_ids


class ChatChunkChoice(BaseModel):
  index: int
  # {"role": "assistant", "content": ""} first, then {"content": ...}, {"reasoning_content": ...} or {"tool_calls": [...]},
  # {} at the end
  delta: dict[str, Any]
  logprobs: ChatLogprobs | None = None
  finish_reason: str | None = None
  stop_reason: int | str | None = None
  token_ids: list[int] | None = None   # vLLM's return_token_ids: the chunk's new tokens


class ChatCompletionChunk(BaseModel):
  id: str
  object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
  created: int
  model: str
  choices: list[ChatChunkChoice]
  usage: Usage | None = None
  prompt_token_ids: list[int] | None = None   # vLLM's return_token_ids: in the first chunk


def chunk_event(chunk: BaseModel, include_usage: bool = True) -> str:
  """A streamed chunk as a server-sent event. With include_usage every chunk carries `usage` (null until the last);
  without it, none does. pydantic writes the JSON itself: half the time of a dict through json.dumps, on the path
  every streamed token takes."""
  return f"data: {chunk.model_dump_json(exclude=None if include_usage else {'usage'})}\n\n"
