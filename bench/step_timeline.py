"""Where the offline-throughput run's time goes, step by step, without slowing it down.

CUDA events recorded on the stream before and after each step's launch give, once the run is over, each step's GPU
time (its upload, kernels and copy out) and the gaps in which the GPU waited for the host. With each step's rows, tokens
and KV tokens read, a least-squares fit over the decode-only steps splits their GPU time into a fixed part, a part per
row and a part per KV token (the attention's bandwidth).

Usage (on the GPU machine, from the repo root): DEV=CUDA python bench/step_timeline.py  ->  $OUT/step_timeline.json
(--kv-cache-dtype fp8 or BENCH_KV_CACHE_DTYPE=fp8: with the FP8 KV cache, -> $OUT/step_timeline_fp8.json; --model
qwen3-30b-a3b --kv-cache-memory 40 on an H200: the mixture-of-experts shape, -> $OUT/step_timeline_qwen3-30b-a3b.json)
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class EventClock:
  """Timing events on the default stream (the one tinygrad's CUDA backend and its graphs use)."""
  def __init__(self, device):
    from tinygrad.runtime.autogen import cuda
    from tinygrad.runtime.ops_cuda import check
    self.cuda, self.check, self.dev = cuda, check, device

  def record(self):
    ev = self.cuda.CUevent()
    self.check(self.cuda.cuCtxSetCurrent(self.dev.context))
    self.check(self.cuda.cuEventCreate(ctypes.byref(ev), 0))
    self.check(self.cuda.cuEventRecord(ev, None))
    return ev

  def elapsed_ms(self, start, end) -> float:
    ms = ctypes.c_float()
    self.check(self.cuda.cuEventElapsedTime(ctypes.byref(ms), start, end))
    return ms.value


def record_steps(llm, clock: EventClock) -> list[dict]:
  """Wrap the runner's launch: events around it, and what the step holds."""
  runner, steps = llm.engine.runner, []
  original = runner.launch

  def launch(step):
    sched = step.sched
    start, t = clock.record(), time.perf_counter()
    out = original(step)
    steps.append({"start": start, "end": clock.record(), "host_launch_ms": (time.perf_counter() - t) * 1e3,
                  "rows": len(sched.scheduled), "tokens": sched.num_tokens,
                  "prompt": any(item.num_new_tokens > 1 for item in sched.scheduled),
                  "kv_tokens": sum(item.start + item.num_new_tokens for item in sched.scheduled)})
    return out
  runner.launch = launch
  return steps


def probe(llm, at_step: int, steps: list[dict]) -> dict:
  """At launch number `at_step` (a decode step in the middle of the run): its captured graph replayed alone (GPU time
  at that state) and one eager run of it with tinygrad's per-kernel timing (DEBUG=2), summed by kernel name."""
  import contextlib
  import io

  from gpu_profile import kernel_times  # (bench/ is on sys.path when this runs as a script)
  from tinygrad import Device
  from tinygrad.helpers import Context
  runner, found = llm.engine.runner, {}
  original_step_fn = runner._step_fn

  def step_fn(layout, **kw):
    fn = original_step_fn(layout, **kw)
    def call(packed):
      out = fn(packed)
      if len(steps) == at_step and layout.query_len == 1 and not found:
        dev = Device[llm.engine.model.device]
        dev.synchronize()
        t = time.perf_counter()
        for _ in range(10): fn(packed)
        dev.synchronize()
        found["replay_ms"] = (time.perf_counter() - t) / 10 * 1e3
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), Context(DEBUG=2): runner._forward(layout, packed)
        times = kernel_times(buf.getvalue())[0]
        found["eager_kernel_ms"] = dict(sorted(times.items(), key=lambda kv: -kv[1])[:15])
        found["rows"], found["context_len"] = layout.rows, layout.context_len
      return out
    return call
  runner._step_fn = step_fn
  return found


def summarise(steps: list[dict], clock: EventClock, seconds: float) -> dict:
  for i, s in enumerate(steps):
    s["gpu_ms"] = clock.elapsed_ms(s["start"], s["end"])
    s["idle_ms"] = clock.elapsed_ms(s["end"], steps[i + 1]["start"]) if i + 1 < len(steps) else 0.0
  decode = [s for s in steps if not s["prompt"]]
  prompt = [s for s in steps if s["prompt"]]
  x = np.array([[1.0, s["rows"], s["kv_tokens"]] for s in decode])
  coef = np.linalg.lstsq(x, np.array([s["gpu_ms"] for s in decode]), rcond=None)[0] if len(decode) > 3 else [0, 0, 0]
  total = lambda xs, key: round(sum(s[key] for s in xs) / 1e3, 3)
  return {
    "seconds": seconds, "steps": len(steps), "decode_steps": len(decode), "prompt_steps": len(prompt),
    "gpu_s": total(steps, "gpu_ms"), "idle_s": total(steps, "idle_ms"),
    "decode_gpu_s": total(decode, "gpu_ms"), "prompt_gpu_s": total(prompt, "gpu_ms"),
    "host_launch_s": total(steps, "host_launch_ms"),
    "decode_fit_ms": {"fixed": float(coef[0]), "per_row": float(coef[1]), "per_1k_kv_tokens": float(coef[2]) * 1e3},
    "kv_tokens_read": int(sum(s["kv_tokens"] for s in decode)),
    "per_step": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items() if k not in ("start", "end")}
                 for s in steps],
  }


def main() -> None:
  from tinygrad import Device

  from tinyvllm import LLM
  from tinyvllm.bench.throughput import nano_vllm_workload, run_throughput
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="qwen3-0.6b")
  p.add_argument("--kv-cache-memory", type=float, default=40.0)
  p.add_argument("--kv-cache-dtype", default=os.environ.get("BENCH_KV_CACHE_DTYPE", "auto"))   # fp8: the E4M3 KV cache
  args = p.parse_args()
  kv_cache_dtype = args.kv_cache_dtype
  llm = LLM(args.model, load_format="dummy", dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory,
            max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_dtype=kv_cache_dtype)
  vocab = llm.engine.model_config.vocab_size
  run_throughput(llm, nano_vllm_workload(vocab, 48))   # captures and compiles outside the timed run
  clock = EventClock(Device[llm.engine.model.device])
  steps = record_steps(llm, clock)
  probed = probe(llm, int(os.environ.get("PROBE_STEP", "150")), steps)
  prompts, params = nano_vllm_workload(vocab).requests()
  start = time.perf_counter()
  outputs = llm.generate(prompts, params, use_tqdm=False)
  seconds = time.perf_counter() - start
  Device[llm.engine.model.device].synchronize()
  result = summarise(steps, clock, seconds)
  result["output_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
  result["probe"] = probed
  print(json.dumps({k: v for k, v in result.items() if k != "per_step"}, indent=1), flush=True)
  name = "step_timeline" + ("" if args.model == "qwen3-0.6b" else f"_{args.model}") + ("_fp8" if kv_cache_dtype.startswith("fp8") else "")
  name += ".json"
  if out := os.environ.get("OUT"): Path(out, name).write_text(json.dumps(result))


if __name__ == "__main__":
  main()
