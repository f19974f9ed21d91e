"""Step layouts: start-up captures (--cuda-graph-sizes), captures shared by covering samplers, the CPU's capture of a
prompt layout when met again, and the padded prompt-step rows of the fused backends; none of them may change a token."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.backend.sampling import SamplerVariant
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.worker.input_batch import StepBuckets
from tinyvllm.worker.step_layout import covers

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_warm_up_captures_each_bucket_once_and_greedy_reuses_them(stories_dir, reference):
  llm = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=64, cuda_graph_sizes=[1, 3, 4])
  runner = llm.engine.runner
  assert runner.num_captures == 2                     # buckets 1 and 4 (the portable backend: decode steps only)
  prompts = [reference["prompt_ids"]] * 3              # contexts stay inside the smallest context bucket
  outs = llm.generate(prompts, GREEDY, use_tqdm=False)
  assert runner.num_captures == 2                     # greedy decode ran on the random-sampler captures
  assert all(o.outputs[0].token_ids == reference["greedy_ids"][:8] for o in outs)
  assert llm.engine.runner.warm_up([2, 4], 64).decode == 1   # only bucket 2 is new


def test_no_warm_up_on_the_cpu_by_default(stories_dir):
  llm = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=64)
  assert llm.engine.runner.num_captures == 0



def test_the_cpu_captures_a_prompt_layout_when_met_again(stories_dir, reference):
  """First meeting: the prompt step runs eagerly (its decode steps are captured at once); second: it is captured;
  third: replayed. The three give the reference's tokens."""
  llm = LLM(str(stories_dir), max_num_seqs=4, num_gpu_blocks=64, enable_prefix_caching=False)
  captured = lambda multi_token: sum(layout.multi_token == multi_token for layout in llm.engine.runner._captures)
  zoo = reference["zoo"]
  for meeting, prompt_captures in ((1, 0), (2, 1), (3, 1)):
    out = llm.generate([zoo["prompt_ids"]], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids + out.outputs[0].token_ids == zoo["greedy_ids_64"][:len(zoo["prompt_ids"]) + 8], meeting
    assert (captured(True), captured(False)) == (prompt_captures, 1), meeting

def test_sampler_cover_rules():
  greedy, rand, filt = SamplerVariant(False, False, False), SamplerVariant(True, False, False), SamplerVariant(True, True, False)
  assert covers(rand, greedy) and covers(filt, rand) and covers(filt, greedy) and covers(greedy, greedy)
  assert not covers(greedy, rand) and not covers(rand, filt)
  assert not covers(SamplerVariant(True, True, True), rand) and not covers(rand, SamplerVariant(True, False, True))


def test_bad_capture_sizes_are_refused():
  with pytest.raises(ConfigError, match="cuda_graph_sizes must be step sizes >= 1"):
    EngineConfig(model="m", cuda_graph_sizes=[4, 0])


def record_steps(llm: LLM) -> list[tuple[int, int]]:
  seen, plan = [], llm.engine.runner._plan

  def recording(sched):
    host, layout, *rest = plan(sched)
    seen.append((layout.query_len, host.context_lens.shape[0]))
    return host, layout, *rest
  llm.engine.runner._plan = recording
  return seen


@pytest.mark.slow
def test_prompt_steps_padded_to_max_num_seqs_change_no_token(stories_dir, reference):
  """The fused backends pad steps with prompt chunks to max_num_seqs rows of one sequence each; forced here on the
  portable path."""
  prompts = [reference["prompt_ids"], [1, 2, 3, 4, 5, 6, 7], reference["zoo"]["prompt_ids"]]
  params = SamplingParams(temperature=0, max_tokens=12)
  plain = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=64, max_num_batched_tokens=8)   # chunked prefill
  padded = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=64, max_num_batched_tokens=8)
  padded.engine.runner.buckets = replace(padded.engine.runner.buckets, min_prefill_rows=8, split_runs=False)
  plain.engine.runner.buckets = replace(plain.engine.runner.buckets, split_runs=False)
  rows = {id(llm): record_steps(llm) for llm in (plain, padded)}   # the (query run, padded sequences) of every step
  expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
  assert [o.outputs[0].token_ids for o in padded.generate(prompts, params, use_tqdm=False)] == expected
  assert expected[0] == reference["greedy_ids"][:12]
  prompt_steps = lambda llm: [s for tq, s in rows[id(llm)] if tq > 1]
  assert prompt_steps(padded) and all(s == 8 for s in prompt_steps(padded))
  assert any(s < 8 for s in prompt_steps(plain))                      # the padding was not there anyway
  assert [s for tq, s in rows[id(padded)] if tq == 1] == [s for tq, s in rows[id(plain)] if tq == 1]   # decode untouched


@pytest.mark.slow
def test_start_up_captures_every_prompt_layout_met_and_change_no_token(stories_dir, reference):
  """With the fused kernels' coarse prompt buckets (forced here on the portable path, every context in the smallest
  context bucket), the start-up captures are every layout that chunked prompts, mixed steps and decodes then meet."""
  llm = LLM(str(stories_dir), max_num_seqs=4, num_gpu_blocks=128, max_num_batched_tokens=64, enable_prefix_caching=False,
            cuda_graph_sizes=[])
  runner = llm.engine.runner
  runner.buckets = StepBuckets(min_context=512, min_prefill_rows=4, min_prompt_tokens=16, coarse_query_runs=True)
  done = runner.warm_up([1 << i for i in range(7)], 64)
  # decode: 1, 2, 4 sequences; prompt steps of 16, 32 and 64 token rows, each with one query-run bucket (min(64, N))
  assert (done.decode, done.prompt) == (3, 3) and runner.num_captures == 6
  # greedy text continues greedily: a prompt of the reference's first k tokens is followed by the rest of them
  story, zoo = reference["prompt_ids"] + reference["greedy_ids"], reference["zoo"]["greedy_ids_64"]
  cuts = [(story, 1), (story, 90), (story, 150), (zoo, 4), (zoo, 20)]   # chunked by the 64-token budget, or not
  outs = llm.generate([ids[:k] for ids, k in cuts], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
  assert [o.outputs[0].token_ids for o in outs] == [ids[k:k + 16] for ids, k in cuts]
  assert runner.num_captures == 6   # nothing met that start-up had not captured


def test_coarse_query_runs_of_a_prompt_step():
  buckets = StepBuckets(min_prompt_tokens=256, coarse_query_runs=True)
  assert buckets.tokens(3, multi_token=True) == 256 and buckets.tokens(3, multi_token=False) == 4
  assert buckets.query_runs(256) == [64, 256] and buckets.query_runs(512) == [64, 256, 512]
  assert buckets.query_runs(2048) == [64, 256, 1024, 2048] and buckets.query_runs(16) == [16]
  assert StepBuckets().query_runs(16) == [2, 4, 8, 16]
