"""Speculative decoding's rejection sampler (tinyvllm/layers/rejection_sampler.py) against its definition: greedy rows
keep exactly the proposals that equal the target's argmax and then emit the argmax; with sampling, every emitted token
has the target's distribution (chi-square over many rows with fixed seeds) although the proposals come from another
distribution, for deterministic (n-gram) and for drafted proposals."""
from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tinyvllm.layers.rejection_sampler import rejection_sample

# chi-square at 4 degrees of freedom (5 tokens) exceeded with probability 1e-4: the tests' seeds are fixed, so a
# correct sampler passes always and a biased one (the draft's distribution, say) fails by orders of magnitude
CHI2_4_DOF = 23.5
TARGET = np.array([[0.1, 0.4, 0.2, 0.2, 0.1], [0.3, 0.05, 0.05, 0.5, 0.1], [0.05, 0.15, 0.6, 0.1, 0.1]], np.float32)
DRAFT = np.array([[0.6, 0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1, 0.6]], np.float32)


def chi_square(samples: np.ndarray, probs: np.ndarray) -> float:
  counts = np.bincount(samples, minlength=len(probs))
  expected = probs * len(samples)
  return float(((counts - expected) ** 2 / expected).sum())


def run(target: np.ndarray, drafts: np.ndarray, rng: np.random.Generator, draft_probs: np.ndarray | None = None):
  s, k1, v = target.shape
  uniforms = rng.random((s, k1 - 1)).astype(np.float32)
  gumbel = -np.log(-np.log(rng.random((s, k1, v)) + 1e-12) + 1e-12).astype(np.float32)
  tokens, emitted = rejection_sample(Tensor(target), Tensor(drafts.astype(np.int32)), Tensor(uniforms), Tensor(gumbel),
                                     None if draft_probs is None else Tensor(draft_probs))
  return tokens.numpy(), emitted.numpy()


def test_greedy_keeps_proposals_up_to_the_first_mismatch_then_the_argmax():
  argmax = np.array([[3, 1, 4], [3, 1, 4], [0, 2, 2], [5, 5, 5]])
  drafts = np.array([[3, 1], [3, 2], [1, 2], [5, 5]])
  target = np.eye(6, dtype=np.float32)[argmax]   # one-hot: what temperature 0 leaves of p
  tokens, emitted = run(target, drafts, np.random.default_rng(0))
  assert emitted.tolist() == [3, 2, 1, 3]
  assert tokens.tolist() == [[3, 1, 4], [3, 1, -1], [0, -1, -1], [5, 5, 5]]


@pytest.mark.parametrize("drafted", [False, True], ids=["ngram", "draft-model"])
def test_emitted_tokens_have_the_target_distribution(drafted):
  rows, rng = 40000, np.random.default_rng(7 + drafted)
  target = np.broadcast_to(TARGET, (rows, 3, 5)).copy()
  if drafted:   # proposals drawn from the draft's own distribution, which differs from the target's
    draft_probs = np.broadcast_to(DRAFT, (rows, 2, 5)).copy()
    drafts = np.stack([rng.choice(5, rows, p=DRAFT[i]) for i in range(2)], axis=1)
  else:         # a deterministic proposal (n-gram lookup): the same tokens every row
    draft_probs, drafts = None, np.tile([1, 4], (rows, 1))
  tokens, emitted = run(target, drafts, rng, draft_probs)
  assert ((emitted >= 1) & (emitted <= 3)).all() and (tokens[np.arange(3) >= emitted[:, None]] == -1).all()
  for i in range(3):
    at = tokens[emitted > i, i]
    assert chi_square(at, TARGET[i]) < CHI2_4_DOF, f"position {i}: {np.bincount(at, minlength=5) / len(at)} vs {TARGET[i]}"
  # the proposals alone would fail: the test tells the distributions apart
  proposed = drafts[:, 0]
  assert chi_square(proposed, TARGET[0]) > 100 * CHI2_4_DOF
  if not drafted:   # a deterministic proposal is kept with the target's probability of it
    assert abs((emitted >= 2).mean() - TARGET[0, 1]) < 0.01


def test_no_proposals_draw_from_the_target():
  rows, rng = 20000, np.random.default_rng(3)
  tokens, emitted = run(np.broadcast_to(TARGET[:1], (rows, 1, 5)).copy(), np.zeros((rows, 0), np.int64), rng)
  assert (emitted == 1).all() and chi_square(tokens[:, 0], TARGET[0]) < CHI2_4_DOF


def test_shapes_must_agree():
  target = Tensor.ones(2, 3, 5) / 5
  with pytest.raises(ValueError, match="do not agree"):
    rejection_sample(target, Tensor.zeros(2, 3, dtype=dtypes.int32), Tensor.zeros(2, 2), Tensor.zeros(2, 3, 5))
  with pytest.raises(ValueError, match="draft_probs"):
    rejection_sample(target, Tensor.zeros(2, 2, dtype=dtypes.int32), Tensor.zeros(2, 2), Tensor.zeros(2, 3, 5),
                     Tensor.ones(2, 3, 5))
