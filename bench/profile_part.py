"""One part of bench/gpu_benchmarks.py under cProfile: prints the functions with the most cumulative and own time and
saves the profile (`python -m pstats FILE` reads it).

Usage (on the GPU machine, from the repo root): DEV=CUDA python bench/profile_part.py startup --out /tmp/startup.prof
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_benchmarks


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("part", choices=list(gpu_benchmarks.PARTS))
  p.add_argument("--out", required=True, help="where the profile is saved")
  p.add_argument("--top", type=int, default=40)
  args = p.parse_args()
  profile = cProfile.Profile()
  profile.runcall(gpu_benchmarks.PARTS[args.part])
  profile.dump_stats(args.out)
  stats = pstats.Stats(profile).strip_dirs()
  stats.sort_stats("cumulative").print_stats(args.top)
  stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__": main()
