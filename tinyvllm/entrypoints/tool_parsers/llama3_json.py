"""`--tool-call-parser llama3_json`: Llama 3.1 / 3.2's JSON tool calls, the whole output being `{"name": ...,
"parameters": {...}}` (or "arguments"), several separated by `;`, after `<|python_tag|>` when the model writes it and
special tokens are kept."""
from __future__ import annotations

import json

from tinyvllm.entrypoints.tool_parsers.abstract import ToolCallDelta, ToolParser, announce, as_call

TAG = "<|python_tag|>"


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
  """An output that starts as a call would (`{` or the tag) is held until it ends, then given as calls if all of it is
  calls, else as the content it is; any other output is content as it comes."""

  def __init__(self) -> None:
    self._buf = ""
    self._mode: str | None = None   # None: undecided, "hold": maybe calls, "text": content

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
    if not final: return "", []
    calls = parse_calls(head.removeprefix(TAG))
    if calls is None: return self._buf, []
    self.calls = len(calls)
    return "", [d for i, call in enumerate(calls) for d in announce(i, *call)]
