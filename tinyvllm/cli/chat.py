"""`chat`: an interactive conversation through the model's chat template.

The conversation is kept within the model's context: before each reply, the oldest user/assistant exchanges are dropped
(the system prompt stays) until the rendered conversation leaves the reply its room (max_tokens, at most half the
context), and stderr says so; a message that does not fit even alone is dropped, the conversation kept. The reply's
max_tokens is capped to the context left after the prompt. Ctrl-C during a reply stops it (its request aborted, nothing
of it left in the engine); what was shown of it stays in the conversation as the assistant's turn (a reply stopped
before any text drops the user's message too). Ctrl-C or Ctrl-D at the prompt, or /exit, quits with status 0."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from tinyvllm.cli.args import (
  add_engine_args,
  add_sampling_args,
  engine_kwargs,
  model_of,
  sampling_kwargs,
  sampling_params_for,
  tokenizer_check,
)

if TYPE_CHECKING:
  from tinyvllm.engine.llm_engine import LLMEngine
  from tinyvllm.sampling_params import SamplingParams
  from tinyvllm.tokenizer import Tokenizer

HELP = "commands: /reset clears the conversation, /exit (or Ctrl-D) quits; Ctrl-C stops a reply"
_ids = itertools.count()


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("chat", help="interactive chat using the model's chat template")
  add_engine_args(p)
  p.add_argument("--system", help="system prompt")
  p.add_argument("--no-thinking", action="store_true", help="pass enable_thinking=False to the template (Qwen3)")
  add_sampling_args(p, max_tokens=1024)
  p.set_defaults(run=run)


def _note(message: str) -> None: print(message, file=sys.stderr, flush=True)


class Conversation:
  """The system prompt and the user/assistant turns so far, rendered by the chat template within `context` tokens."""

  def __init__(self, tokenizer: Tokenizer, context: int, system: str | None = None, template_kwargs: dict[str, Any] | None = None):
    self.tokenizer, self.context, self.template_kwargs = tokenizer, context, template_kwargs or {}
    self.system = [{"role": "system", "content": system}] if system else []
    self.turns: list[dict[str, str]] = []

  def reset(self) -> None: self.turns = []

  def render(self, turns: list[dict[str, str]]) -> tuple[str, list[int]]:
    """The prompt for the next reply after `turns`: its text and token ids."""
    text = self.tokenizer.apply_chat_template(self.system + turns, add_generation_prompt=True, **self.template_kwargs)
    return text, self.tokenizer.encode(text, add_special_tokens=False)

  def ask(self, message: str, room: int) -> tuple[str, list[int]] | None:
    """Add the user's message, dropping the oldest exchanges until the prompt leaves `room` tokens of the context for
    the reply; the prompt (text, ids), or None, the message not added, when even it alone leaves no such room."""
    limit, user = self.context - room, {"role": "user", "content": message}
    alone = len(self.render([user])[1])
    if alone > limit:
      _note(f"[this message does not fit: the prompt would be {alone} tokens, and the {self.context}-token context leaves "
            f"{limit} beside the reply's {room}; it was dropped, the conversation is kept]")
      return None
    self.turns.append(user)
    dropped = 0
    while len((prompt := self.render(self.turns))[1]) > limit: dropped += self._drop_oldest()
    if dropped: _note(f"[dropped the {dropped} oldest turns to fit the {self.context}-token context; /reset clears the conversation]")
    return prompt

  def _drop_oldest(self) -> int:
    """Drop the oldest exchange (a user turn and the reply after it), never the newest message; how many turns went."""
    n = 1
    while n < len(self.turns) - 1 and self.turns[n]["role"] != "user": n += 1
    del self.turns[:n]
    return n

  def answer(self, reply: str) -> None: self.turns.append({"role": "assistant", "content": reply})

  def forget_last(self) -> None: self.turns.pop()


def run(args: argparse.Namespace) -> int:
  from tinyvllm.engine.llm import LLM
  from tinyvllm.sampling_params import SamplingParams
  SamplingParams(**sampling_kwargs(args))   # a bad flag fails before the model loads
  llm = LLM(model_of(args), check_frontend_files=tokenizer_check(args, chat_template=True), **engine_kwargs(args))
  params = sampling_params_for(args, llm.engine.default_sampling_params)
  template_kwargs = {"enable_thinking": False} if args.no_thinking else {}
  conversation = Conversation(llm.engine.tokenizer, llm.engine.max_model_len, args.system, template_kwargs)
  print(HELP, file=sys.stderr)
  lines = StdinLines()
  while (line := lines.read()) is not None:
    if line.strip() == "/exit": break
    if line.strip() == "/reset": conversation.reset()
    elif line.strip():
      with ctrl_c_deferred() as interrupted: turn(llm.engine, conversation, line, params, interrupted)
  return 0


class StdinLines:
  """The lines typed, read from standard input's file descriptor under the Ctrl-C flag: short waits (select) between
  which Ctrl-C is seen at once, where a blocking read that had not started when the signal came would hold it until
  the next line (Python runs a signal's handler between its own instructions, not inside a read). Bytes past a line
  stay here (sys.stdin's buffer would hide them from select: pasted lines would wait for more input)."""

  def __init__(self) -> None:
    self.pending = bytearray()

  def read(self) -> str | None:
    """The next line; None at Ctrl-D (end of input) or Ctrl-C (quit)."""
    print("> ", end="", flush=True)
    fd, eof = sys.stdin.fileno(), False
    with ctrl_c_deferred() as interrupted:
      while b"\n" not in self.pending and not eof and not interrupted():
        if select.select([fd], [], [], 0.1)[0]:
          chunk = os.read(fd, 1 << 16)
          self.pending += chunk
          eof = not chunk
      quit_now = interrupted()
    if quit_now or not self.pending:
      print(file=sys.stderr)
      return None
    line, _, rest = bytes(self.pending).partition(b"\n")   # (a last line without one at end of input: whole)
    self.pending = bytearray(rest)
    return line.decode(sys.stdin.encoding or "utf-8", errors="replace")


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[Callable[[], bool]]:
  """While a turn runs, Ctrl-C sets a flag that the reply loop reads between engine steps, rather than raising in the
  middle of one (which could leave the scheduler's state half-updated); StdinLines' waits read it too."""
  if threading.current_thread() is not threading.main_thread():   # signal handlers are the main thread's only
    yield lambda: False
    return
  pressed = threading.Event()
  previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.set())
  try: yield pressed.is_set
  finally: signal.signal(signal.SIGINT, previous)


def turn(engine: LLMEngine, conversation: Conversation, message: str, params: SamplingParams,
         interrupted: Callable[[], bool] = lambda: False) -> str | None:
  """One exchange: the message added (older turns dropped to fit), the reply streamed to stdout and added; the reply,
  or None when the message was dropped."""
  from tinyvllm.engine.llm_engine import PromptError
  context = conversation.context
  # the reply's room: max_tokens, but at most half the context, so that a max_tokens beyond it still leaves a conversation
  room = max(1, min(params.max_tokens or context, context // 2))
  if (prompt := conversation.ask(message, room)) is None: return None
  text, ids = prompt
  capped = dataclasses.replace(params, max_tokens=min(params.max_tokens or context, context - len(ids)))   # never past the context
  try: reply, stopped = stream_reply(engine, {"prompt": text, "prompt_token_ids": ids}, capped, interrupted)
  except PromptError as e:   # e.g. a KV cache smaller than the context: this message cannot run, the conversation can
    conversation.forget_last()
    _note(f"[{e}: the message was dropped, the conversation is kept]")
    return None
  sys.stdout.write("\n")
  sys.stdout.flush()
  if stopped and not reply:
    conversation.forget_last()
    _note("[stopped before the reply began: the message was dropped]")
    return None
  if stopped: _note("[stopped: the partial reply stays in the conversation; /reset clears it]")
  conversation.answer(reply)
  return reply


def stream_reply(engine: LLMEngine, prompt: dict, params: SamplingParams, interrupted: Callable[[], bool]) -> tuple[str, bool]:
  """Run the request, writing its text to stdout as it comes; (the text, whether `interrupted` stopped it). The request
  is aborted at the end either way, so that none of its blocks stay in use."""
  rid = f"chat-{next(_ids)}"
  engine.add_request(rid, prompt, params)
  parts: list[str] = []
  finished = False
  try:
    while not finished and not interrupted():
      for out in engine.step():
        if out.request_id != rid: continue
        if delta := out.outputs[0].delta_text:
          parts.append(delta)
          sys.stdout.write(delta)
          sys.stdout.flush()
        finished = out.finished
  finally:
    engine.abort_request(rid)
  return "".join(parts), not finished
