"""AsyncLLM: the server's engine (vLLM v1's). The frontend runs here, on the event loop: tokenization and validation
(engine/input_processor.py) when a request comes, detokenization, stop strings, logprob text and RequestOutputs
(engine/output_processor.py) when a step's outputs come; the EngineCore runs in its own process (engine/core_client.py),
or data_parallel_size of them behind a router (engine/dp_client.py).

Each request gets an async stream of RequestOutputs (with delta_text / delta_token_ids); when its consumer goes away
(the generator is closed or cancelled) the request is aborted in the core, which frees its blocks. When the core
fails or dies, every stream gets the EngineDeadError, new requests are refused and `on_dead` is called.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

from tinyvllm.config import EngineConfig
from tinyvllm.engine.beam_search import candidates, start_search, step_params
from tinyvllm.engine.core_client import CoreClient
from tinyvllm.engine.core_launcher import SharedCores
from tinyvllm.engine.core_setup import log
from tinyvllm.engine.dp_client import DPCoreClient, ReplicaStats, start_core_client
from tinyvllm.engine.exceptions import EngineDeadError
from tinyvllm.engine.input_processor import FrontendFiles, InputProcessor, PromptError, PromptType, load_frontend_files, model_folder
from tinyvllm.engine.messages import EngineCoreInfo, EngineCoreOutputs, SchedulerStats
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.stats_logger import StatsLogger
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import BeamSearchParams, SamplingParams

OUTPUT_CHUNK = 128   # outputs processed between two yields to the event loop (a step of 500 requests stays responsive)
_ids = itertools.count()


class AsyncLLM:
  def __init__(self, config: EngineConfig, client: CoreClient | DPCoreClient, info: EngineCoreInfo, files: FrontendFiles,
               on_dead: Callable[[EngineDeadError], None] = lambda e: None):
    self.config, self.client, self.info, self.on_dead = config, client, info, on_dead
    self.tokenizer, self.default_sampling_params = files.tokenizer, files.default_sampling_params
    self.processor = InputProcessor(info, self.tokenizer, config.max_logprobs, config.scheduling_policy, config.logits_processors)
    self.output_processor = OutputProcessor(self.tokenizer)
    self.stats: SchedulerStats | None = None        # the core's, after its latest step
    self.stats_logger = None if config.disable_log_stats else StatsLogger(log)
    self._streams: dict[str, asyncio.Queue] = {}
    self._dead: EngineDeadError | None = None
    self._output_task = asyncio.get_running_loop().create_task(self._output_handler())

  @classmethod
  async def from_config(cls, config: EngineConfig, on_dead: Callable[[EngineDeadError], None] = lambda e: None,
                        shared: SharedCores | None = None) -> AsyncLLM:
    """Start the core process(es) and load the tokenizer meanwhile; EngineLoadError (or the frontend's own error) if
    either fails, with the core process stopped. shared: one of several API servers, the cores it shares."""
    client = await start_core_client(config, shared)
    try:
      files = asyncio.to_thread(lambda: load_frontend_files(config, model_folder(config)))
      info, frontend_files = await asyncio.gather(client.wait_ready(), files)
    except BaseException:
      await client.shutdown()
      raise
    return cls(config, client, info, frontend_files, on_dead)

  @property
  def max_model_len(self) -> int: return self.info.max_model_len

  @property
  def vocab_size(self) -> int: return self.info.vocab_size

  def replica_stats(self) -> list[ReplicaStats]:
    """With data parallelism, each replica's requests and latest stats (self.stats sums them); else nothing."""
    return self.client.replica_stats() if isinstance(self.client, DPCoreClient) else []

  @property
  def is_dead(self) -> bool:
    """The core has stopped (failed, died or shut down): no request can be served any more."""
    return self._dead is not None

  def validate(self, prompt: PromptType, params: SamplingParams) -> list[int]:
    """Tokenize and check a request without queueing it (raises PromptError); returns the prompt's token ids."""
    ids = self.processor.tokenize_prompt(prompt)[1]
    self.processor.check_request(ids, params)
    return ids

  async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, priority: int = 0,
                     group: str | None = None) -> AsyncIterator[RequestOutput]:
    """Stream the request's outputs as they are produced; the last one has finished=True. priority: with
    scheduling_policy priority, lower values are served first. group: the API request it belongs to (requests of
    one group take turns with other groups' for admission: core/fair_share.py)."""
    if self._dead is not None: raise self._dead
    request_id = request_id or f"req-{next(_ids)}"
    if request_id in self._streams: raise ValueError(f"request id {request_id!r} is already in use")
    text, request = self.processor.process(request_id, prompt, params, priority)
    request.group = group
    stream: asyncio.Queue = asyncio.Queue()
    self._streams[request_id] = stream
    self.output_processor.add_request(request, text)
    self.client.add_request(request)
    finished = False
    try:
      while not finished:
        item = await stream.get()
        if isinstance(item, BaseException): raise item
        finished = item.finished
        yield item
    finally:
      self._streams.pop(request_id, None)
      if not finished: self._abort(request_id)

  def validate_beam_search(self, prompt: PromptType, params: BeamSearchParams) -> None:
    """Check a beam search without starting it (PromptError, or SamplingParamsError naming beam_width)."""
    start_search(self.processor, prompt, params)

  async def beam_search(self, prompt: PromptType, params: BeamSearchParams, request_id: str, priority: int = 0,
                        group: str | None = None, skip_special_tokens: bool = True) -> RequestOutput:
    """The prompt's params.beam_width best continuations (engine/beam_search.py), as one finished RequestOutput (vLLM's
    EngineClient.beam_search). Each step's beams run as requests {request_id}-{step}-{beam}; cancelled, the search
    aborts the step's requests."""
    text, search = start_search(self.processor, prompt, params)
    step = step_params(params)

    async def final(tokens: list[int], rid: str) -> RequestOutput:
      outputs = [out async for out in self.generate({"prompt_token_ids": tokens}, step, rid, priority, group)]
      return outputs[-1]   # (the stream ends with the finished output)
    for t in range(params.max_tokens):
      if not search.beams: break   # every candidate was EOS
      tasks = [asyncio.ensure_future(final(beam.tokens, f"{request_id}-{t}-{i}")) for i, beam in enumerate(search.beams)]
      try: outputs = await asyncio.gather(*tasks)
      finally:   # failed or cancelled: none of the step's requests goes on (each aborts itself when cancelled)
        for task in tasks: task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
      search.advance([candidates(out) for out in outputs])
    decode = None if self.tokenizer is None else lambda ids: self.tokenizer.decode(ids, skip_special_tokens)
    return search.request_output(request_id, text, decode)

  async def abort(self, request_id: str) -> None: self._abort(request_id)

  def _abort(self, request_id: str) -> None:
    self.output_processor.abort_request(request_id)
    self.client.abort_requests([request_id])

  async def _output_handler(self) -> None:
    """Read each step's outputs from the core, turn them into RequestOutputs, feed the streams."""
    try:
      while True: await self._process(await self.client.get_output())
    except EngineDeadError as e:
      self._die(e)
    except Exception as e:   # a bug in output processing: every waiting stream learns it, nothing hangs
      self._die(EngineDeadError(f"processing the engine's outputs failed: {type(e).__name__}: {e}"))
      raise

  async def _process(self, outputs: EngineCoreOutputs) -> None:
    if outputs.scheduler_stats is not None:
      self.stats = outputs.scheduler_stats
      if self.stats_logger is not None: self.stats_logger.observe(outputs.scheduler_stats)
    for request_id, reason in outputs.rejected:
      self.output_processor.abort_request(request_id)
      self._deliver(request_id, PromptError(reason))
    for start in range(0, len(outputs.outputs), OUTPUT_CHUNK):
      if start: await asyncio.sleep(0)
      processed = self.output_processor.process_outputs(outputs.outputs[start:start + OUTPUT_CHUNK])
      if processed.samples_to_stop: self.client.stop_samples(processed.samples_to_stop)
      for out in processed.request_outputs: self._deliver(out.request_id, out)

  def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
    stream = self._streams.get(request_id)
    if stream is not None: stream.put_nowait(item)

  def _die(self, error: EngineDeadError) -> None:
    self._dead = error
    log(f"the engine stopped: {error}")
    for stream in self._streams.values(): stream.put_nowait(error)
    self.on_dead(error)

  async def shutdown(self) -> None:
    """Abort everything in flight, stop the core process and the output handler."""
    for request_id in list(self._streams): self._abort(request_id)
    self._output_task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception): await self._output_task
    self._dead = self._dead or EngineDeadError("the engine was shut down")
    await self.client.shutdown()
