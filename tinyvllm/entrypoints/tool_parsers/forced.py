"""The outputs of `tool_choice` "required" and a named function, which a grammar keeps to a JSON schema (vLLM's): the
output is read as that JSON rather than by a tool parser, and streamed as it comes, since the grammar guarantees it.

- a named function: the output is the function's arguments (a JSON object);
- "required": the output is a JSON array of {"name": ..., "parameters": {...}}, one element a call.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from tinyvllm.entrypoints.tool_parsers.abstract import ToolCallDelta, ToolParser, new_call_id


class NamedToolCall(ToolParser):
  """One call of the named function; the output is its arguments, each piece an argument fragment."""

  def __init__(self, name: str) -> None:
    self.name = name

  def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
    if self.calls == 0 and (text or final):
      self.calls = 1
      return "", [ToolCallDelta(0, self.name, new_call_id()), *([ToolCallDelta(0, arguments=text)] if text else [])]
    return "", [ToolCallDelta(0, arguments=text)] if text else []


@dataclass
class _Call:
  name: str | None = None
  announced: bool = False
  start: int | None = None   # where "parameters"' value starts in the text
  end: int | None = None     # and where it ends, once it has
  sent: int = 0              # how much of it has been streamed


class RequiredToolCalls(ToolParser):
  """Walks the JSON array as its text arrives (depth, strings, the keys of each call object): a call's name is given
  once its string closes, its parameters as the raw text the model wrote, fragment by fragment."""

  def __init__(self) -> None:
    self._text = ""
    self._depth = 0
    self._in_string = self._escape = False
    self._string_start = 0
    self._key: str | None = None     # the call object's key whose value comes next
    self._in_value = False           # after the key's colon, before the next comma
    self._calls: list[_Call] = []

  def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
    begin = len(self._text)
    self._text += text
    for i in range(begin, len(self._text)): self._step(i, self._text[i])
    return "", self._deltas()

  def _step(self, i: int, c: str) -> None:
    if self._in_string:
      if self._escape: self._escape = False
      elif c == "\\": self._escape = True
      elif c == '"':
        self._in_string = False
        if self._depth == 2: self._string_closed(json.loads(self._text[self._string_start:i + 1]))
      return
    call = self._calls[-1] if self._calls else None
    if self._depth == 2 and self._in_value and self._key == "parameters" and call is not None and call.start is None \
       and not c.isspace():
      call.start = i
    if c == '"': self._in_string, self._string_start = True, i
    elif c in "[{":
      if self._depth == 1 and c == "{": self._calls.append(_Call())
      self._depth += 1
    elif c in "]}":
      self._depth -= 1
      if self._depth == 2 and self._key == "parameters" and call is not None: call.end = i + 1
      if self._depth == 1:
        if self._key == "parameters" and call is not None and call.end is None: call.end = len(self._text[:i].rstrip())
        self._key, self._in_value = None, False
    elif self._depth == 2 and c == ":": self._in_value = True
    elif self._depth == 2 and c == ",":
      if self._key == "parameters" and call is not None and call.end is None: call.end = len(self._text[:i].rstrip())
      self._key, self._in_value = None, False

  def _string_closed(self, value: str) -> None:
    if not self._in_value: self._key = value
    elif self._key == "name": self._calls[-1].name = value

  def _deltas(self) -> list[ToolCallDelta]:
    out = []
    for index, call in enumerate(self._calls):
      if call.name is None: continue
      if not call.announced:
        out.append(ToolCallDelta(index, call.name, new_call_id()))
        call.announced, self.calls = True, index + 1
      if call.start is None: continue
      upto = call.end if call.end is not None else len(self._text)
      if upto > call.start + call.sent:
        out.append(ToolCallDelta(index, arguments=self._text[call.start + call.sent:upto]))
        call.sent = upto - call.start
    return out
