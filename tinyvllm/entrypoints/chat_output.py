"""A chat choice's text as OpenAI's message: the reasoning split off (--reasoning-parser), the tool calls read out of
the rest (tool_choice and --tool-call-parser), and what is left, the content. One ChatOutputParser per choice, fed the
text as it is produced; a whole response feeds it all at once, so a stream and a whole response always agree."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tinyvllm.entrypoints.chat_tools import ToolPlan
from tinyvllm.entrypoints.protocol import AssistantMessage, FunctionCall, ToolCall
from tinyvllm.entrypoints.reasoning_parser import REASONING_PARSERS
from tinyvllm.entrypoints.tool_parsers import ToolCallDelta


@dataclass
class MessageDelta:
  reasoning: str = ""
  content: str = ""
  tool_calls: list[ToolCallDelta] = field(default_factory=list)

  def openai(self) -> list[dict[str, Any]]:
    """The delta as OpenAI streams it: the text in one chunk's delta, then each tool-call delta in a chunk of its own."""
    text = {k: v for k, v in (("reasoning_content", self.reasoning), ("content", self.content)) if v}
    return [text] * bool(text) + [{"tool_calls": [call.openai()]} for call in self.tool_calls]


class ChatOutputParser:
  def __init__(self, plan: ToolPlan, reasoning_parser: str | None, prompt: str, include_reasoning: bool):
    # a forced call's JSON follows the reasoning too (with a reasoning parser the engine's grammar starts after it)
    make_reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser is not None else None
    self.reasoning = make_reasoning(prompt) if make_reasoning is not None else None
    self.tools = plan.parser() if plan.parser is not None else None
    self.plan, self.include_reasoning = plan, include_reasoning

  def feed(self, text: str, final: bool) -> MessageDelta:
    reasoning, content = self.reasoning.feed(text, final) if self.reasoning is not None else ("", text)
    calls: list[ToolCallDelta] = []
    if self.tools is not None:
      content, calls = self.tools.feed(content, final)
      if self.plan.max_calls is not None: calls = [c for c in calls if c.index < self.plan.max_calls]
    return MessageDelta(reasoning if self.include_reasoning else "", content, calls)

  @property
  def called(self) -> bool: return self.tools is not None and self.tools.calls > 0

  def finish_reason(self, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for an output that ended by itself after making calls (a named function's call: "stop")."""
    return "tool_calls" if reason == "stop" and self.called and self.plan.finish_as_calls else reason

  def message(self, text: str) -> AssistantMessage:
    """The whole output as one message."""
    delta = self.feed(text, final=True)
    calls: dict[int, ToolCall] = {}
    for d in delta.tool_calls:
      if d.name is not None: calls[d.index] = ToolCall(id=d.id or "", function=FunctionCall(name=d.name, arguments=""))
      else: calls[d.index].function.arguments += d.arguments
    parsed = self.reasoning is not None or self.tools is not None
    return AssistantMessage(content=delta.content if delta.content or not parsed else None,
                            reasoning_content=delta.reasoning or None, tool_calls=list(calls.values()))
