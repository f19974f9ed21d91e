"""`serve --api-server-count 2` on the CPU (two API server processes in front of the engine cores, here two data-parallel
replicas): the official client's completions and chat, whole and streamed; 64 concurrent streams each equal to the
same prompt served alone, taken by both API servers; /metrics on either server counting every server's requests; a
disconnect freeing its blocks; bad requests as 400s; a core killed mid-stream ending every client's request (on both
servers) with an error and the whole server with status 1, nothing left running; SIGINT exiting 0, nothing left."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest

from tests.server_process import ServerProcess, StreamReader, model_with_chat_template
from tests.test_core_process import children, wait_gone
from tests.test_server_dp import PROMPTS, scrape, wait_until

MODEL = "stories"
SHORT = {"model": MODEL, "max_tokens": 6, "temperature": 0}
LONG = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def received(server) -> list[int]:
  """Requests each API server logged (--enable-log-requests)."""
  log = server.log()
  return [len(re.findall(rf"\[tinyvllm api server {i}\] Received request", log)) for i in range(2)]


def api_server_pids(server) -> list[int]:
  found = re.search(r"2 API server processes started \(pids (\d+), (\d+)\)", server.log())
  assert found, server.log()
  return [int(found.group(1)), int(found.group(2))]


def core_pids(server) -> list[int]:
  return [int(pid) for pid in re.findall(r"engine core process started \(pid (\d+)\)", server.log())]


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
  model = model_with_chat_template(stories_dir, tmp_path_factory.mktemp("model") / "stories-chat")
  with ServerProcess(model, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", MODEL, "--num-gpu-blocks", "64",
                     "--api-server-count", "2", "--data-parallel-size", "2", "--enable-log-requests") as s:
    yield s


# a server's first requests (each engine core's first steps) once took more than two minutes on CI's two cores while the
# other test worker ran its own servers
FIRST_REQUEST_S = 300


@pytest.fixture(scope="module")
def http(server):
  with httpx.Client(base_url=server.url, timeout=FIRST_REQUEST_S) as c: yield c


@pytest.fixture(scope="module")
def lone(http) -> dict[str, str]:
  return {p: http.post("/v1/completions", json={**SHORT, "prompt": p}).json()["choices"][0]["text"] for p in PROMPTS}


@pytest.mark.slow
def test_the_official_client_is_served(server, lone):
  assert set(api_server_pids(server)) | set(core_pids(server)) <= children(server.proc.pid)
  client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
  assert client.completions.create(prompt=PROMPTS[0], **SHORT).choices[0].text == lone[PROMPTS[0]]
  streamed = list(client.completions.create(prompt=PROMPTS[1], stream=True, **SHORT))
  assert "".join(c.choices[0].text for c in streamed) == lone[PROMPTS[1]] and streamed[-1].choices[0].finish_reason == "length"
  chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **SHORT)
  chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], stream=True, **SHORT))
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content


@pytest.mark.slow
def test_64_concurrent_streams_equal_lone_runs_over_both_api_servers(server, lone):
  before, logged = scrape(server), received(server)

  async def stream(prompt: str) -> str:
    text = []
    body = {**SHORT, "prompt": prompt, "stream": True}
    # a connection of its own: the kernel picks its API server
    async with httpx.AsyncClient(timeout=120) as c, c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
      assert r.status_code == 200
      async for line in r.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]": text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)

  async def main() -> list[str]: return await asyncio.gather(*(stream(PROMPTS[i % 4]) for i in range(64)))
  assert asyncio.run(main()) == [lone[PROMPTS[i % 4]] for i in range(64)]
  took = [a - b for a, b in zip(received(server), logged, strict=True)]
  assert sum(took) == 64 and min(took) > 0, took
  for _ in range(4):   # whichever server answers, it counts both servers' requests
    after = scrape(server)
    key = 'tinyvllm:request_success_total{"finished_reason": "length"}'
    assert after[key] - before[key] == 64
    assert after["tinyvllm:kv_cache_blocks_used"] == 0 and after["tinyvllm:kv_cache_blocks_total"] == 128


@pytest.mark.slow
def test_a_disconnect_frees_its_blocks(server, http):
  aborted = scrape(server)["tinyvllm:request_aborted_total"]
  with http.stream("POST", "/v1/completions", json={**LONG, "prompt": "Lily went to the park", "stream": True}) as r:
    assert r.status_code == 200
    lines = r.iter_lines()   # kept: a dropped iterator closes the connection
    next(line for line in lines if line.startswith("data: "))
    assert scrape(server)["tinyvllm:kv_cache_blocks_used"] > 0

  def freed() -> bool:
    m = scrape(server)
    return m["tinyvllm:kv_cache_blocks_used"] == 0 and m["tinyvllm:request_aborted_total"] == aborted + 1
  wait_until(freed)


@pytest.mark.parametrize(("body", "param"), [({"prompt": "hi", "max_tokens": -1}, "max_tokens"), ({"prompt": "hi " * 600}, "prompt")])
def test_bad_requests_are_400s(server, body, param):
  for _ in range(4):   # on new connections: either server
    r = httpx.post(f"{server.url}/v1/completions", json={**SHORT, **body}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


@pytest.mark.slow
def test_killing_a_core_mid_stream_errors_every_client_and_everything_exits_1(server):
  """Last in the module: it ends the module's server."""
  readers = [StreamReader(f"{server.url}/v1/completions", {**LONG, "prompt": PROMPTS[i % 4], "stream": True}) for i in range(8)]
  for r in readers: r.start()
  assert all(r.started.wait(FIRST_REQUEST_S) for r in readers)
  while min(len(r.lines) for r in readers) < 2: time.sleep(0.01)
  victim = core_pids(server)[1]
  everyone = set(api_server_pids(server)) | set(core_pids(server))
  os.kill(victim, signal.SIGKILL)
  assert server.proc.wait(60) == 1
  for r in readers: r.join(30)
  for r in readers:
    chunks = r.chunks()
    assert r.error is None and r.lines[-1] == "data: [DONE]" and chunks[-1]["error"]["code"] == "service_unavailable"
    assert f"engine core process of data-parallel rank 1 (pid {victim}) was killed by signal 9" in chunks[-1]["error"]["message"]
  assert not wait_gone(everyone), "a process outlived the server"
  assert "Traceback" not in server.log()


@pytest.mark.slow
def test_sigint_drains_and_exits_0_leaving_nothing(stories_dir, tmp_path):
  with ServerProcess(stories_dir, tmp_path / "server.log", "--num-gpu-blocks", "32", "--api-server-count", "2",
                     "--shutdown-timeout", "300") as s:
    reader = StreamReader(f"{s.url}/v1/completions", {"prompt": "Once", "max_tokens": 30, "ignore_eos": True, "stream": True})
    reader.start()
    assert reader.started.wait(FIRST_REQUEST_S)
    everyone = set(api_server_pids(s)) | set(core_pids(s))
    assert s.stop(signal.SIGINT) == 0
  reader.join(30)
  last = reader.chunks()[-1]
  assert reader.lines[-1] == "data: [DONE]" and last.get("choices", [{}])[0].get("finish_reason") == "length", last   # drained
  assert not wait_gone(everyone), "a process outlived the server"
  assert "Traceback" not in s.log() and "second signal" not in s.log()


def test_ray_with_several_api_servers_is_refused(stories_dir):
  from tests.test_cli_hardening import cli
  run, _ = cli("serve", "--model", str(stories_dir), "--api-server-count", "2", "--distributed-executor-backend", "ray", timeout=120)
  assert run.returncode != 0 and "--api-server-count > 1 with --distributed-executor-backend ray" in run.stderr
  assert "Traceback" not in run.stderr


class StandInCore:
  """What EngineCoreProc's routing reads of an EngineCore: its live requests; add_request refuses ids starting 'bad'."""

  def __init__(self) -> None: self.requests: dict[str, object] = {}

  def add_request(self, request) -> None:
    if request.request_id.startswith("bad"): raise ValueError(f"refused {request.request_id}")
    self.requests[request.request_id] = request

  def abort_requests(self, ids) -> None:
    for rid in ids: self.requests.pop(rid, None)


def test_the_core_routes_outputs_and_refusals_to_the_server_that_sent_the_request(tmp_path):
  from tinyvllm.config import EngineConfig
  from tinyvllm.engine.core_process import EngineCoreProc
  from tinyvllm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, RequestType, SchedulerStats
  from tinyvllm.sampling_params import SamplingParams
  proc = EngineCoreProc(EngineConfig(model="m"), [], [f"ipc://{tmp_path}/out-0", f"ipc://{tmp_path}/out-1"])
  try:
    proc.core = core = StandInCore()
    for rid, client in (("a", 0), ("b", 1), ("c", 1), ("bad-1", 1), ("bad-0", 0)):
      proc.handle(RequestType.ADD, EngineCoreRequest(rid, [1], SamplingParams(), [2], 0.0, client_index=client))
    proc.handle(RequestType.ABORT, ["c"])
    stats = SchedulerStats(num_running_reqs=2)
    step = EngineCoreOutputs([EngineCoreOutput("a", 0, [5]), EngineCoreOutput("b", 0, [6], finish_reason="length")], stats, 1.0)
    del core.requests["b"]   # finished in the step
    refused, proc.rejected = proc.rejected, []
    shares = proc.split(step, refused)
    assert [[o.request_id for o in s.outputs] for s in shares] == [["a"], ["b"]]
    assert [s.rejected for s in shares] == [[("bad-0", "refused bad-0")], [("bad-1", "refused bad-1")]]
    assert all(s.scheduler_stats is stats and s.timestamp == 1.0 for s in shares)   # every server gets the stats
    assert proc.owners == {"a": 0}   # b finished, c aborted, the refused never owned
  finally:
    for output in proc.outputs: output.close(linger=0)
    proc.input.close(linger=0)
    proc.context.term()
