"""The sampling kernel (csrc/neutral/sample.inc), CUDA and Metal dialect, run on the CPU through the C++ emulation against
the portable sampler (tinyvllm/layers/sampler.py `sample`, tinygrad ops): the same token ids for greedy rows, seeded
temperature rows (the same hashed noise) and a mix of both, a vocabulary that is not a multiple of the block, ties
(the lowest id wins, also across the blocks of a split row), rows of -inf with one finite logit; CUDA's rows split
over several blocks (the last to arrive picks the token, whatever order the blocks run in) give the one block's
tokens and leave their arrival counters zero; how many blocks a row takes; and which steps the backend sends to it."""
from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tests.emulator.emulator import LazyKernels, Spec, emulate
from tinyvllm.backend.sampling import NEUTRAL_PARAMS, SamplerVariant
from tinyvllm.kernels.sample import sample_plan, sample_splits, takes
from tinyvllm.layers.sampler import sample, sample_packed
from tinyvllm.platform.target import DeviceTarget

ROWS, VOCAB = 6, 1000     # 1000: each of the 512 threads scans one or two ids
SPLITS = 3                # CUDA: a row over three blocks of 334 ids (the last one's 332)


@pytest.fixture(scope="module")
def emu(dialect: str) -> LazyKernels:
  plans = {"sample": sample_plan(ROWS, VOCAB)}
  if dialect == "cuda": plans["sample_split"] = sample_plan(ROWS, VOCAB, SPLITS)
  return emulate(dialect, [Spec(name, "sample", plan.defines, plan.launches) for name, plan in plans.items()])


def _inputs(rng: np.random.Generator, temperatures: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  logits = (rng.standard_normal((ROWS, VOCAB)) * 3).astype(np.float32)
  params = np.tile(np.array(NEUTRAL_PARAMS, np.float32), (ROWS, 1))
  params[:, 0] = temperatures
  seeds = np.stack([rng.integers(0, 2**32, ROWS), rng.integers(0, 1000, ROWS)], 1).astype(np.uint32)
  return logits, params, seeds


def _kernel(emu: LazyKernels, logits, params, seeds, order: str = "forward") -> np.ndarray:
  """The one-block kernel's tokens, after checking that the split kernel (CUDA) draws the same ones, twice (its
  counters left zero for the next launch)."""
  bits = [params.reshape(-1).view(np.int32).copy(), seeds.reshape(-1).view(np.int32).copy()]   # as the packed input
  tokens = np.full(ROWS, -7, np.int32)
  emu.launch("sample", 0, [tokens, logits.reshape(-1).copy(), *bits], order)
  if "sample_split" in emu.specs:
    arrivals = np.zeros(ROWS, np.uint32)
    for again in ("reverse", "random"):
      split = np.full(ROWS, -7, np.int32)
      part = np.zeros(ROWS * SPLITS * 2, np.uint32)
      emu.launch("sample_split", 0, [split, logits.reshape(-1).copy(), *bits, part, arrivals], again if order == "forward" else order)
      np.testing.assert_array_equal(split, tokens)
      assert not arrivals.any()
  return tokens


def _portable(logits, params, seeds, random: bool) -> np.ndarray:
  return sample(Tensor(logits), Tensor(params), Tensor(seeds), SamplerVariant(random, False, False)).numpy()


# the portable sampler's random variant takes tinygrad ~8 s to build on the CPU: the tests that run it are marked slow
@pytest.mark.parametrize("temperatures", [pytest.param([0.0] * ROWS, id="greedy"),
                                          pytest.param([0.6, 1.0, 0.3, 2.0, 0.8, 1.5], id="random", marks=pytest.mark.slow),
                                          pytest.param([0.0, 0.7, 0.0, 1.2, 1e-6, 0.9], id="mixed", marks=pytest.mark.slow)])
def test_kernel_draws_the_portable_samplers_tokens(emu, temperatures):
  rng = np.random.default_rng(len(temperatures) + int(sum(temperatures) * 10))
  for trial in range(3):
    logits, params, seeds = _inputs(rng, temperatures)
    want = _portable(logits, params, seeds, random=any(t >= 1e-5 for t in temperatures))
    got = _kernel(emu, logits, params, seeds, ("forward", "reverse", "random")[trial])
    np.testing.assert_array_equal(got, want)
    greedy = np.array(temperatures) < 1e-5
    np.testing.assert_array_equal(got[greedy], logits[greedy].argmax(1))


@pytest.mark.slow
def test_kernel_seeds_decide_the_draw(emu):
  rng = np.random.default_rng(1)
  logits, params, seeds = _inputs(rng, [1.0] * ROWS)
  logits[:] = 0.0                           # flat rows: the noise alone decides
  first = _kernel(emu, logits, params, seeds)
  np.testing.assert_array_equal(first, _portable(logits, params, seeds, random=True))
  seeds[:, 1] += 1                          # the next step of the same requests draws again
  assert (_kernel(emu, logits, params, seeds) != first).sum() >= ROWS - 1


def test_kernel_ties_and_infinite_rows(emu):
  logits = np.full((ROWS, VOCAB), -np.inf, np.float32)
  logits[0, [7, 300, 999]] = 5.0            # a tie: the lowest id
  logits[1, 998] = -3.0                     # one finite logit
  logits[2, 512] = logits[2, 1] = 2.0       # a tie across threads' strides
  params = np.tile(np.array(NEUTRAL_PARAMS, np.float32), (ROWS, 1))
  seeds = np.zeros((ROWS, 2), np.uint32)
  got = _kernel(emu, logits, params, seeds, "random")
  np.testing.assert_array_equal(got[:3], [7, 998, 1])
  np.testing.assert_array_equal(got, _portable(logits, params, seeds, random=False))


@pytest.mark.slow
def test_packed_contract_is_the_samplers():
  rng = np.random.default_rng(3)
  logits, params, seeds = _inputs(rng, [0.0, 0.7, 1.0, 0.0, 1.3, 0.5])
  variant = SamplerVariant(True, False, False)
  packed = sample_packed(Tensor(logits), Tensor(params.view(np.int32)), Tensor(seeds.view(np.int32)), variant).numpy()
  np.testing.assert_array_equal(packed, sample(Tensor(logits), Tensor(params), Tensor(seeds), variant).numpy())


def test_rows_spread_over_blocks_on_cuda_only():
  h100, metal = DeviceTarget.nominal("cuda"), DeviceTarget.nominal("metal", "")
  assert sample_splits(h100, 1, 151936) == 75            # 512 threads, about 4 ids each
  assert sample_splits(h100, 8, 151936) == 33            # two blocks an SM
  assert sample_splits(h100, 256, 151936) == 2 and sample_splits(h100, 512, 151936) == 1
  assert sample_splits(h100, 1, 1000) == 1               # a small vocabulary: one block
  assert sample_splits(metal, 1, 151936) == 1            # no device-wide atomics in the Metal dialect
  plan = sample_plan(1, 151936, 75)
  assert plan.launches[0].grid == (75, 1, 1) and plan.defines["TV_CHUNK"] * 75 >= 151936


def test_steps_with_filters_or_penalties_stay_portable():
  logits = Tensor.zeros(4, 10).contiguous()
  assert takes(logits, SamplerVariant(True, False, False)) and takes(logits, SamplerVariant(False, False, False))
  assert not takes(logits, SamplerVariant(True, True, False)) and not takes(logits, SamplerVariant(True, False, True))
  assert not takes(logits.cast(dtypes.float16), SamplerVariant(True, False, False))
  assert not takes(logits, SamplerVariant(True, False, False), penalties=(logits, logits))   # penalty tensors given
