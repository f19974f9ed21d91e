"""The OpenAI server (a real `main.py serve` process) against the official client,
checked against the offline LLM on the same model (beam search and best_of too); 64 concurrent streams; /metrics.
Every test of the server runs against one engine and against two data-parallel replicas behind the endpoint."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from tests.server_process import ServerProcess, model_with_chat_template
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import EngineConfig
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.entrypoints.api_server import create_app
from tinyvllm.entrypoints.common import ServerState
from tinyvllm.sampling_params import BeamSearchParams

MODEL = "stories"
PROMPT = "Once upon a time"
SUBJECTS = ["Lily", "Tom", "The cat", "A dog", "The king", "Sue", "Ben", "The bird"]
ACTIONS = ["went to the park", "saw a ball", "was sad", "liked to play", "found a box", "ran home", "had a toy", "ate cake"]


@pytest.fixture(scope="module")
def model_dir(stories_dir, tmp_path_factory):
  return model_with_chat_template(stories_dir, tmp_path_factory.mktemp("model") / "stories-chat")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, data_parallel_size):
  with ServerProcess(model_dir, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", MODEL,
                     "--num-gpu-blocks", "256", "--data-parallel-size", str(data_parallel_size)) as s:
    yield s


@pytest.fixture(scope="module")
def llm(model_dir): return LLM(str(model_dir), num_gpu_blocks=256, seed=0)


@pytest.fixture(scope="module")
def tokenizer(llm): return llm.engine.tokenizer


@pytest.fixture(scope="module")
def client(server): return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(llm, prompt, **kw):
  return llm.generate([prompt], SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


def scrape(server) -> dict[str, float]:
  """Every sample on /metrics, keyed name{label=value,...}."""
  text = httpx.get(f"{server.url}/metrics").text
  return {s.name + json.dumps(s.labels, sort_keys=True) * bool(s.labels): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def test_health_and_models(server, client):
  assert httpx.get(f"{server.url}/health").status_code == 200
  assert [m.id for m in client.models.list().data] == [MODEL]
  card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
  assert card["object"] == "model" and card["max_model_len"] == 512 and card["vocab_size"] == 512


@pytest.mark.slow
def test_greedy_completion_equals_offline_llm(client, llm):
  for prompt, max_tokens in ((PROMPT, 24), ("The cat sat", 16)):
    expected = greedy(llm, prompt, max_tokens=max_tokens)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == expected.finish_reason
    n_prompt = len(llm.get_tokenizer().encode(prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
      (n_prompt, len(expected.token_ids), n_prompt + len(expected.token_ids))
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [expected.finish_reason]
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason and all(c.usage is None for c in chunks)
  default = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0)   # max_tokens defaults to 16
  assert default.usage.completion_tokens == 16 and default.choices[0].text == greedy(llm, PROMPT, max_tokens=16).text


@pytest.mark.slow
def test_prompt_lists_token_ids_n_and_echo(client, llm, tokenizer):
  other = "The cat sat"
  first, second = greedy(llm, PROMPT, max_tokens=10), greedy(llm, other, max_tokens=10)
  r = client.completions.create(model=MODEL, prompt=[PROMPT, other], n=2, temperature=0, max_tokens=10)
  assert [c.index for c in r.choices] == [0, 1, 2, 3]
  assert [c.text for c in r.choices] == [first.text, first.text, second.text, second.text]
  ids, other_ids = tokenizer.encode(PROMPT), tokenizer.encode(other)
  assert r.usage.prompt_tokens == len(ids) + len(other_ids)
  assert r.usage.completion_tokens == 2 * (len(first.token_ids) + len(second.token_ids))
  by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=10)
  assert by_ids.choices[0].text == first.text and by_ids.usage.prompt_tokens == len(ids)
  batch = client.completions.create(model=MODEL, prompt=[ids, other_ids], temperature=0, max_tokens=10)
  assert [c.text for c in batch.choices] == [first.text, second.text]
  echo = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, temperature=0, max_tokens=10)
  assert echo.choices[0].text == PROMPT + first.text


@pytest.mark.slow
def test_seeded_sampling_n2_streaming_and_usage(client):
  kw = dict(model=MODEL, prompt=PROMPT, n=2, temperature=1.0, seed=123, max_tokens=20)
  a, b = client.completions.create(**kw), client.completions.create(**kw)
  texts = [c.text for c in a.choices]
  assert texts == [c.text for c in b.choices] and texts[0] != texts[1]
  assert [c.text for c in client.completions.create(**{**kw, "seed": 124}).choices] != texts
  chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
  streamed, finishes = {0: "", 1: ""}, {0: [], 1: []}
  for c in chunks[:-1]:
    assert c.usage is None and len(c.choices) == 1
    streamed[c.choices[0].index] += c.choices[0].text
    if c.choices[0].finish_reason: finishes[c.choices[0].index].append(c.choices[0].finish_reason)
  assert [streamed[0], streamed[1]] == texts
  assert finishes == {i: [a.choices[i].finish_reason] for i in (0, 1)}
  assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == a.usage.model_dump()


def _span_stop(tokenizer, text: str, token_ids: list[int], k: int) -> tuple[str, int]:
  """A stop string made of the last 2 characters of generated token k-1 and the first 2 of token k, and where it starts."""
  boundary = len(b"".join(tokenizer.token_bytes(t) for t in token_ids[:k]).decode())
  stop = text[boundary - 2:boundary + 2]
  assert len(stop) == 4 and text.find(stop) == boundary - 2
  return stop, boundary - 2


def test_stop_strings_and_stop_tokens(server, client, llm, tokenizer):
  full = greedy(llm, PROMPT, max_tokens=40)
  stop, at = _span_stop(tokenizer, full.text, full.token_ids, 7)
  r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "zzz"])
  assert r.choices[0].text == full.text[:at] and r.choices[0].finish_reason == "stop"
  chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True))
  assert "".join(c.choices[0].text for c in chunks) == full.text[:at]   # nothing of the stop string was streamed early
  assert chunks[-1].choices[0].finish_reason == "stop"
  raw = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                                          "stop": stop, "include_stop_str_in_output": True}).json()
  assert raw["choices"][0]["text"] == full.text[:at + len(stop)] and raw["choices"][0]["stop_reason"] == stop
  stop_id = full.token_ids[4]
  r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"stop_token_ids": [stop_id]})
  assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == full.token_ids.index(stop_id) + 1
  assert r.choices[0].text == greedy(llm, PROMPT, max_tokens=full.token_ids.index(stop_id)).text


def test_completion_logprobs(client):
  r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
  lp, text = r.choices[0].logprobs, r.choices[0].text
  assert len(lp.tokens) == 8 and "".join(lp.tokens) == text
  assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
  for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
    assert len(top) == 3 and token in top and logprob <= 0
    assert top[token] == pytest.approx(max(top.values()), abs=1e-5) == pytest.approx(logprob, abs=1e-5)   # greedy: rank 1
  chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True))
  assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
  assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
  assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)


@pytest.mark.slow
def test_chat_completions(server, client, llm):
  messages = [{"role": "user", "content": "Tell me a story."}]
  expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
  r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
  assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
  assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected.outputs[0].text
  assert r.choices[0].finish_reason == expected.outputs[0].finish_reason and r.choices[0].logprobs is None
  assert r.usage.prompt_tokens == len(expected.prompt_token_ids) and r.usage.completion_tokens == len(expected.outputs[0].token_ids)
  counted = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}).json()
  assert counted["tokens"] == expected.prompt_token_ids and counted["count"] == r.usage.prompt_tokens
  chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20, stream=True,
                                               stream_options={"include_usage": True}))
  assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
  assert chunks[0].choices[0].delta.content == ""
  assert "".join(c.choices[0].delta.content or "" for c in chunks[1:-1]) == expected.outputs[0].text
  final = chunks[-2].choices[0]
  assert final.finish_reason == expected.outputs[0].finish_reason and final.delta.content is None and final.delta.role is None
  assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
  assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
  short = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=5)
  assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"
  assert short.choices[0].message.content == llm.chat(messages, SamplingParams(temperature=0, max_tokens=5),
                                                      use_tqdm=False)[0].outputs[0].text
  two = client.chat.completions.create(model=MODEL, messages=messages, n=2, temperature=1.0, seed=7, max_tokens=12)
  assert [c.index for c in two.choices] == [0, 1] and two.choices[0].message.content != two.choices[1].message.content


@pytest.mark.slow
def test_chat_template_kwargs_reach_the_template(server, client, llm, tokenizer):
  messages = [{"role": "user", "content": "Tell me a story."}]
  plain = tokenizer.apply_chat_template(messages)
  no_think = tokenizer.apply_chat_template(messages, enable_thinking=False)
  assert no_think == plain + " Once"
  counted = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
  assert counted.json()["tokens"] == tokenizer.encode(no_think, add_special_tokens=False)
  r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
  expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False,
                      chat_template_kwargs={"enable_thinking": False})[0]
  assert r.usage.prompt_tokens == counted.json()["count"] and r.choices[0].message.content == expected.outputs[0].text


@pytest.mark.slow
def test_chat_logprobs(client):
  messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "A story about a cat."}]
  r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
  content = r.choices[0].logprobs.content
  assert len(content) == 6 and "".join(c.token for c in content) == r.choices[0].message.content
  for c in content:
    assert c.bytes == list(c.token.encode()) and c.logprob <= 0 and len(c.top_logprobs) == 3
    assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)
    assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
  chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6, logprobs=True,
                                               top_logprobs=3, stream=True))
  assert [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content] == [c.token for c in content]


def test_tokenize_and_detokenize(server, tokenizer):
  r = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
  assert r == {"count": 5, "max_model_len": 512, "tokens": tokenizer.encode(PROMPT)}
  bare = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
  assert bare["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False) == r["tokens"][1:]
  assert httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": PROMPT}


def _stream_text(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int):
  async def run() -> tuple[str, list[str]]:
    text, reasons = [], []
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=payload) as r:
      assert r.status_code == 200
      async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]": continue
        for choice in json.loads(line[6:])["choices"]:
          text.append(choice["text"])
          if choice["finish_reason"]: reasons.append(choice["finish_reason"])
    return "".join(text), reasons
  return run()


@pytest.mark.slow
def test_64_concurrent_streams_get_their_own_text_and_free_every_block(server, llm, data_parallel_size):
  prompts = [f"{s} {a}" for s in SUBJECTS for a in ACTIONS]
  assert len(set(prompts)) == 64
  alone = [greedy(llm, p, max_tokens=12) for p in prompts]   # each prompt by itself
  before = scrape(server)

  async def main():
    async with httpx.AsyncClient(timeout=300) as c:
      return await asyncio.gather(*(_stream_text(c, server.url, p, 12) for p in prompts))
  results = asyncio.run(main())
  assert [text for text, _ in results] == [o.text for o in alone]
  assert [reasons for _, reasons in results] == [[o.finish_reason] for o in alone]
  after = scrape(server)
  assert after["tinyvllm:kv_cache_blocks_used"] == 0 and after["tinyvllm:kv_cache_usage_perc"] == 0
  assert after["tinyvllm:kv_cache_blocks_total"] == 256 * data_parallel_size   # (the replicas' caches summed)
  assert after["tinyvllm:num_requests_running"] == 0 and after["tinyvllm:num_requests_waiting"] == 0
  finished = sum(after[k] - before.get(k, 0) for k in after if k.startswith("tinyvllm:request_success_total"))
  assert finished == 64
  generated = after["tinyvllm:generation_tokens_total"] - before["tinyvllm:generation_tokens_total"]
  assert generated == sum(len(o.token_ids) for o in alone)


def test_metrics_parse_and_move(server, client, tokenizer):
  families = {f.name: f.type for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
  assert families["tinyvllm:prompt_tokens"] == families["tinyvllm:generation_tokens"] == "counter"
  assert families["tinyvllm:time_to_first_token_seconds"] == families["tinyvllm:e2e_request_latency_seconds"] == "histogram"
  assert families["tinyvllm:time_per_output_token_seconds"] == "histogram" and families["tinyvllm:num_preemptions"] == "counter"
  assert families["tinyvllm:kv_cache_usage_perc"] == families["tinyvllm:num_requests_running"] == "gauge"
  assert families["tinyvllm:prefix_cache_hit_rate"] == "gauge"
  long_prompt = PROMPT + ", there was a little girl named Lily. She loved to play outside in the park."
  n_prompt = len(tokenizer.encode(long_prompt))
  assert n_prompt > 16   # a full block: the second request finds it in the prefix cache
  client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=7, temperature=0)
  before = scrape(server)
  client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=7, temperature=0)
  after = scrape(server)
  delta = lambda name: after.get(name, 0) - before.get(name, 0)
  assert delta("tinyvllm:prompt_tokens_total") == n_prompt and delta("tinyvllm:generation_tokens_total") == 7
  assert delta('tinyvllm:request_success_total{"finished_reason": "length"}') == 1
  assert delta("tinyvllm:time_to_first_token_seconds_count") == 1 and delta("tinyvllm:e2e_request_latency_seconds_count") == 1
  assert delta("tinyvllm:time_per_output_token_seconds_count") == 6
  assert delta("tinyvllm:prefix_cache_queries_total") == n_prompt and delta("tinyvllm:prefix_cache_hits_total") == 16
  assert 0 < after["tinyvllm:prefix_cache_hit_rate"] <= 1 and after["tinyvllm:kv_cache_blocks_used"] == 0


def test_health_is_503_until_the_engine_has_loaded(stories_dir):
  gate = threading.Event()

  async def start() -> AsyncLLM:
    await asyncio.to_thread(gate.wait, 60)
    return await AsyncLLM.from_config(EngineConfig(model=str(stories_dir), num_gpu_blocks=16))
  with TestClient(create_app(ServerState(MODEL, str(stories_dir)), start)) as c:
    r = c.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    assert c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT}).status_code == 503
    assert c.get("/v1/models").json()["data"][0]["id"] == MODEL
    gate.set()
    deadline = time.monotonic() + 60
    while c.get("/health").status_code != 200 and time.monotonic() < deadline: time.sleep(0.05)
    assert c.get("/health").json() == {"status": "ok"}
    assert c.post("/tokenize", json={"prompt": PROMPT}).json()["count"] == 5


# two 42-token prompts: over 7 steps each of the 6 beams computes 11 to 16 tokens past its prompt's 32 cached ones, 66 to
# 96 a step (one step layout on the CPU, so few captures)
BEAM_PROMPTS = ["Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big ball.",
                "The cat sat on the mat. The dog ran to the park and saw a big red ball. He was very happy and wanted to play with it."]


@pytest.mark.slow
def test_beam_search_completion_equals_offline_beam_search(client, llm, tokenizer):
  offline = llm.beam_search(BEAM_PROMPTS, BeamSearchParams(beam_width=3, max_tokens=7, length_penalty=0.8))
  r = client.completions.create(model=MODEL, prompt=BEAM_PROMPTS, n=3, max_tokens=7, temperature=0,
                                extra_body={"use_beam_search": True, "length_penalty": 0.8, "return_token_ids": True})
  assert [c.index for c in r.choices] == list(range(6))
  for i, out in enumerate(offline):
    n_prompt = len(tokenizer.encode(BEAM_PROMPTS[i]))
    for rank, seq in enumerate(out.sequences):
      choice = r.choices[3 * i + rank]
      assert choice.text == seq.text and choice.finish_reason == seq.finish_reason and choice.token_ids == seq.tokens[n_prompt:]
  assert len({c.text for c in r.choices[:3]}) == 3
  assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
  echo = client.completions.create(model=MODEL, prompt=BEAM_PROMPTS, n=3, max_tokens=7, temperature=0, echo=True,
                                   extra_body={"use_beam_search": True, "length_penalty": 0.8})
  assert [c.text for c in echo.choices] == [prompt + s.text for prompt, out in zip(BEAM_PROMPTS, offline, strict=True)
                                            for s in out.sequences]


@pytest.mark.slow
def test_beam_search_chat_equals_offline_beam_search_of_the_rendered_messages(client, llm, tokenizer):
  """use_beam_search on the chat endpoint (vLLM's): the n choices are the beams of the chat-rendered prompt, best first,
  each as a message; max_completion_tokens bounds them."""
  messages = [{"role": "user", "content": "Tell me a story about a cat and a dog who play with a big red ball."}]
  rendered = tokenizer.apply_chat_template(messages)
  offline = llm.beam_search([{"prompt_token_ids": tokenizer.encode(rendered, add_special_tokens=False)}],
                            BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.8))[0]
  r = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_completion_tokens=6, temperature=0,
                                     extra_body={"use_beam_search": True, "length_penalty": 0.8})
  assert [c.index for c in r.choices] == [0, 1, 2]
  assert [(c.message.content, c.finish_reason) for c in r.choices] == [(s.text, s.finish_reason) for s in offline.sequences]
  assert len({c.message.content for c in r.choices}) == 3 and r.usage.completion_tokens > 0
  for fields, param in (({"stream": True}, "use_beam_search"), ({"top_p": 0.5}, "top_p"), ({"logprobs": True}, "logprobs"),
                        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools")):
    bad = httpx.post(f"{client.base_url}chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4, "n": 2,
                                                                 "use_beam_search": True, **fields})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
  plain = httpx.post(f"{client.base_url}chat/completions", json={"model": MODEL, "messages": messages, "length_penalty": 0.5})
  assert plain.status_code == 400 and plain.json()["error"]["param"] == "length_penalty"


@pytest.mark.slow
def test_best_of_returns_the_n_most_probable_samples(client, llm):
  kw = dict(n=2, temperature=1.0, seed=11, max_tokens=6)
  samples = llm.generate([PROMPT], SamplingParams(**{**kw, "n": 5}, logprobs=0), use_tqdm=False)[0].outputs
  best = sorted(samples, key=lambda o: o.cumulative_logprob, reverse=True)[:2]
  assert len({o.text for o in samples}) > 2 and best != samples[:2]   # the choice is not the first two samples
  r = client.completions.create(model=MODEL, prompt=PROMPT, best_of=5, **kw)
  assert [(c.index, c.text, c.logprobs) for c in r.choices] == [(0, best[0].text, None), (1, best[1].text, None)]
  assert r.usage.completion_tokens == sum(len(o.token_ids) for o in best)


BAD_BEAM_REQUESTS = [
  ({"use_beam_search": True, "n": 0}, "n"), ({"use_beam_search": True, "n": -2}, "n"), ({"use_beam_search": True, "n": 1.5}, "n"),
  ({"use_beam_search": True, "n": "2"}, "n"), ({"use_beam_search": True, "n": 11}, "n"),
  ({"use_beam_search": True, "n": 2, "stream": True}, "use_beam_search"), ({"use_beam_search": "yes"}, "use_beam_search"),
  ({"use_beam_search": True, "n": 2, "best_of": 3}, "best_of"), ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
  ({"use_beam_search": True, "logprobs": 1}, "logprobs"), ({"use_beam_search": True, "seed": 3}, "seed"),
  ({"use_beam_search": True, "stop": ["."]}, "stop"), ({"use_beam_search": True, "logit_bias": {"5": 10}}, "logit_bias"),
  ({"use_beam_search": True, "length_penalty": "long"}, "length_penalty"),
  ({"use_beam_search": True, "max_tokens": 600}, "prompt"), ({"length_penalty": 0.5}, "length_penalty"),
  ({"n": 2, "best_of": 1}, "best_of"), ({"best_of": 0}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"),
  ({"best_of": 129}, "best_of"),
]


@pytest.mark.parametrize("fields,param", BAD_BEAM_REQUESTS, ids=[f"{p}-{'+'.join(map(str, f.values()))}" for f, p in BAD_BEAM_REQUESTS])
def test_bad_beam_search_and_best_of_values_are_400s_naming_the_field(server, fields, param):
  r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields})
  assert r.status_code == 400, r.text
  assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error", r.json()
  ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}, timeout=120)
  assert ok.status_code == 200 and ok.json()["choices"][0]["text"]   # the server serves on
