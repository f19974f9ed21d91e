"""Scheduling policies (vLLM's `scheduling_policy`): the order of the waiting queue and of the running batch.

- fcfs: first come, first served, taking turns: requests wait in order of their turn (core/fair_share.py: arrival
  order, except that an API request's many sequences take turns with other requests'), a preempted sequence goes
  back to the front of the queue, the running batch is in admission order and its newest sequence is the first to be
  preempted.
- priority: each request's `priority` (lower values first, ties by turn). The waiting queue and the running batch
  are both kept in that order, so the running batch's last sequence is always its lowest-priority one (latest
  arrival among equals): the one preempted when blocks run out. A waiting sequence of higher priority than running
  ones is admitted before them, preempting them (the scheduler's `_admit_ahead_of`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tinyvllm.core.sequence import Sequence

SCHEDULING_POLICIES = ("fcfs", "priority")


def rank(seq: Sequence) -> tuple[int, int, float, int]:
  """Lower ranks are served first: priority, turn, then arrival (seq_id breaks ties of the clock, in creation order)."""
  return seq.priority, seq.turn, seq.arrival_time, seq.seq_id


def _insert_by_rank(queue: deque[Sequence] | list[Sequence], seq: Sequence) -> None:
  key = rank(seq)
  index = next((i for i, other in enumerate(queue) if rank(other) > key), len(queue))
  queue.insert(index, seq)


def _insert_by_turn(queue: deque[Sequence], seq: Sequence) -> None:
  """Behind every sequence of an earlier or equal turn; searched from the back, where a new turn almost always goes."""
  index = len(queue)
  while index and queue[index - 1].turn > seq.turn: index -= 1
  queue.insert(index, seq)


def check_priority(priority: object, policy: str) -> None:
  """A request's priority, refused where it cannot be honoured (as vLLM refuses one under fcfs)."""
  if not isinstance(priority, int) or isinstance(priority, bool):
    raise ValueError(f"priority must be an integer, got {priority!r}")
  if priority != 0 and policy != "priority":
    raise ValueError(f"priority={priority} needs scheduling_policy='priority' (this engine's is {policy!r}, which serves "
                     "requests first come, first served)")


@dataclass(frozen=True)
class SchedulingPolicy:
  name: str = "fcfs"

  def __post_init__(self) -> None:
    if self.name not in SCHEDULING_POLICIES:
      raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.name!r}")

  @property
  def by_priority(self) -> bool: return self.name == "priority"

  def enqueue(self, waiting: deque[Sequence], seq: Sequence) -> None:
    """A new request's first sequence joins the queue."""
    if self.by_priority: _insert_by_rank(waiting, seq)
    else: _insert_by_turn(waiting, seq)

  def requeue(self, waiting: deque[Sequence], seq: Sequence) -> None:
    """A preempted sequence goes back: to the front (fcfs), or to its rank's place (priority)."""
    if self.by_priority: _insert_by_rank(waiting, seq)
    else: waiting.appendleft(seq)

  def start_running(self, running: list[Sequence], seq: Sequence) -> None:
    if self.by_priority: _insert_by_rank(running, seq)
    else: running.append(seq)

  def outranks(self, waiting: Sequence, running: Sequence) -> bool:
    """Whether a waiting sequence may preempt a running one: only for a strictly higher priority (lower value)."""
    return self.by_priority and waiting.priority < running.priority
