"""Where the persistent decode-layer kernel should stop taking decode steps: `main.py bench decode` on the Qwen3-0.6B
shape at batch sizes 1-8 and prompts of the context buckets 2,048-8,192, once with the layer kernel forced on
(decode_layer_max_context large: --decode-layer-max-context) and once on the per-op kernels (decode_layer_kernel=False:
--no-decode-layer-kernel). The tuning table's decode_layer.max_context_by_rows (tinyvllm/kernels/tuning/sm_90.json) is
set from these numbers (and the context sweep's, for buckets beyond 8,192).

  DEV=CUDA python3 bench/layer_bound.py [--cases 8:1500,8:3000]      (bash bench/run_on_device.sh bound; BOUND_CASES)
Writes $OUT/layer_bound.json.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (batch, prompt): prompt + 128 new tokens fixes the context bucket (8,192, 4,096, 2,048)
CASES = "1:5000,2:3000,3:3000,4:3000,4:1500,8:1500,8:3000"
# the engine settings of each mode, as `main.py bench decode` flags
MODES = {"layer kernel": ["--decode-layer-max-context", str(1 << 20)], "per-op kernels": ["--no-decode-layer-kernel"]}


def decode_tok_s(batch: int, prompt: int, flags: list[str]) -> float:
  cmd = [sys.executable, "main.py", "bench", "decode", "--model", "qwen3-0.6b", "--load-format", "dummy", "--dtype", "bfloat16",
         "--max-model-len", "8192", "--max-num-seqs", str(batch), "--cuda-graph-sizes", str(batch), "--no-enable-prefix-caching",
         "--batch-size", str(batch), "--prompt-len", str(prompt), "--max-tokens", "128", *flags]
  run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
  found = re.search(r"decode ([\d.]+) tok/s", run.stdout)
  if run.returncode != 0 or not found: raise RuntimeError(f"{cmd}: {run.stderr[-2000:]}")
  return float(found.group(1))


def main() -> None:
  import argparse
  p = argparse.ArgumentParser()
  p.add_argument("--cases", default=CASES, help="batch:prompt pairs, comma-separated")
  cases = [tuple(map(int, pair.split(":"))) for pair in p.parse_args().cases.split(",")]
  out = Path(os.environ.get("OUT", "/tmp/out"))
  out.mkdir(parents=True, exist_ok=True)
  rows = []
  for batch, prompt in cases:
    row = {"batch": batch, "prompt": prompt, **{mode: decode_tok_s(batch, prompt, flags) for mode, flags in MODES.items()}}
    rows.append(row)
    print(row, flush=True)
    (out / "layer_bound.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
