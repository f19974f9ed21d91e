"""Where the persistent decode-layer kernel's time goes, phase by phase (bench-only instrumentation): the kernel's source
is patched here (never in the package) so that block 0's thread 0 reads %globaltimer after each grid barrier and
prints each phase's total over the launch's layers (printf); the engine then decodes at each batch size and this prints
the median of its launches per row count. A phase's time runs from the barrier before it to the barrier after it, so it
includes the wait for the slowest block.

  DEV=CUDA python3 bench/layer_phases.py [--batches 1,4,8] [--proposals K] [--quantization int8]
                                                                              (bash bench/run_on_device.sh phases)
Writes $OUT/layer_phases.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
PHASES = ("qkv", "attention", "o", "gate_up", "down")
STAMP = ("TV_FN unsigned long long tv_now() { unsigned long long t; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t)); "
         "return t; }\n#define TV_STAMP(k) { const unsigned long long t = tv_now(); tv_phase[k] += t - tv_last; tv_last = t; }\n")
PRINT = ("  if (TV_BID_X == 0 && TV_TID == 0) printf(\"TVPHASES %d %llu %llu %llu %llu %llu\\n\", TV_M, tv_phase[1], tv_phase[2], "
         "tv_phase[3], tv_phase[4], tv_phase[5]);\n")


def instrumented(source: str) -> str:
  """The kernel source with the phase stamps (each replacement must find its one anchor)."""
  edits = [("TV_KERNEL(tv_decode_layer)", STAMP + "TV_KERNEL(tv_decode_layer)"),
           ("  // layer 0's qkv and o slices", "  unsigned long long tv_phase[6] = {0, 0, 0, 0, 0, 0}, tv_last = tv_now();\n"
                                              "  // layer 0's qkv and o slices"),
           ("  // every block has left every barrier's wait", PRINT + "  // every block has left every barrier's wait")]
  edits += [(f"tv_grid_sync(sync, synced + {k} * TV_NB);\n", f"tv_grid_sync(sync, synced + {k} * TV_NB);\n    TV_STAMP({k});\n")
            for k in range(2, 6)]
  edits.append(("tv_grid_sync(sync, synced + TV_NB);\n", "tv_grid_sync(sync, synced + TV_NB);\n    TV_STAMP(1);\n"))
  for old, new in edits:
    if source.count(old) != 1: raise RuntimeError(f"layer_phases: anchor not found once: {old!r}")
    source = source.replace(old, new)
  return source


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--batches", default="1,4,8")
  p.add_argument("--quantization", help="the linears quantized at load (int8, int4, fp8): the packed products' phases")
  p.add_argument("--proposals", type=int, default=0,
                 help="verification steps of this many forced proposals a sequence (bench/spec_bench.py's) instead of decode steps")
  args = p.parse_args()
  from tinyvllm.kernels import decode_layer
  original = decode_layer.kernel_source
  decode_layer.kernel_source = lambda *a, **k: instrumented(original(*a, **k))
  from tinyvllm.bench.decode import run_decode_bench
  from tinyvllm.config import EngineConfig
  from tinyvllm.engine.llm_engine import LLMEngine
  batches = [int(b) for b in args.batches.split(",")]
  spec = {"method": "ngram", "num_speculative_tokens": args.proposals} if args.proposals else None
  engine = LLMEngine(EngineConfig(model="qwen3-0.6b", load_format="dummy", device=os.environ.get("DEV", "CUDA"), max_model_len=2048,
                                  max_num_seqs=max(batches), num_gpu_blocks=1024, cuda_graph_sizes=batches, compile_cache=False,
                                  speculative_config=spec, quantization=args.quantization))
  if args.proposals:
    from bench.spec_bench import ForcedProposals
    engine.core.speculator = ForcedProposals(args.proposals)
  steps = {}
  with tempfile.TemporaryFile("w+") as log:
    fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(log.fileno(), 1)   # the kernel's printf writes to the process's stdout
    try:
      for b in batches:
        run = run_decode_bench(engine, batch=b, prompt_len=128, new_tokens=64, no_kv_cache=False)[0]
        steps[b] = run.decode_s / (run.new_tokens - 1) * 1e3
    finally:
      sys.stdout.flush()
      os.dup2(fd, 1)
    log.seek(0)
    launches = collections.defaultdict(list)
    for line in log:
      if line.startswith("TVPHASES"):
        rows, *times = map(int, line.split()[1:])
        launches[rows].append(times)
  result = []
  for rows, times in sorted(launches.items()):
    phases = {name: round(statistics.median(t[i] for t in times) / 1e3, 1) for i, name in enumerate(PHASES)}
    result.append({"rows": rows, "launches": len(times), "phase_us": phases, "total_us": round(sum(phases.values()), 1)})
    print(json.dumps(result[-1]), flush=True)
  print(json.dumps({"engine_ms_per_step": {b: round(ms, 3) for b, ms in steps.items()}}), flush=True)
  out = Path(os.environ.get("OUT", "/tmp/out"))
  out.mkdir(parents=True, exist_ok=True)
  (out / f"layer_phases{'_' + args.quantization if args.quantization else ''}.json").write_text(
    json.dumps({"phases": result, "engine_ms_per_step": steps}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
