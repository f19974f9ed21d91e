"""A server started with --speculative-config (n-gram proposals): streamed completions carry the accepted tokens of a
step together and add up to the offline greedy text, and /metrics counts proposals and acceptances."""
from __future__ import annotations

import httpx
import pytest

from tests.server_process import ServerProcess, StreamReader
from tinyvllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PROMPT = "Once upon a time, there was a little girl named Lily. She liked to play. Once upon a time, there was"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
  with ServerProcess(stories_dir, tmp_path_factory.mktemp("spec") / "server.log", "--served-model-name", "stories",
                     "--speculative-config", SPEC) as s:
    yield s


def test_streams_carry_accepted_tokens_together_and_equal_offline_greedy(server, stories_dir):
  offline = LLM(str(stories_dir), seed=0).generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                                   use_tqdm=False)[0].outputs[0]
  body = {"model": "stories", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "logprobs": 1}
  reader = StreamReader(f"{server.url}/v1/completions", body)
  reader.start()
  reader.join(120)
  assert reader.error is None
  chunks = [c for c in reader.chunks() if c["choices"]]
  assert "".join(c["choices"][0]["text"] for c in chunks) == offline.text
  tokens_per_chunk = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"][0].get("logprobs")]
  assert sum(tokens_per_chunk) == len(offline.token_ids) and max(tokens_per_chunk) > 1
  metrics = {line.split()[0]: float(line.split()[-1]) for line in httpx.get(f"{server.url}/metrics").text.splitlines()
             if line.startswith("tinyvllm:spec_decode")}
  assert metrics["tinyvllm:spec_decode_num_accepted_tokens_total"] > 0
  assert metrics["tinyvllm:spec_decode_num_draft_tokens_total"] >= metrics["tinyvllm:spec_decode_num_accepted_tokens_total"]
  assert 1 < metrics["tinyvllm:spec_decode_mean_acceptance_length"] <= 5
