"""`--tool-call-parser llama3_json`: Llama 3.1 / 3.2's JSON tool calls, the whole output being `{"name": ...,
"parameters": {...}}` (or "arguments"), several separated by `;`, after `<|python_tag|>` when the model writes it and
special tokens are kept."""
from __future__ import annotations

import json
import re

from tinyvllm.entrypoints.tool_parsers.abstract import ObjectText, ToolCallDelta, ToolParser, announce, as_call, new_call_id

TAG = "<|python_tag|>"
# a call that opens as the format has it, up to its arguments object: streamed from here on
HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\S)')
SEPARATOR = re.compile(r"[\s;]*")   # between calls
SPACE = re.compile(r"\s*")         # before the first
CLOSE = re.compile(r"\s*\}")


def parse_calls(text: str) -> list[tuple[str, str]] | None:
  """Every call in `text`, or None unless all of it is calls."""
  decoder, calls, i = json.JSONDecoder(), [], 0
  text = text.strip()
  while i < len(text):
    try: value, i = decoder.raw_decode(text, i)
    except ValueError: return None
    if (call := as_call(value, ("parameters", "arguments"))) is None: return None
    calls.append(call)
    while i < len(text) and (text[i].isspace() or text[i] == ";"): i += 1
  return calls or None


class Llama3JsonToolParser(ToolParser):
  """An output that starts as a call would (`{` or the tag) is held; each call in it that opens as the format has it
  (`{"name": "...", "parameters": {`) is streamed from there, its name then its arguments' raw text fragment by fragment.
  When the output ends it is read whole: if all of it is calls, the calls not streamed are given then (their arguments
  as vLLM writes them); if not, it is the content it is, unless a call had already left the parser (then the calls
  streamed stand, as vLLM's streams have them, and the text after them is content). Any other output is content as it
  comes."""

  def __init__(self) -> None:
    self._buf = ""
    self._mode: str | None = None   # None: undecided, "hold": maybe calls, "text": content
    self._pos = 0                   # in the held calls' text: where the streaming stands
    self._arguments: ObjectText | None = None   # the arguments of the call being streamed
    self._sent = False              # a call's delta has left the parser

  def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
    if self._mode == "text": return text, []
    self._buf += text
    head = self._buf.lstrip()
    if self._mode is None:
      if head.startswith((TAG, "{")): self._mode = "hold"
      elif TAG.startswith(head) and not final: return "", []   # nothing yet, or part of the tag
      else:
        self._mode, out, self._buf = "text", self._buf, ""
        return out, []
    body = head.removeprefix(TAG)
    deltas = self._stream(body)
    content, deltas = self._finish(body, deltas) if final else ("", deltas)
    self._sent = self._sent or bool(deltas)
    return content, deltas

  def _stream(self, body: str) -> list[ToolCallDelta]:
    """The deltas of the calls that open as the format has it, as far as `body` (the held text so far) shows them."""
    deltas: list[ToolCallDelta] = []
    while True:
      if self._arguments is None:
        m = HEAD.match(body, (SEPARATOR if self.calls else SPACE).match(body, self._pos).end())
        if m is None or body[m.end()] != "{": return deltas
        try: name = json.loads(m.group(1))
        except ValueError: return deltas
        if not name: return deltas
        deltas.append(ToolCallDelta(self.calls, name, new_call_id()))
        self._arguments, self._pos = ObjectText(), m.end()
      if not self._arguments.closed:
        piece = self._arguments.take(body[self._pos:])
        self._pos += len(piece)
        if piece: deltas.append(ToolCallDelta(self.calls, arguments=piece))
      close = CLOSE.match(body, self._pos) if self._arguments.closed else None
      if close is None: return deltas
      self._arguments, self._pos, self.calls = None, close.end(), self.calls + 1

  def _finish(self, body: str, deltas: list[ToolCallDelta]) -> tuple[str, list[ToolCallDelta]]:
    """The output has ended: the calls the streaming did not give; or, if it is not all calls, the whole output as
    content when nothing of a call has left yet, else what follows the streamed calls."""
    streamed = self.calls + (self._arguments is not None)
    calls = parse_calls(body)
    if calls is not None and len(calls) >= streamed:
      self.calls = len(calls)
      return "", deltas + [d for i, call in enumerate(calls[streamed:], streamed) for d in announce(i, *call)]
    if self._sent:   # the calls streamed stand (vLLM's streams do the same); the text after them is content
      self.calls = streamed
      return ("" if self._arguments is not None else body[self._pos:].strip()), deltas
    self._mode, self.calls = "text", 0
    return self._buf, []
