"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's meaning) equal HF transformers' log_softmax of stories260K's
logits at every prompt position: the value, the prompt token's rank and the top-k ids; in one chunk or many, with the
prompt's prefix already cached, beside requests that ask for none, with n > 1, through preemption and asynchronous
scheduling; and nothing is left allocated afterwards."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import assert_all_free
from tinyvllm import LLM, SamplingParams

PROMPTS = ["Once upon a time, there was a little girl named Lily. She loved to play outside in the park",
           "The cat sat on the mat and looked at the big red ball",
           "Tom and Sue went to the shop. They wanted to buy a toy"]
TOL = 1e-4
pytestmark = pytest.mark.slow   # every test runs eager prompt steps that compile their kernels on first use (5-20 s)


@pytest.fixture(scope="module")
def hf(stories_log_softmax): return stories_log_softmax


def assert_matches_hf(prompt_logprobs, ids: list[int], ref: np.ndarray, k: int) -> None:
  assert prompt_logprobs is not None and len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
  for i in range(1, len(ids)):
    entries, row, token = prompt_logprobs[i], ref[i - 1], ids[i]
    assert abs(entries[token].logprob - row[token]) < TOL, f"token {i}: {entries[token].logprob} != {row[token]}"
    assert entries[token].rank == int((row > row[token]).sum()) + 1, f"token {i}: rank"
    top = [t for t, lp in sorted(entries.items(), key=lambda kv: kv[1].rank) if lp.rank <= k]
    assert top == np.argsort(-row, kind="stable")[:k].tolist(), f"token {i}: top-{k} ids"
    assert [entries[t].rank for t in top] == list(range(1, k + 1))
    assert set(entries) == {*top, token}          # the prompt token's own entry plus the top-k, nothing else
    assert all(e.decoded_token is not None for e in entries.values())


def greedy(**kw) -> SamplingParams: return SamplingParams(temperature=0, max_tokens=4, **kw)


@pytest.fixture(scope="module")
def llm(stories_dir): return LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=256)


def test_prompt_logprobs_equal_hf_and_leave_nothing_behind(llm, hf):
  tokenizer = llm.get_tokenizer()
  outs = llm.generate(PROMPTS, [greedy(prompt_logprobs=5), greedy(prompt_logprobs=0), greedy()], use_tqdm=False)
  ids = [tokenizer.encode(p) for p in PROMPTS]
  assert_matches_hf(outs[0].prompt_logprobs, ids[0], hf(ids[0]), 5)
  assert_matches_hf(outs[1].prompt_logprobs, ids[1], hf(ids[1]), 0)
  assert outs[2].prompt_logprobs is None
  alone = llm.generate(PROMPTS, greedy(), use_tqdm=False)   # scoring the prompt changes no generated token
  assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
  assert_all_free(llm)


def test_sample_and_prompt_logprobs_in_one_step(llm, hf):
  """Both kinds in the same steps (each read back in its place), and n > 1: one prompt_logprobs for the request."""
  ids = llm.get_tokenizer().encode(PROMPTS[1])
  out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6, logprobs=2, prompt_logprobs=3),
                     use_tqdm=False)[0]
  assert_matches_hf(out.prompt_logprobs, ids, hf(ids), 3)
  for o in out.outputs:
    assert len(o.logprobs) == len(o.token_ids) == 6
    context = ids + o.token_ids
    ref = hf(context)
    for j, (token, entries) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
      assert abs(entries[token].logprob - ref[len(ids) - 1 + j][token]) < TOL
  assert_all_free(llm)


@pytest.mark.parametrize("settings", [dict(max_num_batched_tokens=8), dict(long_prefill_token_threshold=5, async_scheduling=True)],
                         ids=["small-chunks", "async-chunks"])
def test_chunked_prefill_gives_the_same_prompt_logprobs(stories_dir, hf, settings):
  llm = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=256, **settings)
  ids = llm.get_tokenizer().encode(PROMPTS[0])
  one_chunk = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=256).generate([ids], greedy(prompt_logprobs=4), use_tqdm=False)[0]
  chunked = llm.generate([ids], greedy(prompt_logprobs=4), use_tqdm=False)[0]
  assert_matches_hf(chunked.prompt_logprobs, ids, hf(ids), 4)
  for a, b in zip(one_chunk.prompt_logprobs[1:], chunked.prompt_logprobs[1:], strict=True):
    assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < TOL and a[t].rank == b[t].rank for t in a)
  assert chunked.outputs[0].token_ids == one_chunk.outputs[0].token_ids
  assert_all_free(llm)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(stories_dir, hf):
  llm = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=256, block_size=16)
  ids = llm.get_tokenizer().encode(PROMPTS[0])
  llm.generate([ids], greedy(), use_tqdm=False)          # its full blocks are now in the prefix cache
  hits = llm.engine.allocator.prefix_hits
  llm.generate([ids], greedy(), use_tqdm=False)
  assert llm.engine.allocator.prefix_hits > hits         # a request without prompt logprobs reuses them
  hits = llm.engine.allocator.prefix_hits
  out = llm.generate([ids], greedy(prompt_logprobs=2), use_tqdm=False)[0]
  assert llm.engine.allocator.prefix_hits == hits        # this one computed every prompt token
  assert_matches_hf(out.prompt_logprobs, ids, hf(ids), 2)
  assert_all_free(llm)


def test_preemption_recomputes_without_duplicating_entries(stories_dir, hf):
  llm = LLM(str(stories_dir), num_gpu_blocks=24, async_scheduling=True)
  ids = llm.get_tokenizer().encode(PROMPTS[0])
  outs = llm.generate([ids] * 6, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, prompt_logprobs=1),
                      use_tqdm=False)
  assert llm.engine.scheduler.num_preemptions > 0
  ref = hf(ids)
  for out in outs: assert_matches_hf(out.prompt_logprobs, ids, ref, 1)
  assert_all_free(llm)
