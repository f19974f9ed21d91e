"""A step's static layout: the bucketed shapes of its packed int32 input, which each get their own TinyJit capture."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tinygrad import Tensor

from tinyvllm.backend.sampling import SamplerVariant
from tinyvllm.core.sequence import Sequence
from tinyvllm.layers.sampler import SamplingBatch
from tinyvllm.worker.input_batch import HostBatch
from tinyvllm.worker.logprobs import PromptRows, top_k_bucket
from tinyvllm.worker.token_controls import TokenControls


@dataclass(frozen=True)
class StepLayout:
  """The static shape of one step; each distinct layout gets its own JIT capture."""
  shapes: tuple[tuple[str, tuple[int, ...]], ...]   # every packed int32 field, in order
  context_len: int     # L
  variant: SamplerVariant
  logprobs: int        # top-k logprobs to return per row; -1: none at all
  prompt_logprobs: int = -1   # top-k of the prompt tokens scored (fields prompt_index, prompt_target); -1: none
  multi_token: bool = False   # some sequence computes several tokens (a prompt chunk): FULL_DECODE_ONLY runs it eagerly

  @property
  def rows(self) -> int: return dict(self.shapes)["logits_index"][0]

  @property
  def query_len(self) -> int: return dict(self.shapes)["query_index"][1]

  @property
  def verifies(self) -> bool:
    """Whether the step verifies proposals (speculative decoding)."""
    return "draft_tokens" in dict(self.shapes)

  def unpack(self, packed: Tensor) -> dict[str, Tensor]:
    fields, offset = {}, 0
    for name, shape in self.shapes:
      count = math.prod(shape)
      fields[name], offset = packed[offset:offset + count].reshape(shape), offset + count
    return fields


def packed_fields(host: HostBatch, sampling: SamplingBatch, prompt: PromptRows | None = None,
                  controls: TokenControls | None = None) -> dict[str, np.ndarray]:
  """Every int32 array of the step (float sampling settings travel bit-cast), in packing order."""
  fields = dict(host.arrays)
  fields["params"], fields["rng"] = sampling.params.view(np.int32), sampling.rng.view(np.int32)
  if sampling.penalty_index is not None and sampling.penalty_value is not None:
    fields["penalty_index"], fields["penalty_value"] = sampling.penalty_index, sampling.penalty_value.view(np.int32)
  if prompt is not None: fields["prompt_index"], fields["prompt_target"] = prompt.index, prompt.target
  if controls is not None: fields.update(controls.fields())
  return fields


def logprobs_bucket(seqs: list[Sequence]) -> int:
  """The top-k of the sampled rows' logprobs (-1: no row asks for logprobs)."""
  return top_k_bucket([s.params.logprobs for s in seqs if s.params.logprobs is not None])


def covers(captured: SamplerVariant, wanted: SamplerVariant) -> bool:
  """Whether a capture sampling with `captured` gives `wanted`'s exact tokens: the random sampler takes greedy rows by
  the same argmax, and filters that are off keep every token; penalties and token controls change the step's inputs,
  so never."""
  return (captured.penalties == wanted.penalties and captured.bias == wanted.bias and captured.mask == wanted.mask
          and captured.random >= wanted.random and captured.filters >= wanted.filters)
