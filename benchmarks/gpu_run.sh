#!/usr/bin/env bash
# One H200 session step (device tool). Usage: bash benchmarks/gpu_run.sh STAGE [STAGE...]
# Needs: fla wheels in .whl (carried), optional .tcache/autotune.tgz (carried) from an earlier warm-up.
# Every step runs under its own timeout and appends to $OUT/log.txt; results land in $OUT/*.json.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p $TRITON_CACHE_DIR
# fla autotune winners from an earlier H200 run (fla 0.6.0, triton 3.6.0): a fresh carried pack wins over the
# committed one; Triton ignores entries whose source/compiler hash does not match
for f in benchmarks/h200/fla-0.6.0-triton-3.6-autotune.tgz .tcache/autotune.tgz; do
  [ -f "$f" ] && python3 benchmarks/fla_warmup.py --unpack "$f"
done
step() {  # step NAME SECONDS CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name ($(date +%T), limit ${t}s): $*" | tee -a "$OUT/log.txt"
  local s=$(date +%s)
  timeout -k 5 "$t" "$@" 2>&1 | tee -a "$OUT/log.txt" | tail -n 60
  echo "=== $name rc=${PIPESTATUS[0]} $(( $(date +%s) - s ))s" | tee -a "$OUT/log.txt"
}
for stage in "$@"; do case $stage in
  warm) step warm 330 python3 benchmarks/fla_warmup.py --shapes 96x128,8x128,4x64 --pack "$OUT/autotune.tgz" ;;
  tests) step warm-tests 150 python3 benchmarks/fla_warmup.py --shapes 8x128 --attnres "" --T 1024
         step tests 300 python3 -m pytest -q -s --timeout 120 --durations=10 tests/gpu -k "not tiny_model and not bf16_params_train" ;;
  tests-decode) step tests-decode 330 python3 -m pytest -v -s --timeout 150 --durations=5 \
      tests/generation/test_static_decode.py ;;
  kdafwdlong) step kdafwdlong 260 python3 benchmarks/kda_triton.py --no-accuracy \
      --prep-configs '["default"]' --state-configs long_bv32_s3,long_bv64_s3,long_bv16_s3,base_s3 \
      --shapes B1_T128K,B2_T32K --json "$OUT/kda_triton_long.json" --budget-s 230 ;;
  tests-train) step tests-train 330 python3 -m pytest -q -s -o faulthandler_timeout=280 --timeout 310 \
      tests/gpu/test_gpu_train.py ;;
  situtest) step situtest 120 python3 -m pytest -q -s --timeout 100 tests/gpu/test_gpu_numerics.py -k situ ;;
  tests-bwd) step tests-bwd 200 python3 -m pytest -q -s --timeout 150 tests/gpu -k "kda_triton_backward" ;;
  # eighth session: the conv backward restricted to its tiled launch options (the control for the rolling ones)
  trainbf16-convtiles) step trainbf16-convtiles 300 env K3_CONV_BWD=tiles python3 benchmarks/gpu_model.py --train \
      --batch 8 --seq 4096 --steps 5 --compile modules --bf16-params ;;
  # eighth session: the pipelined forward (prep of piece p + 1 overlapping the walk of piece p) at every shape
  pipetest) step pipetest 150 python3 -m pytest -q -s --timeout 120 tests/gpu/test_gpu_numerics.py -k "pipelined" ;;
  kdapipe) step kdapipe 290 python3 benchmarks/kda_triton.py --no-accuracy \
      --prep-configs '["default"]' --state-configs ${PIPE_CONFIGS:-nopipe,pipe4k,pipe8k,pipe8k_lpt,pipe4k_lpt} \
      --state-every-shape --shapes ${PIPE_SHAPES:-B1_T128K,B2_T32K,varlen,B8_T8K} --json "$OUT/kda_pipe.json" \
      --budget-s 260 ;;
  # ninth session's next-run item 4: the varlen prep with several chunk groups per program and the next group's
  # loads (chunk table included) in flight during the current one's compute
  kdavarlen) step kdavarlen 200 python3 benchmarks/kda_triton.py --no-accuracy --state-configs none \
      --prep-configs '["default", {"loop2_pf": {"loop": 2, "prefetch": true}}, {"loop4_pf": {"loop": 4, "prefetch": true}}, {"loop2": {"loop": 2}}]' \
      --top 4 --shapes varlen,B8_T8K --json "$OUT/kda_varlen.json" --budget-s 170 ;;
  kdafwd4) step kdafwd4 260 python3 benchmarks/kda_triton.py --no-accuracy --prep-configs '["default"]' \
      --state-configs none --shapes B8_T8K,varlen,B2_T32K,B1_T128K --json "$OUT/kda_triton_fwd4.json" --budget-s 230 ;;
  tests-model) step tests-model 200 python3 -m pytest -q -s --timeout 120 --durations=0 tests/gpu -k tiny_model ;;
  # BWDSWEEP_FLA=SECONDS: then fla's fwd+bwd on the same inputs, with that much more time (its first backward autotunes)
  # fourteenth session's next-run item: our fwd+bwd against fla's at the `small` preset's KDA shape (B8 T4096, 8 heads
  # of 128), where the compiled training step with our backend was 2.5-4% slower (fla may autotune this shape first)
  # (fifteenth session: fla's first backward at this shape autotuned past the 200 s it had: now 420, then its pack)
  bwdsmall) step bwdsmall 420 python3 benchmarks/kda_bwd_sweep.py --B 8 --T 4096 --H 8 --configs default --fla \
      --budget-s 20 --json "$OUT/kda_bwd_small.json"
    step pack 60 python3 -c \
      "import sys; sys.path.insert(0, 'benchmarks'); import fla_warmup as f; print(f.pack('$OUT/autotune.tgz'))" ;;
  bwdsweep) step bwdsweep $(( ${BWDSWEEP_BUDGET:-150} + 40 + ${BWDSWEEP_FLA:-0} )) python3 benchmarks/kda_bwd_sweep.py \
      --budget-s ${BWDSWEEP_BUDGET:-150} --json "$OUT/kda_bwd_sweep.json" ${BWDSWEEP_CONFIGS:+--configs $BWDSWEEP_CONFIGS} \
      $( [ "${BWDSWEEP_FLA:-0}" != 0 ] && echo --fla ) ;;
  # tenth session: the backward's bf16 scratch options, accuracy against the fp32 torch path
  bwdscratch) step bwdscratch 300 python3 benchmarks/kda_bwd_scratch.py ;;
  # eleventh session: fwd+bwd vs fla at every K3 shape (one sequence of 8K / 32K / 128K tokens, the varlen batch),
  # with both sides' per-kernel CUDA times; then fla's autotune winners packed for the next run's .tcache
  bwdall) step bwdall $(( ${KDAFB_BUDGET:-420} + 30 )) python3 benchmarks/kda_triton.py --bwd-only \
      --shapes ${BWDALL_SHAPES:-B8_T8K,varlen,B2_T32K,B1_T128K} --json "$OUT/kda_triton_bwdall.json" \
      --budget-s ${KDAFB_BUDGET:-420} ${BWDALL_ENVS:+--ours-envs "$BWDALL_ENVS"}
    step pack 60 python3 -c \
      "import sys; sys.path.insert(0, 'benchmarks'); import fla_warmup as f; print(f.pack('$OUT/autotune.tgz'))" ;;
  # thirteenth session: Nsight Compute on one backward's kernels (kda_bwd_ncu.py; NCU_ARGS=--fwd for the forward;
  # NCU_SET full / detailed / basic): its details page as text ($OUT/ncu_details.txt) and per kernel in NCU_KERNELS
  # the source page (per-SASS-instruction stall samples, CSV) packed in $OUT/ncu_sass.tgz (the report itself, ~50 MB,
  # stays in /tmp: over the 16 MB per file that comes back; at most 8 files come back)
  ncu) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); NR=/tmp/ncu_rep
       mkdir -p $NR/src
       step ncu ${NCU_BUDGET:-300} "$NCU" --clock-control none --profile-from-start off --set ${NCU_SET:-full} \
         -f -o "$NR/ncu" python3 benchmarks/kda_bwd_ncu.py ${NCU_ARGS:-}
       step ncu-details 120 bash -c "'$NCU' -i '$NR/ncu.ncu-rep' --page details > '$OUT/ncu_details.txt' 2>&1; \
         wc -l '$OUT/ncu_details.txt'"
       for kn in ${NCU_KERNELS:-chunk_matrices wy states dstates value_grad inter_grad intra_grad gate_norm_grad}; do
         step "ncu-sass-$kn" 60 bash -c "'$NCU' -i '$NR/ncu.ncu-rep' --page source --csv --print-source sass \
           -k 'regex:_${kn}_kernel' > '$NR/src/$kn.csv' 2>&1; wc -c '$NR/src/$kn.csv'"
       done
       tar czf "$OUT/ncu_sass.tgz" -C $NR/src . ;;
  # sixteenth session: the sequential passes run next to the parallel kernels (a pipelined backward's potential)
  overlap) step overlap 200 python3 benchmarks/kda_bwd_overlap.py ${OVERLAP_ARGS:-} ;;
  # sixteenth session: gradient accuracy of our backward (per scratch dtype) and fla against the fp64 token loop on
  # the same inputs (the interpreter tests' bf16 cases and K3-shaped ones: calibrates the bf16 tolerances)
  bwdacc) step bwdacc ${BWDACC_BUDGET:-300} python3 benchmarks/kda_bwd_accuracy.py ${BWDACC_ARGS:-} ;;
  bwdnan) step bwdnan 120 python3 benchmarks/kda_bwd_nan.py ;;
  bwd) step bwd $(( ${KDAFB_BUDGET:-150} + 30 )) python3 benchmarks/kda_triton.py --bwd-only --shapes B8_T8K \
      --json "$OUT/kda_triton_bwd.json" --budget-s ${KDAFB_BUDGET:-150} ;;
  ops) step ops 200 python3 benchmarks/gpu_ops.py --quick --only kda,moe,attnres,attn --json "$OUT/gpu_ops.json" ;;
  decode) step decode 90 python3 benchmarks/decode.py --device cuda --preset small --min-context 4096 \
      --max-context 1048576 --steps 10 --real-prefill-max 4096 --prefill-chunk 4096 --cuda-graph \
      --json "$OUT/decode_h200_graph.json" ;;
  decodec) step decodec 150 python3 benchmarks/decode.py --device cuda --preset small --contexts 4096,1048576 \
      --steps 10 --real-prefill-max 4096 --prefill-chunk 4096 --cuda-graph --compile-step \
      --json "$OUT/decode_h200_graph_compiled.json" ;;
  decodeb) step decodeb 150 python3 benchmarks/decode.py --device cuda --preset small --contexts 131072,1048576 \
      --batch 4 --steps 10 --cuda-graph --json "$OUT/decode_h200_graph_b4.json" ;;
  # per output token at 1M with (about) the largest batch each model's cache fits next to its weights on one H200:
  # hybrid 3.4 GB per row -> 28 rows (97 GB), all-MLA 13.5 GB per row -> 8 rows (110 GB); one model at a time
  decodemax) step decodemax-hybrid 150 python3 benchmarks/decode.py --device cuda --preset small --contexts 1048576 \
      --models hybrid --batch ${DECODEMAX_HYBRID:-28} --steps 10 --cuda-graph --json "$OUT/decode_h200_max_hybrid.json"
    step decodemax-mla 150 python3 benchmarks/decode.py --device cuda --preset small --contexts 1048576 \
      --models all-mla --batch ${DECODEMAX_MLA:-8} --steps 10 --cuda-graph --json "$OUT/decode_h200_max_mla.json" ;;
  decodetri) step decodetri 120 env K3_MLA_DECODE=triton python3 benchmarks/decode.py --device cuda --preset small \
      --min-context 4096 --max-context 1048576 --steps 10 --real-prefill-max 4096 --prefill-chunk 4096 --cuda-graph \
      --json "$OUT/decode_h200_graph_mlatriton.json" ;;
  prefill) step prefill 240 python3 benchmarks/prefill.py --tokens 1048576 --chunk 131072 --one-shot 65536,131072 \
      --json "$OUT/prefill_1m.json" ;;
  train) step train 200 python3 benchmarks/gpu_model.py --train --profile --batch 8,4,2 --seq 4096 --steps 5 \
      --compile none,modules ;;
  trainbf16) step trainbf16 300 python3 benchmarks/gpu_model.py --train --batch 8 --seq 4096 --steps 5 \
      --compile modules --bf16-params ;;
  # the trainer's recipe for bf16 parameters: Muon + AdamW with fp32 master weights (k3 train --param-dtype bf16)
  trainmaster) step trainmaster 300 python3 benchmarks/gpu_model.py --train --batch 8 --seq 4096 --steps 5 \
      --compile modules --bf16-params --optimizer k3 ;;
  # the Triton momentum / apply are the CUDA default since the seventh session; this is the foreach control
  trainmaster-foreach) step trainmaster-foreach 300 env K3_MUON_FUSED=0 python3 benchmarks/gpu_model.py --train \
      --batch 8 --seq 4096 --steps 5 --compile modules --bf16-params --optimizer k3 ;;
  optim) step optim 120 python3 benchmarks/optim_gpu.py --json "$OUT/optim_gpu.json" ;;
  conv) step conv 150 python3 benchmarks/conv_gpu.py --json "$OUT/conv_gpu.json" ;;
  moe) step moe 150 python3 benchmarks/moe_gpu.py --json "$OUT/moe_gpu.json" ;;
  convtest) step convtest 150 python3 -m pytest -q -s --timeout 100 tests/gpu/test_gpu_numerics.py -k "conv or experts" ;;
  # controls for the seventh session's CUDA defaults: the short conv on its torch path, the router as fp32 GEMMs
  trainbf16-convtorch) step trainbf16-convtorch 300 env K3_BACKEND=conv:torch python3 benchmarks/gpu_model.py \
      --train --batch 8 --seq 4096 --steps 5 --compile modules --bf16-params ;;
  # thirteenth session's next-run item: the whole compiled step with our KDA forward + backward against fla's
  # (alternate with trainbf16 over two or three runs each: a step moves by ±6% between processes)
  trainbf16-kdatriton) step trainbf16-kdatriton 300 env K3_BACKEND=kda:triton python3 benchmarks/gpu_model.py \
      --train --batch 8 --seq 4096 --steps 5 --compile modules --bf16-params ;;
  trainbf16-router32) step trainbf16-router32 300 env K3_BACKEND=router:fp32 python3 benchmarks/gpu_model.py \
      --train --batch 8 --seq 4096 --steps 5 --compile modules --bf16-params ;;
  trainbf16-ckptce) step trainbf16-ckptce 300 env K3_FUSED_CE=0 python3 benchmarks/gpu_model.py --train --batch 8 \
      --seq 4096 --steps 5 --compile modules --bf16-params ;;
  trainbf16-b12) step trainbf16-b12 300 python3 benchmarks/gpu_model.py --train --batch 12 --seq 4096 --steps 5 \
      --compile modules --bf16-params ;;
  newtests) step newtests 240 python3 -m pytest -q -s --timeout 150 tests/gpu/test_gpu_numerics.py \
      tests/gpu/test_gpu_train.py -k "conv or router or fused_muon or linear_cross" ;;
  trainbf16-fused) step trainbf16-fused 300 env K3_BACKEND=moe_combine:triton python3 \
      benchmarks/gpu_model.py --train --batch 8 --seq 4096 --steps 5 --compile modules --bf16-params ;;
  situ) step situ 120 python3 benchmarks/situ_gpu.py --json "$OUT/situ_gpu.json" ;;
  trainbf16-eagerloss) step trainbf16-eagerloss 300 python3 benchmarks/gpu_model.py --train --batch 8 --seq 4096 \
      --steps 5 --compile modules --bf16-params --eager-loss ;;
  # the same step with the exact tanh in the SiTU kernels (the hardware tanh is the default since the sixth session)
  trainbf16-exact) step trainbf16-exact 300 env K3_SITU_TANH=exact python3 benchmarks/gpu_model.py --train \
      --batch 8 --seq 4096 --steps 5 --compile modules --bf16-params ;;
  profk3) step profk3 260 python3 benchmarks/gpu_model.py --profile --profile-compile modules --batch 8 --seq 4096 --bf16-params --optimizer k3 ;;
  profc) step profc 200 python3 benchmarks/gpu_model.py --profile --profile-compile modules --batch 8 --seq 4096 --bf16-params ;;
  longest) step longest 90 python3 benchmarks/gpu_model.py --longest-train --longest-prefill --long-budget 40 --long-start 65536 ;;
  kdabwd) step kdabwd 240 python3 -c "from k3.ops.kda.triton.selfcheck import gpu_selfcheck as g
print(g(dtypes=('bf16',)), flush=True); print(g(dtypes=('fp32',)))" ;;
  kdafwd) step kdafwd $(( ${KDAFWD_BUDGET:-500} + 60 )) python3 benchmarks/kda_triton.py --json "$OUT/kda_triton.json" \
      --budget-s ${KDAFWD_BUDGET:-500} ;;
  kdastate) step kdastate 560 python3 benchmarks/kda_triton.py --json "$OUT/kda_triton_state.json" --budget-s 500 \
      --shapes B8_T8K --prep-configs '["default"]' --state-configs base,base_s3,base_w8_r128,base_w8_s3 ;;
  kdafb) step kdafb $(( ${KDAFB_BUDGET:-300} + 30 )) python3 benchmarks/kda_triton.py \
      --bwd --prep-configs '["default"]' --state-configs none --shapes B8_T8K,varlen \
      --json "$OUT/kda_triton_bwd.json" --budget-s ${KDAFB_BUDGET:-300} ;;
  mladec) step mladec 120 python3 benchmarks/mla_decode.py --sweep --budget-s 105 --json "$OUT/mla_decode.json" ;;
  pack) python3 benchmarks/fla_warmup.py --pack "$OUT/autotune.tgz" ;;
  *) echo "unknown stage $stage" ;;
esac; done
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee -a "$OUT/log.txt"
