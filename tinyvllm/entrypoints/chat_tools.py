"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask for (vLLM's rules), checked at the boundary.

- no tools: nothing (tool_choice "none", "auto" or "required" over no tools asks for nothing; a named function is refused);
- "none": the template still gets the tools (unless --exclude-tools-when-tool-choice-none), the output is text;
- "auto" (the default with tools): the model decides; its calls are read out of its text by --tool-call-parser, which
  --enable-auto-tool-choice must allow;
- "required" and a named function: a grammar keeps the output to vLLM's JSON schema (an array of {name, parameters},
  or the named function's arguments), which is read as that JSON rather than by the parser.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tinyvllm.entrypoints.chat_settings import ChatSettings
from tinyvllm.entrypoints.errors import bad_request
from tinyvllm.entrypoints.protocol import ChatCompletionRequest, ChatTool, NamedToolChoice
from tinyvllm.entrypoints.tool_parsers import TOOL_PARSERS, NamedToolCall, RequiredToolCalls, ToolParser

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class ToolPlan:
  template_tools: list[dict[str, Any]] | None = None   # what the chat template gets, as the client sent them
  schema: dict[str, Any] | None = None                 # the grammar's JSON schema (required, named)
  parser: Callable[[], ToolParser] | None = None       # a fresh parser for each output
  max_calls: int | None = None                         # 1 with parallel_tool_calls false
  markers: tuple[str, ...] = ()                        # the text the parser looks for (kept if it is a special token)
  finish_as_calls: bool = True                         # finish_reason "tool_calls" once calls are made (not for a named one)

  @property
  def forced(self) -> bool:
    """The output is the grammar's JSON (after the reasoning, with a reasoning parser): no text beside it."""
    return self.schema is not None


def check_tools(tools: list[ChatTool]) -> None:
  seen: set[str] = set()
  for i, tool in enumerate(tools):
    if tool.function.name in seen: raise bad_request(f"tools[{i}].function.name {tool.function.name!r} is given twice", "tools")
    seen.add(tool.function.name)


def plan_tools(req: ChatCompletionRequest, settings: ChatSettings) -> ToolPlan:
  tools, choice = req.tools or [], req.tool_choice
  if not tools:
    if isinstance(choice, NamedToolChoice):
      raise bad_request(f"tool_choice names the function {choice.function.name!r}, but the request has no tools", "tool_choice")
    return ToolPlan()
  check_tools(tools)
  choice = "auto" if choice is None else choice
  sent = [t.model_dump(exclude_unset=True) for t in tools]
  max_calls = None if req.parallel_tool_calls is not False else 1
  if choice != "required" and not isinstance(choice, NamedToolChoice): _check_not_strict(tools)
  if choice == "none":
    return ToolPlan(template_tools=None if settings.exclude_tools_when_tool_choice_none else sent)
  if choice == "auto":
    if not settings.enable_auto_tool_choice or settings.tool_call_parser is None: raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
    parser = TOOL_PARSERS[settings.tool_call_parser]
    return ToolPlan(sent, parser=parser, max_calls=max_calls, markers=parser.MARKERS)
  if choice == "required":
    return ToolPlan(sent, required_schema(tools, max_calls), RequiredToolCalls, max_calls)
  assert isinstance(choice, NamedToolChoice)
  named = next((t.function for t in tools if t.function.name == choice.function.name), None)
  if named is None:
    raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                      f"({', '.join(t.function.name for t in tools)})", "tool_choice")
  return ToolPlan(sent, _parameters(named.parameters), lambda: NamedToolCall(named.name), 1, finish_as_calls=False)


def _check_not_strict(tools: list[ChatTool]) -> None:
  """strict asks for arguments that always match the schema: only a grammar (required, named) guarantees that."""
  for i, tool in enumerate(tools):
    if tool.function.strict:
      raise bad_request(f"tools[{i}].function.strict: true is honoured under tool_choice \"required\" or a named function, "
                        "whose grammar keeps the arguments to the schema; under \"auto\" or \"none\" the model's text is "
                        "only parsed (send strict: false, or force the call)", "tools")


def _parameters(parameters: dict[str, Any] | None) -> dict[str, Any]:
  # a function without parameters takes an empty object (vLLM's)
  return copy.deepcopy(parameters) if parameters else {"type": "object", "properties": {}}


def required_schema(tools: list[ChatTool], max_calls: int | None) -> dict[str, Any]:
  """vLLM's schema for tool_choice "required": a non-empty array of {"name": one of the tools, "parameters": its
  arguments} (and nothing else: vLLM's lets a call object have other keys), the tools' $defs gathered at the top (one
  name with two schemas is refused)."""
  defs: dict[str, Any] = {}
  items = []
  for i, tool in enumerate(tools):
    parameters = _parameters(tool.function.parameters)
    for name, schema in parameters.pop("$defs", {}).items():
      if name in defs and defs[name] != schema:
        raise bad_request(f"tools[{i}].function.parameters: $defs {name!r} differs from another tool's; tool_choice "
                          "\"required\" puts every tool's $defs in one schema", "tools")
      defs[name] = schema
    items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
                  "required": ["name", "parameters"], "additionalProperties": False})
  schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
  if max_calls is not None: schema["maxItems"] = max_calls
  if defs: schema["$defs"] = defs
  return schema
