"""Where tensor parallelism's batch-1 decode time goes (bench-only): `main.py bench decode` of the Qwen3-8B shape
(dummy bf16 weights) as one of three parts:
  tp             over --tp GPUs, as users run it;
  no_all_reduce  over --tp GPUs with every all-reduce skipped (each device keeps its partial sums: wrong numbers, the
                 same kernels otherwise), so tp minus this is the all-reduces' time;
  share          one GPU running one device's share alone (heads, KV heads, MLP columns and vocabulary divided by --tp),
                 so tp minus this is everything tensor parallelism adds.
--graph-batch N splits each captured step into CUDA graphs of N calls each (tinygrad's default starts at JIT_BATCH_SIZE
calls and doubles each graph), to see whether the host's launch of a multi-device graph holds the GPUs back.
Usage (on the GPU machine): DEV=CUDA python3 bench/tp_overhead.py --tp 4 --part share
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyvllm.cli import main as cli_main
from tinyvllm.model.presets import PRESETS

DECODE = ["--load-format", "dummy", "--dtype", "bfloat16", "--batch-size", "1", "--prompt-len", "128", "--max-tokens", "256",
          "--max-model-len", "4096"]


def share_folder(tp: int) -> str:
  """A model folder holding only the config of one device's share of the Qwen3-8B shape."""
  cfg = dict(PRESETS["qwen3-8b"])
  for key in ("num_attention_heads", "intermediate_size"): cfg[key] //= tp
  cfg["num_key_value_heads"] = max(1, cfg["num_key_value_heads"] // tp)
  cfg["vocab_size"] = -(-cfg["vocab_size"] // tp)
  folder = Path(tempfile.mkdtemp(prefix="qwen3-8b-share"))
  (folder / "config.json").write_text(json.dumps(cfg))
  return str(folder)


def _constant_graph_batches(size: int) -> None:
  """tinygrad's split of a captured step into graphs, with every graph `size` calls (bench-only patch)."""
  from tinygrad.engine import jit
  original = jit.graph_split_rewrite
  def split(linear, max_batch_size: int = 0):
    calls, out = list(linear.src), []
    for start in range(0, len(calls), size):
      out += list(original(linear.replace(src=tuple(calls[start:start + size])), max_batch_size=0).src)
    graphs = sum(1 for u in out if u.op.name == "CALL" and u.src[0].op.name == "CUSTOM_FUNCTION")
    print(f"[tp_overhead] {len(calls)} calls split into {graphs} graphs", file=sys.stderr)
    return linear.replace(src=tuple(out))
  jit.graph_split_rewrite = split


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tp", type=int, required=True)
  ap.add_argument("--part", choices=("tp", "no_all_reduce", "share"), required=True)
  ap.add_argument("--graph-batch", type=int, default=0, help="calls a CUDA graph (0: tinygrad's doubling batches)")
  args = ap.parse_args()
  if args.graph_batch: _constant_graph_batches(args.graph_batch)
  if args.part == "share": return cli_main(["bench", "decode", "--model", share_folder(args.tp), *DECODE])
  if args.part == "no_all_reduce":
    from tinyvllm.kernels.all_reduce import PeerAllReduce
    PeerAllReduce.all_reduce = lambda self, partial, residual=None: partial
  return cli_main(["bench", "decode", "--model", "qwen3-8b", *DECODE, "-tp", str(args.tp)])


if __name__ == "__main__":
  sys.exit(main())
