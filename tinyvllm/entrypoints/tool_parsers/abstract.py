"""What every tool parser is: a splitter of a chat output's content, fed as it arrives, into text and tool calls.

One object per output. `feed(text, final)` takes the next piece of the output (final: the last, possibly empty) and
returns the text that is now known to be content and the tool-call deltas now known, in OpenAI's streamed form: a
call's first delta has its index, id and name (arguments ""), later ones add argument fragments. The whole output fed
at once with final=True gives the same calls and text as the same output fed piece by piece, so a whole response and
a stream agree, except where a parser streams a call before its text is complete (Hermes and llama3_json, as vLLM's)
and the text then proves not to be one: the stream has given the call, the whole response gives the text.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCallDelta:
  index: int
  name: str | None = None    # with `id`, in a call's first delta only
  id: str | None = None
  arguments: str = ""

  def openai(self) -> dict[str, Any]:
    """The delta as OpenAI streams it: {index, id, type, function: {name, arguments}}, then {index, function: {arguments}}."""
    if self.name is None: return {"index": self.index, "function": {"arguments": self.arguments}}
    return {"index": self.index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
  """OpenAI's form of a tool call's id."""
  return f"call_{uuid.uuid4().hex[:24]}"


def announce(index: int, name: str, arguments: str) -> list[ToolCallDelta]:
  """A complete call as its deltas: the name first, then the arguments."""
  return [ToolCallDelta(index, name, new_call_id()), ToolCallDelta(index, arguments=arguments)]


def as_call(value: Any, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
  """(name, arguments as a JSON string) of a parsed {"name": ..., <argument key>: {...}}, or None if it is not one. The
  arguments are written as vLLM writes them (json.dumps, non-ASCII kept)."""
  if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]: return None
  key = next((k for k in argument_keys if k in value), None)
  arguments = value[key] if key is not None else {}
  if not isinstance(arguments, dict) or set(value) - {"name", *argument_keys}: return None
  return value["name"], json.dumps(arguments, ensure_ascii=False)


def held_back(text: str, marker: str) -> int:
  """How many characters at the end of `text` could be the start of `marker` (they wait for the next piece)."""
  for n in range(min(len(marker) - 1, len(text)), 0, -1):
    if marker.startswith(text[-n:]): return n
  return 0


@dataclass
class ObjectText:
  """A JSON object's raw text as it arrives: where it ends (its closing brace, outside strings)."""
  depth: int = 0
  in_string: bool = False
  escape: bool = False
  closed: bool = False

  def take(self, text: str) -> str:
    """The part of `text` that belongs to the object (all of it, unless the object closes inside it)."""
    for i, c in enumerate(text):
      if self.in_string:
        if self.escape: self.escape = False
        elif c == "\\": self.escape = True
        elif c == '"': self.in_string = False
      elif c == '"': self.in_string = True
      elif c in "{[": self.depth += 1
      elif c in "}]":
        self.depth -= 1
        if self.depth == 0:
          self.closed = True
          return text[:i + 1]
    return text


class ToolParser:
  """Subclasses implement feed(); `calls` counts the calls made so far."""
  MARKERS: tuple[str, ...] = ()   # the text that starts or ends a call
  calls = 0

  def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
    raise NotImplementedError
