"""Batched device sampling: filters, greedy, seeded Gumbel-max, penalties, logprobs, against numpy/torch references."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tinygrad import Tensor, TinyJit, dtypes

from tinyvllm.layers.sampler import (
  NEUTRAL_PARAMS,
  SamplerVariant,
  SamplingBatch,
  apply_penalties,
  compute_logprobs,
  filter_mask,
  fold_seed,
  sample,
  uniform_noise,
)
from tinyvllm.sampling_params import SamplingParams

RANDOM = SamplerVariant(random=True, filters=False, penalties=False)
FILTERED = SamplerVariant(random=True, filters=True, penalties=False)
GREEDY = SamplerVariant(random=False, filters=False, penalties=False)

# hand-made distribution over 8 tokens; boundaries below are chosen far from rounding
PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
LOGITS = np.log(PROBS).astype(np.float32)
TIED = np.array([2.0, 1.0, 1.0, 1.0, 0.0, -1.0, -2.0, -3.0], np.float32)
# (logits, temperature, top_k, top_p, min_p, expected kept tokens)
CASES = [
  (LOGITS, 1.0, 0, 1.0, 0.0, range(8)),
  (LOGITS, 1.0, 3, 1.0, 0.0, range(3)),
  (LOGITS, 1.0, 0, 0.7, 0.0, range(3)),     # mass above token 2 is 0.65 < 0.7, above token 3 is 0.8
  (LOGITS, 1.0, 0, 1.0, 0.3, range(3)),     # prob >= 0.12
  (TIED, 1.0, 2, 1.0, 0.0, range(4)),       # ties at the k-th largest are kept
  (LOGITS, 1.0, 3, 0.75, 0.0, range(2)),    # top-p on the top-3 renormalised: mass above token 2 is 0.8125
  (LOGITS, 1.0, 0, 0.01, 0.0, range(1)),    # the top token always survives
  (np.log([0.3, 0.3, 0.2, 0.2, 1e-9, 1e-9, 1e-9, 1e-9]).astype(np.float32), 1.0, 0, 0.1, 0.0, range(2)),  # tied top
  (LOGITS, 1.0, 2, 1.0, 0.3, range(2)),     # min-p and top-k
  (LOGITS, 2.0, 0, 1.0, 0.55, range(3)),    # min-p sees probs after temperature: p / p_max >= 0.3025
  (LOGITS, 0.5, 5, 0.9, 0.05, range(3)),    # T = 0.5 sharpens: probs ~ p^2; min-p drops token 3 (0.0625)
]


def _params(rows: list[tuple[float, float, float, float]]) -> np.ndarray:
  table = np.tile(np.array(NEUTRAL_PARAMS, np.float32), (len(rows), 1))
  table[:, :4] = rows
  return table


def _rng(seeds: list[int], steps: list[int] | int = 0) -> Tensor:
  steps = steps if isinstance(steps, list) else [steps] * len(seeds)
  return Tensor(np.array([seeds, steps], np.uint32).T.copy())


def _reference_keep(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
  """vLLM's filters by sorting, in float64: min-p, top-k, then top-p on the survivors."""
  s = logits.astype(np.float64) / temperature
  probs = np.exp(s - s.max())
  keep = probs >= min_p * probs.max()
  if top_k > 0:
    keep &= s >= np.sort(s)[::-1][top_k - 1]
  if top_p < 1:
    q = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
    keep &= np.array([q[q > qi].sum() < top_p for qi in q])
  return keep


DRAWS_PER_CASE = 32  # rows per case in one call; 8 calls with different seeds -> 256 draws per case
ROWS = len(CASES) * DRAWS_PER_CASE  # every filter test uses [ROWS, 8] logits: one compiled shape


def test_filter_mask_per_row_settings():
  logits = np.repeat(np.stack([c[0] / c[1] for c in CASES]), DRAWS_PER_CASE, axis=0)
  cols = [Tensor(np.repeat(np.array([c[i] for c in CASES], np.float32), DRAWS_PER_CASE)) for i in (2, 3, 4)]
  mask = filter_mask(Tensor(logits), *cols).numpy()
  for case, (lg, temp, k, p, mp, kept) in enumerate(CASES):
    expected = np.isin(np.arange(8), list(kept))
    np.testing.assert_array_equal(_reference_keep(lg, temp, k, p, mp), expected, err_msg=f"reference, case {case}")
    np.testing.assert_array_equal(mask[case * DRAWS_PER_CASE], expected, err_msg=f"case {case}")


def test_filter_mask_random_logits_match_reference():
  rng = np.random.default_rng(3)
  logits = (rng.standard_normal((ROWS, 8)) * 2).astype(np.float32)
  settings = np.stack([rng.integers(0, 6, ROWS), rng.choice([1.0, 0.3, 0.6, 0.9], ROWS),
                       rng.choice([0.0, 0.05, 0.2], ROWS)], axis=1).astype(np.float32)
  mask = filter_mask(Tensor(logits), *[Tensor(settings[:, i].copy()) for i in range(3)]).numpy()
  for row, (k, p, mp) in enumerate(settings):
    np.testing.assert_array_equal(mask[row], _reference_keep(logits[row], 1.0, int(k), p, mp), err_msg=f"row {row}")


@pytest.fixture(scope="module")
def filtered_draws() -> np.ndarray:
  """[cases, draws] sampled tokens, each case's rows with their own seeds, all cases in one batch."""
  n = len(CASES)
  logits = Tensor(np.repeat(np.stack([c[0] for c in CASES]), DRAWS_PER_CASE, axis=0))
  params = Tensor(np.repeat(_params([c[1:5] for c in CASES]), DRAWS_PER_CASE, axis=0))
  calls = [sample(logits, params, _rng(list(range(i * 1000, i * 1000 + n * DRAWS_PER_CASE))), FILTERED).numpy()
           for i in range(8)]
  return np.stack(calls, axis=1).reshape(n, -1)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sampled_support_and_distribution(filtered_draws, case):
  logits, temp, _, _, _, kept = CASES[case]
  draws = filtered_draws[case]
  assert set(draws.tolist()) <= set(kept)
  q = np.where(np.isin(np.arange(8), list(kept)), np.exp(logits.astype(np.float64) / temp), 0.0)
  q /= q.sum()
  seen_all = {t for t in kept if q[t] > 0.05}  # 256 draws miss a 5% token with probability 2e-6
  assert seen_all <= set(draws.tolist())
  _assert_matches(draws, q)


def _assert_matches(draws: np.ndarray, probs: np.ndarray) -> None:
  """Chi-square goodness of fit, rare tokens pooled; 0.1% critical values."""
  counts = np.bincount(draws, minlength=len(probs)).astype(np.float64)
  expected = probs * len(draws)
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  obs, exp = obs[exp > 0], exp[exp > 0]
  if len(exp) < 2:
    return
  chi2 = ((obs - exp) ** 2 / exp).sum()
  critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}[len(exp) - 1]
  assert chi2 < critical, (counts, expected)


def test_filtered_sampling_under_jit_matches_eager():
  rng = np.random.default_rng(7)
  logits = Tensor((rng.standard_normal((ROWS, 8)) * 2).astype(np.float32))
  params = Tensor(_params([(0.9, 4, 0.8, 0.05)] * ROWS))
  step = TinyJit(lambda lg, p, r: sample(lg, p, r, FILTERED).realize())
  outs = []
  for call in range(4):
    r = _rng(rng.integers(0, 2**32, ROWS).tolist(), call)
    outs.append(step(logits, params, r).numpy())
    np.testing.assert_array_equal(outs[-1], sample(logits, params, r, FILTERED).numpy())
  assert not np.array_equal(outs[-1], outs[-2])  # replays follow the new seeds


def test_unfiltered_distribution_matches_softmax():
  logits = np.array([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2], np.float32)
  rows = 256
  params = Tensor(_params([(0.7, 0, 1.0, 0.0)] * rows))
  draws = np.concatenate([sample(Tensor(np.tile(logits, (rows, 1))), params, _rng(list(range(i, i + rows)), 7), RANDOM)
                          .numpy() for i in range(0, 8 * rows, rows)])
  q = torch.softmax(torch.tensor(logits, dtype=torch.float64) / 0.7, 0).numpy()
  _assert_matches(draws, q)


def test_greedy_equals_torch_argmax_with_ties():
  rng = np.random.default_rng(0)
  logits = rng.integers(-3, 4, (6, 300)).astype(np.float32)  # many ties at the maximum
  logits[1] = 0.0
  out = sample(Tensor(logits), Tensor(_params([(0.0, 0, 1.0, 0.0)] * 6)), _rng([0] * 6), GREEDY).numpy()
  np.testing.assert_array_equal(out, torch.argmax(torch.tensor(logits), dim=1).numpy())
  assert out.dtype == np.int32


def test_greedy_row_unaffected_by_random_rows():
  rng = np.random.default_rng(1)
  logits = rng.standard_normal(8).astype(np.float32)
  for trial in range(3):
    other = rng.standard_normal((ROWS, 8)).astype(np.float32) * 5
    other[2], other[3] = logits, [2, 0, 3, 1, 3, 3, -1, 0]   # row 3: tied maxima, the first one wins
    params = _params([(1.5, 3, 0.8, 0.1)] * ROWS)
    params[2, 0] = params[3, 0] = 0.0
    for variant in (FILTERED, RANDOM):
      out = sample(Tensor(other), Tensor(params), _rng([trial * 1000 + i for i in range(ROWS)]), variant).numpy()
      assert out[2] == int(np.argmax(logits)) and out[3] == 2


def test_same_seed_same_token_whatever_the_batch():
  """24 target rows (fixed logits, seed, step) placed at different positions among different random rows."""
  rng = np.random.default_rng(2)
  rows, n = 48, 24
  targets = rng.standard_normal((n, 300)).astype(np.float32)
  seeds, steps = list(range(100, 100 + n)), [3] * n

  def draw(positions: np.ndarray) -> np.ndarray:
    logits = rng.standard_normal((rows, 300)).astype(np.float32) * 3
    params = _params([(float(rng.uniform(0.5, 2)), 0, 1.0, 0.0) for _ in range(rows)])
    row_seeds, row_steps = rng.integers(0, 2**32, rows).tolist(), rng.integers(0, 50, rows).tolist()
    logits[positions], params[positions, 0] = targets, 1.0
    for i, pos in enumerate(positions):
      row_seeds[pos], row_steps[pos] = seeds[i], steps[i]
    return sample(Tensor(logits), Tensor(params), _rng(row_seeds, row_steps), RANDOM).numpy()[positions]

  first = draw(np.arange(n))
  np.testing.assert_array_equal(draw(rng.permutation(rows)[:n]), first)
  assert len(set(first.tolist())) > 5  # different seeds give different draws


def test_steps_and_seeds_change_the_noise():
  u = uniform_noise(_rng([1, 1, 2, 1], [0, 1, 0, 0]), 4096).numpy()
  assert u.min() > 0 and u.max() < 1
  np.testing.assert_array_equal(u[0], u[3])
  for a, b in ((0, 1), (0, 2), (1, 2)):
    assert np.abs(np.corrcoef(u[a], u[b])[0, 1]) < 0.1
  assert abs(u.mean() - 0.5) < 0.01


def _np_fmix32(h: np.ndarray) -> np.ndarray:
  h = h.astype(np.uint64)
  h ^= h >> 16
  h = (h * 0x85EBCA6B) & 0xFFFFFFFF
  h ^= h >> 13
  h = (h * 0xC2B2AE35) & 0xFFFFFFFF
  return (h ^ (h >> 16)).astype(np.uint32)


def test_noise_matches_numpy_uint32_hash():
  """tinygrad's uint32 multiply must wrap like C for the documented hash."""
  seeds, steps = np.array([0, 7, 0xFFFFFFFF], np.uint32), np.array([0, 123456, 5], np.uint32)
  key1 = _np_fmix32(_np_fmix32(seeds ^ np.uint32(0x3C6EF372)) ^ steps)[:, None]
  key2 = _np_fmix32(key1 ^ np.uint32(0x9E3779B9))
  h = _np_fmix32((_np_fmix32(np.arange(64, dtype=np.uint32)[None, :] ^ key1).astype(np.uint64) + key2) & 0xFFFFFFFF)
  expected = ((h >> 8).astype(np.float32) + 0.5) / (1 << 24)
  np.testing.assert_array_equal(uniform_noise(_rng(seeds.tolist(), steps.tolist()), 64).numpy(), expected)


def _reference_penalties(logits: np.ndarray, params: list[SamplingParams], histories: list) -> np.ndarray:
  out = logits.astype(np.float64).copy()
  for b, (p, (prompt, output)) in enumerate(zip(params, histories, strict=True)):
    counts = np.bincount(np.asarray(output, np.int64), minlength=logits.shape[1])
    seen = (counts > 0) | np.isin(np.arange(logits.shape[1]), prompt)
    rep = np.where(seen, p.repetition_penalty, 1.0)
    out[b] = np.where(out[b] > 0, out[b] / rep, out[b] * rep)
    out[b] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
  return out


PEN_PARAMS = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25, temperature=0),
              SamplingParams(temperature=0.0),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, temperature=0),
              SamplingParams(frequency_penalty=-0.7, temperature=0)]


def _pen_histories(rng: np.random.Generator, v: int) -> list:
  return [(rng.integers(0, v, 6).tolist(), rng.integers(0, v, int(rng.integers(0, 12))).tolist()) for _ in PEN_PARAMS]


def test_penalties_match_numpy_reference():
  rng = np.random.default_rng(4)
  v = 24
  logits, histories = rng.standard_normal((4, v)).astype(np.float32) * 2, _pen_histories(rng, v)
  batch = SamplingBatch.build(PEN_PARAMS, [1, 2, 3, 4], [0] * 4, histories, 4, v)
  params, _, (index, value) = batch.tensors()
  got = apply_penalties(Tensor(logits), params, index, value).numpy()
  np.testing.assert_allclose(got, _reference_penalties(logits, PEN_PARAMS, histories), rtol=1e-6, atol=1e-6)


def test_penalised_greedy_under_jit_follows_new_histories():
  rng = np.random.default_rng(5)
  v = 24
  step = TinyJit(lambda lg, p, r, i, val: sample(lg, p, r, batch.variant, (i, val)).realize())
  for _ in range(4):
    logits, histories = rng.standard_normal((4, v)).astype(np.float32), _pen_histories(rng, v)
    batch = SamplingBatch.build(PEN_PARAMS, [1, 2, 3, 4], [0] * 4, histories, 4, v)
    assert batch.variant == SamplerVariant(random=False, filters=False, penalties=True)
    params, rngt, (index, value) = batch.tensors()
    out = step(Tensor(logits), params, rngt, index, value).numpy()
    np.testing.assert_array_equal(out, _reference_penalties(logits, PEN_PARAMS, histories).argmax(1))


def test_build_pads_and_flags():
  params = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, seed=-3, presence_penalty=0.5)]
  batch = SamplingBatch.build(params, [9, -3], [0, 4], [([1, 2], []), ([3, 3, 40], [3, 7, 7])], 4, 50)
  assert batch.variant == SamplerVariant(random=True, filters=True, penalties=True)
  np.testing.assert_array_equal(batch.params[2:], np.tile(NEUTRAL_PARAMS, (2, 1)))
  np.testing.assert_array_equal(batch.params[1, :4], [1.0, 5, 1.0, 0.0])
  np.testing.assert_array_equal(batch.rng[:, 1], [0, 4, 0, 0])
  assert batch.rng[1, 0] == fold_seed(-3) and batch.rng.dtype == np.uint32
  assert batch.penalty_index is not None and batch.penalty_value is not None
  assert (batch.penalty_index[[0, 2, 3]] == -1).all()  # row 0 uses no penalties: nothing sent
  assert batch.penalty_index.shape[1] >= 3 and batch.penalty_index.shape[1] & (batch.penalty_index.shape[1] - 1) == 0
  np.testing.assert_array_equal(batch.penalty_index[1, :4], [50 + 3, 50 + 7, 50 + 40, -1])
  np.testing.assert_array_equal(batch.penalty_value[1, :3], [[1, 1], [2, 1], [0, 1]])
  greedy_only = SamplingBatch.build([SamplingParams(temperature=0.0, top_k=3)], [0], [0], None, 2, 50)
  assert greedy_only.variant == GREEDY and greedy_only.penalty_index is None


def test_compute_logprobs_matches_torch():
  rng = np.random.default_rng(6)
  logits = (rng.standard_normal((4, 50)) * 3).astype(np.float32)
  ids = np.array([0, 17, 49, 3], np.int32)
  chosen, top_ids, top_vals = compute_logprobs(Tensor(logits), Tensor(ids), 5)
  ref = torch.log_softmax(torch.tensor(logits), dim=1)
  vals, idx = torch.topk(ref, 5, dim=1)
  expected_chosen = ref[torch.arange(4), torch.tensor(ids, dtype=torch.long)].numpy()
  np.testing.assert_allclose(chosen.numpy(), expected_chosen, atol=1e-5)
  np.testing.assert_array_equal(top_ids.numpy(), idx.numpy())
  np.testing.assert_allclose(top_vals.numpy(), vals.numpy(), atol=1e-5)
  assert top_ids.dtype == dtypes.int32
  _, none_ids, none_vals = compute_logprobs(Tensor(logits), Tensor(ids), 0)
  assert none_ids.shape == (4, 0) and none_vals.shape == (4, 0)


def test_compute_logprobs_distinct_ids_on_ties():
  logits = np.array([[0.0, 5.0, 5.0, float("-inf"), float("-inf")]], np.float32)
  _, ids, vals = compute_logprobs(Tensor(logits), Tensor(np.array([1], np.int32)), 4)
  assert ids.numpy().tolist() == [[1, 2, 0, 3]]
  assert vals.numpy()[0, 3] == float("-inf")


@pytest.mark.parametrize("rows,vocab", [(1, 151936), (3, 1000), (2, 257), (4, 256), (5, 513)])
def test_two_stage_argmax_is_numpys_first_maximum(rows, vocab):
  from tinyvllm.layers.sampler import argmax_rows
  x = np.random.default_rng(vocab).integers(-5, 5, (rows, vocab)).astype(np.float32)   # many ties
  x[0, -1] = 99.0                                                                       # a maximum in the padded chunk
  if rows > 1: x[1] = -np.inf
  assert argmax_rows(Tensor(x)).numpy().tolist() == x.argmax(1).tolist()
