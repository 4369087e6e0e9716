#!/usr/bin/env bash
# Every claim's training runs (`tiny`, 3 seeds, eager) on one GPU: the scripts (and slices of the AttnRes variants)
# side by side, since a `tiny` step is launch-bound and one run leaves the GPU mostly idle; then each script once
# more over the same directories (finished points are not re-run) to write the combined report, then the gate
# claim's kernel timing alone. Results (json / jsonl / md / csv / png, no checkpoints) go to $OUT/claims/.
# Usage (from gpu_run.sh's environment): bash benchmarks/claims/run_gpu.sh [CLAIM...]; CLAIM_ARGS adds flags.
set -u
OUT=${OUT:-/tmp/out}; W=${CLAIMS_WORK:-/tmp/claims}; mkdir -p "$OUT/claims" "$W"
claims=${*:-"gate attnres situ mla_gate balancing stages"}
common="--device cuda --compile none ${CLAIM_ARGS:-}"
args_of() {  # the claim's own flags
  case $1 in
    gate) echo "--no-kernel" ;;                             # kernel timing runs alone below
    mla_gate) echo "--steps ${MLA_GATE_STEPS:-400}" ;;      # a sink needs longer training than the others
    stages) echo "--equal-time" ;;
  esac
}
launch() {  # launch NAME LOG ARGS...
  local c=$1 log=$2; shift 2
  ( timeout -k 5 ${CLAIM_TIMEOUT:-400} python3 benchmarks/claims/$c.py $common "$@" > "$log" 2>&1
    echo "rc=$?" >> "$log" ) &
}
for c in $claims; do
  if [ "$c" = attnres ]; then  # 6 variants x 3 seeds: three slices at once, one report after
    launch attnres "$OUT/claims/attnres.1.log" --block-sizes 1 --out "$W/attnres"
    launch attnres "$OUT/claims/attnres.2.log" --block-sizes 2,3 --no-standard --out "$W/attnres"
    launch attnres "$OUT/claims/attnres.3.log" --block-sizes 4,8 --no-standard --out "$W/attnres"
  else
    launch $c "$OUT/claims/$c.log" $(args_of $c) --out "$W/$c"
  fi
done
wait
for c in $claims; do  # the combined reports (everything above resumes as finished)
  [ "$c" = attnres ] && launch attnres "$OUT/claims/attnres.log" --out "$W/attnres"
done
wait
if [[ " $claims " == *" gate "* ]]; then
  timeout -k 5 120 python3 benchmarks/claims/gate.py --device cuda --no-train --kernel-shape 1,8192,96,128 \
    --backends fla,triton,torch --out "$W/gate_kernel" > "$OUT/claims/gate_kernel.log" 2>&1
fi
cd "$W" && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.csv' -o -name '*.png' \) \
  -size -2M -exec cp --parents {} "$OUT/claims/" \;
du -sh "$OUT/claims"; tail -n 3 "$OUT"/claims/*.log
