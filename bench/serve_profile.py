"""Where serving time goes: the OpenAI server under load with timers around each stage, bench-only instrumentation.

Runs `main.py serve` in this process with the engine's and the event loop's stages wrapped in timers, drives it with
`main.py bench serve` in a child process, then writes what each stage cost:
- the engine thread, per step: scheduling, batch preparation + launch, waiting for the GPU's sampled tokens, landing
  them (scheduler update with the output processor's stop checks and detokenization inside), building RequestOutputs,
  adding requests; and the time it sat idle between steps waiting for the event loop to hand it the next one;
- the event loop thread: busy time by what ran (HTTP parsing and writes, the request handlers' tasks, the engine
  loop task, SSE encoding), so the host's share of a step is visible.
The engine thread and the event loop share the GIL: time one spends in Python slows the other.

Usage (GPU machine, repo root): DEV=CUDA python3 bench/serve_profile.py --out $OUT/serve_profile.json \
    --bench "--num-prompts 500 --input-len 512 --output-len 128 --request-rate inf" -- \
    --model qwen3-0.6b --load-format dummy --dtype bfloat16 --kv-cache-memory 40 --max-num-seqs 256 --max-model-len 4096
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class Timers:
  """Seconds and calls per named stage, from any thread."""

  def __init__(self) -> None:
    self.seconds: dict[str, float] = defaultdict(float)
    self.calls: dict[str, int] = defaultdict(int)
    self.lock = threading.Lock()

  def add(self, name: str, seconds: float) -> None:
    with self.lock:
      self.seconds[name] += seconds
      self.calls[name] += 1

  def wrap(self, owner: object, attr: str, name: str) -> None:
    original = getattr(owner, attr)

    def timed(*args, **kwargs):
      t = time.perf_counter()
      try: return original(*args, **kwargs)
      finally: self.add(name, time.perf_counter() - t)
    setattr(owner, attr, timed)

  def report(self) -> dict:
    return {name: {"s": round(s, 4), "calls": self.calls[name], "ms_per_call": round(1e3 * s / max(self.calls[name], 1), 4)}
            for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}


ENGINE, LOOP = Timers(), Timers()
STEP_GAPS: list[float] = []
STEP_ROWS: list[int] = []
ENGINES: list = []   # the AsyncLLMEngine, once it has run a step


def instrument_engine() -> None:
  from tinyvllm.core.async_scheduling import AsyncScheduler
  from tinyvllm.core.scheduler import Scheduler, SchedulerBase
  from tinyvllm.engine.async_engine import AsyncLLMEngine
  from tinyvllm.engine.llm_engine import LLMEngine
  from tinyvllm.engine.output_processor import OutputProcessor
  from tinyvllm.worker.model_runner import LaunchedStep, ModelRunner
  for cls in {Scheduler, AsyncScheduler, SchedulerBase}:
    if "schedule" in vars(cls): ENGINE.wrap(cls, "schedule", "schedule")
    if "update_from_output" in vars(cls): ENGINE.wrap(cls, "update_from_output", "update_from_output (land tokens, stop checks)")
  ENGINE.wrap(ModelRunner, "_prepare", "runner: prepare batch + upload")
  ENGINE.wrap(ModelRunner, "launch", "runner: launch (prepare + enqueue)")
  ENGINE.wrap(LaunchedStep, "result", "wait for sampled tokens (GPU)")
  ENGINE.wrap(OutputProcessor, "process_token", "  of which: process_token (detokenize, stops)")
  ENGINE.wrap(OutputProcessor, "request_output", "request_output (build outputs)")
  ENGINE.wrap(LLMEngine, "add_request", "add_request")
  ENGINE.wrap(LLMEngine, "step", "engine.step (all of it)")
  original_step = AsyncLLMEngine._step
  last_end = [0.0]

  def step(self, adds, aborts):
    t = time.perf_counter()
    if last_end[0]: STEP_GAPS.append(t - last_end[0])
    if not ENGINES: ENGINES.append(self)
    try: return original_step(self, adds, aborts)
    finally:
      last_end[0] = time.perf_counter()
      ENGINE.add("AsyncLLMEngine._step (engine thread busy)", last_end[0] - t)
      STEP_ROWS.append(len(self.engine.scheduler.running))
  AsyncLLMEngine._step = step


def _category(handle: asyncio.Handle) -> str:
  callback = getattr(handle, "_callback", None)
  task = getattr(callback, "__self__", None)
  if isinstance(task, asyncio.Task):
    coro = task.get_coro()
    return f"task {getattr(coro, '__qualname__', type(coro).__name__)}"
  return f"callback {getattr(callback, '__qualname__', repr(callback))[:80]}"


def instrument_loop() -> None:
  """Time every callback the event loop runs (asyncio.Handle._run), by task coroutine or callback."""
  original_run = asyncio.events.Handle._run

  def run(self):
    t = time.perf_counter()
    try: return original_run(self)
    finally: LOOP.add(_category(self), time.perf_counter() - t)
  asyncio.events.Handle._run = run
  from tinyvllm.entrypoints import serving_chat, serving_completion
  for module in (serving_completion, serving_chat):
    LOOP.wrap(module, "sse", "  inside tasks: sse (JSON encoding)")
    LOOP.wrap(module, "chunk_json", "  inside tasks: chunk_json (pydantic dump)")


def wait_healthy(url: str, timeout: float = 600) -> None:
  deadline = time.time() + timeout
  while time.time() < deadline:
    try:
      with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
        if r.status == 200: return
    except OSError: pass
    time.sleep(0.5)
  raise TimeoutError("the server did not become healthy")


def drive(url: str, bench_args: str, result_file: Path, done: threading.Event, server_exit) -> None:
  """In a thread: wait for the server, run the benchmark client, then ask the server to stop."""
  try:
    wait_healthy(url)
    cmd = [sys.executable, str(REPO / "main.py"), "bench", "serve", "--url", url, "--result-file", str(result_file),
           "--disable-tqdm", *shlex.split(bench_args)]
    t = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True)
    ENGINE.add("benchmark wall time", time.perf_counter() - t)
  finally:
    done.set()
    server_exit()


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--bench", default="--num-prompts 500 --input-len 512 --output-len 128 --request-rate inf")
  p.add_argument("--port", type=int, default=8766)
  p.add_argument("serve_args", nargs=argparse.REMAINDER)
  args = p.parse_args()
  serve_args = [a for a in args.serve_args if a != "--"]
  instrument_engine()
  instrument_loop()
  from tinyvllm.cli import build_parser
  from tinyvllm.cli.args import engine_config
  from tinyvllm.entrypoints import api_server
  from tinyvllm.entrypoints.api_server import ServerSettings
  ns = build_parser().parse_args(["serve", *serve_args, "--port", str(args.port), "--log-level", "warning"])
  servers = []
  original_init = api_server._Server.__init__

  def init(self, *a, **kw):
    original_init(self, *a, **kw)
    servers.append(self)
  api_server._Server.__init__ = init
  result_file, done = Path(args.out).with_name("serve_profile_bench.json"), threading.Event()

  def stop() -> None:
    for s in servers: s.should_exit = True
  threading.Thread(target=drive, args=(f"http://127.0.0.1:{args.port}", args.bench, result_file, done, stop), daemon=True).start()
  api_server.run_server(engine_config(ns), ServerSettings(port=args.port, log_level="warning", shutdown_timeout=1))
  done.wait()
  gaps = sorted(STEP_GAPS)
  runner = ENGINES[0].engine.runner if ENGINES else None
  result = {
    "serve_args": serve_args, "bench_args": args.bench,
    "bench": json.loads(result_file.read_text()) if result_file.exists() else None,
    "engine_thread": ENGINE.report(), "event_loop": LOOP.report(),
    "captures": runner.num_captures if runner else None,
    "capture_s": round(runner.capture_seconds, 3) if runner else None,   # start-up captures included
    "start_up_capture_s": round(ENGINES[0].engine.warm_up_seconds, 3) if ENGINES else None,
    "steps": len(STEP_ROWS), "mean_running": sum(STEP_ROWS) / max(len(STEP_ROWS), 1),
    "idle_between_steps": {"total_s": round(sum(gaps), 4), "median_ms": round(1e3 * gaps[len(gaps) // 2], 4) if gaps else None,
                           "p90_ms": round(1e3 * gaps[int(len(gaps) * 0.9)], 4) if gaps else None},
  }
  Path(args.out).write_text(json.dumps(result, indent=1))
  print(json.dumps({k: v for k, v in result.items() if k != "bench"}, indent=1))


if __name__ == "__main__":
  main()
