#!/usr/bin/env bash
# Before/after timing of two k3 builds on one GPU machine, side by side in one call (device tool): the working tree
# ("after") and another tree at $BEFORE (e.g. `git archive <commit> | tar -x -C .before`), alternating
# after/before/after/before so drift shows up. Stages: kda (our KDA forward, default launch, vs fla in the same
# process) and decode (the CUDA-graph decode step of `small` at 4K and 1M context).
# Usage: BEFORE=.before bash benchmarks/ab_builds.sh kda decode     (REPS=N alternations, default 2)
#   KDA_ARGS_BEFORE: extra kda_triton.py flags for the before-tree (an older CLI, e.g. "--variants c16p").
# Needs the fla wheels in .whl (carried) as benchmarks/gpu_run.sh does. Results: $OUT/ab_<stage>_<build>_<rep>.json.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BEFORE=$(cd "${BEFORE:?set BEFORE to the other tree}" && pwd)   # absolute: each stage runs inside its tree
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
AFTER=$PWD
[ -f benchmarks/h200/fla-0.6.0-triton-3.6-autotune.tgz ] && PYTHONPATH=/tmp/site:$AFTER \
  python3 benchmarks/fla_warmup.py --unpack benchmarks/h200/fla-0.6.0-triton-3.6-autotune.tgz >/dev/null 2>&1
run() {  # run STAGE BUILD REP
  local stage=$1 build=$2 rep=$3 dir extra=""
  if [ "$build" = before ]; then dir=$BEFORE; extra=${KDA_ARGS_BEFORE:-}; else dir=$AFTER; fi
  local json="$OUT/ab_${stage}_${build}_${rep}.json"
  echo "=== $stage $build rep $rep ($(date +%T))"
  case $stage in
    kda) (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout -k 5 ${KDA_LIMIT:-100} python3 benchmarks/kda_triton.py \
           --no-accuracy $extra --prep-configs '["default"]' --state-configs none \
           --shapes ${KDA_SHAPES:-B8_T8K,B1_T128K} --json "$json" --budget-s ${KDA_BUDGET:-80} 2>&1 | tail -n 12) ;;
    decode) (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout -k 5 ${DECODE_LIMIT:-90} python3 benchmarks/decode.py \
           --device cuda --preset small --contexts ${DECODE_CONTEXTS:-4096,1048576} --models hybrid --steps 20 \
           --real-prefill-max 4096 --prefill-chunk 4096 --cuda-graph --json "$json" 2>&1 | tail -n 8) ;;
    *) echo "unknown stage $stage" ;;
  esac
}
for stage in "$@"; do
  for rep in $(seq 1 ${REPS:-2}); do run "$stage" after $rep; run "$stage" before $rep; done
done
