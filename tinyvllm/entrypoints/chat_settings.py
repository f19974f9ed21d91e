"""The server's chat flags (vLLM's): the chat template, tool calling and the reasoning parser."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatSettings:
  chat_template: str | None = None             # --chat-template: used instead of the model's
  trust_request_chat_template: bool = False    # a request's own chat_template is rendered only when the operator allows it
  enable_auto_tool_choice: bool = False        # tool_choice "auto": the model decides, its calls are parsed out of its text
  tool_call_parser: str | None = None          # which format the calls are parsed from (tool_parsers.TOOL_PARSERS)
  exclude_tools_when_tool_choice_none: bool = False   # tool_choice "none": the template gets no tools either
  reasoning_parser: str | None = None          # splits the reasoning from the answer (reasoning_parser.REASONING_PARSERS)
