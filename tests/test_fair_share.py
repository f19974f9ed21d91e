"""Fair admission between API requests (core/fair_share.py), driven by the fake engine loop: a later small request is
not held back by an earlier wide one, large requests alternate, nothing is computed twice or leaked, and requests
without a group keep plain arrival order."""
from __future__ import annotations

import random

from tests.scheduler_sim import random_requests, sim
from tinyvllm.core.fair_share import FairShare, dominant_group
from tinyvllm.core.sequence import Sequence, SequenceStatus


def first_step_of(s, seq: Sequence) -> int:
  """The index of the first step that scheduled seq."""
  return next(i for i, out in enumerate(s.outputs) if any(item.seq is seq for item in out.scheduled))


def test_a_small_request_runs_at_once_beside_a_wide_one_holding_every_seat():
  s = sim(num_blocks=256, max_num_seqs=8)
  big = [s.add(list(range(10 * i, 10 * i + 5)), max_tokens=30, n=4, group="big") for i in range(10)]
  for _ in range(3): s.step()
  assert sum(seq.group == "big" for seq in s.sched.running) == 8   # two of its prompts, forked, hold every seat
  (small,) = s.add([7, 8, 9], max_tokens=2, group="small")
  out = s.step()
  assert any(item.seq is small for item in out.scheduled) and len(out.preempted) == 1
  assert out.preempted[0].group == "big" and out.preempted[0] is big[1][-1]   # the wide request's newest sample yields
  assert small.status is SequenceStatus.RUNNING
  s.run()
  s.check_done()


def test_the_wide_request_keeps_half_of_the_seats():
  s = sim(num_blocks=256, max_num_seqs=8)
  for i in range(10): s.add(list(range(10 * i, 10 * i + 5)), max_tokens=30, n=4, group="big")
  for _ in range(3): s.step()
  smalls = [s.add([100 + i, 7], max_tokens=40, group=f"small{i}")[0] for i in range(6)]
  for _ in range(8): s.step()
  assert sum(seq.group == "big" for seq in s.sched.running) == 4
  assert sum(seq in s.sched.running for seq in smalls) == 4   # the other two wait for a free seat
  s.run()
  s.check_done()


def test_no_preemption_when_no_group_holds_half_of_the_seats():
  s = sim(num_blocks=256, max_num_seqs=4)
  first = [s.add([10 * i, 1, 2], max_tokens=6, group=f"g{i}")[0] for i in range(4)]
  s.step()
  (late,) = s.add([99, 1], max_tokens=2, group="late")
  for _ in range(5): assert not s.step().preempted
  assert late.status is SequenceStatus.WAITING
  s.run()
  assert first_step_of(s, late) > max(first_step_of(s, seq) for seq in first)
  assert s.sched.num_preemptions == 0
  s.check_done()


def test_a_later_request_queues_ahead_of_a_large_ones_remaining_prompts():
  s = sim(num_blocks=256, max_num_seqs=2)
  big = [s.add([10 * i, 1, 2], max_tokens=3, group="big")[0] for i in range(8)]
  s.step()
  (late,) = s.add([99, 1], max_tokens=3, group="late")
  assert list(s.sched.waiting).index(late) == 0   # ahead of the 6 waiting prompts of the large request
  s.run()
  assert first_step_of(s, late) < first_step_of(s, big[3])
  s.check_done()


def test_two_large_requests_take_turns():
  s = sim(num_blocks=256, max_num_seqs=1)
  a = [s.add([i, 1], max_tokens=1, group="a")[0] for i in range(6)]
  s.step()                                       # a's first prompt runs (and finishes)
  b = [s.add([50 + i, 1], max_tokens=1, group="b")[0] for i in range(4)]
  s.run()
  order = sorted(a + b, key=lambda seq: first_step_of(s, seq))
  assert [seq.group for seq in order] == ["a", "b", "a", "b", "a", "b", "a", "b", "a", "a"]
  s.check_done()


def test_requests_without_a_group_keep_arrival_order():
  s = sim(num_blocks=256, max_num_seqs=1)
  seqs = [s.add([i, 1], max_tokens=1, n=1 + i % 3)[0] for i in range(6)]
  s.run()
  assert sorted(seqs, key=lambda seq: first_step_of(s, seq)) == seqs
  s.check_done()


def test_priority_policy_never_preempts_a_better_priority_for_fairness():
  s = sim(num_blocks=256, max_num_seqs=4, scheduling_policy="priority")
  for i in range(3): s.add([10 * i, 1, 2], max_tokens=20, n=2, group="big", priority=0)
  for _ in range(3): s.step()
  (low,) = s.add([99, 1], max_tokens=2, group="low", priority=5)
  for _ in range(5): assert not s.step().preempted
  assert low.status is SequenceStatus.WAITING
  s.run()
  s.check_done()


def test_random_groups_compute_every_position_once_and_free_everything():
  rng = random.Random(7)
  for _ in range(10):
    s = sim(num_blocks=48, block_size=4, max_num_seqs=rng.choice([2, 4, 6]), max_num_batched_tokens=rng.choice([8, 16, 64]))
    pending = list(random_requests(rng, 30, 4, 48))
    while pending or s.sched.has_unfinished():
      for _ in range(rng.randint(0, 3)):
        if pending:
          prompt, max_tokens, n = pending.pop()
          s.add(prompt, max_tokens, n, group=rng.choice(["a", "b", "c", None]))
      if s.sched.has_unfinished(): s.step()
      s.check()
    s.check_done()


def test_turns_and_dominance():
  fair = FairShare()
  seqs = [Sequence("r", [1], None, 0, group="g") for _ in range(3)]   # type: ignore[arg-type]
  assert [fair.assign_turn(seq, 4) for seq in seqs] == [0, 4, 8]
  other = Sequence("o", [1], None, 0, group="h")   # type: ignore[arg-type]
  assert fair.assign_turn(other, 1) == 0
  fair.admitted(Sequence("x", [1], None, 0, turn=6))   # type: ignore[arg-type]
  assert fair.assign_turn(Sequence("n", [1], None, 0), 1) == 6   # no group: the clock
  assert fair.assign_turn(Sequence("r", [1], None, 0, group="g"), 1) == 12
  running = [Sequence("r", [1], None, 0, group="g") for _ in range(3)] + [Sequence("o", [1], None, 0, group="h")]  # type: ignore[arg-type]
  assert dominant_group(running, 4) == "g" and dominant_group(running, 6) is None
