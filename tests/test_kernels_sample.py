"""The sampling kernel (csrc/neutral/sample.inc), CUDA and Metal dialect, run on the CPU through the C++ emulation against
the portable sampler (tinyvllm/layers/sampler.py `sample`, tinygrad ops): the same token ids for greedy rows, seeded
temperature rows (the same hashed noise) and a mix of both, a vocabulary that is not a multiple of the block, ties
(the lowest id wins), rows of -inf with one finite logit; and which steps the backend sends to it."""
from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tests.emulator.emulator import LazyKernels, Spec, emulate
from tinyvllm.backend.sampling import NEUTRAL_PARAMS, SamplerVariant
from tinyvllm.kernels.sample import sample_plan, takes
from tinyvllm.layers.sampler import sample, sample_packed

ROWS, VOCAB = 6, 1000     # 1000: each of the 512 threads scans one or two ids


@pytest.fixture(scope="module")
def emu(dialect: str) -> LazyKernels:
  plan = sample_plan(ROWS, VOCAB)
  return emulate(dialect, [Spec("sample", "sample", plan.defines, plan.launches)])


def _inputs(rng: np.random.Generator, temperatures: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  logits = (rng.standard_normal((ROWS, VOCAB)) * 3).astype(np.float32)
  params = np.tile(np.array(NEUTRAL_PARAMS, np.float32), (ROWS, 1))
  params[:, 0] = temperatures
  seeds = np.stack([rng.integers(0, 2**32, ROWS), rng.integers(0, 1000, ROWS)], 1).astype(np.uint32)
  return logits, params, seeds


def _kernel(emu: LazyKernels, logits, params, seeds, order: str = "forward") -> np.ndarray:
  tokens = np.full(ROWS, -7, np.int32)
  bits = [params.reshape(-1).view(np.int32).copy(), seeds.reshape(-1).view(np.int32).copy()]   # as the packed input
  emu.launch("sample", 0, [tokens, logits.reshape(-1).copy(), *bits], order)
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


def test_steps_with_filters_or_penalties_stay_portable():
  logits = Tensor.zeros(4, 10).contiguous()
  assert takes(logits, SamplerVariant(True, False, False)) and takes(logits, SamplerVariant(False, False, False))
  assert not takes(logits, SamplerVariant(True, True, False)) and not takes(logits, SamplerVariant(True, False, True))
  assert not takes(logits.cast(dtypes.float16), SamplerVariant(True, False, False))
  assert not takes(logits, SamplerVariant(True, False, False), penalties=(logits, logits))   # penalty tensors given
