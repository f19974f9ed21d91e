"""The EngineCore alone (the engine loop the server runs in its own process) on stories260K: token ids against the greedy
reference, the token-level stops it decides, samples the frontend stops, aborts, its stats snapshots, and its outputs
through the msgpack channel unchanged. The frontend's output processor: stop strings stop the core's sample."""
from __future__ import annotations

import time

import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine.messages import EngineCoreOutput, EngineCoreRequest, OutputType, SampleRef
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def core(stories_dir):
  from tinyvllm.engine.core import EngineCore
  return EngineCore(EngineConfig(model=str(stories_dir), num_gpu_blocks=64, max_num_seqs=8, seed=0))


def request(rid: str, prompt: list[int], eos: tuple[int, ...] = (), **params) -> EngineCoreRequest:
  return EngineCoreRequest(rid, prompt, SamplingParams(temperature=0, **params), list(eos), time.time())


def run(core, on_step=None) -> dict[tuple[str, int], list[EngineCoreOutput]]:
  """Step until the core is idle; every sample's outputs in order. on_step(step number, outputs) may intervene."""
  got: dict[tuple[str, int], list[EngineCoreOutput]] = {}
  step = 0
  while core.has_unfinished_requests():
    outputs = core.step()
    for out in outputs.outputs: got.setdefault((out.request_id, out.index), []).append(out)
    if on_step is not None: on_step(step, outputs)
    step += 1
  return got


def tokens(outs: list[EngineCoreOutput]) -> list[int]: return [t for o in outs for t in o.new_token_ids]


def assert_idle(core) -> None:
  assert not core.requests and core.allocator.num_used_blocks == 0 and core._in_flight is None
  assert not core.scheduler.running and not core.scheduler.waiting
  stats = core.stats()
  assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_blocks_used) == (0, 0, 0)


def test_greedy_tokens_equal_the_reference_and_max_tokens_is_the_cores(core, reference):
  core.add_request(request("a", reference["prompt_ids"], max_tokens=30))
  outs = run(core)[("a", 0)]
  assert tokens(outs) == reference["greedy_ids"][:30]
  assert [o.finish_reason for o in outs] == [None] * 29 + ["length"]
  assert outs[-1].first_scheduled_time <= outs[0].first_token_time <= outs[-1].last_token_time <= outs[-1].finished_time
  assert_idle(core)


def test_eos_and_stop_token_ids_end_a_sample_in_the_core(core, reference):
  greedy = reference["greedy_ids"]
  core.add_request(request("eos", reference["prompt_ids"], eos=(greedy[5],), max_tokens=50))
  core.add_request(request("ignored", reference["prompt_ids"], eos=(greedy[5],), max_tokens=12, ignore_eos=True))
  core.add_request(request("stop-id", reference["prompt_ids"], max_tokens=50, stop_token_ids=[greedy[8]]))
  got = run(core)
  first = lambda token: greedy.index(token) + 1
  assert tokens(got["eos", 0]) == greedy[:first(greedy[5])] and got["eos", 0][-1].finish_reason == "stop"
  assert got["eos", 0][-1].stop_reason is None   # EOS: no stop reason, as vLLM's
  assert tokens(got["ignored", 0]) == greedy[:12] and got["ignored", 0][-1].finish_reason == "length"
  assert tokens(got["stop-id", 0]) == greedy[:first(greedy[8])]
  assert (got["stop-id", 0][-1].finish_reason, got["stop-id", 0][-1].stop_reason) == ("stop", greedy[8])
  assert_idle(core)


def test_a_stopped_sample_and_an_aborted_request_free_their_blocks(core, reference):
  core.add_request(request("pair", reference["prompt_ids"], n=2, max_tokens=40))
  core.add_request(request("gone", reference["prompt_ids"], max_tokens=40))
  used = []

  def intervene(step: int, outputs) -> None:
    if step != 5: return
    used.append(core.stats().kv_cache_blocks_used)
    core.stop_samples([SampleRef("pair", 1)])
    core.abort_requests(["gone"])
    used.append(core.stats().kv_cache_blocks_used)
  got = run(core, intervene)
  assert tokens(got["pair", 0]) == reference["greedy_ids"][:40]
  assert 3 <= len(got["pair", 1]) <= 7 and all(o.finish_reason is None for o in got["pair", 1])
  assert len(got["gone", 0]) <= 7 and "gone" not in core.requests
  assert used[0] > used[1] > 0   # the stopped sample's own blocks and the aborted request's went back at once
  assert_idle(core)


def test_stats_count_requests_blocks_and_the_prefix_cache(core, reference):
  before = core.stats()
  core.add_request(request("s1", reference["prompt_ids"], max_tokens=3))
  first = core.step().scheduler_stats
  assert (first.num_running_reqs, first.num_waiting_reqs) == (1, 0) and first.kv_cache_blocks_used > 0
  assert first.step_prompt_tokens == len(reference["prompt_ids"]) and first.step_generation_tokens == 1
  assert first.kv_cache_blocks_total == 64 and first.prefix_caching
  run(core)
  assert core.stats().prefix_cache_queries - before.prefix_cache_queries == len(reference["prompt_ids"])
  assert_idle(core)


@pytest.mark.slow   # the prompt-logprob steps run eagerly, compiled on first use
def test_outputs_cross_the_channel_unchanged(core, reference):
  pytest.importorskip("msgspec")
  from tinyvllm.engine.serialization import decode_output, encode
  params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=6, logprobs=2, prompt_logprobs=1)
  core.add_request(EngineCoreRequest("lp", reference["prompt_ids"] + reference["greedy_ids"][:19], params, [], time.time()))
  steps = []
  while core.has_unfinished_requests(): steps.append(core.step())
  assert any(o.new_logprobs for s in steps for o in s.outputs) and any(o.prompt_logprobs for s in steps for o in s.outputs)
  for outputs in steps: assert decode_output(encode(OutputType.OUTPUTS, outputs)) == (OutputType.OUTPUTS, outputs)
  assert_idle(core)


def test_a_stop_string_stops_the_cores_sample_and_later_tokens_are_dropped(stories_dir, reference):
  tokenizer = load_tokenizer(stories_dir)
  greedy, prompt = reference["greedy_ids"], reference["prompt_ids"]
  text = tokenizer.decode(greedy[:20])
  stop = text[len(tokenizer.decode(greedy[:9])):][:4]   # begins in token 10's text
  processor = OutputProcessor(tokenizer)
  processor.add_request(request("r", prompt, stop=[stop], max_tokens=50), None)
  out = lambda i, **kw: EngineCoreOutput("r", 0, [greedy[i]], **kw)
  results = [processor.process_outputs([out(i)]) for i in range(20)]
  stopped_at = next(i for i, r in enumerate(results) if r.samples_to_stop)
  assert results[stopped_at].samples_to_stop == [SampleRef("r", 0)]
  final = results[stopped_at].request_outputs[0]
  assert final.finished and final.outputs[0].text == text[:text.index(stop)] and final.outputs[0].stop_reason == stop
  assert final.outputs[0].token_ids == greedy[:stopped_at + 1]
  assert all(not r.request_outputs and not r.samples_to_stop for r in results[stopped_at + 1:]) and not processor.states
  # a finish the core decided needs no stop back
  processor.add_request(request("c", prompt, max_tokens=2), None)
  processor.process_outputs([EngineCoreOutput("c", 0, [greedy[0]])])
  last = processor.process_outputs([EngineCoreOutput("c", 0, [greedy[1]], finish_reason="length")])
  assert not last.samples_to_stop and last.request_outputs[0].outputs[0].finish_reason == "length"
