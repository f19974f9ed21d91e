"""IncrementalDetokenizer: the text of generated tokens as it grows, without ever emitting half a character."""
from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

from tinyvllm.tokenizer.tokenizer import Tokenizer

_TAIL_BYTES = 4  # an unfinished UTF-8 character is at most 3 bytes, so 4 bytes of prompt give the decoder's state


class IncrementalDetokenizer:
  """Feeds token bytes through an incremental UTF-8 decoder, so each step costs O(new tokens) and the deltas add up
  to the text the whole sequence decodes to after the prompt's text.

  Bytes of an unfinished character wait for the next tokens. The prompt's last bytes prime the decoder, so a
  character the prompt started is finished by the output. SentencePiece's decoder drops one leading space of the
  whole text; that only touches the output when the prompt decodes to nothing (e.g. only a skipped BOS).
  """

  def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
    self._tokenizer = tokenizer
    self._skip = skip_special_tokens
    self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self._pieces: list[str] = []
    tail = self._prompt_tail(prompt_ids)
    self._strip_pending = tokenizer.strip_leading_space and not tail
    self._decoder.decode(tail)

  def _prompt_tail(self, prompt_ids: Sequence[int]) -> bytes:
    """The last few bytes of the prompt's text (b"" only when the prompt has no text at all)."""
    tail = b""
    for token_id in reversed(prompt_ids):
      tail = self._tokenizer.ids_to_bytes((token_id,), self._skip) + tail
      if len(tail) >= _TAIL_BYTES:
        break
    return tail

  def add(self, new_ids: Iterable[int]) -> str:
    """The text the new tokens complete ("" while a character is still unfinished)."""
    raw = self._tokenizer.ids_to_bytes(new_ids, self._skip)
    if self._strip_pending and raw:
      self._strip_pending = False
      if raw[:1] == b" ":
        raw = raw[1:]
    delta = self._decoder.decode(raw)
    if delta:
      self._pieces.append(delta)
    return delta

  def flush(self) -> str:
    """At the end of generation: bytes still waiting for the rest of their character, as U+FFFD."""
    delta = self._decoder.decode(b"", final=True)
    if delta:
      self._pieces.append(delta)
    return delta

  @property
  def text(self) -> str:
    if len(self._pieces) > 1:
      self._pieces[:] = ["".join(self._pieces)]
    return self._pieces[0] if self._pieces else ""
