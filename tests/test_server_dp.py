"""`serve --data-parallel-size 2` on the CPU (two engine-core processes behind one endpoint): the official client's
completions and chat, whole and streamed; concurrent streams each equal to the same prompt served alone, spread over
both replicas; a shared prefix sent back to the replica that cached it; a disconnect freeing the blocks on the replica
that held them; bad requests as 400s; a core killed mid-stream ending every client's request with an error and the
server with status 1; SIGTERM exiting 0 with both cores gone."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_process import ServerProcess, StreamReader, model_with_chat_template
from tests.test_core_process import children, running, wait_gone

MODEL = "stories"
PROMPTS = ["Once upon a time, there was a little girl named Lily. She liked to play",   # each over one 16-token block
           "The cat sat on the mat. It was a big, fat cat and it liked to sleep",
           "Tom had a red ball. He threw it to his dog and the dog ran after it",
           "The king was sad because his crown was lost. He looked under the bed"]
SHORT = {"model": MODEL, "max_tokens": 6, "temperature": 0}
LONG = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def scrape(server) -> dict[str, float]:
  """Every sample on /metrics, keyed name or name{"engine": "i"}."""
  text = httpx.get(f"{server.url}/metrics").text
  return {s.name + (json.dumps(s.labels) if s.labels else ""): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def per_engine(metrics: dict[str, float], name: str) -> list[float]:
  return [metrics.get(f'tinyvllm:{name}{{"engine": "{i}"}}', 0.0) for i in range(2)]


def core_pids(server) -> list[int]:
  found = re.findall(r"engine core process started \(pid (\d+)\) of data-parallel rank (\d)", server.log())
  assert sorted(rank for _, rank in found) == ["0", "1"], server.log()
  return [int(pid) for pid, _ in sorted(found, key=lambda f: f[1])]


def wait_until(check, timeout: float = 30) -> None:
  deadline = time.monotonic() + timeout
  while not check():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.05)


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
  model = model_with_chat_template(stories_dir, tmp_path_factory.mktemp("model") / "stories-chat")
  with ServerProcess(model, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", MODEL,
                     "--num-gpu-blocks", "64", "--data-parallel-size", "2") as s:
    yield s


@pytest.fixture(scope="module")
def http(server):
  # the module's first requests (each engine core's first steps) once took more than two minutes on CI's two cores while
  # the other test worker ran its own servers
  with httpx.Client(base_url=server.url, timeout=300) as c: yield c


@pytest.fixture(scope="module")
def client(server): return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def lone(http) -> dict[str, str]:
  """Each prompt's greedy text, served alone."""
  return {p: http.post("/v1/completions", json={**SHORT, "prompt": p}).json()["choices"][0]["text"] for p in PROMPTS}


@pytest.mark.slow
def test_both_replicas_serve_with_the_official_client(server, client, lone):
  assert httpx.get(f"{server.url}/health").status_code == 200 and "2 data-parallel replicas ready" in server.log()
  assert all(running(pid) for pid in core_pids(server))
  r = client.completions.create(prompt=PROMPTS[0], **SHORT)
  assert r.choices[0].text == lone[PROMPTS[0]] and r.usage.completion_tokens == 6
  streamed = list(client.completions.create(prompt=PROMPTS[1], stream=True, **SHORT))
  assert "".join(c.choices[0].text for c in streamed) == lone[PROMPTS[1]] and streamed[-1].choices[0].finish_reason == "length"
  chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **SHORT)
  assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
  chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], stream=True, **SHORT))
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content


@pytest.mark.slow
def test_concurrent_streams_equal_lone_runs_and_use_both_replicas(server, lone):
  before = scrape(server)

  async def stream(c: httpx.AsyncClient, prompt: str) -> str:
    text = []
    async with c.stream("POST", f"{server.url}/v1/completions", json={**SHORT, "prompt": prompt, "stream": True}) as r:
      assert r.status_code == 200
      async for line in r.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]": text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)

  async def main() -> list[str]:
    async with httpx.AsyncClient(timeout=120) as c: return await asyncio.gather(*(stream(c, p) for p in PROMPTS))
  assert asyncio.run(main()) == [lone[p] for p in PROMPTS]
  after = scrape(server)
  routed = [a - b for a, b in zip(per_engine(after, "dp_requests_routed_total"), per_engine(before, "dp_requests_routed_total"),
                                  strict=True)]
  assert sorted(routed) == [2, 2]   # each where it went alone (its prefix is cached there)
  assert after["tinyvllm:kv_cache_blocks_used"] == 0 and after["tinyvllm:num_requests_running"] == 0
  assert after["tinyvllm:kv_cache_blocks_total"] == 128   # summed over the replicas


@pytest.mark.slow
def test_a_shared_prefix_goes_back_to_the_replica_that_cached_it(server, http, lone):
  homes = []
  for prompt in PROMPTS[:2]:   # their first blocks went to different replicas (in turn)
    before = per_engine(scrape(server), "dp_requests_routed_total")
    hits = scrape(server)["tinyvllm:prefix_cache_hits_total"]
    assert http.post("/v1/completions", json={**SHORT, "prompt": prompt + " with her mom."}).status_code == 200
    after = scrape(server)
    homes.append([a - b for a, b in zip(per_engine(after, "dp_requests_routed_total"), before, strict=True)].index(1))
    assert after["tinyvllm:prefix_cache_hits_total"] >= hits + 16   # the block the replica had cached
  assert sorted(homes) == [0, 1]


@pytest.mark.slow
def test_a_disconnect_frees_the_blocks_on_the_owning_replica(server, http):
  aborted = scrape(server)["tinyvllm:request_aborted_total"]
  with http.stream("POST", "/v1/completions", json={**LONG, "prompt": "Lily went to the park", "stream": True}) as r:
    assert r.status_code == 200
    lines = r.iter_lines()   # kept: a dropped iterator closes the connection
    next(line for line in lines if line.startswith("data: "))
    used = per_engine(scrape(server), "dp_kv_cache_blocks_used")
    assert sorted(used)[0] == 0 and sorted(used)[1] > 0   # one replica holds the request
  owner = used.index(max(used))

  def freed() -> bool:
    m = scrape(server)
    return per_engine(m, "dp_kv_cache_blocks_used")[owner] == 0 and m["tinyvllm:request_aborted_total"] == aborted + 1
  wait_until(freed)


@pytest.mark.parametrize(("body", "param"), [
  ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
  ({"prompt": "hi " * 600}, "prompt"),
  ({"prompt": "hi", "temperature": "hot"}, "temperature"),
])
def test_bad_requests_are_400s_and_the_server_serves_on(http, body, param):
  r = http.post("/v1/completions", json={**SHORT, **body})
  assert r.status_code == 400 and r.json()["error"]["param"] == param
  assert http.post("/v1/completions", json={**SHORT, "prompt": "Hi"}).json()["usage"]["completion_tokens"] == 6


@pytest.mark.slow
def test_killing_one_core_mid_stream_errors_every_client_and_the_server_exits_1(server):
  """Last in the module: it ends the module's server."""
  readers = [StreamReader(f"{server.url}/v1/completions", {**LONG, "prompt": p, "stream": True}) for p in PROMPTS[:2]]
  whole: dict = {}
  waiting = threading.Thread(target=lambda: whole.update(r=httpx.post(f"{server.url}/v1/completions", timeout=120,
                                                                       json={**LONG, "prompt": PROMPTS[2]})))
  for r in readers: r.start()
  waiting.start()
  assert all(r.started.wait(120) for r in readers)
  while min(len(r.lines) for r in readers) < 2: time.sleep(0.01)
  survivor, victim = core_pids(server)
  os.kill(victim, signal.SIGKILL)
  assert server.proc.wait(60) == 1
  for r in readers: r.join(30)
  waiting.join(30)
  for r in readers:   # the stream on the surviving replica ends with the error too
    chunks = r.chunks()
    assert r.error is None and r.lines[-1] == "data: [DONE]" and "error" not in chunks[0]
    assert chunks[-1]["error"]["code"] == "service_unavailable"
    assert f"engine core process of data-parallel rank 1 (pid {victim}) was killed by signal 9" in chunks[-1]["error"]["message"]
  assert whole["r"].status_code == 503
  assert not wait_gone({survivor}), "the surviving core outlived the server"
  assert "Traceback" not in server.log()


@pytest.mark.slow
def test_sigterm_exits_0_and_leaves_no_core(stories_dir, tmp_path):
  with ServerProcess(stories_dir, tmp_path / "server.log", "--num-gpu-blocks", "16", "-dp", "2") as s:
    pids = core_pids(s)
    assert set(pids) <= children(s.proc.pid)
    assert s.stop(signal.SIGTERM) == 0
  assert not wait_gone(set(pids)), "an engine core outlived the server"
  assert "Application shutdown complete" in s.log() and "Traceback" not in s.log()
