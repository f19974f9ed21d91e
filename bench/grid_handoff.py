"""What a grid-wide handoff costs on the GPU: the floor under any batch-1 decode step whose layers run in one persistent
kernel, since each layer's products need every element of a vector that every block helped compute.

One persistent launch of B blocks (one an SM, all resident) runs R rounds; a round is
  barrier   the layer kernel's grid barrier alone (csrc/cuda/decode_layer_ops.inc's tv_grid_sync: a release add, an
            acquire spin);
  vector    each block writes its slice of a LEN-float vector, the barrier, then every block reads the whole vector
            (the RMSNorm's input of the next product: the handoff every phase of the layer kernel makes);
  reduce    each block adds a partial LEN-float vector into the round's sums (float atomics at L2: a K-split product's
            reduction), the barrier, then every block reads the sums (the least a layer needs twice: after o and down).
Time a round = (wall time of the launch - that of a launch of no rounds) / R, the medians of five launches.

With --splits, the barrier's arrivals spread over that many counters (block b's on counter b % S), lane i of each
block's first warp waiting on counter i.

  DEV=CUDA python3 bench/grid_handoff.py [--rounds 2000] [--blocks 132,264] [--splits 1,8]   writes $OUT/grid_handoff.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {"barrier": 0, "vector": 1, "reduce": 2}
LEN, THREADS = 1024, 256   # Qwen3-0.6B's hidden size; a thread's share of the vector read is one float4

BODY = r"""
extern "C" __global__ void __launch_bounds__(TV_NT) tv_handoff(float* out, unsigned* sync, float* vec) {
  TV_WAIT_PRIOR_GRIDS();
  const int nb = gridDim.x, b = blockIdx.x, t = threadIdx.x;
  float acc = 0.0f;
  for (int r = 0; r < TV_ROUNDS; r++) {
    float* v = vec + (long long)r * TV_LEN;   // a round's own vector: no block rewrites one another may still read
#if TV_MODE == 1
    for (int i = b * TV_NT + t; i < TV_LEN; i += nb * TV_NT) v[i] = (float)(r + i);
#elif TV_MODE == 2
    for (int i = t; i < TV_LEN; i += TV_NT) atomicAdd(v + i, (float)(b + i));
#endif
    __syncthreads();
    // TV_SPLIT counters 128 bytes apart: block b arrives on counter b % TV_SPLIT; lane i of warp 0 waits for counter i's
    // blocks (each counter then takes a share of the arrivals and of the polls)
    if (t == 0) asm volatile("red.release.gpu.global.add.u32 [%0], %1;" : : "l"(sync + b % TV_SPLIT * 32), "r"(1u) : "memory");
    if (t < TV_SPLIT) {
      unsigned seen;
      const unsigned target = (unsigned)(r + 1) * (unsigned)((nb - t + TV_SPLIT - 1) / TV_SPLIT);
      do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(sync + t * 32) : "memory"); } while (seen < target);
    }
    __syncthreads();
#if TV_MODE >= 1
    if (t * 4 < TV_LEN) {
      const float4 x = __ldcg(reinterpret_cast<const float4*>(v) + t);
      acc += x.x + x.y + x.z + x.w;
    }
#endif
  }
  out[b * TV_NT + t] = acc;
}
"""


def launch_time(device: str, mode: str, blocks: int, rounds: int, split: int = 1) -> float:
  """Median wall seconds of five launches of `rounds` rounds (each on zeroed counters and sums)."""
  from tinygrad import Device, Tensor, dtypes

  from tinyvllm.kernels.plan import Launch, Param
  from tinyvllm.kernels.sources import kernel_source
  from tinyvllm.kernels.tinygrad_program import run_kernel
  source = kernel_source("cuda", "grid_handoff", {"TV_NT": THREADS, "TV_LEN": LEN, "TV_ROUNDS": rounds, "TV_MODE": MODES[mode],
                                              "TV_SPLIT": split},
                         body=BODY)
  vec_len = max(1, rounds) * LEN
  launch = Launch("tv_handoff", (blocks, 1, 1), THREADS, (Param("out", "float", True, blocks * THREADS),
                  Param("sync", "uint", True, 32 * split), Param("vec", "float", True, vec_len)), cooperative=True)
  times = []
  for _ in range(6):
    out = Tensor.zeros(blocks * THREADS, dtype=dtypes.float32, device=device).contiguous().realize()
    sync = Tensor.zeros(32 * split, dtype=dtypes.uint32, device=device).contiguous().realize()
    vec = Tensor.zeros(vec_len, dtype=dtypes.float32, device=device).contiguous().realize()
    Device[device].synchronize()
    start = time.perf_counter()
    Tensor.realize(*run_kernel(launch, source, [out, sync, vec]))
    Device[device].synchronize()
    times.append(time.perf_counter() - start)
  return statistics.median(times[1:])   # (the first compiles)


def main() -> None:
  from tinygrad import Device
  p = argparse.ArgumentParser()
  p.add_argument("--rounds", type=int, default=2000)
  p.add_argument("--blocks", default="132,264")
  p.add_argument("--splits", default="1", help="arrival counters (128 bytes apart), comma-separated")
  args = p.parse_args()
  device = Device.DEFAULT
  records = []
  for blocks in map(int, args.blocks.split(",")):
    for split in map(int, args.splits.split(",")):
      for mode in MODES:
        empty = launch_time(device, mode, blocks, 0, split)
        full = launch_time(device, mode, blocks, args.rounds, split)
        us = (full - empty) / args.rounds * 1e6
        records.append({"mode": mode, "blocks": blocks, "split": split, "rounds": args.rounds, "us_a_round": round(us, 3),
                        "launch_us": round(empty * 1e6, 1)})
        print(f"{mode:8} {blocks:4} blocks, {split:2} counters: {us:6.3f} us a round (a launch of none {empty * 1e6:6.1f} us)",
              flush=True)
  if out := os.environ.get("OUT"): Path(out, "grid_handoff.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
  main()
