"""Schedulers: which sequences run in the next step, and all of their state (as vLLM v1's scheduler owns its requests').

`schedule()` decides a step and moves its sequences on at once (their computed tokens, forks, in-flight placeholders);
`update_from_output()` lands the step's sampled tokens, applies the output processor's stop verdicts, registers full
blocks in the prefix cache, and finishes and frees what ended. Nothing else writes a Sequence's state.
- `Scheduler` (continuous batching, the default): every step serves the running sequences at their current positions
  (decodes and unfinished prompt chunks) and then admits waiting sequences mid-flight while the token budget
  (--max-num-batched-tokens), --max-num-seqs and free blocks allow. Long prompts are split into chunks (chunked
  prefill) that share a step with decodes. When a running sequence needs a block and none is free, the newest running
  sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later.
- `StaticScheduler` (the baseline): admit a batch, run it until all of it is done, then admit the next.
- Their asynchronous forms (`AsyncScheduling`, tinyvllm/core/async_scheduling.py) schedule a step while the previous
  one is still in flight.

A request with n > 1 samples queues only its first sequence; the others are forked from it (sharing its prompt blocks)
in the step that samples its first token, each sampling its own token from the same logits.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tinyvllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from tinyvllm.core.sequence import Sequence, SequenceStatus, StopVerdict
from tinyvllm.sampling_params import SamplingParams

# (sequence, sampled token, its row in the step) -> the output processor's verdict
Judge = Callable[[Sequence, int, int], StopVerdict | None]


@dataclass
class SchedulerConfig:
  max_num_seqs: int = 64
  max_num_batched_tokens: int = 2048
  enable_chunked_prefill: bool = True
  long_prefill_token_threshold: int = 0   # most prompt tokens of one sequence per step (0: up to the budget)


class SchedulerBase:
  def __init__(self, allocator, config: SchedulerConfig):
    self.allocator, self.config = allocator, config
    self.waiting: deque[Sequence] = deque()
    self.running: list[Sequence] = []
    self.pending_forks: dict[int, list[Sequence]] = {}   # first sequence's id -> the samples forked from it
    self.pending_copies: list[tuple[int, int]] = []       # block copies (copy-on-write) the next step must do first
    self.num_preemptions = 0

  # ---- requests
  def add(self, seqs: list[Sequence]) -> None:
    """Queue a request's sequences: the first runs, the rest wait to be forked from it."""
    first, *forks = seqs
    if forks: self.pending_forks[first.seq_id] = forks
    self.waiting.append(first)

  def has_unfinished(self) -> bool: return bool(self.waiting or self.running)

  def abort(self, seqs: list[Sequence]) -> None:
    """End sequences wherever they are (a step in flight drops their tokens) and free what they hold."""
    for seq in seqs: self._finish(seq, SequenceStatus.FINISHED_ABORTED)

  def reset_prefix_cache(self) -> None:
    if hasattr(self.allocator, "reset_prefix_cache"): self.allocator.reset_prefix_cache()

  # ---- one step
  def schedule(self) -> SchedulerOutput:
    """Decide the next step and move its sequences on: they count its tokens as computed from now on."""
    items, preempted = self._plan()
    out = SchedulerOutput(items, preempted, self.pending_copies)
    self.pending_copies = []
    for item in items: item.seq.num_computed_tokens += item.num_new_tokens
    for item in items:
      for child in item.forks: self._start_fork(item.seq, child)
    self._record_in_flight(out)
    return out

  def update_from_output(self, out: SchedulerOutput, token_ids: list[int], judge: Judge) -> list[Sequence]:
    """Land a finished step's sampled tokens (row order of `out.sampling_seqs`) and ask the output processor about
    each; enter the newly full blocks into the prefix cache (now that every token they hold is known), then finish
    what the verdicts end. Returns the sequences that got a token (one that ended while the step ran gets none)."""
    landed, verdicts, now = [], [], time.time()
    for row, (seq, token) in enumerate(zip(out.sampling_seqs, token_ids, strict=True)):
      if not self._land(seq): continue
      seq.output_token_ids.append(token)
      if seq.first_token_time is None: seq.first_token_time = now
      seq.last_token_time = now
      landed.append(seq)
      verdicts.append((seq, judge(seq, token, row)))
    for item in out.scheduled:
      if not item.seq.is_finished: self.allocator.register_computed(item.seq)
    for seq, verdict in verdicts:
      if verdict is not None: self._finish(seq, verdict.status, verdict.stop_reason)
    return landed

  @contextlib.contextmanager
  def scoring(self, prompt_ids: list[int]) -> Iterator[SchedulerOutput]:
    """A one-sequence step over prompt_ids on free cache space, outside the queues (for logits); freed afterwards."""
    seq = Sequence("score", list(prompt_ids), SamplingParams(max_tokens=1), seed=0)
    if not self.allocator.can_allocate(seq, seq.num_tokens): raise RuntimeError("no free KV cache space to score a prompt")
    seq.num_computed_tokens = self.allocator.allocate(seq)
    try:
      copies = self.allocator.append_slots(seq, seq.num_uncomputed_tokens)
      item = ScheduledSequence(seq, seq.num_computed_tokens, seq.num_uncomputed_tokens, self.allocator.block_table(seq), True)
      yield SchedulerOutput([item], [], copies)
    finally:
      self.allocator.free(seq)

  # ---- the policies' building blocks
  def _plan(self) -> tuple[list[ScheduledSequence], list[Sequence]]:
    """The step's items and the sequences preempted to make room."""
    raise NotImplementedError

  def _item(self, seq: Sequence, num_new: int) -> ScheduledSequence:
    self.pending_copies.extend(self.allocator.append_slots(seq, num_new))
    start = seq.num_computed_tokens
    samples = start + num_new == seq.num_tokens
    forks = tuple(self.pending_forks.get(seq.seq_id, ())) if samples and not seq.output_token_ids else ()
    return ScheduledSequence(seq, start, num_new, self.allocator.block_table(seq), samples, forks, self._token_source(seq),
                             seq.num_output_tokens)

  def _admit(self, seq: Sequence) -> None:
    self.waiting.remove(seq)
    seq.num_computed_tokens = self.allocator.allocate(seq, 1 + len(self.pending_forks.get(seq.seq_id, [])))
    seq.status = SequenceStatus.RUNNING
    if seq.first_scheduled_time is None:   # its first admission (a preempted sequence comes back with its outputs)
      seq.first_scheduled_time, seq.num_cached_tokens = time.time(), seq.num_computed_tokens
    self.running.append(seq)

  def _can_admit(self, seq: Sequence, num_new: int) -> bool:
    return self.allocator.can_allocate(seq, num_new, 1 + len(self.pending_forks.get(seq.seq_id, [])))

  def _start_fork(self, parent: Sequence, child: Sequence) -> None:
    """The parent samples its first token this step: the child shares its blocks and runs from here on."""
    self.pending_forks.pop(parent.seq_id, None)
    self.pending_copies.extend(self.allocator.fork(parent, child))
    child.num_computed_tokens, child.status = parent.num_computed_tokens, SequenceStatus.RUNNING
    child.first_scheduled_time, child.num_cached_tokens = time.time(), parent.num_cached_tokens
    self.running.append(child)

  def _finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
    """End a sequence wherever it is; its blocks are free for this very step."""
    if not seq.is_finished: seq.status, seq.stop_reason, seq.finished_time = status, stop_reason, time.time()
    if seq in self.running: self.running.remove(seq)
    if seq in self.waiting: self.waiting.remove(seq)
    self.pending_forks.pop(seq.seq_id, None)
    self.allocator.free(seq)

  # ---- what asynchronous scheduling changes (core/async_scheduling.py)
  def _record_in_flight(self, out: SchedulerOutput) -> None:
    """Nothing to record: the step's tokens land before the next step is scheduled."""

  def _land(self, seq: Sequence) -> bool:
    """Whether a token sampled for seq is kept (not when seq ended while the step ran)."""
    return not seq.is_finished

  def _done_in_flight(self, seq: Sequence) -> bool:
    """Whether seq's tokens in flight already end it (a step for it now would be wasted)."""
    return False

  def _token_source(self, seq: Sequence) -> int: return -1

  def _readmittable(self, seq: Sequence) -> bool: return True


class Scheduler(SchedulerBase):
  """Continuous batching with chunked prefill and preemption by recomputation (FCFS)."""

  def _chunk(self, seq: Sequence, budget: int) -> int:
    num_new = min(seq.num_uncomputed_tokens, budget)
    if seq.in_prefill and self.config.long_prefill_token_threshold and self.config.enable_chunked_prefill:
      num_new = min(num_new, self.config.long_prefill_token_threshold)
    return num_new

  def _plan(self) -> tuple[list[ScheduledSequence], list[Sequence]]:
    budget, items, preempted = self.config.max_num_batched_tokens, [], []
    index = 0
    while index < len(self.running) and budget > 0:
      seq = self.running[index]
      if self._done_in_flight(seq):
        index += 1
        continue
      num_new = self._chunk(seq, budget)
      if not self._make_room(seq, num_new, preempted): break
      items.append(self._item(seq, num_new))
      budget -= num_new
      index += 1
    if not preempted: self._admit_waiting(budget, items)
    return items, preempted

  def _make_room(self, seq: Sequence, num_new: int, preempted: list[Sequence]) -> bool:
    """Preempt the newest running sequences until seq can take num_new more tokens; False if seq itself went."""
    while not self.allocator.can_append(seq, num_new):
      victim = self.running[-1]
      preempted.append(self._preempt(victim))
      if victim is seq: return False
    return True

  def _admit_waiting(self, budget: int, items: list[ScheduledSequence]) -> None:
    while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
      seq = self.waiting[0]
      if not self._readmittable(seq): return
      # its pending forks will run too, and so will those of running sequences (a lone wide request still runs)
      seats = len(self.running) + sum(len(self.pending_forks.get(s.seq_id, [])) for s in self.running)
      if seats and seats + 1 + len(self.pending_forks.get(seq.seq_id, [])) > self.config.max_num_seqs: return
      num_new = self._chunk(seq, budget)
      if num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill: return
      if not self._can_admit(seq, num_new): return
      self._admit(seq)
      num_new = self._chunk(seq, budget)  # the prefix cache may have covered part of it
      items.append(self._item(seq, num_new))
      budget -= num_new

  def _preempt(self, seq: Sequence) -> Sequence:
    """Free the newest running sequence's blocks; it restarts from scratch (recomputation) when readmitted."""
    self.running.remove(seq)
    self.allocator.free(seq)
    seq.num_computed_tokens, seq.status = 0, SequenceStatus.WAITING
    self.waiting.appendleft(seq)
    self.num_preemptions += 1
    return seq


class StaticScheduler(SchedulerBase):
  """Static batching: admit up to max_num_seqs whole prompts, run them to completion, then admit the next batch.

  A batch is admitted only if every member's worst case (prompt + max_tokens, for each of its samples) fits in the
  cache at once, so a static batch never needs preemption.
  """

  def _plan(self) -> tuple[list[ScheduledSequence], list[Sequence]]:
    if not self.running: self._admit_batch()
    return [self._item(seq, seq.num_uncomputed_tokens) for seq in self.running if not self._done_in_flight(seq)], []

  def _worst_case_blocks(self, seq: Sequence) -> int:
    max_tokens = seq.params.max_tokens or 0
    return self.allocator.blocks_for(seq.num_tokens + max_tokens) * (1 + len(self.pending_forks.get(seq.seq_id, [])))

  def _admit_batch(self) -> None:
    reserved = seats = 0
    while self.waiting:
      seq = self.waiting[0]
      need, width = self._worst_case_blocks(seq), 1 + len(self.pending_forks.get(seq.seq_id, []))
      if seats + width > self.config.max_num_seqs and seats: return
      if reserved + need > self.allocator.num_blocks and reserved: return
      reserved, seats = reserved + need, seats + width
      self._admit(seq)
