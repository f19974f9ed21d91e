"""Reasoning parsers (`--reasoning-parser`, vLLM's names): the model's reasoning, split from its answer.

`qwen3`: Qwen3 thinks in `<think>...</think>` at the start of its reply; that part is the message's
`reasoning_content` (streamed as `delta.reasoning_content`), the rest its content. With `enable_thinking: false` Qwen3's
template writes an empty think block into the prompt, the reply has none, and all of it is content. A prompt that
itself ends by opening the block (Qwen3's thinking-only templates) makes the reply start inside it. The newlines the
template puts around the two parts belong to neither (the template strips them when it renders the turn back). A
reply cut before `</think>` is all reasoning, streamed or not.
"""
from __future__ import annotations

from tinyvllm.config import REASONING_MARKERS
from tinyvllm.entrypoints.tool_parsers.abstract import held_back


class Qwen3ReasoningParser:
  START, END = REASONING_MARKERS["qwen3"]

  def __init__(self, prompt: str) -> None:
    self._state = "reasoning" if prompt.rstrip().endswith(self.START) else "start"
    self._buf = ""
    self._trim = True   # whitespace at the start of the reasoning or of the answer after it is dropped

  def feed(self, text: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) now known from the next piece of the reply (final: its last)."""
    self._buf += text
    if self._state == "start":
      head = self._buf.lstrip()
      if head.startswith(self.START): self._state, self._buf = "reasoning", head[len(self.START):]
      elif self.START.startswith(head) and not final: return "", ""
      else: self._state, self._trim = "content", False
    if self._state == "reasoning": return self._reasoning(final)
    return "", self._content()

  def _reasoning(self, final: bool) -> tuple[str, str]:
    if self._trim: self._buf = self._buf.lstrip()
    self._trim = self._trim and not self._buf
    end = self._buf.find(self.END)
    if end >= 0:
      reasoning, self._buf = self._buf[:end].rstrip(), self._buf[end + len(self.END):]
      self._state, self._trim = "content", True
      return reasoning, self._content()
    # what could be the start of </think> waits, and so does trailing whitespace (dropped if </think> follows)
    ready = self._buf if final else self._buf[:len(self._buf) - held_back(self._buf, self.END)].rstrip()
    self._buf = self._buf[len(ready):]
    return ready, ""

  def _content(self) -> str:
    if self._trim: self._buf = self._buf.lstrip()
    self._trim = self._trim and not self._buf
    out, self._buf = self._buf, ""
    return out


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
