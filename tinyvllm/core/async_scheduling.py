"""Asynchronous scheduling (`--async-scheduling`, as vLLM's): step n + 1 is scheduled and launched while step n runs.

A token sampled by a step still in flight is a placeholder (`Sequence.num_pending`): it counts in its sequence's length,
so the next step can compute its K/V, and the runner takes its id on the device from the previous step's samples (row
`pending_row`, handed on as the item's `token_source`). What must not change under it:
- a sequence whose length limit is already reached by its tokens in flight is not scheduled;
- a token that lands after its sequence ended (a stop read late, an abort) is dropped; the ended sequence's blocks were
  freed at once (later steps are ordered after it on the device);
- a sequence preempted with a token in flight waits for it before it is readmitted (swapped out, its blocks are copied
  out after that step's writes: the copy is ordered after it on the device);
- prefix-cache blocks are registered only once their tokens are known (update_from_output does it after landing).
The engine reads a step before scheduling the next where a row needs every earlier token on the host (penalties).
"""
from __future__ import annotations

from tinyvllm.core.scheduler import Scheduler, SchedulerBase
from tinyvllm.core.scheduler_output import SchedulerOutput
from tinyvllm.core.sequence import Sequence
from tinyvllm.core.static_scheduler import StaticScheduler


class AsyncScheduling(SchedulerBase):
  """Mixed in before a policy (AsyncScheduler, AsyncStaticScheduler): placeholders for tokens in flight."""

  def _record_in_flight(self, out: SchedulerOutput) -> None:
    for row, seq in enumerate(out.sampling_seqs): seq.num_pending, seq.pending_row = seq.num_pending + 1, row

  def _land(self, seq: Sequence) -> bool:
    seq.num_pending -= 1
    return not seq.is_finished

  def _done_in_flight(self, seq: Sequence) -> bool: return seq.reaches_max_tokens

  def _token_source(self, seq: Sequence) -> int: return seq.pending_row if seq.num_pending else -1

  def _readmittable(self, seq: Sequence) -> bool: return not seq.num_pending


class AsyncScheduler(AsyncScheduling, Scheduler):
  """Continuous batching, scheduled one step ahead."""


class AsyncStaticScheduler(AsyncScheduling, StaticScheduler):
  """Static batching, scheduled one step ahead."""


def make_scheduler(kind: str, asynchronous: bool, allocator, config) -> SchedulerBase:
  """kind: "continuous" or "static". The static baseline admits whole batches first come, first served and never
  preempts, so it takes neither the priority policy nor swapping."""
  if kind not in ("continuous", "static"): raise ValueError(f"unknown scheduler {kind!r}")
  if kind == "static" and config.scheduling_policy != "fcfs":
    raise ValueError(f"scheduling_policy={config.scheduling_policy!r} needs the continuous scheduler (the static one serves fcfs)")
  if kind == "static" and config.preemption_mode != "recompute":
    raise ValueError(f"preemption_mode={config.preemption_mode!r} needs the continuous scheduler (the static one never preempts)")
  cls = {("continuous", False): Scheduler, ("static", False): StaticScheduler, ("continuous", True): AsyncScheduler,
         ("static", True): AsyncStaticScheduler}[(kind, asynchronous)]
  return cls(allocator, config)
