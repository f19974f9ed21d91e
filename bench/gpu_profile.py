"""Where a decode step's time goes on the GPU: decode tok/s, kernel count, and the slowest kernels of one step.

Usage (on the GPU machine): DEV=CUDA python bench/gpu_profile.py --model qwen3-0.6b --batch 1 [--stories PATH]
  [--quantization int4] [--replay-only]
--replay-only: the step breakdown alone, with the captured decode graph replayed in --replay-rounds rounds (its median
is the GPU's step, free of the host's pace; bench/replay_ab.sh alternates checkouts with it).
Writes $OUT/profile_<tag>.json when OUT is set.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINE = re.compile(r"\*\*\*\s+\S+\s+\d+\s+(\S+).*?tm\s+([\d.]+)(us|ms)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def kernel_times(debug_output: str) -> tuple[dict[str, float], dict[str, int]]:
  """Milliseconds and launches per kernel name from tinygrad's DEBUG=2 lines."""
  times: dict[str, float] = defaultdict(float)
  counts: dict[str, int] = defaultdict(int)
  for m in LINE.finditer(ANSI.sub("", debug_output)):
    times[m.group(1)] += float(m.group(2)) * (1e-3 if m.group(3) == "us" else 1.0)
    counts[m.group(1)] += 1
  return times, counts


def profile_one_step(engine, batch: int) -> dict:
  """One eager decode step with tinygrad's DEBUG=2 per-kernel timing (kernels run one by one, no graph)."""
  from tinygrad.helpers import Context

  from tinyvllm import SamplingParams
  runner = engine.runner
  params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
  for i in range(batch): engine.add_request(f"p{i}", [1] * 100, params)
  engine.step()
  engine.step()
  mode, runner.cudagraph_mode = runner.cudagraph_mode, "NONE"   # eager steps (the engine setting enforce_eager)
  try:
    engine.step()  # compile the eager kernels outside the measurement
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), Context(DEBUG=2): engine.step()
  finally:
    runner.cudagraph_mode = mode
  while engine.has_unfinished_requests(): engine.step()
  times, counts = kernel_times(buf.getvalue())
  top = sorted(times.items(), key=lambda kv: -kv[1])[:25]
  return {"kernels": sum(counts.values()), "total_ms": sum(times.values()),
          "top": [{"name": k, "ms": round(v, 4), "count": counts[k]} for k, v in top]}


@contextlib.contextmanager
def recorded_steps(runner):
  """While inside: every step function the runner hands out records its layout's last call, seen[layout] = (fn,
  packed), so that the captured graph can be replayed afterwards (replay_ms)."""
  seen: dict = {}
  original = runner._step_fn
  def step_fn(layout, **kw):
    fn = original(layout, **kw)
    def record(packed):
      seen[layout] = (fn, packed)
      return fn(packed)
    return record
  runner._step_fn = step_fn
  try: yield seen
  finally: runner._step_fn = original


def replay_ms(engine, fn, packed, steps: int = 50, rounds: int = 1) -> tuple[float, float]:
  """A captured step replayed back to back: (the median round's ms a step, GPU time + launch; the host's launch alone
  in that round)."""
  from tinygrad import Device
  group = engine.model.group   # a tensor-parallel model's step runs on every device of its group
  devices = [Device[d] for d in (group.devices if group is not None else (engine.model.device,))]
  def synchronize() -> None:
    for dev in devices: dev.synchronize()
  for _ in range(3): fn(packed)
  synchronize()
  replays = []
  for _ in range(rounds):
    t = time.perf_counter()
    for _ in range(steps): fn(packed)
    launch_s = (time.perf_counter() - t) / steps
    synchronize()
    replays.append(((time.perf_counter() - t) / steps, launch_s))
  replay_s, launch_s = sorted(replays)[len(replays) // 2]
  return replay_s * 1e3, launch_s * 1e3


def step_breakdown(engine, batch: int, steps: int = 50, rounds: int = 1) -> dict:
  """Where a decode step's wall time goes: the whole engine.step, the runner's launch (batch prep + upload + graph
  launch), and the captured graph alone replayed back to back (GPU time + launch), in ms. With asynchronous
  scheduling the engine step overlaps the host's work with the previous step's graph."""
  from tinyvllm import SamplingParams
  runner = engine.runner
  orig_launch = runner.launch
  launch_s: list[float] = []

  def launch(sched):
    t = time.perf_counter()
    out = orig_launch(sched)
    launch_s.append(time.perf_counter() - t)
    return out

  runner.launch = launch
  params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
  for i in range(batch): engine.add_request(f"b{i}", [1 + i] * 100, params)
  step_s = []
  try:
    with recorded_steps(runner) as seen:
      while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t)
  finally:
    runner.launch = orig_launch
  layout = next(lay for lay in reversed(list(seen)) if lay.query_len == 1)
  replay, graph_launch = replay_ms(engine, *seen[layout], steps, rounds)
  tail = len(step_s) // 2   # the second half: decode steps only, captures warm
  ms = lambda xs: round(1e3 * sorted(xs)[len(xs) // 2], 3)
  return {"engine_step_ms": ms(step_s[-tail:]), "runner_launch_ms": ms(launch_s[-tail:]),
          "graph_replay_ms": round(replay, 3), "graph_launch_host_ms": round(graph_launch, 3),
          "async_scheduling": engine.async_scheduling}


def host_profile(engine, batch: int, steps: int = 30) -> list[str]:
  """cProfile of steady decode steps (captures warm): the host functions that take the most time of their own."""
  import cProfile
  import pstats

  from tinyvllm import SamplingParams
  params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
  for i in range(batch): engine.add_request(f"h{i}", [2 + i] * 100, params)
  for _ in range(4): engine.step()
  prof = cProfile.Profile()
  prof.enable()
  for _ in range(steps): engine.step()
  prof.disable()
  while engine.has_unfinished_requests(): engine.step()
  buf = io.StringIO()
  pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
  return [line for line in buf.getvalue().splitlines() if line.strip()][-19:]


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="qwen3-0.6b")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--max-model-len", type=int, default=4096)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--tag", default="default")
  p.add_argument("--tensor-parallel-size", type=int, default=1)
  p.add_argument("--stories", help="stories260K-hf folder: check the greedy reference on this device first")
  p.add_argument("-q", "--quantization", help="weights quantized at load (int8, int4, fp8)")
  p.add_argument("--replay-only", action="store_true", help="only the step breakdown (no host or kernel profile)")
  p.add_argument("--replay-rounds", type=int, default=1, help="rounds of graph replays; the median round is reported")
  args = p.parse_args()
  from tinyvllm import LLM, SamplingParams
  from tinyvllm.bench.decode import run_decode_bench
  result: dict = {"tag": args.tag, "jitbeam": os.environ.get("JITBEAM", "0")}
  if args.stories:
    ref = json.loads((Path(args.stories) / "reference_greedy.json").read_text())
    llm = LLM(args.stories, num_gpu_blocks=256)
    out = llm.generate([ref["prompt_ids"]], SamplingParams(temperature=0, max_tokens=256), use_tqdm=False)[0].outputs[0]
    result["stories_greedy_ok"] = out.token_ids == ref["greedy_ids"]
    print("stories greedy matches reference:", result["stories_greedy_ok"], flush=True)
    del llm
  t0 = time.perf_counter()
  llm = LLM(args.model, load_format="dummy", dtype=args.dtype, num_gpu_blocks=2048, max_model_len=args.max_model_len,
            max_num_seqs=256, tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization)
  result["load_s"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  runs = run_decode_bench(llm.engine, args.batch, 128, 256, no_kv_cache=False)
  result["bench_s"] = time.perf_counter() - t0
  result["decode_tok_s"] = runs[0].decode_tok_s
  result["prefill_ms"] = runs[0].prefill_s * 1e3
  print(runs[0].line(), flush=True)
  result["breakdown"] = step_breakdown(llm.engine, args.batch, rounds=args.replay_rounds)
  print("step breakdown (median ms):", result["breakdown"], flush=True)
  if args.replay_only: return
  result["host_profile"] = host_profile(llm.engine, args.batch)
  print("\n".join(result["host_profile"]), flush=True)
  if args.tensor_parallel_size > 1:
    # tinygrad's per-kernel timing (DEBUG=2) waits for each launch before queueing the next: one device's all-reduce
    # would wait forever for the others' (csrc/cuda/all_reduce.inc)
    print("eager step: not profiled under tensor parallelism (per-kernel timing serialises the devices' launches)", flush=True)
  else:
    result["profile"] = profile_one_step(llm.engine, args.batch)
    prof = result["profile"]
    print(f"eager step: {prof['kernels']} kernels, {prof['total_ms']:.3f} ms of kernel time", flush=True)
    for row in prof["top"]: print(f"  {row['ms']:8.4f} ms  x{row['count']:<4} {row['name']}", flush=True)
  if out_dir := os.environ.get("OUT"):
    Path(out_dir, f"profile_{args.tag}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
