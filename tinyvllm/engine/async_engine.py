"""AsyncLLMEngine: an asyncio front of the in-process LLMEngine (vLLM's shape), for embedding the engine in an asyncio
program without a second process. The server uses AsyncLLM instead (engine/async_llm.py: the engine core in its own
process).

One background loop owns the engine: it applies queued additions and aborts between steps and runs each step on a
dedicated worker thread, so the event loop stays free while the model computes and the engine is only ever touched
from that one thread. Each request gets an async stream of RequestOutputs (with delta_text / delta_token_ids);
when its consumer goes away (the generator is closed or cancelled), the request is aborted and its blocks freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tinyvllm.config import EngineConfig
from tinyvllm.engine.exceptions import EngineDeadError
from tinyvllm.engine.llm_engine import LLMEngine, PromptType
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

_ids = itertools.count()
__all__ = ["AsyncLLMEngine", "EngineDeadError"]


@dataclass
class _Pending:
  request_id: str
  prompt: PromptType
  params: SamplingParams
  stream: asyncio.Queue = field(default_factory=asyncio.Queue)


class AsyncLLMEngine:
  def __init__(self, engine: LLMEngine):
    self.engine = engine
    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyvllm-engine")
    self._streams: dict[str, asyncio.Queue] = {}
    self._to_add: list[_Pending] = []
    self._to_abort: set[str] = set()
    self._wakeup: asyncio.Event | None = None
    self._loop_task: asyncio.Task | None = None
    self._dead: BaseException | None = None

  @classmethod
  def from_config(cls, config: EngineConfig) -> AsyncLLMEngine: return cls(LLMEngine(config))

  @property
  def tokenizer(self): return self.engine.tokenizer

  @property
  def is_dead(self) -> bool:
    """The loop has stopped (crashed or shut down): no request can be served any more."""
    return self._dead is not None

  def validate(self, prompt: PromptType, params: SamplingParams) -> list[int]:
    """Tokenize and check a request without queueing it (raises PromptError); returns the prompt's token ids."""
    ids = self.engine.tokenize_prompt(prompt)[1]
    self.engine.check_request(ids, params)
    return ids

  async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None
                     ) -> AsyncIterator[RequestOutput]:
    """Stream the request's outputs as they are produced; the last one has finished=True."""
    if self._dead is not None: raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
    self.validate(prompt, params)
    request_id = request_id or f"req-{next(_ids)}"
    if request_id in self._streams: raise ValueError(f"request id {request_id!r} is already in use")
    pending = _Pending(request_id, prompt, params)
    self._streams[request_id] = pending.stream
    self._to_add.append(pending)
    self._start()
    finished = False
    try:
      while not finished:
        item = await pending.stream.get()
        if isinstance(item, BaseException): raise item
        finished = item.finished
        yield item
    finally:
      self._streams.pop(request_id, None)
      if not finished: await self.abort(request_id)

  async def abort(self, request_id: str) -> None:
    self._to_abort.add(request_id)
    self._to_add = [p for p in self._to_add if p.request_id != request_id]
    self._start()

  def _start(self) -> None:
    if self._wakeup is None: self._wakeup = asyncio.Event()
    if self._loop_task is None or self._loop_task.done():
      self._loop_task = asyncio.get_running_loop().create_task(self._run())
    self._wakeup.set()

  async def _run(self) -> None:
    loop = asyncio.get_running_loop()
    assert self._wakeup is not None
    try:
      while True:
        if not (self._to_add or self._to_abort or self.engine.has_unfinished_requests()):
          self._wakeup.clear()
          await self._wakeup.wait()
          continue
        adds, aborts = self._to_add, self._to_abort
        self._to_add, self._to_abort = [], set()
        outputs, failures = await loop.run_in_executor(self._executor, self._step, adds, aborts)
        for request_id, error in failures: self._deliver(request_id, error)
        for out in outputs: self._deliver(out.request_id, out)
    except asyncio.CancelledError:
      raise
    except BaseException as e:  # a crash in the engine: every waiting stream learns it, nothing hangs
      self._dead = e
      for stream in self._streams.values(): stream.put_nowait(EngineDeadError(f"the engine loop crashed: {e!r}"))
      raise

  def _step(self, adds: list[_Pending], aborts: set[str]) -> tuple[list[RequestOutput], list[tuple[str, BaseException]]]:
    """On the engine thread: apply queued changes, then run one step."""
    failures: list[tuple[str, BaseException]] = []
    for request_id in aborts: self.engine.abort_request(request_id)
    for p in adds:
      try: self.engine.add_request(p.request_id, p.prompt, p.params)
      except ValueError as e: failures.append((p.request_id, e))
    return (self.engine.step() if self.engine.has_unfinished_requests() else []), failures

  def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
    stream = self._streams.get(request_id)
    if stream is not None: stream.put_nowait(item)

  async def shutdown(self) -> None:
    """Abort everything in flight and stop the loop."""
    for request_id in list(self._streams): await self.abort(request_id)
    if self._loop_task is not None:
      while self._to_abort or self._to_add: await asyncio.sleep(0.01)
      self._loop_task.cancel()
      with contextlib.suppress(asyncio.CancelledError): await self._loop_task
    self._dead = self._dead or EngineDeadError("the engine was shut down")
    self._executor.shutdown(wait=True)
