#!/usr/bin/env bash
# Nsight Compute's view of single skinny products (bench/skinny_bench.py --layout): duration, throughput, occupancy and
# warp stalls of the first launch of each variant, one report a variant under $OUT/ncu_<shape>_<rpw>_<ksplit>.txt.
#   bash bench/skinny_ncu.sh 1b_down_int4:4:8 1b_down_int4:8:8
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for spec in "$@"; do
  IFS=: read -r shape rpw ksplit <<< "$spec"
  ncu --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis -k regex:tv_linear -c 1 \
    python3 bench/skinny_bench.py --only "$shape" --layout "$rpw:$ksplit" --replays 1 \
    > "$OUT/ncu_${shape}_${rpw}_${ksplit}.txt" 2>&1
done
