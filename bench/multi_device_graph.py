"""Does one CUDA graph over several GPUs run their kernels slower than one graph a GPU? (bench-only; docs/benchmarks.md
section 14, where a tensor-parallel step runs 0.6 ms slower than one device's share alone.)

Each GPU runs the same chain of --kernels dependent elementwise kernels over --mib MiB (about a decode step's count of
small kernels), the chains independent of each other, captured three ways:
  one:        one GPU's chain alone (its own graph);
  multi:      every GPU's chain in one TinyJit (tinygrad puts the GPUs' kernels into multi-device graphs);
  sharded:    one chain over a tensor sharded across the GPUs (each op one call on every GPU, as tensor parallelism's);
  tp_like:    sharded, plus a small input on the first GPU copied to every GPU first and a small output gathered to the
              first GPU last (a tensor-parallel step's packed input and logits); broadcast_only, gather_only: one of the two;
  per_device: a TinyJit a GPU (a graph each), launched one after another, then all synchronised.
Prints the median ms per replay of each.
Usage (on the GPU machine): DEV=CUDA python3 bench/multi_device_graph.py --devices 4
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from tinygrad import Device, Tensor, TinyJit


def chain(x: Tensor, kernels: int) -> Tensor:
  for _ in range(kernels): x = (x * 0.999 + 0.001).contiguous()
  return x


def timed(run, sync, repeats: int) -> float:
  """Median ms of run() followed by sync(), after warm-up replays (the captures)."""
  for _ in range(3): run()
  sync()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    run()
    sync()
    times.append(time.perf_counter() - t)
  return float(np.median(times)) * 1e3


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", type=int, default=4)
  ap.add_argument("--kernels", type=int, default=300)
  ap.add_argument("--mib", type=float, default=4.0)
  ap.add_argument("--repeats", type=int, default=30)
  args = ap.parse_args()
  base = Device.DEFAULT
  devices = [f"{base}:{i}" for i in range(args.devices)]
  n = int(args.mib * (1 << 20)) // 4
  xs = [Tensor.ones(n, device=d).contiguous().realize() for d in devices]
  sharded = Tensor.ones(args.devices, n).shard(tuple(devices), axis=0).contiguous().realize()
  sync = lambda: [Device[d].synchronize() for d in devices]

  one_jit = TinyJit(lambda x: chain(x, args.kernels))
  multi_jit = TinyJit(lambda *xs: [chain(x, args.kernels) for x in xs])
  sharded_jit = TinyJit(lambda x: chain(x, args.kernels))
  small = Tensor.ones(256, device=devices[0]).contiguous().realize()
  def tp_like(p: Tensor, x: Tensor) -> Tensor:
    y = chain(x + p.to(tuple(devices))[:1].reshape(1, 1), args.kernels)
    return y[:, :256].contiguous().to(devices[0])
  tp_jit = TinyJit(tp_like)
  broadcast_jit = TinyJit(lambda p, x: chain(x + p.to(tuple(devices))[:1].reshape(1, 1), args.kernels))
  gather_jit = TinyJit(lambda x: chain(x, args.kernels)[:, :256].contiguous().to(devices[0]))
  per_jits = [TinyJit(lambda x: chain(x, args.kernels)) for _ in devices]
  result = {"devices": args.devices, "kernels": args.kernels, "mib": args.mib,
            "one_ms": timed(lambda: one_jit(xs[0]), sync, args.repeats),
            "multi_ms": timed(lambda: multi_jit(*xs), sync, args.repeats),
            "sharded_ms": timed(lambda: sharded_jit(sharded), sync, args.repeats),
            "tp_like_ms": timed(lambda: tp_jit(small, sharded), sync, args.repeats),
            "broadcast_only_ms": timed(lambda: broadcast_jit(small, sharded), sync, args.repeats),
            "gather_only_ms": timed(lambda: gather_jit(sharded), sync, args.repeats),
            "per_device_ms": timed(lambda: [jit(x) for jit, x in zip(per_jits, xs, strict=True)], sync, args.repeats)}
  print(json.dumps(result), flush=True)
  if out := os.environ.get("OUT"): Path(out, f"multi_device_graph_{args.devices}.json").write_text(json.dumps(result, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
