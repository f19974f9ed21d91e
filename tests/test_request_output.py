"""RequestOutput as vLLM's: num_cached_tokens is the prefix-cache hit at admission, metrics' times are ordered."""
from __future__ import annotations

import pytest

from tests.conftest import assert_all_free
from tinyvllm import LLM, SamplingParams
from tinyvllm.outputs import RequestOutput

BLOCK = 16


@pytest.fixture(scope="module")
def llm(stories_dir):
  return LLM(str(stories_dir), num_gpu_blocks=256, block_size=BLOCK, max_num_seqs=4)


def run(llm, prompts, **params) -> list[RequestOutput]:
  return llm.generate(prompts, SamplingParams(**{"temperature": 0, "max_tokens": 4, **params}), use_tqdm=False)


@pytest.mark.slow
def test_a_repeated_prompt_reports_its_cached_blocks(llm, reference):
  prompt = reference["zoo"]["greedy_ids_64"][:50]   # 50 tokens: 3 full blocks before the last token
  llm.engine.reset_prefix_cache()
  first = run(llm, [prompt])[0]
  hits_before = llm.engine.allocator.prefix_hits
  again = run(llm, [prompt])[0]
  cached_blocks = (len(prompt) - 1) // BLOCK   # the last prompt token is always computed
  assert first.num_cached_tokens == 0
  assert again.num_cached_tokens == cached_blocks * BLOCK == llm.engine.allocator.prefix_hits - hits_before == 48
  assert again.outputs[0].token_ids == first.outputs[0].token_ids == reference["zoo"]["greedy_ids_64"][50:54]
  assert_all_free(llm)


def test_a_shared_prefix_counts_only_its_whole_blocks(llm, reference):
  ids = reference["zoo"]["greedy_ids_64"]
  llm.engine.reset_prefix_cache()
  run(llm, [ids[:40]])                       # caches blocks 0 and 1 (tokens 0-31)
  other = run(llm, [ids[:20] + [300] * 30])[0]  # shares tokens 0-19: block 0 only
  assert other.num_cached_tokens == BLOCK


def test_without_prefix_caching_nothing_is_cached(stories_dir, reference):
  llm = LLM(str(stories_dir), num_gpu_blocks=64, enable_prefix_caching=False)
  prompt = reference["zoo"]["greedy_ids_64"][:40]
  assert [run(llm, [prompt])[0].num_cached_tokens for _ in range(2)] == [0, 0]


@pytest.mark.slow
def test_metrics_times_are_ordered(llm, reference):
  out = run(llm, [reference["zoo"]["greedy_ids_64"][:10]], max_tokens=6)[0]
  m = out.metrics
  assert m is not None and out.finished
  assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
  assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
  assert m.first_token_time < m.last_token_time   # six tokens came from more than one step


@pytest.mark.slow
def test_metrics_while_streaming_and_for_n_samples(llm, reference):
  engine = llm.engine
  engine.add_request("stream", reference["zoo"]["greedy_ids_64"][:10], SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=5))
  seen = []
  while engine.has_unfinished_requests(): seen += [o for o in engine.step() if o.request_id == "stream"]
  running, final = seen[0], seen[-1]
  assert running.metrics.finished_time is None and not running.finished
  assert running.metrics.first_token_time == final.metrics.first_token_time
  assert final.metrics.finished_time >= final.metrics.last_token_time >= running.metrics.last_token_time
  assert len(final.outputs) == 2 and all(len(o.token_ids) == 5 for o in final.outputs)


def test_a_queued_request_waits_for_a_seat(stories_dir, reference):
  llm = LLM(str(stories_dir), num_gpu_blocks=64, max_num_seqs=1)
  prompt = reference["zoo"]["greedy_ids_64"][:10]
  first, second = llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
  assert second.metrics.first_scheduled_time >= first.metrics.finished_time
  assert second.metrics.time_in_queue > first.metrics.time_in_queue
