"""Chat templates: found in the tokenizer folder, rendered with jinja2 the way HF transformers renders them."""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tinyvllm.tokenizer.errors import TokenizerError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def find_chat_template(folder: Path | None, tokenizer_config: dict[str, Any]) -> str | None:
  """chat_template.jinja beside the tokenizer, else tokenizer_config's `chat_template` (a string, or a list of
  {name, template} of which "default" is used)."""
  if folder is not None and (folder / "chat_template.jinja").is_file():
    return (folder / "chat_template.jinja").read_text(encoding="utf-8")
  value = tokenizer_config.get("chat_template")
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    value = named.get("default", next(iter(named.values()), None))
  return value if isinstance(value, str) and value else None


def load_chat_template(value: str) -> str:
  """A chat template given by the user (vLLM's --chat-template): a file's contents, or the value itself when it reads
  as a template (it has braces or a newline); anything else is a file that is not there."""
  path = Path(value).expanduser()
  if path.is_file():
    return path.read_text(encoding="utf-8")
  if any(c in value for c in "{}\n"):
    return value
  raise TokenizerError(f"chat template {value!r}: no such file, and it is not a template (no braces or newline)")


def _raise_exception(message: str) -> None:
  raise jinja2.exceptions.TemplateError(message)
def _strftime_now(fmt: str) -> str:
  return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
  # jinja's own tojson escapes HTML characters and non-ASCII; HF's keeps them
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
  """jinja's namespace(), refusing underscore names (a sandbox escape route), as HF does."""

  def __init__(*args: Any, **kwargs: Any):
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name: str, value: Any) -> None:
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes, got {name!r}")


class _GenerationTag(Extension):
  """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): rendered as its body."""
  tags = frozenset({"generation"})

  def parse(self, parser: Any) -> nodes.Node:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller: Any) -> str:
    return caller()


@cache
def _environment() -> ImmutableSandboxedEnvironment:
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                     dict=lambda *args, **kwargs: dict(*args, **kwargs))
  return env


def _plain(value: Any) -> Any:
  """A fresh copy made of JSON types only, so the template never edits or reaches into the caller's objects."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, Mapping):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return f"<{type(value).__name__}>"


def check_messages(messages: Any) -> list[dict[str, Any]]:
  """The messages as plain dicts; a TokenizerError names the first one that is not {role: str, content: ...}."""
  if not isinstance(messages, (list, tuple)):
    raise TokenizerError(f"messages must be a list of dicts, got {type(messages).__name__}")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping):
      raise TokenizerError(f"message {i} must be a dict with role and content, got {m!r}")
    if not isinstance(m.get("role"), str):
      raise TokenizerError(f"message {i} has no string 'role': {m!r}")
    if "content" not in m and "tool_calls" not in m:
      raise TokenizerError(f"message {i} has no 'content': {m!r}")
    if not isinstance(m.get("content"), (str, list, tuple, type(None))):
      raise TokenizerError(f"message {i} 'content' must be a string or a list of parts, got {m['content']!r}")
    out.append(_alias_reasoning(_plain(m)))
  return out


def parse_tool_call_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The messages with their tool calls' arguments as objects: OpenAI's clients send them as JSON strings, HF templates
  write them with `tojson` (vLLM parses them so too; an empty string is {})."""
  out = []
  for i, m in enumerate(messages):
    calls = m.get("tool_calls") if isinstance(m, Mapping) else None
    if isinstance(calls, list):
      m = {**m, "tool_calls": [_with_parsed_arguments(call, i) for call in calls]}
    out.append(m)
  return out


def _with_parsed_arguments(call: Any, message: int) -> Any:
  function = call.get("function") if isinstance(call, Mapping) else None
  arguments = function.get("arguments") if isinstance(function, Mapping) else None
  if not isinstance(function, Mapping) or not isinstance(arguments, (str, type(None))): return call
  try: parsed = json.loads(arguments) if arguments else {}
  except json.JSONDecodeError as e:
    raise TokenizerError(f"message {message}: a tool call's arguments are not valid JSON ({e}): {arguments!r}") from None
  return {**call, "function": {**function, "arguments": parsed}}


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
  # transformers fills `reasoning_content` (and gpt-oss's `thinking`) from whichever reasoning field is given
  reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
  return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
  def __init__(self, source: str):
    self.source = source
    self._compiled: jinja2.Template | None = None

  def _template(self) -> jinja2.Template:
    if self._compiled is None:
      try:
        self._compiled = _environment().from_string(self.source)
      except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not parse: {e}") from e
    return self._compiled

  def render(self, messages: Any, add_generation_prompt: bool, special_tokens: dict[str, Any],
             continue_final_message: bool = False, **kwargs: Any) -> str:
    """The template's text for `messages`; kwargs (tools, documents, enable_thinking, ...) reach the template.
    continue_final_message: the text ends inside the last message, for the model to go on writing it (HF's)."""
    if continue_final_message and add_generation_prompt:
      raise TokenizerError("continue_final_message and add_generation_prompt cannot both be set: the first continues the last "
                           "message, the second starts a new one")
    chat = check_messages(messages)
    variables = {**special_tokens, "tools": None, "documents": None, **_plain(kwargs)}
    try:
      text = self._template().render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
    except (jinja2.TemplateError, TypeError, AttributeError, LookupError) as e:
      raise TokenizerError(f"chat template failed: {e}") from e
    return _cut_after_final_message(text, chat) if continue_final_message else text


def _cut_after_final_message(text: str, chat: list[dict[str, Any]]) -> str:
  """`text` cut right after the last message's content (what the template writes after it, an end-of-turn token, goes),
  as HF transformers cuts it."""
  final = chat[-1].get("content") if chat else None
  if isinstance(final, list):   # content parts: the last text part
    final = next((p["text"] for p in reversed(final) if isinstance(p, dict) and isinstance(p.get("text"), str)), None)
  if not isinstance(final, str):
    raise TokenizerError("continue_final_message needs a final message with text content to continue")
  if final.strip() not in text:
    raise TokenizerError("continue_final_message: the final message does not appear in the rendered chat (the chat template "
                         "changes it)")
  at = text.rindex(final.strip())
  # the template kept the message's own trailing spacing, or it trimmed it: cut after what it wrote
  kept = text[at:at + len(final.lstrip())] == final
  return text[:at + len(final.lstrip() if kept else final.strip())]
