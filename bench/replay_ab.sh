#!/usr/bin/env bash
# bench/decode_ab.sh measuring the GPU's step alone (MEASURE=replay: the captured decode graph replayed back to back,
# bench/gpu_profile.py --replay-only), free of the host's pace. Arguments as decode_ab.sh's; lines in $OUT/replay_ab.txt.
#   ROUNDS=2 bash bench/replay_ab.sh .before "llama-3.2-1b --quantization int4"
MEASURE=replay exec bash "$(dirname "$0")/decode_ab.sh" "$@"
