"""EngineCore: the engine loop (vLLM v1's EngineCore). It owns the scheduler, the model runner and the KV cache, takes
tokenized, validated requests (EngineCoreRequest) and returns each step's outputs as token ids (EngineCoreOutputs).

It decides the token-level stops, as vLLM's scheduler does: EOS (unless ignore_eos), stop_token_ids, max_tokens and the
context limit; the frontend (engine/output_processor.py) detokenizes, finds stop strings and tells the core to stop
those samples. The offline LLMEngine runs it in its own process; the server runs it in a process of its own
(engine/core_process.py), so that HTTP, tokenization and detokenization never take time from the step loop.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import numpy as np

from tinyvllm.config import EngineConfig
from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.scheduler_output import SchedulerOutput
from tinyvllm.core.sequence import Request, Sequence, SequenceStatus, StopVerdict
from tinyvllm.core.structured_output import reasoning_ended
from tinyvllm.engine.core_setup import build_engine_parts, log
from tinyvllm.engine.input_processor import engine_tokenizer
from tinyvllm.engine.messages import (
  EngineCoreInfo,
  EngineCoreOutput,
  EngineCoreOutputs,
  EngineCoreRequest,
  LogprobsLists,
  PromptLogprobsChunk,
  SampleRef,
  SchedulerStats,
  SwapStats,
)
from tinyvllm.engine.structured_outputs import GrammarCompiler
from tinyvllm.worker.logprobs import ScoredPromptChunk, TokenLogprobs
from tinyvllm.worker.model_runner import freeze_long_lived_objects
from tinyvllm.worker.runner_steps import LaunchedStep, PreparedStep, StepResult


@dataclass
class InFlightStep:
  sched: SchedulerOutput
  launched: LaunchedStep


class EngineCore:
  def __init__(self, config: EngineConfig, log_stats: bool = True):
    """log_stats: every step's outputs carry a stats snapshot (the server's /metrics and stats line need them)."""
    start = time.perf_counter()
    self.config, self.log_stats = config, log_stats
    parts = build_engine_parts(config)
    self.device, self.model_config, self.model_folder = parts.device, parts.model_config, parts.model_folder
    self.max_model_len, self.dtype, self.kv_dtype = parts.max_model_len, parts.dtype, parts.kv_dtype
    self.model, self.allocator, self.kv_cache = parts.model, parts.allocator, parts.kv_cache
    self.scheduler, self.runner, self.async_scheduling = parts.scheduler, parts.runner, parts.async_scheduling
    self.warm_up_seconds = parts.warm_up_seconds
    self.speculator = parts.speculator
    self.requests: dict[str, Request] = {}
    self._eos_ids: dict[str, frozenset[int]] = {}   # request id -> the token ids that end its samples
    self._in_flight: InFlightStep | None = None
    # a grammar step whose forward pass runs and whose masks are being filled: its sampling launches at the next step
    self._sampling_ahead: tuple[SchedulerOutput, PreparedStep] | None = None
    self._seed_rng = random.Random(config.seed)
    # structured output's grammars, compiled against the tokenizer (loaded on the first structured request)
    self.grammars = GrammarCompiler(lambda: engine_tokenizer(config), self.model_config.vocab_size,
                                    list(self.model_config.eos_token_ids),
                                    config.structured_outputs_config.get("disable_any_whitespace", False),
                                    config.reasoning_parser)
    freeze_long_lived_objects()
    log(f"engine core ready in {time.perf_counter() - start:.1f} s")

  def info(self) -> EngineCoreInfo:
    paged = isinstance(self.allocator, BlockManager)
    return EngineCoreInfo(self.max_model_len, self.model_config.vocab_size, list(self.model_config.eos_token_ids),
                          self.allocator.num_blocks, self.allocator.block_size, paged,
                          None if self.model_folder is None else str(self.model_folder))

  # ---- requests
  def add_request(self, request: EngineCoreRequest) -> None:
    """Queue a request the frontend has validated (its max_tokens set)."""
    rid, params = request.request_id, request.sampling_params
    if rid in self.requests: raise ValueError(f"request id {rid!r} is already in use")
    base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
    eos = frozenset(request.eos_token_ids)
    grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs is not None else None
    if grammar is not None and (markers := self.grammars.reasoning_markers()) is not None \
        and not reasoning_ended(request.prompt_token_ids, *markers):
      grammar = grammar.after_reasoning(markers[1])
    seqs = [Sequence(rid, request.prompt_token_ids, params, seed=hash((base_seed, i)) if i else base_seed, index=i,
                     priority=request.priority, group=request.group, eos_token_ids=eos,
                     grammar=grammar.copy() if grammar is not None and i else grammar)
            for i in range(params.n)]
    self.requests[rid] = Request(rid, None, request.prompt_token_ids, params, seqs, arrival_time=request.arrival_time)
    self._eos_ids[rid] = eos
    self.scheduler.add(seqs)

  def abort_requests(self, request_ids: list[str]) -> None:
    """Stop requests wherever they are and free everything they hold (unknown or finished ids are ignored)."""
    for rid in request_ids:
      request = self.requests.get(rid)
      if request is not None:
        self.scheduler.abort(request.seqs)
        self._retire(request)

  def stop_samples(self, samples: list[SampleRef]) -> None:
    """The frontend found a stop string in these samples: end them and free their blocks."""
    for ref in samples:
      request = self.requests.get(ref.request_id)
      if request is None: continue
      self.scheduler.abort([request.seqs[ref.index]])
      if request.is_finished: self._retire(request)

  def has_unfinished_requests(self) -> bool:
    return bool(self.requests) or self._in_flight is not None or self._sampling_ahead is not None

  def reset_prefix_cache(self) -> None:
    """Forget every cached prefix block (blocks in use stay where they are)."""
    self.scheduler.reset_prefix_cache()

  def compute_logits(self, prompt_ids: list[int]) -> np.ndarray:
    """The model's next-token logits after prompt_ids ([vocab], float32); runs on free cache space, outside the queue."""
    with self.scheduler.scoring(prompt_ids) as sched: return self.runner.logits(sched)[0]

  # ---- the loop
  def step(self) -> EngineCoreOutputs:
    """Schedule and launch one step; return the outputs of the step that finished, and the stats after it.

    With asynchronous scheduling the finished step is the previous one: this step was scheduled and launched while
    it ran, its tokens still in flight counted as placeholders (core/async_scheduling.py) and read on the device. A
    step with grammar rows is scheduled and prepared while the previous one runs too, and its forward pass launched;
    its masks need the grammars advanced by that step's tokens, so they are filled once it has landed, on a thread,
    while this call returns and its caller processes the outputs and the next call schedules and prepares its step;
    that call then launches the sampling and, right behind it, its own step's forward pass (so the device runs them
    back to back, and only landing, advancing and masking wait for each other)."""
    outputs: list[EngineCoreOutput] = []
    if self._sampling_ahead is not None and not self.runner.chains(self._sampling_ahead[1]):
      self._launch_sampling_ahead()   # the next step needs its tokens on the host: sampled and landed first
    if self._in_flight is not None and not self._in_flight.launched.chains: self._finish_in_flight(outputs)
    if self.speculator is not None: self.scheduler.set_proposals(self.speculator.propose(self.scheduler.running))
    sched = self.scheduler.schedule()
    if self.speculator is not None and sched.speculates: sched = self.speculator.complete(sched)
    prepared = self.runner.prepare(sched) if sched else None
    # the last step's sampling (its masks filled on a thread meanwhile) only now, so that this step's forward pass
    # follows it on the device at once: the GPU does not wait while this step is scheduled and prepared
    if self._sampling_ahead is not None: self._launch_sampling_ahead()
    if self._in_flight is not None and prepared is not None and prepared.waits_for_tokens:
      self.runner.launch_forward(prepared)   # its forward pass now, behind the step in flight
      self._finish_in_flight(outputs)
      if prepared.logits is not None:   # its sampling at the next step; the masks are filled meanwhile, beside the
        prepared.controls.start_fill()   # caller's own work with these outputs
        self._sampling_ahead, prepared = (sched, prepared), None
    launched = InFlightStep(sched, self.runner.launch(prepared)) if prepared is not None else None
    if self._in_flight is not None: self._finish_in_flight(outputs)
    self._in_flight = launched
    if launched is not None and not self.async_scheduling: self._finish_in_flight(outputs)
    return EngineCoreOutputs(outputs, self.stats(sched, sum(len(o.new_token_ids) for o in outputs)) if self.log_stats else None,
                             time.time())

  def _launch_sampling_ahead(self) -> None:
    """Launch the sampling of the step whose forward pass went ahead; it becomes the step in flight (there is none
    then: the step before it landed in the call that stored it)."""
    assert self._sampling_ahead is not None and self._in_flight is None
    (sched, prepared), self._sampling_ahead = self._sampling_ahead, None
    self._in_flight = InFlightStep(sched, self.runner.launch(prepared))

  def _finish_in_flight(self, outputs: list[EngineCoreOutput]) -> None:
    """Wait for the step in flight, land its tokens (the scheduler applies the token-level stops) and report them."""
    flight, self._in_flight = self._in_flight, None
    assert flight is not None
    result = flight.launched.result()
    chunks = {chunk.seq.seq_id: chunk for chunk in result.prompt_logprobs}
    rows: dict[int, tuple[int, int]] = {}   # seq id -> (its row, the tokens it landed)

    def judge(seq: Sequence, token: int, row: int) -> StopVerdict | None:
      rows[seq.seq_id] = (row, rows.get(seq.seq_id, (row, 0))[1] + 1)
      return self._token_stop(seq, token)
    for seq in self.scheduler.update_from_output(flight.sched, result.token_ids, judge):
      row, landed = rows[seq.seq_id]
      outputs.append(self._output(seq, seq.output_token_ids[-landed:], self._logprobs(result, row, landed, seq),
                                  chunks.pop(seq.seq_id, None)))
    for chunk in chunks.values():   # prompt chunks of sequences that sampled nothing this step
      if not chunk.seq.is_finished: outputs.append(self._output(chunk.seq, [], None, chunk))
    for request in {seq.request_id: self.requests.get(seq.request_id) for seq in result.seqs}.values():
      if request is not None and request.is_finished: self._retire(request)

  def _token_stop(self, seq: Sequence, token: int) -> StopVerdict | None:
    """vLLM's order: EOS (unless ignore_eos) or a stop token ends the sample with "stop"; then max_tokens or the
    context with "length"."""
    params = seq.params
    if token in self._eos_ids[seq.request_id] and not params.ignore_eos: return StopVerdict(SequenceStatus.FINISHED_STOPPED)
    if token in params.stop_token_ids: return StopVerdict(SequenceStatus.FINISHED_STOPPED, token)
    if (params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens) or seq.num_known_tokens >= self.max_model_len:
      return StopVerdict(SequenceStatus.FINISHED_LENGTH)
    return None

  @staticmethod
  def _output(seq: Sequence, new_token_ids: list[int], logprobs: LogprobsLists | None,
              chunk: ScoredPromptChunk | None) -> EngineCoreOutput:
    prompt = None if chunk is None else PromptLogprobsChunk(chunk.first, chunk.token_ids,
                                                            _lists(chunk.logprobs, chunk.seq.params.prompt_logprobs or 0))
    stop_reason = seq.stop_reason if isinstance(seq.stop_reason, int) else None
    return EngineCoreOutput(seq.request_id, seq.index, new_token_ids, logprobs, prompt, seq.finish_reason, stop_reason,
                            seq.num_cached_tokens or 0, seq.first_scheduled_time, seq.first_token_time, seq.last_token_time,
                            seq.finished_time, seq.num_draft_tokens, seq.num_accepted_tokens)

  @staticmethod
  def _logprobs(result: StepResult, row: int, count: int, seq: Sequence) -> LogprobsLists | None:
    """The logprobs of the `count` tokens sampling row `row` landed (a verification's rows lie spec_rows apart)."""
    if result.logprobs is None or seq.params.logprobs is None: return None
    first = row * result.spec_rows
    return _lists(result.logprobs.rows(first, first + count), seq.params.logprobs)

  def _retire(self, request: Request) -> None:
    self.requests.pop(request.request_id, None)
    self._eos_ids.pop(request.request_id, None)

  # ---- stats
  def stats(self, sched: SchedulerOutput | None = None, generated: int = 0) -> SchedulerStats:
    """The state now, the prompt tokens `sched` (the step just scheduled) computes, and the `generated` tokens that
    reached the host in this call (a verification lands several a sequence)."""
    alloc, scheduler = self.allocator, self.scheduler
    running = {s.request_id for s in scheduler.running}
    swapped = {s.request_id for s in scheduler.swapped}
    waiting = {s.request_id for s in scheduler.waiting} - running - swapped
    prompt_tokens = 0
    for item in sched.scheduled if sched is not None else ():
      prompt_len = len(item.seq.prompt_token_ids)
      if item.start < prompt_len: prompt_tokens += min(item.start + item.num_new_tokens, prompt_len) - item.start
    prefix_caching = isinstance(alloc, BlockManager) and alloc.enable_prefix_caching
    swap = scheduler.swap_space
    swap_stats = SwapStats(len(swapped), swap.num_used_blocks, swap.num_blocks, scheduler.num_swapped_out_blocks,
                           scheduler.num_swapped_in_blocks, scheduler.num_swap_fallbacks) if swap is not None else None
    spec_stats = None if self.speculator is None else replace(scheduler.spec)   # a snapshot
    return SchedulerStats(len(running), len(waiting), alloc.num_used_blocks, alloc.num_blocks, prefix_caching,
                          getattr(alloc, "prefix_queries", 0), getattr(alloc, "prefix_hits", 0), scheduler.num_preemptions,
                          prompt_tokens, generated, swap_stats, spec_stats)


def _lists(lp: TokenLogprobs, k: int) -> LogprobsLists:
  """Raw logprobs as plain lists, the top-k cut to the k asked for."""
  return LogprobsLists(lp.logprob.tolist(), lp.rank.tolist(), lp.top_ids[:, :k].tolist(), lp.top_logprobs[:, :k].tolist())
