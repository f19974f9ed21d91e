#!/usr/bin/env bash
# Nsight Compute's sections (speed of light, memory workload, occupancy, scheduler and warp-state statistics) and each
# warp-stall reason's cycles per issued instruction for the first NCU_COUNT kernels matching NCU_KERNELS in the captured
# decode steps of bench/ncu_step.py (each kernel on its own, caches flushed, so weights come from HBM; clocks left
# alone), the report in $OUT/ncu_sections_<batch>.txt.
#   NCU_BATCH=256 NCU_COUNT=6 bash bench/ncu_sections.sh      # one sparse layer's products and attention
set -u
OUT=${OUT:-/tmp/out}
batch=${NCU_BATCH:-256}
mkdir -p "$OUT"
ncu --profile-from-start off --graph-profiling node --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section Occupancy --section SchedulerStats --section WarpStateStats --section LaunchStats \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  -k "regex:${NCU_KERNELS:-^(tv_gemm|tv_paged_prefill_tc)$}" -c "${NCU_COUNT:-6}" \
  python3 bench/ncu_step.py --model "${NCU_MODEL:-qwen3-30b-a3b}" --batch "$batch" --steps 1 \
  > "$OUT/ncu_sections_$batch.txt" 2>&1
status=$?
grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|stalled|Warp Cycles Per Issued|Issued Warp|L2 Hit|Block Limit|Waves Per SM" \
  "$OUT/ncu_sections_$batch.txt" | head -200
exit $status
