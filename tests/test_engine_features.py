"""Copy-on-write samples, admission, aborts, the asyncio front and the capture modes, on stories260K."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.conftest import assert_all_free
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.engine.async_engine import AsyncLLMEngine
from tinyvllm.engine.llm_engine import PromptError

PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267]  # 20 tokens


@pytest.fixture(scope="module")
def llm(stories_dir):
  return LLM(str(stories_dir), max_num_seqs=16, num_gpu_blocks=64)


@pytest.mark.slow
def test_n_samples_share_prompt_blocks(llm):
  engine = llm.engine
  engine.add_request("cow", PROMPT, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8))
  engine.step()  # prefill, then the three other samples fork off the first
  seqs = engine.requests["cow"].seqs
  tables = [engine.allocator.block_table(s) for s in seqs]
  assert all(t == tables[0] for t in tables) and len(tables[0]) == 2     # 20 tokens: one full block + one partial
  assert [engine.allocator.blocks[b].ref_count for b in tables[0]] == [4, 4]
  engine.step()  # each sample writes its first token into the shared partial block: copy-on-write
  tables = [engine.allocator.block_table(s) for s in seqs]
  assert len({t[0] for t in tables}) == 1 and engine.allocator.blocks[tables[0][0]].ref_count == 4
  assert len({t[1] for t in tables}) == 4 and all(engine.allocator.blocks[t[1]].ref_count == 1 for t in tables)
  while engine.has_unfinished_requests(): engine.step()
  assert_all_free(llm)


def test_greedy_n4_is_four_copies(llm, reference):
  out = llm.generate([reference["prompt_ids"]], SamplingParams(n=4, temperature=0, max_tokens=40), use_tqdm=False)[0]
  assert [o.index for o in out.outputs] == [0, 1, 2, 3]
  assert all(o.token_ids == reference["greedy_ids"][:40] for o in out.outputs)
  assert_all_free(llm)


def test_seeded_samples_differ_and_reproduce(llm):
  params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=30)
  first = [o.token_ids for o in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]
  again = [o.token_ids for o in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]
  assert first == again
  assert len({tuple(t) for t in first}) == 4
  assert_all_free(llm)


def test_request_larger_than_cache_is_refused_and_others_finish(stories_dir, reference):
  small = LLM(str(stories_dir), num_gpu_blocks=16)
  engine = small.engine
  for i in range(3): engine.add_request(f"ok{i}", reference["prompt_ids"], SamplingParams(temperature=0, max_tokens=30))
  engine.step()
  with pytest.raises(PromptError, match=r"request needs 21 KV cache blocks \(300 prompt \+ 20 new tokens, n=1\) but the "
                                        r"whole cache holds 16"):
    engine.add_request("huge", [1] * 300, SamplingParams(max_tokens=20))
  finals = {}
  while engine.has_unfinished_requests():
    for out in engine.step(): finals[out.request_id] = out
  assert sorted(finals) == ["ok0", "ok1", "ok2"]
  assert all(o.outputs[0].token_ids == reference["greedy_ids"][:30] for o in finals.values())
  assert_all_free(small)


@pytest.mark.slow
def test_load_larger_than_cache_all_finishes(llm, reference):
  # 16 requests of 20 + 100 tokens need 8 blocks each: twice the 64-block cache
  outs = llm.generate([reference["prompt_ids"]] * 16, SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)
  assert all(o.outputs[0].token_ids == reference["greedy_ids"][:100] for o in outs)
  assert llm.engine.scheduler.num_preemptions > 0
  assert_all_free(llm)


def test_abort_mid_flight_frees_blocks(llm):
  engine = llm.engine
  for i in range(5): engine.add_request(f"a{i}", PROMPT, SamplingParams(temperature=0, max_tokens=50))
  for _ in range(4): engine.step()
  assert engine.allocator.num_used_blocks > 0
  for i in range(5): engine.abort_request(f"a{i}")
  assert_all_free(llm)
  engine.add_request("w", PROMPT, SamplingParams(max_tokens=5))
  engine.abort_request("w")  # aborted while still waiting
  assert_all_free(llm)


def test_async_streams_and_abort(llm, reference):
  async def main():
    engine = AsyncLLMEngine(llm.engine)

    async def collect(prompt, params):
      text, last = "", None
      async for out in engine.generate(prompt, params):
        text, last = text + out.outputs[0].delta_text, out
      return text, last

    greedy = SamplingParams(temperature=0, max_tokens=60)
    results = await asyncio.gather(*(collect(reference["prompt_ids"], greedy) for _ in range(6)))
    for text, last in results:
      assert last.finished and text == last.outputs[0].text
      assert last.outputs[0].token_ids == reference["greedy_ids"][:60]
    stream = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=200))
    await stream.__anext__()
    await stream.aclose()  # the consumer goes away: the request is aborted
    deadline = time.monotonic() + 60   # a loaded machine may take a while to run the abort's step
    while (llm.engine.requests or llm.engine.allocator.num_used_blocks) and time.monotonic() < deadline:
      await asyncio.sleep(0.01)
    with pytest.raises(PromptError): await engine.generate([], SamplingParams()).__anext__()
    await engine.shutdown()
  asyncio.run(main())
  assert_all_free(llm)


def test_cudagraph_mode_and_enforce_eager_are_config_fields():
  assert EngineConfig("m").cudagraph_mode == "FULL"
  assert EngineConfig("m", cudagraph_mode="full_decode_only").cudagraph_mode == "FULL_DECODE_ONLY"
  assert EngineConfig("m", enforce_eager=True).cudagraph_mode == "NONE"
  with pytest.raises(ConfigError, match="cudagraph_mode must be one of"): EngineConfig("m", cudagraph_mode="PIECEWISE")


@pytest.mark.slow
def test_enforce_eager_captures_nothing_and_changes_no_token(stories_dir):
  reference = json.loads((stories_dir / "reference_greedy.json").read_text())
  llm = LLM(str(stories_dir), enforce_eager=True, max_model_len=256)
  out = llm.generate([reference["prompt_ids"]], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
  assert out.outputs[0].token_ids == reference["greedy_ids"][:20] and llm.engine.runner.num_captures == 0
