"""`--tool-call-parser hermes`: the Hermes / Qwen format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
anywhere in the text, as many as the model writes (Qwen2.5 and Qwen3's chat templates ask for it)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tinyvllm.entrypoints.tool_parsers.abstract import (
  ObjectText,
  ToolCallDelta,
  ToolParser,
  announce,
  as_call,
  held_back,
  new_call_id,
)

START, END = "<tool_call>", "</tool_call>"
# a block that opens as the format asks, up to its arguments object: the call is streamed from here on
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


def parse_call(block: str) -> tuple[str, str] | None:
  try: return as_call(json.loads(block), ("arguments",))
  except ValueError: return None


@dataclass
class _StreamedCall:
  index: int
  scanned: int                 # block text read into the arguments so far (from the block's start)
  arguments: ObjectText = field(default_factory=ObjectText)
  sent: bool = False           # a delta of it has left the parser: it can no longer become content


class HermesToolParser(ToolParser):
  """A block that opens as the format asks (`{"name": "...", "arguments": {`) is streamed as a call from there: its name,
  then its arguments' raw text fragment by fragment. If the block then proves not to be a call (cut, or more keys), it is
  given as the content it is when nothing of the call has left the parser yet (always so for a whole response),
  else the call stands as streamed (as vLLM's). A block that opens otherwise is a call only if all of its JSON is one,
  given when it closes (its arguments then as vLLM writes them). The whitespace around calls is not content (but text
  on both sides of a call stays apart). An unclosed block at the end of the output is a call if its JSON is one (the
  model stopped right after it), as vLLM reads it."""
  MARKERS = (START, END)   # a tokenizer that makes them special tokens must keep them in the text

  def __init__(self) -> None:
    self._buf = ""
    self._inside = False       # in a <tool_call> block (_buf: the block's text so far, then what follows)
    self._call: _StreamedCall | None = None   # the block's call, being streamed
    self._after_call = False   # the whitespace that follows a call is dropped, unless text came before the call
    self._said = False         # some content has been given

  def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
    self._buf += text
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    while True:
      if self._inside:
        if not self._block(final, content, deltas): break
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
    if self._call is not None and any(d.index == self._call.index for d in deltas): self._call.sent = True
    text = "".join(content)
    self._said = self._said or bool(text)
    return text, deltas

  def _block(self, final: bool, content: list[str], deltas: list[ToolCallDelta]) -> bool:
    """Reads the open block as far as its text is known; True once it has ended (and been given as a call or content)."""
    end = self._buf.find(END)
    ended = end >= 0 or final
    known = self._buf[:end] if end >= 0 else self._buf if final else self._buf[:len(self._buf) - held_back(self._buf, END)]
    if self._call is None: self._open_call(known, deltas)
    call = self._call
    if call is not None and not call.arguments.closed:
      piece = call.arguments.take(known[call.scanned:])
      call.scanned += len(piece)
      if piece: deltas.append(ToolCallDelta(call.index, arguments=piece))
    if not ended: return False
    block, self._buf, self._inside, self._call = known, self._buf[len(known) + (len(END) if end >= 0 else 0):], False, None
    parsed = parse_call(block)
    if call is None and parsed is not None:
      deltas += announce(self.calls, *parsed)
      self.calls += 1
    retracted = call is not None and parsed is None and not call.sent   # not a call after all, and nothing of it has left
    if retracted:
      deltas[:] = [d for d in deltas if d.index != call.index]
      self.calls -= 1
    if parsed is None and (call is None or retracted): content.append(START + block + (END if end >= 0 else ""))
    else: self._after_call = True
    return True

  def _open_call(self, known: str, deltas: list[ToolCallDelta]) -> None:
    """Starts streaming the block as a call once its text shows the format's head and the arguments object opening."""
    m = HEAD.match(known)
    if m is None or known[m.end()] != "{": return
    try: name = json.loads(m.group(1))
    except ValueError: return
    if not name: return
    self._call = _StreamedCall(self.calls, m.end())
    deltas.append(ToolCallDelta(self.calls, name, new_call_id()))
    self.calls += 1
