"""Each kernel's own GPU time inside a captured decode step, as the graph replays it (not one by one, as tinygrad's
DEBUG=2 or Nsight Compute time them): the offline-throughput run of a model, and at the first decode step of at most
each of --rows sequences its captured graph replayed under the PyTorch profiler, whose CUPTI tracing records every
kernel of the process, tinygrad's graphs included.

Usage (on the GPU machine, from the repo root): DEV=CUDA python bench/graph_kernels.py --model qwen3-30b-a3b
  --kv-cache-memory 40  ->  $OUT/graph_kernels_<model>.json: for each probed step its rows, context, replay ms, and
  the kernels' ms by name and by (name, grid), each kernel's own share of the span beside its start-to-end time.
  --workload decode [--quantization int4] --model llama-3.2-1b: a batch-1 decode step instead.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def traced_kernels(fn, packed, device, replays: int) -> tuple[list[list[dict]], float]:
  """The kernels of `replays` back-to-back replays of a captured step, one list a replay (in start order), and the
  wall ms a replay took under the tracer."""
  from torch.profiler import ProfilerActivity, profile
  for _ in range(3): fn(packed)
  device.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    t = time.perf_counter()
    for _ in range(replays): fn(packed)
    device.synchronize()
    wall_ms = (time.perf_counter() - t) / replays * 1e3
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp, "trace.json")
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
  kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
  per = len(kernels) // replays if replays else 0
  return [kernels[i * per:(i + 1) * per] for i in range(replays)], wall_ms


def exclusive_us(kernels: list[dict]) -> list[float]:
  """Each kernel's share of the step's span: from the later of its start and the previous kernels' end to its own end.
  A kernel launched early (programmatic dependent launch) waits inside for its predecessor; that wait is not its own."""
  shares, done = [], kernels[0]["ts"] if kernels else 0.0
  for k in kernels:
    end = k["ts"] + k["dur"]
    shares.append(max(0.0, end - max(done, k["ts"])))
    done = max(done, end)
  return shares


def summarise(kernels: list[dict]) -> dict:
  """One replay's kernels: busy and span ms; by name and by (name, grid): [own ms, ms start to end, launches]."""
  by_name: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])
  by_grid: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])
  for k, own in zip(kernels, exclusive_us(kernels), strict=True):
    grid = "x".join(str(g) for g in k.get("args", {}).get("grid", []))
    for table, key in ((by_name, k["name"]), (by_grid, f"{k['name']} [{grid}]")):
      table[key][0] += own / 1e3
      table[key][1] += k["dur"] / 1e3
      table[key][2] += 1
  busy = sum(k["dur"] for k in kernels) / 1e3
  span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / 1e3 if kernels else 0.0
  top = lambda table, n: {k: [round(v[0], 4), round(v[1], 4), v[2]]
                          for k, v in sorted(table.items(), key=lambda kv: -kv[1][0])[:n]}
  return {"kernels": len(kernels), "busy_ms": round(busy, 3), "span_ms": round(span, 3),
          "by_name_ms": top(by_name, 40), "by_grid_ms": top(by_grid, 60)}


class ProbesDone(Exception):
  """Raised out of the run once every target's step is traced (--stop-after-probes)."""


def patch_tuning(assignments: list[str]) -> None:
  """SECTION.FIELD=JSON assignments over the tuning tables (a trial of other planner values in this process only)."""
  from tinyvllm.kernels import tuning
  if not assignments: return
  read = tuning._table
  def patched(name: str) -> dict:
    table = read(name)
    if name == "default":
      for item in assignments:
        key, value = item.split("=", 1)
        section, field = key.split(".")
        table.setdefault(section, {})[field] = json.loads(value)
    return table
  tuning._table = patched
  tuning.tuning_for.cache_clear()


def install_probe(llm, targets: list[int], replays: int, found: list[dict], stop: bool = False) -> None:
  """At the first decode step of at most each target's rows (largest first), trace its graph's replays; with `stop`,
  end the run (ProbesDone) once the last is traced."""
  from tinygrad import Device
  runner, pending = llm.engine.runner, sorted(targets, reverse=True)
  device = Device[llm.engine.model.device]
  original = runner._step_fn

  def step_fn(layout, **kw):
    fn = original(layout, **kw)
    def call(packed):
      out = fn(packed)
      if pending and layout.query_len == 1 and layout.rows <= pending[0]:
        while pending and layout.rows <= pending[0]: pending.pop(0)
        replays_k, wall_ms = traced_kernels(fn, packed, device, replays)
        middle = replays_k[len(replays_k) // 2] if replays_k else []
        found.append({"rows": layout.rows, "context_len": layout.context_len, "replay_wall_ms": round(wall_ms, 3),
                      **summarise(middle), "sequence": [[k["name"], k.get("args", {}).get("grid"),
                                                         round(k["ts"] - middle[0]["ts"], 3), k["dur"]] for k in middle]})
        print(f"probe rows={layout.rows}: {found[-1]['busy_ms']} ms busy of {wall_ms:.3f}", flush=True)
        if stop and not pending: raise ProbesDone
      return out
    return call
  runner._step_fn = step_fn


def main() -> None:
  from tinyvllm import LLM, SamplingParams
  from tinyvllm.bench.throughput import nano_vllm_workload, run_throughput
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="qwen3-30b-a3b")
  p.add_argument("--workload", choices=("throughput", "decode"), default="throughput",
                 help="throughput: the offline workload (probes at --rows); decode: one request of a 128-token prompt")
  p.add_argument("--quantization", default=None)
  p.add_argument("--kv-cache-memory", type=float, default=40.0)
  p.add_argument("--kv-cache-dtype", default="auto")
  p.add_argument("--rows", default="256,192,128,64,32,16,8,4,1")
  p.add_argument("--replays", type=int, default=5)
  p.add_argument("--timed", action="store_true", help="first one run of the workload without probes, timed")
  p.add_argument("--stop-after-probes", action="store_true")
  p.add_argument("--tuning", action="append", default=[], help="SECTION.FIELD=JSON over the tuning table (a trial)")
  args = p.parse_args()
  patch_tuning(args.tuning)
  llm = LLM(args.model, load_format="dummy", dtype="bfloat16", enable_prefix_caching=False, quantization=args.quantization,
            kv_cache_memory=args.kv_cache_memory, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192,
            kv_cache_dtype=args.kv_cache_dtype)
  vocab = llm.engine.model_config.vocab_size
  found: list[dict] = []
  timed = None
  if args.workload == "decode":
    prompt, params = {"prompt_token_ids": list(range(100, 228))}, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)   # captures and compiles outside the probed run
    install_probe(llm, [1], args.replays, found)
    llm.generate([prompt], params, use_tqdm=False)
  else:
    run_throughput(llm, nano_vllm_workload(vocab, 48))
    prompts, params = nano_vllm_workload(vocab).requests()
    if args.timed:
      start = time.perf_counter()
      outputs = llm.generate(prompts, params, use_tqdm=False)
      seconds = time.perf_counter() - start
      timed = {"seconds": round(seconds, 3), "output_tok_s": round(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds, 1)}
      print(f"timed: {timed} tuning {args.tuning}", flush=True)
    targets = [int(r) for r in args.rows.split(",") if r]
    if targets:
      install_probe(llm, targets, args.replays, found, args.stop_after_probes)
      try: llm.generate(prompts, params, use_tqdm=False)
      except Exception as e:   # ProbesDone, or the engine's error wrapping it
        if not (isinstance(e, ProbesDone) or isinstance(e.__cause__, ProbesDone)): raise
  result = {"model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
            "tuning": args.tuning, "timed": timed, "probes": found}
  for probe in found:
    print(json.dumps({k: v for k, v in probe.items() if k not in ("sequence", "by_name_ms")}))
  tag = args.model + (f"_{args.quantization}" if args.quantization else "") + ("" if args.workload == "throughput" else "_b1")
  tag += "_trial" if args.tuning else ""
  if out := os.environ.get("OUT"): Path(out, f"graph_kernels_{tag}.json").write_text(json.dumps(result))


if __name__ == "__main__":
  main()
