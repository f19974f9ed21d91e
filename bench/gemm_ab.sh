#!/usr/bin/env bash
# The planned tensor-core GEMMs (bench/gemm_bench.py, GEMM_ONLY_PLANNED=1, no checks) of another checkout (e.g. main
# before a change, exported with `git archive REV | tar -x -C .before`) and this one alternating, for each weight format
# of GEMM_FORMATS ("none" = bf16; those also in THIS_ONLY run on this checkout alone), ROUNDS times. Each run's lines
# under $OUT/gemm_ab/<side>-<format>-<round>.txt; a table of µs a call, one column a run, in $OUT/gemm_ab.txt.
#   ROUNDS=2 GEMM_FORMATS="none int8 int4" THIS_ONLY=none bash bench/gemm_ab.sh .before --rows 64,256 --projections gate_up
set -u
other=$1
shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/gemm_ab"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
run() {   # side, checkout, format, round, gemm_bench arguments
  local quant=()
  [ "$3" = none ] || quant=(GEMM_QUANT="$3")
  (cd "$2" && env PYTHONPATH="/tmp/site:$PWD" DEV=CUDA GEMM_NO_CHECK=1 GEMM_ONLY_PLANNED=1 "${quant[@]}" \
    python3 bench/gemm_bench.py "${@:5}" 2>&1 | grep "'kind': 'gemm'}" > "$OUT/gemm_ab/$1-$3-$4.txt")
}
for r in $(seq 1 "${ROUNDS:-1}"); do
  for q in ${GEMM_FORMATS:-none int8}; do
    [[ " ${THIS_ONLY:-} " == *" $q "* ]] || run before "$other" "$q" "$r" "$@"
    run after "$PWD" "$q" "$r" "$@"
  done
done
python3 - "$OUT/gemm_ab" > "$OUT/gemm_ab.txt" <<'EOF_PY'
import re, sys
from pathlib import Path
runs = {f.stem: {f"{m[1]} m={m[2]}": m[3] for m in re.finditer(r"(\w+)\s+m=\s*(\d+) \{'kind': 'gemm'\}\s+([\d.]+) us", f.read_text())}
        for f in sorted(Path(sys.argv[1]).glob("*.txt"))}
products = list(dict.fromkeys(p for times in runs.values() for p in times))
print("product | " + " | ".join(runs))
for p in products: print(f"{p} | " + " | ".join(times.get(p, "-") for times in runs.values()))
EOF_PY
cat "$OUT/gemm_ab.txt"
