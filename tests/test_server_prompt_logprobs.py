"""prompt_logprobs through the server, in vLLM's shape (per prompt token null or {token id: {logprob, rank,
decoded_token}}), equal to HF transformers' log_softmax of stories260K's logits: on each completion choice, with echo
in the legacy logprobs (streamed too), and on the chat response."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from openai import OpenAI

from tests.server_process import ServerProcess, model_with_chat_template

pytestmark = pytest.mark.slow   # a server and eager prompt steps that compile on first use
MODEL = "stories"
PROMPTS = ["Once upon a time, there was a little girl named Lily", "The cat sat on the mat"]
TOL = 1e-4


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory, data_parallel_size):
  model = model_with_chat_template(stories_dir, tmp_path_factory.mktemp("model") / "stories-chat")
  with ServerProcess(model, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", MODEL, "--num-gpu-blocks", "128",
                     "--data-parallel-size", str(data_parallel_size)) as s:
    yield s


@pytest.fixture(scope="module")
def http(server):
  with httpx.Client(base_url=server.url, timeout=120) as c: yield c


def token_ids(http, **body) -> list[int]: return http.post("/tokenize", json=body).json()["tokens"]


def assert_vllm_shape_matches_hf(prompt_logprobs: list, ids: list[int], ref: np.ndarray, k: int) -> None:
  assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
  for i in range(1, len(ids)):
    entries, row = {int(t): e for t, e in prompt_logprobs[i].items()}, ref[i - 1]
    assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in entries.values())
    own = entries[ids[i]]
    assert abs(own["logprob"] - row[ids[i]]) < TOL and own["rank"] == int((row > row[ids[i]]).sum()) + 1, (i, own)
    top = [t for t, e in sorted(entries.items(), key=lambda kv: kv[1]["rank"]) if e["rank"] <= k]
    assert top == np.argsort(-row, kind="stable")[:k].tolist() and set(entries) == {*top, ids[i]}


def test_completion_choices_carry_prompt_logprobs(http, stories_log_softmax):
  r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS, "n": 2, "max_tokens": 4, "temperature": 0,
                                         "prompt_logprobs": 3})
  assert r.status_code == 200, r.text
  choices = r.json()["choices"]
  assert [c["index"] for c in choices] == [0, 1, 2, 3]
  for c in choices:
    ids = token_ids(http, prompt=PROMPTS[c["index"] // 2])
    assert_vllm_shape_matches_hf(c["prompt_logprobs"], ids, stories_log_softmax(ids), 3)
  plain = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}).json()
  assert plain["choices"][0]["prompt_logprobs"] is None and plain["choices"][0]["text"] == choices[0]["text"]


def test_echo_with_logprobs_covers_the_prompt(http, stories_log_softmax):
  body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 2}
  choice = http.post("/v1/completions", json=body).json()["choices"][0]
  ids = token_ids(http, prompt=PROMPTS[1])
  ref = stories_log_softmax(ids)
  lps = choice["logprobs"]
  assert choice["text"].startswith(PROMPTS[1]) and len(lps["tokens"]) == len(ids) + 5
  assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
  for i in range(1, len(ids)):
    assert abs(lps["token_logprobs"][i] - ref[i - 1][ids[i]]) < TOL
    assert len(lps["top_logprobs"][i]) in (2, 3)   # the top 2 and the prompt token
  assert_vllm_shape_matches_hf(choice["prompt_logprobs"], ids, ref, 2)   # vLLM: echo's logprobs are the prompt logprobs
  streamed = []
  with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
    for line in r.iter_lines():
      if line.startswith("data: {"): streamed.append(json.loads(line[6:])["choices"][0])
  assert "".join(c["text"] for c in streamed) == choice["text"]
  joined = {key: [x for c in streamed for x in c["logprobs"][key]] for key in ("tokens", "token_logprobs", "text_offset")}
  assert joined == {key: lps[key] for key in joined}


def test_chat_response_carries_prompt_logprobs(http, stories_log_softmax):
  messages = [{"role": "user", "content": "Tell me a story"}]
  r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 3, "prompt_logprobs": 1})
  assert r.status_code == 200, r.text
  ids = token_ids(http, messages=messages)
  assert_vllm_shape_matches_hf(r.json()["prompt_logprobs"], ids, stories_log_softmax(ids), 1)


def test_the_official_client_reads_them(server, http, stories_log_softmax):
  client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
  r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, extra_body={"prompt_logprobs": 0})
  ids = token_ids(http, prompt=PROMPTS[0])
  assert_vllm_shape_matches_hf(r.choices[0].prompt_logprobs, ids, stories_log_softmax(ids), 0)
