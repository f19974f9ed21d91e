"""Sequences and requests: the scheduler's bookkeeping, plain Python (no tensors)."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tinyvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
  from tinyvllm.core.structured_output import StructuredOutputGrammar

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  SWAPPED = "swapped"       # preempted with its KV blocks in the swap space (host memory), waiting to come back
  FINISHED_STOPPED = "stop"
  FINISHED_LENGTH = "length"
  FINISHED_ABORTED = "abort"

  @property
  def finished(self) -> bool: return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                                              SequenceStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Sequence:
  """One generated continuation of a prompt. Its state fields (status, output_token_ids, num_computed_tokens, the
  in-flight placeholders, stop_reason, what it reports: cached tokens and times) are written by the scheduler alone
  (tests/test_architecture.py enforces it); its KV blocks are the block manager's (`block_table(seq)`)."""
  request_id: str
  prompt_token_ids: list[int]
  params: SamplingParams
  seed: int                                   # the sampling seed (the request's, or one drawn for it)
  index: int = 0                              # which of the request's n samples this is
  priority: int = 0                           # the request's (scheduling_policy priority: lower values are served first)
  group: str | None = None                    # the API request it came with (fair admission: core/fair_share.py)
  eos_token_ids: frozenset[int] = frozenset()   # the ids that end it unless ignore_eos (min_tokens holds them back)
  grammar: StructuredOutputGrammar | None = None   # structured output: its matcher, advanced by the scheduler
  seq_id: int = field(default_factory=lambda: next(_seq_ids))
  output_token_ids: list[int] = field(default_factory=list)
  status: SequenceStatus = SequenceStatus.WAITING
  num_computed_tokens: int = 0                # tokens whose K/V are in the cache (or being computed by a launched step)
  stop_reason: int | str | None = None
  arrival_time: float = field(default_factory=time.monotonic)
  turn: int = 0                               # its place in the fair queue (core/fair_share.py)
  # Asynchronous scheduling: tokens sampled by steps still in flight (0 or 1 when a step is scheduled). They count in
  # num_tokens, so the next step can be scheduled before they are read, and take their id on the device from row
  # `pending_row` of the latest such step's samples.
  num_pending: int = 0
  pending_row: int = -1
  # Speculative decoding: the proposals its next step verifies (found after each step, consumed when scheduled), and
  # totals for what RequestOutput reports
  spec_token_ids: list[int] = field(default_factory=list)
  num_draft_tokens: int = 0                   # proposals verified
  num_accepted_tokens: int = 0                # ... and accepted
  # What RequestOutput reports (num_cached_tokens, metrics), None until it happens; times are time.time()
  num_cached_tokens: int | None = None        # prompt tokens the prefix cache covered when first admitted
  first_scheduled_time: float | None = None
  first_token_time: float | None = None       # when its first token reached the host
  last_token_time: float | None = None
  finished_time: float | None = None

  @property
  def num_tokens(self) -> int: return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

  @property
  def num_known_tokens(self) -> int: return len(self.prompt_token_ids) + len(self.output_token_ids)

  @property
  def num_output_tokens(self) -> int: return len(self.output_token_ids) + self.num_pending

  @property
  def reaches_max_tokens(self) -> bool:
    """Whether the tokens in flight already end the sequence by length (a step for it now would be wasted)."""
    return self.params.max_tokens is not None and self.num_output_tokens >= self.params.max_tokens

  @property
  def token_ids(self) -> list[int]: return self.prompt_token_ids + self.output_token_ids   # the known ones

  def token_slice(self, start: int, end: int) -> list[int]:
    """token_ids[start:end] without copying the whole sequence."""
    prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
    if end <= n: return prompt[start:end]
    if start >= n: return self.output_token_ids[start - n:end - n]
    return prompt[start:] + self.output_token_ids[:end - n]

  @property
  def is_finished(self) -> bool: return self.status.finished

  @property
  def finish_reason(self) -> str | None:
    return self.status.value if self.status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH) else None

  @property
  def num_uncomputed_tokens(self) -> int: return self.num_tokens - self.num_computed_tokens

  @property
  def in_prefill(self) -> bool: return self.num_computed_tokens < len(self.prompt_token_ids)

  @property
  def decoding(self) -> bool:
    """Whether its next step computes just its last token (so proposals may follow it)."""
    return self.num_uncomputed_tokens == 1 and not self.in_prefill


@dataclass(frozen=True)
class StopVerdict:
  """The output processor's finding that a sequence is done; the scheduler applies it."""
  status: SequenceStatus          # FINISHED_STOPPED or FINISHED_LENGTH
  stop_reason: int | str | None = None   # the stop string or stop token id (None: EOS or a length limit)


@dataclass
class Request:
  """What a user asked for: one prompt, n sequences sampled from it."""
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  params: SamplingParams
  seqs: list[Sequence]
  arrival_time: float = field(default_factory=time.time)   # wall clock, as RequestMetrics reports it

  @property
  def is_finished(self) -> bool: return all(s.is_finished for s in self.seqs)
