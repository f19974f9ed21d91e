"""Serving under rising concurrency: output tok/s, TTFT and TPOT against 1, 2, 4 ... 256 concurrent clients.

Starts one server (`main.py serve` with the given flags), then for each concurrency C runs `main.py bench serve` with
--max-concurrency C and --request-rate inf (workload 3's shape by default: 512 prompt tokens, 128 output tokens), each
level with its own warm-up, and writes the table (JSON) and a plot.

Usage (GPU machine, repo root): DEV=CUDA python3 bench/serve_sweep.py --out $OUT/serve_sweep.json --plot $OUT/serve_sweep.png \
    -- --model qwen3-0.6b --load-format dummy --dtype bfloat16 --kv-cache-memory 40 --max-num-seqs 256 --max-model-len 4096
(`bash bench/run_on_device.sh sweep` does this); where the GPU machine lacks matplotlib, plot the JSON elsewhere:
    python bench/serve_sweep.py --replot serve_sweep.json --plot docs/serve_sweep_h100.png
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METRICS = ("output_throughput", "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "median_itl_ms",
           "request_throughput", "completed", "failed")


def wait_healthy(url: str, server: subprocess.Popen | None = None, timeout: float = 900) -> None:
  """Poll the server's /health until it answers 200 (failing at once if its process, when given, exits)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    if server is not None and server.poll() is not None: raise RuntimeError(f"the server exited with {server.returncode}")
    try:
      with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
        if r.status == 200: return
    except OSError: pass
    time.sleep(0.5)
  raise TimeoutError("the server did not become healthy")


def run_level(url: str, concurrency: int, args: argparse.Namespace, result_file: Path) -> dict:
  prompts = max(args.min_prompts, args.prompts_per_client * concurrency)
  cmd = [sys.executable, str(REPO / "main.py"), "bench", "serve", "--url", url, "--num-prompts", str(prompts),
         "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--request-rate", "inf",
         "--max-concurrency", str(concurrency), "--warmup", str(min(concurrency, args.warmup)), "--seed", str(concurrency),
         "--result-file", str(result_file), "--disable-tqdm"]
  subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
  result = json.loads(result_file.read_text())
  return {"concurrency": concurrency, "num_prompts": prompts, **{k: result.get(k) for k in METRICS}}


def plot(rows: list[dict], path: Path, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  c = [r["concurrency"] for r in rows]
  fig, axes = plt.subplots(1, 3, figsize=(14, 4))
  for ax, key, label in zip(axes, ("output_throughput", "median_ttft_ms", "median_tpot_ms"),
                            ("output tok/s", "median TTFT (ms)", "median TPOT (ms)"), strict=True):
    ax.plot(c, [r[key] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--out", help="JSON result")
  p.add_argument("--replot", help="a sweep's JSON: only plot it (to --plot)")
  p.add_argument("--plot", help="PNG plot")
  p.add_argument("--levels", default="1,2,4,8,16,32,64,128,256")
  p.add_argument("--input-len", type=int, default=512)
  p.add_argument("--output-len", type=int, default=128)
  p.add_argument("--prompts-per-client", type=int, default=4)
  p.add_argument("--min-prompts", type=int, default=16)
  p.add_argument("--warmup", type=int, default=8, help="warm-up requests per level (at most the concurrency)")
  p.add_argument("--port", type=int, default=8767)
  p.add_argument("--title", default="tinyvllm serving: 512 prompt / 128 output tokens per request")
  p.add_argument("serve_args", nargs=argparse.REMAINDER)
  args = p.parse_args()
  if args.replot:
    plot(json.loads(Path(args.replot).read_text())["rows"], Path(args.plot), args.title)
    return
  if not args.out: p.error("--out is required (or --replot)")
  url = f"http://127.0.0.1:{args.port}"
  serve = [sys.executable, str(REPO / "main.py"), "serve", *[a for a in args.serve_args if a != "--"], "--port", str(args.port),
           "--log-level", "warning"]
  server = subprocess.Popen(serve, cwd=REPO)
  rows: list[dict] = []
  try:
    wait_healthy(url, server)
    for level in (int(x) for x in args.levels.split(",")):
      rows.append(run_level(url, level, args, Path(tempfile.gettempdir()) / f"serve_sweep_c{level}.json"))
      print(json.dumps(rows[-1]), flush=True)
      Path(args.out).write_text(json.dumps({"serve_args": serve[3:], "rows": rows}, indent=1))
  finally:
    server.terminate()
    server.wait(timeout=60)
  if args.plot: plot(rows, Path(args.plot), args.title)


if __name__ == "__main__":
  main()
