#!/usr/bin/env bash
# Every claim's training runs (`tiny`, 3 seeds, eager) on one GPU, one script after another (processes side by side
# time-slice the GPU: 9 at once ran each 200-step run 5-7x slower, docs/LOG.md), then the gate claim's kernel timing.
# A `tiny` run of 200 steps takes ~40 s on an H200, so all six claims take ~45 min: pass a subset (CLAIM...).
# Results (json / jsonl / md / csv / png, no checkpoints) go to $OUT/claims/.
# Usage (from gpu_run.sh's environment): bash benchmarks/claims/run_gpu.sh [CLAIM...]; CLAIM_ARGS adds flags.
set -u
OUT=${OUT:-/tmp/out}; W=${CLAIMS_WORK:-/tmp/claims}; mkdir -p "$OUT/claims" "$W"
claims=${*:-"gate attnres situ mla_gate balancing stages"}
for c in $claims; do
  case $c in
    gate) extra="--no-kernel" ;;                             # kernel timing runs alone below
    mla_gate) extra="--steps ${MLA_GATE_STEPS:-400}" ;;      # a sink needs longer training than the others
    stages) extra="--equal-time" ;;
    *) extra="" ;;
  esac
  timeout -k 5 ${CLAIM_TIMEOUT:-3000} python3 benchmarks/claims/$c.py --device cuda --compile none ${CLAIM_ARGS:-} \
    $extra --out "$W/$c" > "$OUT/claims/$c.log" 2>&1
  echo "$c rc=$?" | tee -a "$OUT/claims/$c.log"
done
if [[ " $claims " == *" gate "* ]]; then
  timeout -k 5 120 python3 benchmarks/claims/gate.py --device cuda --no-train --kernel-shape 1,8192,96,128 \
    --backends fla,triton,torch --out "$W/gate_kernel" > "$OUT/claims/gate_kernel.log" 2>&1
fi
cd "$W" && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.csv' -o -name '*.png' \) \
  -size -2M -exec cp --parents {} "$OUT/claims/" \;
du -sh "$OUT/claims"
