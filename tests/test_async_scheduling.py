"""Asynchronous scheduling: each step is scheduled and launched before the previous one's tokens are read, the
tokens in flight taken on the device. It must change nothing a user sees: the same tokens, texts, logprobs and finish
reasons as running step by step, and nothing left behind. On the CPU the copy of the samples is synchronous, but the
engine's pipeline (placeholders, tokens chained on the device, late stops, aborts, forks) is the one CUDA runs."""
from __future__ import annotations

import pytest

from tests.conftest import assert_all_free
from tinyvllm import LLM, SamplingParams

PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267]  # 20 tokens


@pytest.fixture(scope="module")
def pair(stories_dir):
  """The same engine twice: step by step, and asynchronously scheduled."""
  make = lambda mode: LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=96, async_scheduling=mode)
  return make(False), make(True)


def summary(outputs) -> list:
  return [[(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.cumulative_logprob,
            [{t: round(lp.logprob, 4) for t, lp in step.items()} for step in o.logprobs or []]) for o in out.outputs]
          for out in outputs]


def run_both(pair, prompts, params):
  results = [summary(llm.generate(prompts, params, use_tqdm=False)) for llm in pair]
  for llm in pair: assert_all_free(llm)
  return results


def test_steps_overlap_and_tokens_in_flight_are_placeholders(pair, reference):
  engine = pair[1].engine
  engine.add_request("r", reference["prompt_ids"], SamplingParams(temperature=0, max_tokens=5))
  assert engine.step() == []   # the prompt step was launched; nothing is finished yet
  seq = engine.requests["r"].seqs[0]
  assert seq.num_pending == 1 and seq.output_token_ids == [] and seq.num_tokens == len(reference["prompt_ids"]) + 1
  outputs = engine.step()      # the first decode step launched, then the prompt step's token landed
  assert seq.num_pending == 1 and outputs[0].outputs[0].token_ids == reference["greedy_ids"][:1]
  while engine.has_unfinished_requests(): final = engine.step()
  assert final[0].outputs[0].token_ids == reference["greedy_ids"][:5]
  # the last token is never computed: no step ran for a sequence whose length limit was already in flight
  assert seq.num_computed_tokens == len(reference["prompt_ids"]) + 4
  assert_all_free(pair[1])


@pytest.mark.slow
def test_greedy_batch_with_preemption_matches_reference(stories_dir, reference):
  llm = LLM(str(stories_dir), num_gpu_blocks=24, async_scheduling=True)
  outs = llm.generate([reference["prompt_ids"]] * 6, SamplingParams(temperature=0, max_tokens=120), use_tqdm=False)
  assert llm.engine.scheduler.num_preemptions > 0
  assert all(o.outputs[0].token_ids == reference["greedy_ids"][:120] for o in outs)
  assert_all_free(llm)


@pytest.mark.slow
def test_seeded_sampling_forks_filters_and_logprobs_match(pair, reference):
  prompts = [PROMPT, reference["prompt_ids"], PROMPT[:7]]
  params = [SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=3, max_tokens=25, logprobs=2),
            SamplingParams(temperature=1.0, top_k=20, seed=4, max_tokens=40),
            SamplingParams(n=2, temperature=0.7, min_p=0.05, seed=5, max_tokens=12, logprobs=0)]
  sync, overlapped = run_both(pair, prompts, params)
  assert overlapped == sync
  assert len({tuple(o[0]) for o in sync[0]}) == 3   # the samples really differ


@pytest.mark.slow
def test_stops_that_land_late_drop_the_extra_token(pair, reference):
  text = reference["greedy_text"]
  stop = text[len(text) // 3:len(text) // 3 + 6]
  stop_token = reference["greedy_ids"][30]
  params = [SamplingParams(temperature=0, max_tokens=200, stop=[stop]),
            SamplingParams(temperature=0, max_tokens=200, stop_token_ids=[stop_token]),
            SamplingParams(temperature=0, max_tokens=200, stop=[stop], include_stop_str_in_output=True),
            SamplingParams(temperature=0, max_tokens=300)]
  sync, overlapped = run_both(pair, [reference["prompt_ids"]] * 4, params)
  assert overlapped == sync
  assert [out[0][2] for out in sync] == ["stop", "stop", "stop", "length"]
  assert sync[1][0][0][-1] == stop_token and len(sync[1][0][0]) <= 31


@pytest.mark.slow
def test_penalties_wait_for_their_tokens(pair, reference):
  """A penalised row needs every earlier token on the host, so its step is read before the next is scheduled."""
  params = [SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.2),
            SamplingParams(temperature=0, max_tokens=40),
            SamplingParams(temperature=0.8, seed=9, max_tokens=30, presence_penalty=0.5)]
  sync, overlapped = run_both(pair, [reference["prompt_ids"], PROMPT, PROMPT], params)
  assert overlapped == sync
  assert sync[0][0][0] != reference["greedy_ids"][:40]   # the penalty did change the tokens


def test_abort_while_a_step_is_in_flight(pair, reference):
  engine = pair[1].engine
  for i in range(4): engine.add_request(f"a{i}", PROMPT, SamplingParams(temperature=0, max_tokens=60))
  engine.add_request("keep", reference["prompt_ids"], SamplingParams(temperature=0, max_tokens=50))
  for _ in range(6): engine.step()
  assert engine.core._in_flight is not None and any(s.num_pending for s in engine.requests["a1"].seqs)
  for i in range(4): engine.abort_request(f"a{i}")
  finals = {}
  while engine.has_unfinished_requests():
    for out in engine.step(): finals[out.request_id] = out
  assert list(finals) == ["keep"] and finals["keep"].outputs[0].token_ids == reference["greedy_ids"][:50]
  assert_all_free(pair[1])
