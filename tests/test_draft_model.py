"""Speculative decoding with a draft model (tinyvllm/engine/draft_model.py): stories260K as its own draft accepts every
proposal and changes no greedy token; a random tiny draft for a random tiny target (models saved by transformers)
changes no greedy token either, batched with varied lengths and under preemption, and leaves nothing behind after
aborts mid-verification; on an 8-token vocabulary the tokens a verification emits have the target's distribution
(chi-square over thousands of seeded requests) though the draft proposes otherwise. A draft that cannot serve the
target is refused by name."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tests.conftest import assert_all_free
from tests.hf_models import make_model
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError

pytestmark = pytest.mark.slow   # several engines, thousands of requests on the CPU

K = 3
PROMPTS = [[3, 17, 5, 200, 9], [44], [7, 7, 7, 7, 7, 7, 7, 7, 12, 13, 14, 15, 16, 17, 18, 19, 20], [100, 101] * 10]


def greedy(max_tokens: int) -> SamplingParams: return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  root = tmp_path_factory.mktemp("draft")
  make_model("llama", root / "target", seed=1)
  make_model("llama", root / "draft", seed=2, hidden_size=32, intermediate_size=48, num_hidden_layers=1)
  # weights small enough that no token takes nearly all the mass: the draft's proposal is neither always accepted nor never
  make_model("llama", root / "small_target", seed=3, vocab_size=8, initializer_range=0.15)
  make_model("llama", root / "small_draft", seed=4, vocab_size=8, initializer_range=0.15, num_hidden_layers=1)
  make_model("llama", root / "other_vocab", seed=5, vocab_size=300)
  make_model("llama", root / "short", seed=6, max_position_embeddings=64)
  return root


def tokens(llm, prompts, params):
  return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_stories260k_as_its_own_draft_accepts_every_proposal(stories_dir, reference):
  llm = LLM(str(stories_dir), max_num_seqs=4, num_gpu_blocks=128,
            speculative_config={"model": str(stories_dir), "num_speculative_tokens": 4})
  out = llm.generate([reference["prompt_ids"]], greedy(len(reference["greedy_ids"])), use_tqdm=False)[0]
  assert out.outputs[0].token_ids == reference["greedy_ids"]
  m = out.metrics
  assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens
  assert_all_free(llm)


def drafting(models, blocks: int) -> LLM:
  return LLM(str(models / "target"), max_num_seqs=4, num_gpu_blocks=blocks,
             speculative_config={"model": str(models / "draft"), "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def drafting_64(models):
  """The random target with the random draft and 64 blocks (the batch fits); shared by the tests that need no other."""
  return drafting(models, 64)


def test_a_random_draft_changes_no_greedy_token_batched_and_under_preemption(models, drafting_64):
  plain = LLM(str(models / "target"), max_num_seqs=4, num_gpu_blocks=64)
  params = [greedy(m) for m in (40, 2, 60, 25)]
  want = tokens(plain, PROMPTS, params)
  for blocks in (64, 6):   # 6 blocks of 16 tokens: the batch does not fit, sequences are preempted
    llm = drafting_64 if blocks == 64 else drafting(models, blocks)
    assert tokens(llm, PROMPTS, params) == want
    spec = llm.engine.scheduler.spec
    assert spec.num_draft_tokens > spec.num_accepted_tokens
    assert (llm.engine.scheduler.num_preemptions > 0) == (blocks == 6)
    assert_all_free(llm)


def test_aborts_mid_verification_leave_nothing_behind(drafting_64):
  llm = drafting_64   # the engine of the test above, all free after its generate (checked there)
  engine = llm.engine
  before = engine.scheduler.spec.num_drafts
  for i, prompt in enumerate(PROMPTS): engine.add_request(f"a{i}", prompt, greedy(50))
  while engine.scheduler.spec.num_drafts < before + 6: engine.step()
  for i in range(len(PROMPTS)): engine.abort_request(f"a{i}")
  assert_all_free(llm)


def chi2_threshold(dof: int, z: float = 3.719) -> float:
  """The chi-square value exceeded with probability 1e-4 (z: the normal quantile), by Wilson and Hilferty."""
  return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_emitted_tokens_have_the_targets_distribution_though_the_draft_differs(models):
  """3,000 seeded requests of 3 tokens at temperature 1: the second token comes out of a verification of the draft's
  proposal; given the most frequent first token, its frequencies match the target's softmax."""
  llm = LLM(str(models / "small_target"), max_num_seqs=256, num_gpu_blocks=512,
            speculative_config={"model": str(models / "small_draft"), "num_speculative_tokens": 1})
  prompt = [1, 2, 3]
  outs = llm.generate([prompt] * 3000, [SamplingParams(temperature=1.0, max_tokens=3, seed=i, ignore_eos=True)
                                        for i in range(3000)], use_tqdm=False)
  pairs = np.array([o.outputs[0].token_ids[:2] for o in outs])
  first = np.bincount(pairs[:, 0], minlength=8).argmax()
  seconds = pairs[pairs[:, 0] == first, 1]
  logits = llm.engine.compute_logits([*prompt, int(first)]).astype(np.float64)
  p = np.exp(logits - logits.max())
  p /= p.sum()
  expected, counts = p * len(seconds), np.bincount(seconds, minlength=8).astype(np.float64)
  big = expected >= 5   # cells too small for the test are pooled
  obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
  keep = exp > 0
  stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
  assert stat < chi2_threshold(int(keep.sum()) - 1), f"{counts / len(seconds)} vs {p}"
  spec = llm.engine.scheduler.spec
  assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens   # the draft's proposals are not the target's draws
  assert len(seconds) > 500 and p.max() < 0.9


def test_a_draft_that_cannot_serve_the_target_is_refused(models):
  with pytest.raises(ConfigError, match="vocabulary of 300 tokens, the target 320"):
    LLM(str(models / "target"), num_gpu_blocks=16, speculative_config={"model": str(models / "other_vocab"), "num_speculative_tokens": 2})
  with pytest.raises(ConfigError, match="context of 64 tokens, shorter than max_model_len"):
    LLM(str(models / "target"), num_gpu_blocks=16, speculative_config={"model": str(models / "short"), "num_speculative_tokens": 2})


def test_swapped_out_sequences_catch_the_draft_up_again(stories_dir):
  """With preemption by swapping the draft's K/V is not swapped: a sequence back in other blocks is caught up again,
  so stories260K as its own draft still has every proposal accepted, and the output is plain decoding's."""
  prompts = ["Once upon a time", "Tom had a red ball. Tom had a red ball. Tom", "Lily"]
  params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
  settings = {"preemption_mode": "swap", "num_gpu_blocks": 9, "max_num_seqs": 3}
  want = tokens(LLM(str(stories_dir), **settings), prompts, params)
  llm = LLM(str(stories_dir), speculative_config={"model": str(stories_dir), "num_speculative_tokens": 3}, **settings)
  assert tokens(llm, prompts, params) == want
  spec = llm.engine.scheduler.spec
  assert llm.engine.scheduler.num_preemptions > 0 and spec.num_accepted_tokens == spec.num_draft_tokens > 0
  assert_all_free(llm)
