"""Batching, paging, preemption, chunked prefill and prefix caching never change a greedy
result, and nothing is left behind. The reference is each request run alone; a divergence is accepted only where the
lone run's top two logprobs differ by less than 1e-4 (checked), since a near-tie can flip under different batching."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tinyvllm import LLM, SamplingParams

pytestmark = pytest.mark.slow   # every case runs several engines over many requests

TIE = 1e-4
rng = np.random.default_rng(0)
PROMPT_LENS = [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 50, 64, 77, 100, 128, 150, 199, 200, 233, 256, 270, 299, 300]
MAX_TOKENS = [1, 200, 2, 150, 3, 100, 17, 64, 5, 33, 120, 9, 80, 1, 45, 16, 60, 12, 90, 7, 31, 2, 150, 25]
PROMPTS = [[1, *rng.integers(3, 512, n - 1).tolist()] for n in PROMPT_LENS]
SYSTEM = [1, *rng.integers(3, 512, 99).tolist()]  # a shared 100-token "system prompt"
SHARED_PROMPTS = [SYSTEM + rng.integers(3, 512, n).tolist() for n in rng.integers(1, 120, 24)]


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
  return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def run_alone(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple[list[int], list[float]]]:
  """Each request on its own: its tokens and the top-2 logprob gap at every position."""
  refs = []
  for prompt, m in zip(prompts, max_tokens, strict=True):
    out = llm.generate([prompt], greedy(m, logprobs=2), use_tqdm=False)[0].outputs[0]
    gaps = [sorted((e.logprob for e in step.values()), reverse=True) for step in out.logprobs]
    refs.append((out.token_ids, [g[0] - g[1] for g in gaps]))
  return refs


def assert_matches_alone(outputs, refs) -> None:
  for i, (out, (tokens, gaps)) in enumerate(zip(outputs, refs, strict=True)):
    ours = out.outputs[0].token_ids
    assert len(ours) == len(tokens), f"request {i}: {len(ours)} tokens, alone {len(tokens)}"
    diverged = next((j for j, (a, b) in enumerate(zip(ours, tokens, strict=True)) if a != b), None)
    if diverged is not None:
      assert gaps[diverged] < TIE, f"request {i} diverges at {diverged} where the lone run's top-2 gap is {gaps[diverged]:.3g}"


def assert_nothing_left(llm: LLM) -> None:
  engine, alloc = llm.engine, llm.engine.allocator
  assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
  assert not engine.scheduler.pending_forks and not engine.output_processor.states
  assert alloc.num_used_blocks == 0, f"{alloc.num_used_blocks} blocks still referenced"


@pytest.fixture(scope="module")
def lone(stories_dir):
  llm = LLM(str(stories_dir), max_num_seqs=4, num_gpu_blocks=160)
  return llm, run_alone(llm, PROMPTS, MAX_TOKENS)


CONFIGS = {
  "default": dict(num_gpu_blocks=1024),
  "preemption": dict(num_gpu_blocks=40),
  "small-chunks": dict(num_gpu_blocks=1024, max_num_seqs=24, max_num_batched_tokens=40, long_prefill_token_threshold=7),
  "no-prefix-cache": dict(num_gpu_blocks=1024, enable_prefix_caching=False, block_size=8),
  "async-small-chunks": dict(num_gpu_blocks=1024, max_num_seqs=24, max_num_batched_tokens=40, long_prefill_token_threshold=7,
                             async_scheduling=True),
  "static-contiguous": dict(kv_cache="contiguous", scheduler="static", max_num_seqs=24, enable_chunked_prefill=False,
                            max_num_batched_tokens=8192),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_equals_alone(stories_dir, lone, name):
  _, refs = lone
  llm = LLM(str(stories_dir), **CONFIGS[name])
  outputs = llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS], use_tqdm=False)
  assert_matches_alone(outputs, refs)
  if name == "preemption": assert llm.engine.scheduler.num_preemptions > 0
  assert_nothing_left(llm)


def test_prefix_caching_with_shared_system_prompt(stories_dir, lone):
  lone_llm, _ = lone
  max_tokens = [int(m) for m in rng.integers(1, 60, len(SHARED_PROMPTS))]
  refs = run_alone(lone_llm, SHARED_PROMPTS, max_tokens)
  llm = LLM(str(stories_dir), num_gpu_blocks=512)
  first = llm.generate([SHARED_PROMPTS[0]], greedy(max_tokens[0]), use_tqdm=False)  # fills the cache with the prefix
  assert llm.engine.allocator.prefix_hits == 0
  outputs = first + llm.generate(SHARED_PROMPTS[1:], [greedy(m) for m in max_tokens[1:]], use_tqdm=False)
  assert_matches_alone(outputs, refs)
  alloc = llm.engine.allocator
  # every later request found the system prompt's 6 full blocks (96 of its 100 tokens) in the cache
  assert alloc.prefix_hits >= 96 * (len(SHARED_PROMPTS) - 1), f"only {alloc.prefix_hits} prompt tokens came from the cache"
  assert_nothing_left(llm)
  assert alloc.num_cached_free_blocks > 0  # the cache keeps its blocks (unreferenced) for later requests


def test_stories_reference_inside_a_batch(stories_dir, lone):
  _, refs = lone
  reference = json.loads((stories_dir / "reference_greedy.json").read_text())
  llm = LLM(str(stories_dir), num_gpu_blocks=48)   # small enough to preempt
  prompts = [*PROMPTS[:12], reference["prompt_ids"], reference["zoo"]["prompt_ids"], *PROMPTS[12:]]
  params = [greedy(m) for m in MAX_TOKENS[:12]] + [greedy(256), greedy(64)] + [greedy(m) for m in MAX_TOKENS[12:]]
  outputs = llm.generate(prompts, params, use_tqdm=False)
  assert outputs[12].outputs[0].token_ids == reference["greedy_ids"]
  assert outputs[12].outputs[0].text == reference["greedy_text"]
  assert reference["zoo"]["prompt_ids"] + outputs[13].outputs[0].token_ids == reference["zoo"]["greedy_ids_64"]
  assert_matches_alone(outputs[:12] + outputs[14:], refs)
  assert_nothing_left(llm)
