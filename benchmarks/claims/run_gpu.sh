#!/usr/bin/env bash
# The claims' `tiny` training runs (3 seeds, eager) on one GPU, then the gate claim's kernel timing.
# A `tiny` run of 200 steps takes ~40 s alone on an H200, so all six claims take ~45 min one after another.
# Two modes:
#   bash benchmarks/claims/run_gpu.sh [CLAIM...]       one claim after another (default: all six)
#   CLAIMS_PAR="gate:--no-kernel;stages;attnres:--block-sizes 1;attnres:--block-sizes 2,4 --no-standard" \
#     bash benchmarks/claims/run_gpu.sh                 these jobs side by side ("claim[:flags]"; jobs of one claim
#                                                       share its output directory, one variant set each)
#   A claim whose one sweep is too long for a job splits its seeds: "mla_gate:--seeds 1 --first-seed 1 --out
#   /tmp/claims/mla_gate.1" (a job's --out wins; keep it under CLAIMS_WORK); afterwards, anywhere,
#   `python benchmarks/claims/mla_gate.py --out DIR --merge DIR.1 DIR.2` takes those runs in and reports all seeds.
# Side by side, each job gets 2 CPU threads: a launch-bound `tiny` step leaves the GPU idle between kernels, but
# jobs with the default threads oversubscribe the CPU (9 jobs x 16 threads: 276 s per run, docs/LOG.md).
# The sweeps resume: a point finished in an earlier call is not re-run when its results are put back under
# CLAIMS_WORK, and re-running a claim script over the merged directory (any device) rewrites its report.
# Results (json / jsonl / md / csv / png, no checkpoints) go to $OUT/claims_results.tgz (unpack it into CLAIMS_WORK
# to resume or re-report), also when a job hits its timeout.
# Usage (from gpu_run.sh's environment); CLAIM_ARGS adds flags to every job.
set -u
OUT=${OUT:-/tmp/out}; W=${CLAIMS_WORK:-/tmp/claims}; mkdir -p "$OUT/claims" "$W"
# the device returns only plain names in shallow trees (the sweeps' run directories have '=', spaces, parentheses and
# five levels) and only the first ~8 files (top-level files first): every result file goes into one archive at the
# top of $OUT, and each claim's report (.md) also as a flat copy in $OUT/claims to read at once
copy_results() {
  (cd "$W" && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.csv' -o -name '*.png' \) \
    -size -2M -print0 | tar czf "$OUT/claims_results.tgz" --null -T -)
  for f in "$W"/*/*.md; do
    [ -f "$f" ] && cp "$f" "$OUT/claims/$(basename "$(dirname "$f")")_$(basename "$f")"
  done
  du -sh "$OUT/claims_results.tgz"
}
kernel=0
if [ -n "${CLAIMS_PAR:-}" ]; then
  IFS=';' read -ra jobs <<< "$CLAIMS_PAR"
  i=0
  for j in "${jobs[@]}"; do
    c=${j%%:*}; extra=""; [[ $j == *:* ]] && extra=${j#*:}
    OMP_NUM_THREADS=2 timeout -k 5 ${CLAIM_TIMEOUT:-3000} python3 benchmarks/claims/$c.py --device cuda \
      --compile none --threads 2 ${CLAIM_ARGS:-} --out "$W/$c" $extra > "$OUT/claims/$c.$i.log" 2>&1 &
    i=$((i + 1))
  done
  wait
  [ -n "${CLAIMS_KERNEL:-}" ] && kernel=1
else
  claims=${*:-"gate attnres situ mla_gate balancing stages"}
  for c in $claims; do
    case $c in
      gate) extra="--no-kernel"; kernel=1 ;;                  # kernel timing runs alone below
      mla_gate) extra="--steps ${MLA_GATE_STEPS:-400}" ;;      # a sink needs longer training than the others
      stages) extra="--equal-time" ;;
      *) extra="" ;;
    esac
    timeout -k 5 ${CLAIM_TIMEOUT:-3000} python3 benchmarks/claims/$c.py --device cuda --compile none ${CLAIM_ARGS:-} \
      $extra --out "$W/$c" > "$OUT/claims/$c.log" 2>&1
    echo "$c rc=$?" | tee -a "$OUT/claims/$c.log"
  done
fi
if [ $kernel = 1 ]; then
  timeout -k 5 120 python3 benchmarks/claims/gate.py --device cuda --no-train --kernel-shape 1,8192,96,128 \
    --backends fla,triton,torch --out "$W/gate_kernel" > "$OUT/claims/gate_kernel.log" 2>&1
fi
copy_results
