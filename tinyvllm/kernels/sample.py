"""Sampling in one kernel (csrc/neutral/sample.inc) for the steps whose rows use no filters and no penalties: greedy and
temperature-only rows, the common case. The portable sampler (tinyvllm/layers/sampler.py) makes several passes over
the [B, V] logits for these (the noise, two logs, a two-stage argmax: 0.46 ms at batch 256 over 151,936 tokens on an
H100); the kernel reads them once (0.135 ms) and draws the same tokens from the same hashed noise. On CUDA a row spreads
over several blocks (`sample_splits`) whose last to finish picks the token: one block scanning a batch-1 row of 128,256
logits took 17 us of the step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tinygrad import Tensor, dtypes

from tinyvllm.backend.sampling import GREEDY_EPS, NUM_PARAMS, SamplerVariant
from tinyvllm.kernels.plan import Launch, Param
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import run_kernel, zeroed_counters
from tinyvllm.layers.sampler import sample_packed
from tinyvllm.platform.target import DeviceTarget

THREADS = 512
IDS_PER_THREAD = 4        # a split block's thread scans about this many ids
BLOCKS_PER_SM = 2         # splits stop growing once the grid gives every SM this many blocks


@dataclass(frozen=True)
class SamplePlan:
  rows: int
  vocab_size: int
  splits: int                # blocks a row (their last merges; 1: the block stores the token)
  defines: dict[str, int | str] = field(compare=False)
  launches: tuple[Launch, ...] = field(compare=False)


def sample_splits(target: DeviceTarget, rows: int, vocab_size: int, threads: int = THREADS) -> int:
  """Blocks a row: CUDA spreads a row until its blocks' threads scan about IDS_PER_THREAD ids each or the grid fills
  the SMs BLOCKS_PER_SM deep; the merge needs device-wide atomics, so other dialects take one block a row."""
  if target.dialect != "cuda": return 1
  by_ids = -(-vocab_size // (threads * IDS_PER_THREAD))
  by_grid = -(-BLOCKS_PER_SM * max(target.multiprocessors, 1) // rows)
  return max(1, min(by_ids, by_grid))


def sample_plan(rows: int, vocab_size: int, splits: int = 1, threads: int = THREADS) -> SamplePlan:
  chunk = -(-vocab_size // splits)
  defines: dict[str, int | str] = {"TV_DTYPE": 0, "TV_NT": threads, "TV_B": rows, "TV_V": vocab_size,
                                   "TV_NPARAMS": NUM_PARAMS, "TV_GREEDY_EPS": f"{GREEDY_EPS!r}f", "TV_SPLITS": splits,
                                   "TV_CHUNK": chunk}
  params = (Param("tokens", "int", True, rows), Param("logits", "float", False, rows * vocab_size),
            Param("params", "int", False, rows * NUM_PARAMS), Param("rng", "int", False, rows * 2))
  if splits > 1:   # arrivals: counters the kernel leaves zero (kept across launches), so read-only to the graph
    params += (Param("part", "uint", True, rows * splits * 2), Param("arrivals", "uint", False, rows))
  return SamplePlan(rows, vocab_size, splits, defines, (Launch("tv_sample", (splits, rows, 1), threads, params),))


@functools.cache
def _compiled(target: DeviceTarget, rows: int, vocab_size: int) -> tuple[SamplePlan, str]:
  plan = sample_plan(rows, vocab_size, sample_splits(target, rows, vocab_size))
  return plan, kernel_source(target.dialect, "sample", plan.defines)


def takes(logits: Tensor, variant: SamplerVariant, penalties: tuple[Tensor, Tensor] | None = None) -> bool:
  """Whether the kernel samples this step: no filters, no penalties, float32 logits [B, V]."""
  return (not variant.filters and not variant.penalties and penalties is None and logits.ndim == 2
          and logits.dtype == dtypes.float32)


def fused_sample(target: DeviceTarget, logits: Tensor, params_bits: Tensor, rng_bits: Tensor, variant: SamplerVariant,
                 penalties: tuple[Tensor, Tensor] | None = None) -> Tensor:
  """sample_packed()'s contract (params and rng as int32 bits; [B] int32 token ids); steps the kernel does not take go
  to the portable sampler."""
  if not takes(logits, variant, penalties): return sample_packed(logits, params_bits, rng_bits, variant, penalties)
  rows, vocab = logits.shape
  plan, source = _compiled(target, rows, vocab)
  tokens = Tensor.empty(rows, dtype=dtypes.int32, device=logits.device)
  merge = []
  if plan.splits > 1:
    merge = [Tensor.empty(rows * plan.splits * 2, dtype=dtypes.uint32, device=logits.device),
             zeroed_counters(logits.device, rows)]
  return run_kernel(plan.launches[0], source, [tokens, logits.contiguous(), params_bits, rng_bits, *merge])[0]
