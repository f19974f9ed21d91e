"""Registers a thread and resident blocks an SM of the skinny product's decode specialisations, by ptxas (no GPU needed:
nvcc on the PATH), for the shapes of bench/skinny_bench.py and Qwen3-8B's all-reducing products at TP=2 and TP=4.

A product's epilogue shares the kernel's register budget: ptxas allocates for the busiest point, so an epilogue that
keeps many loads in flight lowers how many blocks an SM holds for the whole product (docs/benchmarks.md section 14).

Usage: python bench/kernel_registers.py [--rows 1] [--sms 132] [--arch sm_90]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.skinny_bench import SHAPES
from tinyvllm.kernels.linear import LinearShape, linear_plan
from tinyvllm.kernels.sources import kernel_source

# (name, out_features, in_features, prologue/epilogue, weight, all-reduce group): a device's share of Qwen3-8B's
# row-parallel products, which all-reduce their own outputs
ALL_REDUCING = (("8b_tp2_o", 4096, 2048, {"residual": True}, "elem", 2),
                ("8b_tp2_down", 4096, 6144, {"silu_mul": True, "residual": True}, "elem", 2),
                ("8b_tp4_o_ar", 4096, 1024, {"residual": True}, "elem", 4),
                ("8b_tp4_down_ar", 4096, 3072, {"silu_mul": True, "residual": True}, "elem", 4))
THREADS_PER_SM, REGISTERS_PER_SM, BLOCKS_PER_SM = 2048, 65536, 32


def linear_shape_of(rows: int, spec: tuple) -> LinearShape:
  _name, o, k, opts, weight, *group = spec
  return LinearShape("bfloat16", rows, k, o, False, 1e-6 if opts.get("norm") else None, bool(opts.get("silu_mul")),
                     bool(opts.get("residual")), bool(opts.get("out_float32")), weight,
                     0 if weight == "elem" else 128 if weight == "int4" else k, group[0] if group else 0)


def registers(source: str, arch: str) -> int:
  """ptxas's registers a thread for the one kernel in `source`."""
  with tempfile.TemporaryDirectory() as d:
    path = Path(d) / "kernel.cu"
    path.write_text(source)
    done = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-o", str(Path(d) / "kernel.cubin"), "-Xptxas", "-v", str(path)],
                          capture_output=True, text=True, check=True)
  return int(re.findall(r"Used (\d+) registers", done.stderr)[0])


def resident_blocks(threads: int, regs: int) -> int:
  """Blocks of `threads` an SM holds with `regs` registers a thread (allocated per warp in units of 256)."""
  per_warp = -(-regs * 32 // 256) * 256
  return min(THREADS_PER_SM // threads, REGISTERS_PER_SM // (per_warp * (threads // 32)), BLOCKS_PER_SM)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--rows", type=int, default=1)
  p.add_argument("--sms", type=int, default=132, help="multiprocessors (an H100 SXM's 132)")
  p.add_argument("--arch", default="sm_90")
  args = p.parse_args()
  for spec in (*SHAPES, *ALL_REDUCING):
    shape = linear_shape_of(args.rows, spec)
    plan = linear_plan(shape)
    regs = registers(kernel_source("cuda", "linear_all_reduce" if shape.all_reduce else "linear", plan.defines), args.arch)
    threads, grid = int(plan.defines["TV_NT"]), plan.launch.grid[0]
    blocks = resident_blocks(threads, regs)
    print(f"{spec[0]:18} layout ({plan.defines['TV_RPW']}, {plan.defines['TV_KSPLIT']:2}) {threads:4} threads x {grid:6} blocks: "
          f"{regs:3} registers, {blocks:2} blocks an SM, {grid / (blocks * args.sms):6.2f} waves", flush=True)


if __name__ == "__main__":
  main()
