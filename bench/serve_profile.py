"""Where serving time goes: the OpenAI server under load with timers around each stage, bench-only instrumentation.

Runs `main.py serve` in this process (the API process) with its stages wrapped in timers, the engine core in the process
the server spawns (its entry point swapped for one that wraps the core's stages the same way first), drives it with
`main.py bench serve` in a child process, then writes what each stage cost:
- the core process, per step: scheduling, batch preparation + launch, waiting for the GPU's sampled tokens, landing
  them (scheduler update with the token-level stop checks), building the step's outputs, sending them (msgpack + ZeroMQ),
  draining the input (requests, aborts), adding requests; the time between steps (the loop's own work) and the time it
  sat idle, blocked on its input;
- the API process: the event loop's busy time by what ran (HTTP parsing and writes, the request handlers' tasks, the
  output handler, SSE encoding), and inside it the frontend's stages: decoding each step's outputs, output processing
  (detokenization, stop strings, RequestOutputs), input processing (tokenization, validation).
The two processes share no GIL: the core's loop runs whatever the API process does.

Usage (GPU machine, repo root): DEV=CUDA python3 bench/serve_profile.py --out $OUT/serve_profile.json \
    --bench "--num-prompts 500 --input-len 512 --output-len 128 --request-rate inf" -- \
    --model qwen3-0.6b --load-format dummy --dtype bfloat16 --kv-cache-memory 40 --max-num-seqs 256 --max-model-len 4096
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from serve_sweep import wait_healthy  # (this script's folder is on sys.path)
from stage_timers import Timers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CORE_REPORT_ENV = "SERVE_PROFILE_CORE_REPORT"   # where the core process writes its timers (set for the child by main())



def gap_report(gaps: list[float]) -> dict:
  gaps = sorted(gaps)
  return {"total_s": round(sum(gaps), 4), "median_ms": round(1e3 * gaps[len(gaps) // 2], 4) if gaps else None,
          "p90_ms": round(1e3 * gaps[int(len(gaps) * 0.9)], 4) if gaps else None}


# ---------------------------------------------------------------- the core process

def profiled_engine_core(config, input_address: str, output_address: str) -> None:
  """The core process's entry point with timers on its stages; writes them where $SERVE_PROFILE_CORE_REPORT says."""
  from tinyvllm.core.async_scheduling import AsyncScheduler
  from tinyvllm.core.scheduler import Scheduler, SchedulerBase
  from tinyvllm.engine import core_process
  from tinyvllm.engine.core import EngineCore
  from tinyvllm.worker.model_runner import ModelRunner
  from tinyvllm.worker.runner_steps import LaunchedStep
  timers, gaps, rows, cores = Timers(), [], [], []
  for cls in {Scheduler, AsyncScheduler, SchedulerBase}:
    if "schedule" in vars(cls): timers.wrap(cls, "schedule", "schedule")
    if "update_from_output" in vars(cls): timers.wrap(cls, "update_from_output", "update_from_output (land tokens, stop checks)")
  timers.wrap(ModelRunner, "prepare", "runner: prepare batch")
  timers.wrap(ModelRunner, "launch", "runner: launch (upload + enqueue)")
  timers.wrap(LaunchedStep, "result", "wait for sampled tokens (GPU)")
  timers.wrap(EngineCore, "_output", "  of which: build the step's outputs")
  timers.wrap(EngineCore, "stats", "stats snapshot")
  timers.wrap(EngineCore, "add_request", "add_request")
  timers.wrap(core_process.EngineCoreProc, "send_outputs", "send outputs (msgpack + ZeroMQ)")
  timers.wrap(core_process.EngineCoreProc, "handle", "apply an input message (decoded)")
  original_step, original_input, last_end = EngineCore.step, core_process.EngineCoreProc.process_input_queue, [0.0]

  def step(self):
    t = time.perf_counter()
    if last_end[0]: gaps.append(t - last_end[0])
    if not cores: cores.append(self)
    try: return original_step(self)
    finally:
      last_end[0] = time.perf_counter()
      timers.add("EngineCore.step (all of it)", last_end[0] - t)
      rows.append(len(self.scheduler.running))

  def process_input_queue(self):
    idle, t = not self.core.has_unfinished_requests(), time.perf_counter()
    try: return original_input(self)
    finally: timers.add("idle: blocked on the input" if idle else "drain the input (no wait)", time.perf_counter() - t)
  EngineCore.step, core_process.EngineCoreProc.process_input_queue = step, process_input_queue
  try:
    core_process.run_engine_core(config, input_address, output_address)
  finally:
    runner = cores[0].runner if cores else None
    report = {"stages": timers.report(), "steps": len(rows), "mean_running": sum(rows) / max(len(rows), 1),
              "between_steps": gap_report(gaps), "captures": runner.num_captures if runner else None,
              "capture_s": round(runner.capture_seconds, 3) if runner else None,   # start-up captures included
              "start_up_capture_s": round(cores[0].warm_up_seconds, 3) if cores else None}
    Path(os.environ[CORE_REPORT_ENV]).write_text(json.dumps(report, indent=1))


# ---------------------------------------------------------------- the API process

API = Timers()
LOOP = Timers()


def instrument_api_process() -> None:
  """The frontend's stages, and every callback the event loop runs (asyncio.Handle._run), by task coroutine or callback."""
  from tinyvllm.engine import async_llm, core_client, core_process
  from tinyvllm.engine.input_processor import InputProcessor
  from tinyvllm.engine.output_processor import OutputProcessor
  from tinyvllm.entrypoints import serving_chat, serving_completion
  core_process.run_engine_core = profiled_engine_core   # what CoreClient spawns
  API.wrap(core_client, "decode_output", "decode a step's outputs (msgpack)")
  API.wrap(OutputProcessor, "process_outputs", "output processing (detokenize, stops, RequestOutputs)")
  API.wrap(OutputProcessor, "request_output", "  of which: request_output (build outputs)")
  API.wrap(InputProcessor, "process", "input processing (tokenize, validate)")
  API.wrap(async_llm.AsyncLLM, "_deliver", "deliver to the request streams")
  original_run = asyncio.events.Handle._run

  def run(self):
    t = time.perf_counter()
    try: return original_run(self)
    finally: LOOP.add(_category(self), time.perf_counter() - t)
  asyncio.events.Handle._run = run
  for module in (serving_completion, serving_chat):
    LOOP.wrap(module, "sse", "  inside tasks: sse (JSON encoding)")
    LOOP.wrap(module, "chunk_json", "  inside tasks: chunk_json (pydantic dump)")


def _category(handle: asyncio.Handle) -> str:
  callback = getattr(handle, "_callback", None)
  task = getattr(callback, "__self__", None)
  if isinstance(task, asyncio.Task):
    coro = task.get_coro()
    return f"task {getattr(coro, '__qualname__', type(coro).__name__)}"
  return f"callback {getattr(callback, '__qualname__', repr(callback))[:80]}"


def drive(url: str, bench_args: str, result_file: Path, done: threading.Event, server_exit) -> None:
  """In a thread: wait for the server, run the benchmark client, then ask the server to stop."""
  try:
    wait_healthy(url)
    cmd = [sys.executable, str(REPO / "main.py"), "bench", "serve", "--url", url, "--result-file", str(result_file),
           "--disable-tqdm", *shlex.split(bench_args)]
    t = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True)
    API.add("benchmark wall time", time.perf_counter() - t)
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
  core_report = Path(args.out).with_name("serve_profile_core.json")
  os.environ[CORE_REPORT_ENV] = str(core_report)   # the core process inherits it
  instrument_api_process()
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
  result = {
    "serve_args": serve_args, "bench_args": args.bench,
    "bench": json.loads(result_file.read_text()) if result_file.exists() else None,
    "core_process": json.loads(core_report.read_text()) if core_report.exists() else None,
    "api_process": {"frontend": API.report(), "event_loop": LOOP.report()},
  }
  Path(args.out).write_text(json.dumps(result, indent=1))
  print(json.dumps({k: v for k, v in result.items() if k != "bench"}, indent=1))


if __name__ == "__main__":
  main()
