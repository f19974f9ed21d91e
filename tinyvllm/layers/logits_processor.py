"""Custom logits processors: vLLM v1's batch-level interface (`LLM(..., logits_processors=[cls])`).

A processor sees the whole batch: each step, `update_state` tells it how the batch changed since the last step (the
requests added at a row with their SamplingParams, prompt and live output token list, the rows removed, the rows moved
or swapped: apply them in that order, as vLLM's builtin processors do), then `apply` takes the step's logits
[batch, vocab] (a tinygrad Tensor on the device, after allowed_token_ids, bad words, logit_bias and min_tokens) and
returns them changed, before the penalties and the sampler. Per-request arguments come through
`SamplingParams.extra_args`; `validate_params` refuses a request's bad ones when it arrives. A processor whose
`is_argmax_invariant()` is true (it never changes a row's largest logit) is skipped in steps where every row is greedy.
Steps of an engine with processors run eagerly (not as captured graphs: a processor makes new tensors from its state).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tinygrad import Tensor

from tinyvllm.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
  UNIDIRECTIONAL = enum.auto()   # the request at the first row moves to the second (which was empty)
  SWAP = enum.auto()             # the two rows' requests trade places


AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]   # (row, params, prompt ids, output ids: the live list)
MovedRequest = tuple[int, int, MoveDirectionality]
RemovedRequest = int


@dataclass(frozen=True)
class BatchUpdate:
  batch_size: int                       # rows in the batch after the update
  removed: Sequence[RemovedRequest]
  added: Sequence[AddedRequest]         # a row given here holds no request before, or one that leaves without a `removed`
  moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
  @classmethod
  def validate_params(cls, sampling_params: SamplingParams) -> None:
    """Raise ValueError for a request whose arguments (extra_args) this processor cannot take (by default: none)."""
    return None

  @abstractmethod
  def __init__(self, vllm_config: Any, device: str, is_pin_memory: bool) -> None:
    """vllm_config: the EngineConfig; device: the tinygrad device the logits are on."""

  @abstractmethod
  def apply(self, logits: Tensor) -> Tensor: ...

  @abstractmethod
  def is_argmax_invariant(self) -> bool: ...

  @abstractmethod
  def update_state(self, batch_update: BatchUpdate | None) -> None:
    """None: the batch is as it was."""
