"""The HTTP `priority` field (vLLM's) on a server started with --scheduling-policy priority: each request's priority
reaches the core, and greedy results under preemption by priority stay those of lone runs."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server_process import ServerProcess
from tinyvllm import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day, a big bird"]
MAX_TOKENS = 40

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
  # the four prompts grown by MAX_TOKENS need 3, 3, 4 and 4 blocks of 16 tokens: a cache of 8 cannot hold the four
  # running at once, so running requests are preempted whatever order the requests arrive in
  with ServerProcess(stories_dir, tmp_path_factory.mktemp("priority") / "server.log", "--served-model-name", "stories",
                     "--scheduling-policy", "priority", "--num-gpu-blocks", "8", "--max-num-seqs", "4") as s:
    yield s


@pytest.fixture(scope="module")
def lone(stories_dir) -> list[str]:
  llm = LLM(str(stories_dir), seed=0)
  params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
  return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in PROMPTS]


async def _complete_all(url: str, priorities: list[int]) -> list[dict]:
  async with httpx.AsyncClient(base_url=url, timeout=120) as client:
    async def one(prompt: str, priority: int) -> dict:
      body = {"model": "stories", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
              "priority": priority}
      r = await client.post("/v1/completions", json=body)
      assert r.status_code == 200, r.text
      return r.json()
    return await asyncio.gather(*[one(p, prio) for p, prio in zip(PROMPTS * 3, priorities, strict=True)])


def test_priorities_keep_greedy_results_equal_to_lone_runs(server, lone):
  priorities = [5, 5, 5, 5, 0, 0, 0, 0, 9, 1, 3, 2]
  results = asyncio.run(_complete_all(server.url, priorities))
  assert [r["choices"][0]["text"] for r in results] == lone * 3
  metrics = httpx.get(f"{server.url}/metrics").text
  preemptions = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("tinyvllm:num_preemptions"))
  assert preemptions > 0, "the cache was meant to be too small for every request at once"


def test_a_priority_must_be_an_integer(server):
  r = httpx.post(f"{server.url}/v1/completions", json={"model": "stories", "prompt": "Hi", "max_tokens": 2, "priority": 1.5})
  assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
