"""Sampling in one kernel (csrc/neutral/sample.inc) for the steps whose rows use no filters and no penalties: greedy and
temperature-only rows, the common case. The portable sampler (tinyvllm/layers/sampler.py) makes several passes over
the [B, V] logits for these (the noise, two logs, a two-stage argmax: 0.46 ms at batch 256 over 151,936 tokens on an
H100); the kernel reads them once (0.135 ms) and draws the same tokens from the same hashed noise.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tinygrad import Tensor, dtypes

from tinyvllm.backend.sampling import GREEDY_EPS, NUM_PARAMS, SamplerVariant
from tinyvllm.kernels.plan import Launch, Param
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import run_kernel
from tinyvllm.layers.sampler import sample_packed

THREADS = 512


@dataclass(frozen=True)
class SamplePlan:
  rows: int
  vocab_size: int
  defines: dict[str, int | str] = field(compare=False)
  launches: tuple[Launch, ...] = field(compare=False)


def sample_plan(rows: int, vocab_size: int, threads: int = THREADS) -> SamplePlan:
  defines: dict[str, int | str] = {"TV_DTYPE": 0, "TV_NT": threads, "TV_B": rows, "TV_V": vocab_size,
                                   "TV_NPARAMS": NUM_PARAMS, "TV_GREEDY_EPS": f"{GREEDY_EPS!r}f"}
  params = (Param("tokens", "int", True, rows), Param("logits", "float", False, rows * vocab_size),
            Param("params", "int", False, rows * NUM_PARAMS), Param("rng", "int", False, rows * 2))
  return SamplePlan(rows, vocab_size, defines, (Launch("tv_sample", (rows, 1, 1), threads, params),))


@functools.cache
def _compiled(dialect: str, rows: int, vocab_size: int) -> tuple[SamplePlan, str]:
  plan = sample_plan(rows, vocab_size)
  return plan, kernel_source(dialect, "sample", plan.defines)


def takes(logits: Tensor, variant: SamplerVariant, penalties: tuple[Tensor, Tensor] | None = None) -> bool:
  """Whether the kernel samples this step: no filters, no penalties, float32 logits [B, V]."""
  return (not variant.filters and not variant.penalties and penalties is None and logits.ndim == 2
          and logits.dtype == dtypes.float32)


def fused_sample(dialect: str, logits: Tensor, params_bits: Tensor, rng_bits: Tensor, variant: SamplerVariant,
                 penalties: tuple[Tensor, Tensor] | None = None) -> Tensor:
  """sample_packed()'s contract (params and rng as int32 bits; [B] int32 token ids); steps the kernel does not take go
  to the portable sampler."""
  if not takes(logits, variant, penalties): return sample_packed(logits, params_bits, rng_bits, variant, penalties)
  rows, vocab = logits.shape
  plan, source = _compiled(dialect, rows, vocab)
  tokens = Tensor.empty(rows, dtype=dtypes.int32, device=logits.device)
  return run_kernel(plan.launches[0], source, [tokens, logits.contiguous(), params_bits, rng_bits])[0]
