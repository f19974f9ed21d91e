"""The server's engine core in its own process: killed mid-stream, every client gets an error and the server exits 1;
a crash in its loop reaches every stream with its reason; a load error is raised with the core's message; SIGTERM
stops it with the server, and it never outlives the server."""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess, StreamReader
from tinyvllm.config import EngineConfig
from tinyvllm.engine import core_process
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.engine.exceptions import EngineDeadError, EngineLoadError
from tinyvllm.sampling_params import SamplingParams

LONG = {"max_tokens": 450, "ignore_eos": True, "temperature": 0}
PROMPTS = ["Once upon a time", "The cat sat", "Lily went to the park", "Tom had a red ball"]


def running(pid: int) -> bool:
  """Whether pid is a live process (a zombie is not)."""
  try: state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
  except (FileNotFoundError, ProcessLookupError): return False
  return state != "Z"


def children(pid: int) -> set[int]:
  return {int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()}


def wait_gone(pids: set[int], timeout: float = 15) -> set[int]:
  deadline = time.monotonic() + timeout
  while (alive := {p for p in pids if running(p)}) and time.monotonic() < deadline: time.sleep(0.05)
  return alive


@pytest.mark.slow
def test_killing_the_core_mid_stream_errors_every_client_and_the_server_exits_1(stories_dir, tmp_path):
  with ServerProcess(stories_dir, tmp_path / "server.log", "--num-gpu-blocks", "256") as s:
    readers = [StreamReader(f"{s.url}/v1/completions", {"prompt": p, **LONG, "stream": True}) for p in PROMPTS]
    whole: dict = {}
    waiting = threading.Thread(target=lambda: whole.update(r=httpx.post(f"{s.url}/v1/completions", json={"prompt": "Hi", **LONG},
                                                                         timeout=120)), daemon=True)
    for r in readers: r.start()
    waiting.start()
    assert all(r.started.wait(120) for r in readers)
    while min(len(r.lines) for r in readers) < 3: time.sleep(0.01)   # every stream has its first tokens
    core = s.core_pid()
    os.kill(core, signal.SIGKILL)
    assert s.proc.wait(60) == 1
    for r in readers: r.join(30)
    waiting.join(30)
  for r in readers:
    chunks = r.chunks()
    assert r.error is None and r.lines[-1] == "data: [DONE]" and len(chunks) >= 3
    error = chunks[-1]["error"]
    assert error["code"] == "service_unavailable" and f"engine core process (pid {core}) was killed by signal 9" in error["message"]
    assert all("error" not in c for c in chunks[:-1])
  assert whole["r"].status_code == 503 and "killed by signal 9" in whole["r"].json()["error"]["message"]
  log = s.log()
  assert "the engine stopped" in log and "Traceback" not in log


@pytest.mark.slow
def test_sigterm_stops_the_core_and_leaves_no_process(stories_dir, tmp_path):
  with ServerProcess(stories_dir, tmp_path / "server.log", "--num-gpu-blocks", "64") as s:
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}, timeout=120)
    assert r.status_code == 200
    spawned = children(s.proc.pid)
    assert s.core_pid() in spawned and running(s.core_pid())
    assert s.stop(signal.SIGTERM) == 0
  assert not wait_gone(spawned), "processes the server started outlived it"
  assert "Application shutdown complete" in s.log()


@pytest.mark.slow
def test_the_core_exits_when_the_server_is_killed(stories_dir, tmp_path):
  with ServerProcess(stories_dir, tmp_path / "server.log", "--num-gpu-blocks", "64") as s:
    core = s.core_pid()
    s.proc.kill()
    s.proc.wait(30)
    assert not wait_gone({core}), "the engine core outlived its server"


def crashing_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
  """The real core process, whose loop raises at its fifth step (a test stand-in for a crash in the engine)."""
  from tinyvllm.engine.core import EngineCore
  original, steps = EngineCore.step, []

  def step(self):
    steps.append(1)
    if len(steps) == 5: raise RuntimeError("boom in step 5")
    return original(self)
  EngineCore.step = step
  core_process.run_engine_core(config, input_address, output_address)


@pytest.mark.slow
def test_a_crash_in_the_cores_loop_reaches_every_stream(stories_dir, monkeypatch):
  monkeypatch.setattr(core_process, "run_engine_core", crashing_engine_core)

  async def main() -> None:
    dead: list[EngineDeadError] = []
    engine = await AsyncLLM.from_config(EngineConfig(model=str(stories_dir), num_gpu_blocks=64), on_dead=dead.append)
    try:
      async def consume(prompt: str) -> int:
        got = 0
        with pytest.raises(EngineDeadError, match="the engine core failed: RuntimeError: boom in step 5"):
          async for _ in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)): got += 1
        return got
      counts = await asyncio.gather(*(consume(p) for p in PROMPTS))
      assert all(1 <= c <= 4 for c in counts) and len(dead) == 1 and engine.is_dead
      with pytest.raises(EngineDeadError): await engine.generate("Hi", SamplingParams()).__anext__()
      engine.client.process.join(30)
      assert engine.client.process.exitcode == 1
    finally:
      await engine.shutdown()
  asyncio.run(main())


def test_a_load_error_in_the_core_is_raised_with_its_message_and_leaves_no_process(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))

  async def main() -> None:
    with pytest.raises(EngineLoadError, match=r"ConfigError: .*unsupported architecture"):
      await AsyncLLM.from_config(EngineConfig(model=str(tmp_path)))
  asyncio.run(main())
  assert not [p for p in multiprocessing.active_children() if p.name == "tinyvllm-engine-core"]


def test_a_message_sent_before_the_core_connects_waits_for_it(tmp_path):
  """A core the supervisor of several API servers started connects to a server's input socket on its own schedule (it
  retries every 100 ms) and its READY may come first, on the other socket: a request the server sends meanwhile is
  delivered once the core connects, in order with those after it, never dropped."""
  import zmq

  from tinyvllm.engine.core_client import CoreClient
  from tinyvllm.engine.core_launcher import SharedCoreLauncher
  from tinyvllm.engine.messages import RequestType
  from tinyvllm.engine.serialization import decode_input

  launcher = SharedCoreLauncher(f"ipc://{tmp_path}/input", f"ipc://{tmp_path}/output", pid=0)

  async def scenario() -> list[tuple]:
    client = CoreClient(EngineConfig(model="unused"), launcher)
    client.abort_requests(["first"])   # no core connected: the socket cannot take it yet
    await asyncio.sleep(0.05)
    client.abort_requests(["second"])
    context = zmq.Context()
    core = context.socket(zmq.PULL)   # the core connects late
    core.connect(launcher.input_address)
    try:
      got = []
      for _ in range(2):
        assert await asyncio.to_thread(core.poll, 5000), f"only {got} arrived"
        got.append(decode_input(core.recv_multipart()))
      return got
    finally:
      core.close(linger=0)
      context.term()
      await client.shutdown()

  assert asyncio.run(scenario()) == [(RequestType.ABORT, ["first"]), (RequestType.ABORT, ["second"])]
