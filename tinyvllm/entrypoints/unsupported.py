"""What the server refuses, as data: the fields of OpenAI's and vLLM's request shapes that it does not implement.

A request field is one of three things:
- implemented: a field of the endpoint's pydantic model (tinyvllm/entrypoints/protocol.py);
- refused: listed here with the feature it asks for. A value that asks for exactly the default behaviour (what clients
  send by default: `store: false`, `suffix: ""`, `modalities: ["text"]`, ...) is accepted, since
  honouring it takes nothing; any other value is a 400 naming the field (OpenAI's code `unsupported_parameter`);
- unknown (a typo, an extension nobody lists): a 400 as OpenAI's own server answers it, "Unrecognized request argument
  supplied: X".
Nothing is accepted and then ignored. Implementing a feature moves its fields from here into the model.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import BaseModel

Accepts = Callable[[Any, Mapping[str, Any]], bool]   # (the field's value, the whole request body) -> default behaviour


def equals(value: Any, default: Any) -> bool:
  """JSON equality without Python's bool/int mixing (true is not 1) but with 1 == 1.0."""
  if isinstance(value, bool) or isinstance(default, bool): return value is default
  if isinstance(default, (int, float)): return isinstance(value, (int, float)) and value == default
  return value == default


def unset(value: Any, body: Mapping[str, Any]) -> bool: return value is None


def empty(value: Any, body: Mapping[str, Any]) -> bool: return value is None or any(equals(value, e) for e in ([], {}, ""))


def one_of(*defaults: Any) -> Accepts: return lambda value, body: value is None or any(equals(value, d) for d in defaults)


def _no_functions(value: Any, body: Mapping[str, Any]) -> bool:
  """A function_call that calls nothing: "none", or "auto" without functions."""
  return value is None or value == "none" or (value == "auto" and not body.get("functions"))


@dataclass(frozen=True)
class Unsupported:
  feature: str              # what the field asks for that this server does not do (and what would implement it)
  accepts: Accepts = unset  # the values that ask for the default behaviour, which are accepted


STRUCTURED = {
  "guided_decoding_backend": Unsupported("the grammar engine is llguidance; choosing another is not implemented",
                                         one_of("auto", "guidance")),
}
# the fields of vLLM's structured_outputs object that the server does not implement (none now)
STRUCTURED_OUTPUTS: dict[str, Unsupported] = {}

# vLLM's extra sampling and request fields that both generation endpoints take
SAMPLING = {
  "spaces_between_special_tokens": Unsupported("the detokenizer never adds spaces between special tokens",
                                               one_of(True)),
  "truncate_prompt_tokens": Unsupported("prompt truncation is not implemented: send a prompt that fits the context"),
  "truncation_side": Unsupported("prompt truncation is not implemented"),
  "logprob_token_ids": Unsupported("logprobs of chosen token ids are not implemented: use logprobs (top-k)", empty),
  "logits_processors": Unsupported("custom logits processors are not implemented", empty),
  "repetition_detection": Unsupported("stopping on repeated n-grams is not implemented"),
  "thinking_token_budget": Unsupported("a budget for reasoning tokens is not implemented", one_of(-1)),
  "cache_salt": Unsupported("salting the prefix cache per request is not implemented"),
  "kv_transfer_params": Unsupported("disaggregated serving (KV transfer) is not implemented", empty),
  "ec_transfer_params": Unsupported("disaggregated serving (encoder-cache transfer) is not implemented", empty),
  "return_tokens_as_token_ids": Unsupported("tokens as 'token_id:N' strings in logprobs are not implemented", one_of(False)),
  "return_token_offsets": Unsupported("token offsets belong to vLLM's render endpoints, which this server does not have",
                                      one_of(False)),
  "mm_processor_kwargs": Unsupported("the server takes text only (no multimodal processor)", empty),
  "media_io_kwargs": Unsupported("the server takes text only (no media inputs)", empty),
}

COMPLETION = {
  **STRUCTURED, **SAMPLING,
  "suffix": Unsupported("insertion (text after the completion, fill-in-the-middle) is not implemented", empty),
  "prompt_embeds": Unsupported("prompts as embeddings are not implemented: send text or token ids"),
}

# OpenAI's deprecated function calling (tools and tool_choice replace it; vLLM does not take it either)
FUNCTIONS = {
  "functions": Unsupported("the deprecated function calling is not implemented: use tools and tool_choice", empty),
  "function_call": Unsupported("the deprecated function calling is not implemented: use tools and tool_choice; only \"none\" "
                               "is accepted", _no_functions),
}

# OpenAI's chat fields for its own platform's services
OPENAI_SERVICES = {
  "audio": Unsupported("audio output is not implemented"),
  "modalities": Unsupported("only text output is implemented; only [\"text\"] is accepted",
                            lambda v, body: v is None or v == ["text"]),
  "prediction": Unsupported("predicted outputs (speculative decoding from given text) are not implemented"),
  "reasoning_effort": Unsupported("reasoning effort is not implemented: use chat_template_kwargs (e.g. enable_thinking)"),
  "verbosity": Unsupported("a verbosity control is not implemented", one_of("medium")),
  "web_search_options": Unsupported("web search is not implemented"),
  "store": Unsupported("stored completions are not implemented", one_of(False)),
  "metadata": Unsupported("metadata belongs to stored completions, which are not implemented", empty),
  "service_tier": Unsupported("there is one service tier; only \"auto\" or \"default\" is accepted",
                              one_of("auto", "default")),
  "moderation": Unsupported("moderation is not implemented"),
  "prompt_cache_options": Unsupported("explicit prompt-cache breakpoints and lifetimes are not implemented "
                                      "(the prefix cache is automatic)", empty),
  "prompt_cache_retention": Unsupported("cache lifetimes are not guaranteed (the prefix cache evicts least recently "
                                        "used blocks); only \"in_memory\" is accepted", one_of("in_memory")),
}

# beam search is the completions endpoint's (vLLM's chat endpoint has it too)
CHAT = {
  **STRUCTURED, **SAMPLING, **FUNCTIONS, **OPENAI_SERVICES,
  "echo": Unsupported("echoing the last message into the reply is not implemented", one_of(False)),
}

TOKENIZE = {
  "mm_processor_kwargs": SAMPLING["mm_processor_kwargs"],
  "media_io_kwargs": SAMPLING["media_io_kwargs"],
  "return_token_strs": Unsupported("token strings are not implemented (the tokenizer keeps token bytes)", one_of(False)),
}

STREAM_OPTIONS = {
  "include_obfuscation": Unsupported("obfuscation padding on stream events is not implemented", one_of(False)),
  "continuous_usage_stats": Unsupported("usage on every streamed chunk is not implemented: use include_usage",
                                        one_of(False)),
}


class RefusedField(ValueError):
  """A refused or unknown request field; `param` is the request's top-level field that holds it."""

  def __init__(self, param: str, message: str, code: str | None):
    super().__init__(message)
    self.param, self.code = param, code


def _nested_model(model: type[BaseModel], name: str) -> type[BaseModel] | None:
  """The request model of a field that holds one (stream_options: StreamOptions | None), else None."""
  annotation = model.model_fields[name].annotation
  for t in (annotation, *get_args(annotation)):
    if isinstance(t, type) and issubclass(t, BaseModel) and hasattr(t, "refused"): return t
  return None


def implemented_fields(model: type[BaseModel], data: dict[str, Any], path: str = "") -> dict[str, Any]:
  """`data` (a request body, or an object in it) with the refused fields that ask for the default behaviour left out;
  raises RefusedField for a refused field with another value or a field in no list. `model.refused` is its table."""
  refused: Mapping[str, Unsupported] = getattr(model, "refused", {})
  fields = {info.alias or field: field for field, info in model.model_fields.items()}   # by the name the JSON uses
  kept: dict[str, Any] = {}
  for name, value in data.items():
    where, param = f"{path}{name}", (path.split(".")[0] or name)
    if name in fields:
      nested = _nested_model(model, fields[name])
      kept[name] = implemented_fields(nested, value, f"{where}.") if nested is not None and isinstance(value, dict) else value
    elif (rule := refused.get(name)) is not None:
      if not rule.accepts(value, data): raise RefusedField(param, f"{where} is not supported: {rule.feature}", "unsupported_parameter")
    else:
      raise RefusedField(param, f"Unrecognized request argument supplied: {where}", None)
  return kept
