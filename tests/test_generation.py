"""Acceptance 4 through the engine: seeds, temperature 0, stop conditions and streaming on stories260K."""
from __future__ import annotations

import json
import shutil

import pytest

from tinyvllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def greedy(stories_dir):
  return json.loads((stories_dir / "reference_greedy.json").read_text())


def run(llm, prompt, **kwargs):
  return llm.generate([prompt], SamplingParams(**kwargs), use_tqdm=False)[0].outputs[0]


@pytest.mark.slow
def test_seed_reproduces_and_differs(llm):
  a = run(llm, "Once upon a time", temperature=1.0, seed=7, max_tokens=40)
  b = run(llm, "Once upon a time", temperature=1.0, seed=7, max_tokens=40)
  c = run(llm, "Once upon a time", temperature=1.0, seed=8, max_tokens=40)
  assert a.token_ids == b.token_ids and a.text == b.text
  assert a.token_ids != c.token_ids


@pytest.mark.slow
def test_seeded_sample_ignores_its_batch(llm):
  params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=3, max_tokens=30)
  alone = run(llm, "The cat", temperature=0.9, top_p=0.9, top_k=40, seed=3, max_tokens=30)
  others = [SamplingParams(temperature=1.2, seed=s, max_tokens=25) for s in range(5)]
  outs = llm.generate(["A dog", "The cat", "Zoo", "Tom", "She", "He"], [others[0], params, *others[1:]], use_tqdm=False)
  assert outs[1].outputs[0].token_ids == alone.token_ids


def test_temperature_zero_is_greedy(llm, greedy):
  out = run(llm, greedy["prompt_ids"], temperature=0.0, top_p=0.5, top_k=3, max_tokens=50)
  assert out.token_ids == greedy["greedy_ids"][:50]


def test_max_tokens_ends_with_length(llm):
  out = run(llm, "Zoo", temperature=0, max_tokens=7)
  assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_string_is_cut(llm, greedy):
  out = run(llm, greedy["prompt_ids"], temperature=0, max_tokens=100, stop=["park"])
  text = greedy["greedy_text"]
  assert out.text == text[:text.index("park")]
  assert out.finish_reason == "stop" and out.stop_reason == "park"


def test_stop_string_spanning_two_tokens(llm, greedy):
  tok = llm.get_tokenizer()
  ids, text = greedy["greedy_ids"], greedy["greedy_text"]
  prefixes = [tok.decode(ids[:i]) for i in range(len(ids[:40]) + 1)]
  # a boundary after token i where both neighbouring tokens contribute at least two characters
  i = next(i for i in range(10, 39) if len(prefixes[i]) - len(prefixes[i - 1]) >= 2 and len(prefixes[i + 1]) - len(prefixes[i]) >= 3)
  stop = prefixes[i][-2:] + prefixes[i + 1][len(prefixes[i]):len(prefixes[i]) + 2]
  assert text.index(stop) == len(prefixes[i]) - 2
  out = run(llm, greedy["prompt_ids"], temperature=0, max_tokens=100, stop=[stop])
  assert out.text == text[:text.index(stop)]
  assert out.stop_reason == stop and out.token_ids == ids[:i + 1]
  kept = run(llm, greedy["prompt_ids"], temperature=0, max_tokens=100, stop=[stop], include_stop_str_in_output=True)
  assert kept.text == text[:text.index(stop) + len(stop)]


def test_stop_token_ids(llm, greedy):
  target = greedy["greedy_ids"][5]
  out = run(llm, greedy["prompt_ids"], temperature=0, max_tokens=100, stop_token_ids=[target])
  assert out.token_ids == greedy["greedy_ids"][:6] and out.stop_reason == target and out.finish_reason == "stop"
  assert out.text == llm.get_tokenizer().decode(greedy["greedy_ids"][:5])


def test_eos_from_generation_config_stops_unless_ignored(stories_dir, greedy, tmp_path):
  """An extra EOS id listed in generation_config.json ends generation (and is left out of the text)."""
  shutil.copytree(stories_dir, tmp_path / "m")
  eos = greedy["greedy_ids"][8]
  (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, eos]}))
  llm = LLM(str(tmp_path / "m"), max_num_seqs=2, num_gpu_blocks=64)
  out = run(llm, greedy["prompt_ids"], temperature=0, max_tokens=50)
  first = greedy["greedy_ids"].index(eos)
  assert out.token_ids == greedy["greedy_ids"][:first + 1] and out.finish_reason == "stop" and out.stop_reason is None
  assert out.text == llm.get_tokenizer().decode(greedy["greedy_ids"][:first])
  ignored = run(llm, greedy["prompt_ids"], temperature=0, max_tokens=50, ignore_eos=True)
  assert ignored.token_ids == greedy["greedy_ids"][:50] and ignored.finish_reason == "length"


def test_stream_deltas_add_up(llm, greedy):
  text = greedy["greedy_text"]
  stop = text[300:306]
  deltas = list(llm.stream(greedy["prompt_ids"], SamplingParams(temperature=0, max_tokens=200, stop=[stop])))
  assert "".join(deltas) == text[:300] and len(deltas) > 20
  assert not any(stop in d for d in deltas)


@pytest.mark.slow
def test_penalties_change_greedy_output(llm, greedy):
  out = run(llm, greedy["prompt_ids"], temperature=0, max_tokens=60, repetition_penalty=1.5, frequency_penalty=0.5)
  assert out.token_ids != greedy["greedy_ids"][:60]
  counts = {t: out.token_ids.count(t) for t in set(out.token_ids)}
  base = {t: greedy["greedy_ids"][:60].count(t) for t in set(greedy["greedy_ids"][:60])}
  assert max(counts.values()) < max(base.values())


@pytest.mark.slow
def test_final_only_requests_report_once_and_match_cumulative(llm):
  from tinyvllm.sampling_params import RequestOutputKind
  engine = llm.engine
  engine.add_request("cum", "Once upon a time", SamplingParams(temperature=0, max_tokens=12))
  engine.add_request("final", "Once upon a time", SamplingParams(temperature=0, max_tokens=12,
                                                                 output_kind=RequestOutputKind.FINAL_ONLY))
  seen: dict[str, list] = {"cum": [], "final": []}
  while engine.has_unfinished_requests():
    for out in engine.step(): seen[out.request_id].append(out)
  assert len(seen["final"]) == 1 and seen["final"][0].finished
  assert len(seen["cum"]) == 12 and seen["cum"][-1].finished
  assert seen["final"][0].outputs[0].token_ids == seen["cum"][-1].outputs[0].token_ids
  assert seen["final"][0].outputs[0].text == seen["cum"][-1].outputs[0].text


def test_generate_leaves_the_callers_params_alone(llm):
  params = SamplingParams(temperature=0, max_tokens=None)
  llm.generate(["Zoo"], params, use_tqdm=False)
  assert params.max_tokens is None and params.output_kind.name == "CUMULATIVE"
