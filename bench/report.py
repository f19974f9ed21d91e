"""Turn the JSON that bench/gpu_benchmarks.py and bench/check_kernels.py wrote into markdown tables and PNG plots.

Usage: python bench/report.py RESULTS_DIR [--plots docs/] > tables.md   (needs matplotlib: pip install -e .[bench])
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(folder: Path, name: str) -> dict | None:
  path = folder / name
  return json.loads(path.read_text()) if path.exists() else None


def table(header: list[str], rows: list[list]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def decode_table(d: dict) -> str:
  return table(["prompt", "new tokens", "decode tok/s", "ms/step", "achieved GB/s"],
               [[r["prompt_len"], r["new_tokens"], f"{r['decode_tok_s']:.0f}", f"{r['step_ms']:.3f}", f"{r['gb_s']:.0f}"]
                for r in d["rows"]])


def prefill_table(d: dict) -> str:
  by_len: dict[int, dict] = {}
  for backend, rows in d.items():
    if not isinstance(rows, list): continue
    for r in rows: by_len.setdefault(r["prompt_len"], {})[backend] = r
  rows = []
  for length in sorted(by_len):
    a, p = by_len[length].get("auto"), by_len[length].get("portable")
    rows.append([length, f"{a['ms']:.1f}" if a else "-", f"{a['peak_extra_mib']:.0f}" if a else "-",
                 f"{p['ms']:.1f}" if p else "(failed)", f"{p['peak_extra_mib']:.0f}" if p else "-"])
  return table(["prompt tokens", "tiled ms", "tiled peak MiB", "naive ms", "naive peak MiB"], rows)


def context_table(d: dict) -> str:
  batches = [k for k in d if k.startswith("batch")]
  contexts = sorted({r["context"] for k in batches for r in d[k]})
  rows = [[c, *[next((f"{r['tok_s']:.0f}" for r in d[k] if r["context"] == c), "-") for k in batches]] for c in contexts]
  return table(["context", *[f"{k.replace('batch', 'batch ')} tok/s" for k in batches]], rows)


def plot_prefill(d: dict, out: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  for backend, label in (("auto", "tiled (fused kernel)"), ("portable", "naive (portable)")):
    rows = d.get(backend) or []
    if not rows: continue
    xs = [r["prompt_len"] for r in rows]
    ax1.plot(xs, [r["ms"] for r in rows], "o-", label=label)
    ax2.plot(xs, [r["peak_extra_mib"] for r in rows], "o-", label=label)
  for ax, title in ((ax1, "prefill latency (ms)"), (ax2, "peak extra memory (MiB)")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out, dpi=110)


def plot_context(d: dict, out: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for key, rows in d.items():
    if not key.startswith("batch"): continue
    ax.plot([r["context"] for r in rows], [r["tok_s"] for r in rows], "o-", label=key.replace("batch", "batch "))
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel("decode tok/s")
  ax.set_title("decode throughput vs context")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out, dpi=110)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("folder", type=Path)
  p.add_argument("--plots", type=Path, help="write PNG plots here")
  args = p.parse_args()
  if (d := load(args.folder, "bench_decode.json")) and "rows" in d: print("### Decode, batch 1\n\n" + decode_table(d) + "\n")
  if (d := load(args.folder, "bench_prefill.json")):
    print("### Prefill\n\n" + prefill_table(d) + "\n")
    if args.plots: plot_prefill(d, args.plots / "prefill.png")
  if (d := load(args.folder, "bench_context.json")) and "batch1" in d:
    print("### Decode vs context\n\n" + context_table(d) + "\n")
    if args.plots: plot_context(d, args.plots / "decode_vs_context.png")


if __name__ == "__main__":
  main()
