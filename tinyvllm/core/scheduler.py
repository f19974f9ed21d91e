"""Schedulers: which sequences run in the next step, and all of their state (as vLLM v1's scheduler owns its requests').

`schedule()` decides a step and moves its sequences on at once (their computed tokens, forks, in-flight placeholders);
`update_from_output()` lands the step's sampled tokens, applies the output processor's stop verdicts, registers full
blocks in the prefix cache, and finishes and frees what ended. Nothing else writes a Sequence's state.
- `Scheduler` (continuous batching, the default): every step serves the running sequences at their current positions
  (decodes and unfinished prompt chunks) and then admits waiting sequences mid-flight while the token budget
  (--max-num-batched-tokens), --max-num-seqs and free blocks allow. Long prompts are split into chunks (chunked
  prefill) that share a step with decodes. The scheduling policy (core/scheduling_policy.py) orders the queue and the
  batch: first come, first served, or by priority, where a waiting sequence of higher priority is admitted ahead of
  lower-priority running ones and preempts them if it needs their room. When a running sequence needs a block and
  none is free, the batch's last sequence (the newest, or the lowest-priority one) is preempted.
- Preemption (--preemption-mode): `recompute` frees the sequence's blocks, and it is computed again from scratch when
  readmitted; `swap` copies its blocks to the swap space in host memory (core/swap_space.py) and back into free
  device blocks when it is readmitted, where it continues exactly where it was (recomputed when the swap space is full).
- `StaticScheduler` (the baseline, core/static_scheduler.py): admit a batch, run it until all of it is done, then
  admit the next.
- Their asynchronous forms (`AsyncScheduling`, tinyvllm/core/async_scheduling.py) schedule a step while the previous
  one is still in flight.

Speculative decoding: a decoding sequence's proposals (`set_proposals`, found by the engine after each step) are
scheduled after its last token, so the step computes 1 + k tokens for it and verifies them; the step lands the accepted
proposals and the token after them, and the rejected ones' K/V slots are given back (a block holding only rejected
tokens is freed). Proposals never preempt: without room for them the sequence decodes one token.

A request with n > 1 samples queues only its first sequence; the others are forked from it (sharing its prompt blocks)
in the step that samples its first token, each sampling its own token from the same logits.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tinyvllm.core.fair_share import FairShare, dominant_group, first_without_seats
from tinyvllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from tinyvllm.core.scheduling_policy import SchedulingPolicy
from tinyvllm.core.sequence import Sequence, SequenceStatus, StopVerdict
from tinyvllm.core.spec_decoding_stats import SpecDecodingStats
from tinyvllm.core.swap_space import SwapSpace
from tinyvllm.sampling_params import SamplingParams

# (sequence, sampled token, its row in the step) -> the output processor's verdict
Judge = Callable[[Sequence, int, int], StopVerdict | None]


@dataclass
class SchedulerConfig:
  max_num_seqs: int = 64
  max_num_batched_tokens: int = 2048
  enable_chunked_prefill: bool = True
  long_prefill_token_threshold: int = 0   # most prompt tokens of one sequence per step (0: up to the budget)
  scheduling_policy: str = "fcfs"         # fcfs | priority (core/scheduling_policy.py)
  preemption_mode: str = "recompute"      # recompute | swap (a preempted sequence's blocks go to the swap space)
  num_swap_blocks: int = 0                # the swap space's blocks (preemption_mode swap)


@dataclass
class StepPlan:
  """A step being planned: the token budget left, its items, the sequences it preempted."""
  budget: int
  items: list[ScheduledSequence] = field(default_factory=list)
  preempted: list[Sequence] = field(default_factory=list)
  outranking_done: bool = False   # priority: no waiting sequence is admitted ahead of running ones for the rest of it

  def add(self, item: ScheduledSequence) -> None:
    self.items.append(item)
    self.budget -= item.num_new_tokens


class SchedulerBase:
  def __init__(self, allocator, config: SchedulerConfig):
    self.allocator, self.config = allocator, config
    self.waiting: deque[Sequence] = deque()
    self.running: list[Sequence] = []
    self.pending_forks: dict[int, list[Sequence]] = {}   # first sequence's id -> the samples forked from it
    self.pending_copies: list[tuple[int, int]] = []       # block copies (copy-on-write) the next step must do first
    self.policy = SchedulingPolicy(config.scheduling_policy)
    self.fair_share = FairShare()
    if config.preemption_mode not in ("recompute", "swap"):
      raise ValueError(f"preemption_mode must be recompute or swap, got {config.preemption_mode!r}")
    self.swap_space = SwapSpace(config.num_swap_blocks) if config.preemption_mode == "swap" else None
    self.pending_swap_out: list[tuple[int, int]] = []     # (device, swap-space) block copies the next step must do first
    self.pending_swap_in: list[tuple[int, int]] = []      # (swap-space, device) block copies, after the swap-outs
    self.num_preemptions = 0
    self.num_swapped_out_blocks = self.num_swapped_in_blocks = 0   # blocks copied to / from the swap space
    self.num_swap_fallbacks = 0   # preemptions recomputed because the swap space could not hold the sequence
    self.spec = SpecDecodingStats()

  # ---- requests
  def add(self, seqs: list[Sequence]) -> None:
    """Queue a request's sequences: the first runs, the rest wait to be forked from it."""
    first, *forks = seqs
    if forks: self.pending_forks[first.seq_id] = forks
    first.turn = self.fair_share.assign_turn(first, len(seqs))
    self.policy.enqueue(self.waiting, first)

  def has_unfinished(self) -> bool: return bool(self.waiting or self.running)

  @property
  def swapped(self) -> list[Sequence]:
    """The preempted sequences whose blocks are in the swap space (they wait in the queue)."""
    return [seq for seq in self.waiting if seq.status is SequenceStatus.SWAPPED]

  @property
  def num_swapped_requests(self) -> int: return len({seq.request_id for seq in self.swapped})

  def set_proposals(self, proposals: dict[Sequence, list[int]]) -> None:
    """Speculative decoding: the tokens each running sequence's next step verifies after its last one."""
    for seq, tokens in proposals.items():
      if seq.status is SequenceStatus.RUNNING and seq.decoding: seq.spec_token_ids = list(tokens)

  def abort(self, seqs: list[Sequence]) -> None:
    """End sequences wherever they are (a step in flight drops their tokens) and free what they hold."""
    for seq in seqs: self._finish(seq, SequenceStatus.FINISHED_ABORTED)

  def reset_prefix_cache(self) -> None:
    if hasattr(self.allocator, "reset_prefix_cache"): self.allocator.reset_prefix_cache()

  # ---- one step
  def schedule(self) -> SchedulerOutput:
    """Decide the next step and move its sequences on: they count its tokens as computed from now on."""
    plan = self._plan()
    if self.swap_space is not None: self.swap_space.end_step()
    # a step that runs nothing moves no blocks either: its swap-outs go first in the next step that runs
    if not plan.items: return SchedulerOutput([], plan.preempted)
    out = SchedulerOutput(plan.items, plan.preempted, self.pending_copies, self.pending_swap_out, self.pending_swap_in)
    self.pending_copies, self.pending_swap_out, self.pending_swap_in = [], [], []
    for item in plan.items:
      item.seq.num_computed_tokens += item.num_new_tokens
      item.seq.spec_token_ids = []   # verified in this step, or dropped: fresh ones follow its tokens
    for item in plan.items:
      for child in item.forks: self._start_fork(item.seq, child)
    self._record_in_flight(out)
    return out

  def update_from_output(self, out: SchedulerOutput, token_ids: list[list[int]], judge: Judge) -> list[Sequence]:
    """Land a finished step's new tokens (per row of `out.sampling_seqs`: the sampled one, or the accepted proposals
    and the token after them) and ask the output processor about each, up to the first that ends the sequence; give
    back the rejected proposals' slots; enter the newly full blocks into the prefix cache (now that every token they
    hold is known), then finish what the verdicts end. Returns the sequences that got tokens (one that ended while the
    step ran gets none)."""
    landed, verdicts, now = [], [], time.time()
    for row, (seq, tokens) in enumerate(zip(out.sampling_seqs, token_ids, strict=True)):
      if not self._land(seq): continue
      verdict = None
      for token in tokens:
        seq.output_token_ids.append(token)
        if (verdict := judge(seq, token, row)) is not None: break
        if seq.grammar is not None and seq.grammar.advance(token):   # structured output: the grammar is complete
          verdict = StopVerdict(SequenceStatus.FINISHED_STOPPED)
          break
      if seq.first_token_time is None: seq.first_token_time = now
      seq.last_token_time = now
      landed.append(seq)
      verdicts.append((seq, verdict))
    if out.speculates: self._roll_back_rejected(out, token_ids)
    for item in out.scheduled:   # (not one preempted meanwhile: its blocks are gone or in the swap space)
      if item.seq.status is SequenceStatus.RUNNING: self.allocator.register_computed(item.seq)
    for seq, verdict in verdicts:
      if verdict is not None: self._finish(seq, verdict.status, verdict.stop_reason)
    return landed

  def _roll_back_rejected(self, out: SchedulerOutput, token_ids: list[list[int]]) -> None:
    """Count each verification and give back the K/V slots of the proposals it rejected: only the last token and the
    accepted proposals hold the sequence's true K/V."""
    emitted = {id(seq): len(tokens) for seq, tokens in zip(out.sampling_seqs, token_ids, strict=True)}
    for item in out.scheduled:
      if not item.spec_token_ids or id(item.seq) not in emitted: continue
      seq, accepted = item.seq, emitted[id(item.seq)] - 1
      seq.num_draft_tokens += len(item.spec_token_ids)
      seq.num_accepted_tokens += accepted
      self.spec.count(len(item.spec_token_ids), accepted)
      if seq.status is SequenceStatus.RUNNING:
        seq.num_computed_tokens -= len(item.spec_token_ids) - accepted
        self.allocator.trim(seq)

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
  def _plan(self) -> StepPlan:
    """The step's items and the sequences preempted to make room."""
    raise NotImplementedError

  def _item(self, seq: Sequence, num_new: int) -> ScheduledSequence:
    self.pending_copies.extend(self.allocator.append_slots(seq, num_new))
    start = seq.num_computed_tokens
    proposals = tuple(seq.spec_token_ids[:max(0, num_new - seq.num_uncomputed_tokens)])
    samples = start + num_new - len(proposals) == seq.num_tokens
    forks = tuple(self.pending_forks.get(seq.seq_id, ())) if samples and not seq.output_token_ids else ()
    return ScheduledSequence(seq, start, num_new, self.allocator.block_table(seq), samples, forks, self._token_source(seq),
                             seq.num_output_tokens, proposals)

  def _admit(self, seq: Sequence) -> None:
    self.waiting.remove(seq)
    if seq.status is SequenceStatus.SWAPPED: self._swap_in(seq)
    else: seq.num_computed_tokens = self.allocator.allocate(seq, self._width(seq))
    seq.status = SequenceStatus.RUNNING
    self.fair_share.admitted(seq)
    if seq.first_scheduled_time is None:   # its first admission (a preempted sequence comes back with its outputs)
      seq.first_scheduled_time, seq.num_cached_tokens = time.time(), seq.num_computed_tokens
    self.policy.start_running(self.running, seq)

  def _swap_in(self, seq: Sequence) -> None:
    """Give a swapped-out sequence device blocks again; the runner copies its blocks back before the step."""
    assert self.swap_space is not None
    host = self.swap_space.swap_in(seq.seq_id)
    cached = self.allocator.swap_in(seq, len(host))   # leading blocks the prefix cache still holds: no copy
    self.pending_swap_in += zip(host[cached:], self.allocator.block_table(seq)[cached:len(host)], strict=True)
    self.num_swapped_in_blocks += len(host) - cached

  def _width(self, seq: Sequence) -> int:
    """The sequences seq stands for: itself and the samples still to be forked from it."""
    return 1 + len(self.pending_forks.get(seq.seq_id, []))

  def _start_fork(self, parent: Sequence, child: Sequence) -> None:
    """The parent samples its first token this step: the child shares its blocks and runs from here on."""
    self.pending_forks.pop(parent.seq_id, None)
    self.pending_copies.extend(self.allocator.fork(parent, child))
    child.num_computed_tokens, child.status, child.turn = parent.num_computed_tokens, SequenceStatus.RUNNING, parent.turn
    child.first_scheduled_time, child.num_cached_tokens = time.time(), parent.num_cached_tokens
    self.policy.start_running(self.running, child)

  def _finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
    """End a sequence wherever it is; its blocks are free for this very step."""
    if not seq.is_finished: seq.status, seq.stop_reason, seq.finished_time = status, stop_reason, time.time()
    if seq in self.running: self.running.remove(seq)
    if seq in self.waiting: self.waiting.remove(seq)
    self.pending_forks.pop(seq.seq_id, None)
    self.allocator.free(seq)
    if self.swap_space is not None: self.swap_space.free(seq.seq_id)

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
  """Continuous batching with chunked prefill, ordered by the scheduling policy, and preemption."""

  def _chunk(self, seq: Sequence, budget: int) -> int:
    """The tokens seq computes next: a prompt chunk, or its last token and its proposals, within the budget."""
    num_new = min(seq.num_uncomputed_tokens + (len(seq.spec_token_ids) if seq.decoding else 0), budget)
    if seq.in_prefill and self.config.long_prefill_token_threshold and self.config.enable_chunked_prefill:
      num_new = min(num_new, self.config.long_prefill_token_threshold)
    return num_new

  def _plan(self) -> StepPlan:
    plan, index = StepPlan(self.config.max_num_batched_tokens), 0
    self._make_room_fairly(plan)
    while index < len(self.running) and plan.budget > 0:
      if self._admit_ahead_of(index, plan):
        index += 1   # it went in ahead of running[index], which is next
        continue
      seq = self.running[index]
      if self._done_in_flight(seq):
        index += 1
        continue
      num_new = self._chunk(seq, plan.budget)
      if num_new > 1 and seq.decoding and not self.allocator.can_append(seq, num_new): num_new = 1   # proposals never preempt
      if not self._make_room(seq, num_new, plan.preempted): break
      plan.add(self._item(seq, num_new))
      index += 1
    self._admit_waiting(plan)
    return plan

  def _make_room(self, seq: Sequence, num_new: int, preempted: list[Sequence]) -> bool:
    """Preempt the batch's last sequences (none scheduled yet) until seq can take num_new more tokens; False if seq
    itself went."""
    while not self.allocator.can_append(seq, num_new):
      victim = self.running[-1]
      preempted.append(self._preempt(victim))
      if victim is seq: return False
    return True

  def _admit_waiting(self, plan: StepPlan) -> None:
    """Admit waiting sequences in queue order while they fit; never one preempted in this very step (that would undo
    the preemption, and could do so forever)."""
    while self.waiting and plan.budget > 0:
      seq = self.waiting[0]
      if seq in plan.preempted or not self._readmittable(seq) or not self._fits(seq, plan.budget): return
      self._admit_into(seq, plan)

  def _make_room_fairly(self, plan: StepPlan) -> None:
    """Fair admission (core/fair_share.py): while a group holds more than half of the seats, the first waiting sequence
    of a group holding none (one a step) gets room from that group's newest sequences (never below half of the seats,
    never of a better priority than its own) and goes to the queue's front, to be admitted at the step's end."""
    if not self.waiting or 2 * len(self.running) <= self.config.max_num_seqs: return   # no group can hold half of the seats
    if (dominant := dominant_group(self.running, self.config.max_num_seqs)) is None: return
    seq = first_without_seats(self.waiting, self.running, dominant)
    if seq is None or not self._readmittable(seq): return
    spare = sum(s.group == dominant for s in self.running) - self.config.max_num_seqs // 2
    victims = [s for s in reversed(self.running) if s.group == dominant and s.priority >= seq.priority][:spare]
    if not self._fits(seq, plan.budget, victims): return
    count = next(n for n in range(len(victims) + 1) if self._fits(seq, plan.budget, victims[:n]))
    for victim in victims[:count]: plan.preempted.append(self._preempt(victim))
    self.waiting.remove(seq)
    self.waiting.appendleft(seq)

  def _admit_ahead_of(self, index: int, plan: StepPlan) -> bool:
    """Priority policy: admit the front waiting sequence ahead of running[index] if its priority is higher. If it needs
    their seats or blocks, the lowest-priority running sequences are preempted for it (from the batch's end, down to
    running[index]: none is scheduled yet), as few as will do, and none unless enough of them will. Whether it was
    admitted."""
    if plan.outranking_done or not self.waiting or not self.policy.outranks(self.waiting[0], self.running[index]):
      return False
    seq, victims = self.waiting[0], self.running[index:][::-1]
    if seq in plan.preempted or not self._readmittable(seq) or not self._fits(seq, plan.budget, victims):
      plan.outranking_done = True   # it cannot get in this step, and the queue is served in its order
      return False
    count = next(n for n in range(len(victims) + 1) if self._fits(seq, plan.budget, victims[:n]))
    for victim in victims[:count]: plan.preempted.append(self._preempt(victim))
    self._admit_into(seq, plan)
    return True

  def _fits(self, seq: Sequence, budget: int, releasing: list[Sequence] | None = None) -> bool:
    """Whether waiting seq can be admitted now, once the `releasing` running sequences are preempted: a seat for it and
    its pending forks (and those of running sequences; a lone wide request still runs), a chunk within the budget
    (without chunked prefill, all of the rest of its prompt), and the blocks for it."""
    releasing = releasing or []
    seats = sum(self._width(s) for s in self.running) - sum(self._width(s) for s in releasing)
    if seats and seats + self._width(seq) > self.config.max_num_seqs: return False
    num_new = self._chunk(seq, budget)
    if num_new == 0 or (num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill): return False
    if seq.status is SequenceStatus.SWAPPED: return self.allocator.can_swap_in(seq, num_new, releasing)
    return self.allocator.can_allocate(seq, num_new, self._width(seq), releasing)

  def _admit_into(self, seq: Sequence, plan: StepPlan) -> None:
    self._admit(seq)
    plan.add(self._item(seq, self._chunk(seq, plan.budget)))   # (the prefix cache may have covered part of it)

  def _preempt(self, seq: Sequence) -> Sequence:
    """Take a running sequence's blocks back: to the swap space (preemption_mode swap, while it has room), else freed,
    to be recomputed from scratch when it is readmitted. It waits at the queue's front (fcfs) or at its rank."""
    self.running.remove(seq)
    seq.spec_token_ids = []
    if self._swap_out(seq): seq.status = SequenceStatus.SWAPPED
    else:
      self.allocator.free(seq)
      seq.num_computed_tokens, seq.status = 0, SequenceStatus.WAITING
    self.policy.requeue(self.waiting, seq)
    self.num_preemptions += 1
    return seq

  def _swap_out(self, seq: Sequence) -> bool:
    """Move seq's blocks to the swap space (the runner copies them out before the next step) if it can hold them."""
    if self.swap_space is None: return False
    num_blocks = len(self.allocator.block_table(seq))
    if not self.swap_space.can_hold(num_blocks):
      self.num_swap_fallbacks += 1
      return False
    host = self.swap_space.take(seq.seq_id, num_blocks)
    self.pending_swap_out += zip(self.allocator.swap_out(seq), host, strict=True)
    self.num_swapped_out_blocks += num_blocks
    return True
