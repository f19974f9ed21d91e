"""Each kernel of captured decode steps under Nsight Compute: its GPU time and the DRAM bytes it read, by kernel name,
against the step's graph replay time (what is left is the time between kernels).

Usage (on the GPU machine, from the repo root; ncu profiles only between cuProfilerStart and cuProfilerStop, each node
of the CUDA graphs on its own, clocks left alone):
  ncu --profile-from-start off --clock-control none --graph-profiling node --csv --log-file $OUT/ncu.csv \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum python3 bench/ncu_step.py --model qwen3-30b-a3b
  python3 bench/ncu_step.py --report $OUT/ncu.csv [--steps 2] [--in-order]   # the table (per step: divided by --steps)
--quantization: weights quantized at load; --in-order: also the first step's kernels one by one, in launch order;
--proposals K: verification steps of K forced proposals (bench/spec_bench.py's ForcedProposals) instead of decode steps.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import io
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def profiled_steps(model: str, batch: int, steps: int, quantization: str | None = None, proposals: int = 0) -> None:
  """Decode steps of `batch` sequences (prompts of 128 tokens), `steps` of them between cuProfilerStart and Stop; with
  `proposals` > 0, verification steps of that many forced proposals a sequence (bench/spec_bench.py's)."""
  from tinyvllm import LLM, SamplingParams
  spec = {"method": "ngram", "num_speculative_tokens": proposals} if proposals else None
  llm = LLM(model, load_format="dummy", dtype="bfloat16", kv_cache_memory=4, max_model_len=4096, max_num_seqs=max(4, batch),
            cuda_graph_sizes=[batch], enable_prefix_caching=False, async_scheduling=False, quantization=quantization,
            speculative_config=spec)
  engine = llm.engine
  if proposals:
    from bench.spec_bench import ForcedProposals
    engine.core.speculator = ForcedProposals(proposals)
  params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
  for i in range(batch): engine.add_request(f"p{i}", [3 + i] * 128, params)
  prefill_steps = -(-batch * 128 // engine.config.max_num_batched_tokens)
  for _ in range(prefill_steps + 8): engine.step()   # the prompts' chunks and warm decode steps
  cuda = ctypes.CDLL("libcuda.so.1")
  cuda.cuProfilerStart()
  for _ in range(steps): engine.step()
  cuda.cuProfilerStop()
  while engine.has_unfinished_requests(): engine.step()


def report(path: str, steps: int, in_order: bool = False) -> dict:
  """Per kernel name: launches, microseconds and DRAM megabytes a step, and the GB/s they make."""
  text = Path(path).read_text()
  rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
  kernels: dict[str, dict[str, float]] = defaultdict(lambda: {"launches": 0, "us": 0.0, "mb": 0.0})
  launches: dict[str, dict] = {}   # by ncu's launch ID, in order
  for row in rows:
    name = row["Kernel Name"].split("(")[0]
    value = float(row["Metric Value"].replace(",", ""))
    unit = row["Metric Unit"]
    k, one = kernels[name], launches.setdefault(row["ID"], {"name": name, "us": 0.0, "mb": 0.0, "grid": row.get("Grid Size", "")})
    if row["Metric Name"] == "gpu__time_duration.sum":
      k["launches"] += 1
      one["us"] = value * {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[unit]
      k["us"] += one["us"]
    elif row["Metric Name"] == "dram__bytes_read.sum":
      one["mb"] = value * {"B": 1e-6, "byte": 1e-6, "KB": 1e-3, "Kbyte": 1e-3, "MB": 1.0, "Mbyte": 1.0, "GB": 1e3, "Gbyte": 1e3}[unit]
      k["mb"] += one["mb"]
  table = {name: {"launches": k["launches"] / steps, "us": k["us"] / steps, "mb": k["mb"] / steps,
                  "gb_s": k["mb"] / k["us"] * 1e3 if k["us"] else 0.0} for name, k in kernels.items()}
  total_us = sum(k["us"] for k in table.values())
  print(f"kernels a step: {sum(k['launches'] for k in table.values()):.0f}, GPU time {total_us:.1f} us, "
        f"DRAM read {sum(k['mb'] for k in table.values()):.1f} MB")
  for name, k in sorted(table.items(), key=lambda kv: -kv[1]["us"]):
    print(f"  {k['us']:9.1f} us  x{k['launches']:<5.0f} {k['us'] / max(k['launches'], 1):7.2f} us each  {k['mb']:9.1f} MB "
          f"{k['gb_s']:7.0f} GB/s  {name}")
  first = list(launches.values())[:len(launches) // steps]
  if in_order:
    for one in first: print(f"  {one['us']:8.2f} us {one['mb']:8.2f} MB  grid {one['grid']:>14}  {one['name']}")
  return {"total_us": total_us, "kernels": table, "first_step": first}


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="qwen3-30b-a3b")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--steps", type=int, default=2)
  p.add_argument("--report", help="an ncu --csv log: print its table instead of running")
  p.add_argument("--quantization", help="weights quantized at load (int8, int4, fp8)")
  p.add_argument("--in-order", action="store_true", help="with --report: the first step's kernels in launch order")
  p.add_argument("--proposals", type=int, default=0, help="verification steps of this many forced proposals a sequence")
  args = p.parse_args()
  if args.report is None: return profiled_steps(args.model, args.batch, args.steps, args.quantization, args.proposals)
  result = report(args.report, args.steps, args.in_order)
  if out := os.environ.get("OUT"): Path(out, "ncu_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
