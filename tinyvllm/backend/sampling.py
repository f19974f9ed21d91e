"""The sampler's contract between the runner, the portable sampler and the sampling kernel.

Per row, the step carries NUM_PARAMS float32 settings (bit-cast into the packed int32 input) in the column order
below and two uint32 words of randomness (seed, step). `SamplerVariant` says which features a compiled step has.
"""
from __future__ import annotations

from dataclasses import dataclass

# columns of the per-row settings
TEMPERATURE, TOP_K, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(7)
NUM_PARAMS = 7
NEUTRAL_PARAMS = (0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0)  # greedy, no filters, no penalties: padding rows
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature samples greedily


@dataclass(frozen=True)
class SamplerVariant:
  """Static flags: which features this compiled graph has (each combination is its own JIT capture). bias and mask are
  the token controls applied before the sampler (layers/token_controls.py): a sparse logit bias, a bitmask of allowed
  tokens."""
  random: bool
  filters: bool
  penalties: bool
  bias: bool = False
  mask: bool = False
