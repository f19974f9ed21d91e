"""Fair admission between API requests: one large request cannot hold back small ones from other clients.

A completions request with 300 prompts and n=128 is 38,400 sequences; served strictly in arrival order, a 4-token
request behind it waits until all of them have run. Two rules prevent that, for sequences that carry a `group` (the
API request they came with; the offline engine's requests carry none and are served in arrival order):

- Turns: the waiting queue is ordered by turn, not arrival. The queue's clock is the turn of the latest sequence
  admitted; a group's sequences take consecutive turns from the clock on (as many as each one stands for: itself and
  the samples forked from it), so a request arriving later queues its first sequence at the clock, ahead of the big
  request's later prompts, and two large requests alternate.
- Seats: a group holding more than half of the batch's seats yields them, one preemption at a time, to a waiting
  group that holds none (`Scheduler._admit_fairly`), so a newcomer runs from the next step instead of waiting for a
  wide request's samples to finish.
"""
from __future__ import annotations

from collections import Counter

from tinyvllm.core.sequence import Sequence


class FairShare:
  def __init__(self) -> None:
    self.clock = 0                        # the turn of the latest sequence admitted
    self._next_turn: dict[str, int] = {}  # group -> the turn its next sequence takes

  def assign_turn(self, seq: Sequence, width: int) -> int:
    """The turn of a new request's first sequence, which stands for `width` sequences (itself and its forks)."""
    if seq.group is None: return self.clock
    turn = max(self.clock, self._next_turn.get(seq.group, 0))
    self._next_turn[seq.group] = turn + width
    if len(self._next_turn) > 1024: self._forget_past_groups()
    return turn

  def admitted(self, seq: Sequence) -> None:
    self.clock = max(self.clock, seq.turn)

  def _forget_past_groups(self) -> None:
    """A group whose next turn the clock has passed starts from the clock anyway."""
    self._next_turn = {g: t for g, t in self._next_turn.items() if t > self.clock}


def dominant_group(running: list[Sequence], max_num_seqs: int) -> str | None:
  """The group holding more than half of the batch's seats, if one does."""
  counts = Counter(seq.group for seq in running if seq.group is not None)
  if not counts: return None
  group, held = counts.most_common(1)[0]
  return group if 2 * held > max_num_seqs else None


def first_without_seats(waiting: list[Sequence] | tuple[Sequence, ...], running: list[Sequence],
                        dominant: str) -> Sequence | None:
  """The first waiting sequence (queue order) of a group other than `dominant` that holds no running sequence."""
  seated = {seq.group for seq in running}
  return next((seq for seq in waiting if seq.group is not None and seq.group != dominant and seq.group not in seated), None)
