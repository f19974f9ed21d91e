"""`--tool-call-parser hermes`: the Hermes / Qwen format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
anywhere in the text, as many as the model writes (Qwen2.5 and Qwen3's chat templates ask for it)."""
from __future__ import annotations

import json

from tinyvllm.entrypoints.tool_parsers.abstract import ToolCallDelta, ToolParser, announce, as_call, held_back

START, END = "<tool_call>", "</tool_call>"


def parse_call(block: str) -> tuple[str, str] | None:
  try: return as_call(json.loads(block), ("arguments",))
  except ValueError: return None


class HermesToolParser(ToolParser):
  """A call is given when its block closes (only then is its JSON known to be a call); a block that is not one stays in
  the content as written. The whitespace around calls is not content (but text on both sides of a call stays apart).
  An unclosed block at the end of the output is a call if its JSON is one (the model stopped right after it), as vLLM
  reads it."""
  MARKERS = (START, END)   # a tokenizer that makes them special tokens must keep them in the text

  def __init__(self) -> None:
    self._buf = ""
    self._inside = False       # in a <tool_call> block
    self._after_call = False   # the whitespace that follows a call is dropped, unless text came before the call
    self._said = False         # some content has been given

  def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
    self._buf += text
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    while True:
      if self._inside:
        end = self._buf.find(END)
        if end < 0 and not final: break
        block, self._buf = (self._buf, "") if end < 0 else (self._buf[:end], self._buf[end + len(END):])
        self._inside = False
        call = parse_call(block)
        if call is None: content.append(START + block + (END if end >= 0 else ""))
        else:
          deltas += announce(self.calls, *call)
          self.calls, self._after_call = self.calls + 1, True
        continue
      if self._after_call:
        if not self._buf.strip(): break   # whitespace after a call waits: dropped at the end, or before the next call
        # text after a call keeps the whitespace that parts it from text before the call
        self._buf, self._after_call = self._buf if self._said or any(content) else self._buf.lstrip(), False
      start = self._buf.find(START)
      if start >= 0:
        content.append(self._buf[:start].rstrip())
        self._buf, self._inside = self._buf[start + len(START):], True
        continue
      # what could still be the start of a call waits, and so does trailing whitespace (dropped if a call follows)
      ready = self._buf if final else self._buf[:len(self._buf) - held_back(self._buf, START)].rstrip()
      content.append(ready)
      self._buf = self._buf[len(ready):]
      break
    text = "".join(content)
    self._said = self._said or bool(text)
    return text, deltas
