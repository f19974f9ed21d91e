"""LLM.beam_search against a reference beam search written here over HF transformers' logits (vLLM's algorithm and
scoring: each live beam's 2 x width most probable next tokens, EOS candidates complete their beam, the width best of the
rest by cumulative logprob / len ** length_penalty live on), on a tiny random Llama and on stories260K."""
from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.conftest import assert_all_free
from tests.hf_models import assert_same_greedy, hf_greedy, make_model
from tinyvllm import LLM
from tinyvllm.beam_search import get_beam_search_score
from tinyvllm.engine.beam_search import start_search
from tinyvllm.engine.input_processor import InputProcessor, PromptError
from tinyvllm.sampling_params import BeamSearchParams, SamplingParamsError

# 41 and 57 tokens: as the beams grow over 6 steps, each step's requests find 32 and 48 of their tokens in the prefix
# cache and compute 9 to 14, within one context bucket (few step layouts, so few captures on the CPU)
rng = np.random.default_rng(7)
PROMPTS = [[int(x) for x in rng.integers(0, 320, n)] for n in (41, 57)]
STEPS = 6
LogSoftmax = Callable[[list[int]], np.ndarray]   # tokens -> the log_softmax of the next token's logits


def reference_beam_search(next_logprobs: LogSoftmax, prompt: list[int], width: int, max_tokens: int, eos: int | None,
                          length_penalty: float = 1.0, ignore_eos: bool = False) -> list[tuple[list[int], float]]:
  """The width best (tokens with the prompt, cumulative logprob), best first."""
  # vLLM's score (vllm/beam_search.py, after HF's): over the whole sequence's length, a final EOS not counted
  score = lambda beam: beam[1] / (len(beam[0]) - (beam[0][-1] == eos)) ** length_penalty
  beams, completed = [(list(prompt), 0.0)], []
  for _ in range(max_tokens):
    if not beams: break
    extended = []
    for tokens, cum in beams:
      lp = next_logprobs(tokens)
      for t in np.argsort(-lp, kind="stable")[:2 * width]:
        child = ([*tokens, int(t)], cum + float(lp[t]))
        (completed if int(t) == eos and not ignore_eos else extended).append(child)
    beams = sorted(extended, key=score, reverse=True)[:width]
  return sorted(completed + beams, key=score, reverse=True)[:width]


def hf_next_logprobs(model) -> LogSoftmax:
  cache: dict[tuple[int, ...], np.ndarray] = {}

  def next_logprobs(tokens: list[int]) -> np.ndarray:
    if (key := tuple(tokens)) not in cache:
      with torch.no_grad(): cache[key] = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1).numpy()
    return cache[key]
  return next_logprobs


def assert_same_beams(ours, ref: list[tuple[list[int], float]], eos: int | None = None) -> None:
  assert [seq.tokens for seq in ours.sequences] == [tokens for tokens, _ in ref]
  np.testing.assert_allclose([seq.cum_logprob for seq in ours.sequences], [cum for _, cum in ref], atol=1e-4, rtol=0)
  for seq in ours.sequences:
    assert seq.finish_reason == ("stop" if seq.tokens[-1] == eos else "length") and seq.stop_reason is None
    assert np.isclose(sum(lps[t].logprob for t, lps in zip(seq.tokens[-len(seq.logprobs):], seq.logprobs, strict=True)),
                      seq.cum_logprob, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A random one-layer Llama whose EOS is a token the searches meet (the third token of the second best of 4 beams
  without EOS), and the reference's next-token logprobs."""
  folder = tmp_path_factory.mktemp("beam-llama")
  hf = make_model("llama", folder, num_hidden_layers=1, tie_word_embeddings=False)
  next_logprobs = hf_next_logprobs(hf)
  eos = reference_beam_search(next_logprobs, PROMPTS[0], 4, STEPS, None)[1][0][len(PROMPTS[0]) + 2]
  config = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
  return LLM(str(folder), max_num_seqs=16, num_gpu_blocks=128), hf, next_logprobs, eos


def search(llm, width: int, **kwargs) -> list:
  """Both prompts' searches, batched."""
  return llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], BeamSearchParams(beam_width=width, max_tokens=STEPS, **kwargs))


CASES = [(1, 1.0, False), (2, 0.5, False), (2, 2.0, True), (4, 1.0, False), (4, 2.0, False), (4, 0.5, False)]


@pytest.mark.slow
@pytest.mark.parametrize("width,length_penalty,ignore_eos", CASES, ids=[f"w{w}-lp{lp}{'-ignore_eos' * i}" for w, lp, i in CASES])
def test_equals_the_reference_over_hf_logits(tiny, width, length_penalty, ignore_eos):
  llm, _, next_logprobs, eos = tiny
  outputs = search(llm, width, length_penalty=length_penalty, ignore_eos=ignore_eos)
  for prompt, out in zip(PROMPTS, outputs, strict=True):
    assert len(out.sequences) == width and out.sequences[0].text is None   # (no tokenizer: no text)
    assert_same_beams(out, reference_beam_search(next_logprobs, prompt, width, STEPS, eos, length_penalty, ignore_eos), eos)
  assert_all_free(llm)


@pytest.mark.slow
def test_eos_completes_beams_and_beams_share_prefix_blocks(tiny):
  """EOS ends beams: complete ones come back beside live ones (scored without their EOS); with ignore_eos none ends.
  Each step's beams find their prompt's full blocks in the prefix cache (32 and 48 tokens a beam)."""
  llm, _, _, eos = tiny
  hits = llm.engine.allocator.prefix_hits
  outputs = search(llm, 4)
  assert llm.engine.allocator.prefix_hits - hits >= (STEPS - 1) * 4 * (32 + 48)
  finishes = [seq.finish_reason for out in outputs for seq in out.sequences]
  assert "stop" in finishes and "length" in finishes, finishes
  for out in outputs:
    assert all((seq.tokens[-1] == eos) == (seq.finish_reason == "stop") for seq in out.sequences)
  for prompt, out in zip(PROMPTS, search(llm, 4, ignore_eos=True), strict=True):
    assert all(seq.finish_reason == "length" and len(seq.tokens) == len(prompt) + STEPS for seq in out.sequences)
  assert_all_free(llm)


@pytest.mark.slow
def test_width_1_is_greedy(tiny):
  llm, hf = tiny[:2]
  for prompt, out in zip(PROMPTS, search(llm, 1, ignore_eos=True), strict=True):
    ref, ref_logits = hf_greedy(hf, prompt, STEPS)
    assert_same_greedy(out.sequences[0].tokens[len(prompt):], ref, ref_logits)


@pytest.mark.slow
def test_batched_equals_alone(tiny):
  llm = tiny[0]
  params = BeamSearchParams(beam_width=2, max_tokens=STEPS, length_penalty=0.5)
  for prompt, out in zip(PROMPTS, llm.beam_search(PROMPTS, params), strict=True):
    (alone,) = llm.beam_search([prompt], params)
    assert [s.tokens for s in out.sequences] == [s.tokens for s in alone.sequences]
    np.testing.assert_allclose([s.cum_logprob for s in out.sequences], [s.cum_logprob for s in alone.sequences], atol=1e-5)
  assert_all_free(llm)


@pytest.mark.slow
def test_sampled_candidates_keep_exact_scores(tiny):
  """temperature > 0 adds each beam's sampled token to its candidates (vLLM's): every beam's cumulative logprob is
  still the sum of the reference's logprobs of its tokens."""
  llm, _, next_logprobs, _ = tiny
  for prompt, out in zip(PROMPTS, search(llm, 1, temperature=2.0, ignore_eos=True), strict=True):
    seq = out.sequences[0]
    ref = sum(next_logprobs(seq.tokens[:i])[seq.tokens[i]] for i in range(len(prompt), len(seq.tokens)))
    assert abs(seq.cum_logprob - ref) < 1e-4 and len(seq.tokens) == len(prompt) + STEPS
  assert_all_free(llm)


def test_score_is_vllms():
  """cumulative logprob / len ** length_penalty, len counting the prompt and not a final EOS (any of the EOS ids)."""
  assert get_beam_search_score([5, 6, 7, 2], -3.0, 2, 1.0) == -1.0
  assert get_beam_search_score([5, 6, 7, 2], -3.0, None, 2.0) == -3.0 / 16
  assert get_beam_search_score([5, 6, 2], -2.0, {2, 9}, 0.5) == -2.0 / 2 ** 0.5


def test_bad_params_are_refused_naming_the_field():
  for kwargs, param in [({"beam_width": 0}, "beam_width"), ({"beam_width": -2}, "beam_width"), ({"beam_width": 2.0}, "beam_width"),
                        ({"beam_width": 11}, "beam_width"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                        ({"length_penalty": float("nan")}, "length_penalty"), ({"ignore_eos": 1}, "ignore_eos")]:
    with pytest.raises(SamplingParamsError) as e: BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    assert e.value.param == param, (kwargs, e.value.param)


@pytest.mark.slow
def test_a_search_that_cannot_run_is_refused_before_anything_runs(tiny):
  llm = tiny[0]
  with pytest.raises(PromptError, match=r"prompt 1: .*exceeds the model's context"):
    llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=256 - len(PROMPTS[1]) + 1))
  fewer_logprobs = InputProcessor(llm.engine.core.info(), None, max_logprobs=5)
  with pytest.raises(SamplingParamsError, match=r"beam_width=3 takes the top 6 logprobs .* max_logprobs \(5\)") as e:
    start_search(fewer_logprobs, PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=2))
  assert e.value.param == "beam_width"
  assert_all_free(llm)


@pytest.mark.slow
def test_stories260k_equals_the_reference(llm, stories_log_softmax, reference):
  """The real model with its tokenizer: token ids and cumulative logprobs as the reference's, text decoded from them.
  (The prompt, the start of its greedy story, is 25 tokens: 9 to 16 computed a beam each step.)"""
  prompt = [1, *reference["greedy_ids"][:24]]
  next_logprobs = lambda tokens: stories_log_softmax(tokens)[-1]
  eos = llm.engine.model_config.eos_token_ids[0]
  out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.8))[0]
  assert_same_beams(out, reference_beam_search(next_logprobs, prompt, 3, 8, eos, 0.8), eos)
  tokenizer = llm.get_tokenizer()
  for seq in out.sequences: assert seq.text == tokenizer.decode(seq.tokens[len(prompt):], skip_special_tokens=True)
  assert len({s.text for s in out.sequences}) == 3
  assert_all_free(llm)
