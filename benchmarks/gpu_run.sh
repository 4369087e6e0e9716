#!/usr/bin/env bash
# One H200 session step (device tool). Usage: bash benchmarks/gpu_run.sh STAGE [STAGE...]
# Needs: fla wheels in .whl (carried), optional .tcache/autotune.tgz (carried) from an earlier warm-up.
# Every step runs under its own timeout and appends to $OUT/log.txt; results land in $OUT/*.json.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# (once per machine: a second gpu_run.sh running beside the first leaves the installed wheels alone)
[ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
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
  # fla's autotune for the K3 KDA head shapes and the AttnRes widths, packed for the next run's .tcache
  warm) step warm 330 python3 benchmarks/fla_warmup.py --shapes 96x128,8x128,4x64 --pack "$OUT/autotune.tgz" ;;
  # --- correctness on the GPU (tests/gpu and the CUDA-only decode tests)
  # everything in tests/gpu but the tiny model and bf16 training (own stages below)
  tests) step warm-tests 150 python3 benchmarks/fla_warmup.py --shapes 8x128 --attnres "" --T 1024
         step tests 300 python3 -m pytest -q -s --timeout 120 --durations=10 tests/gpu -k "not tiny_model and not bf16_params_train" ;;
  # the static (CUDA-graph) decode against the eager cached decode
  tests-decode) step tests-decode 330 python3 -m pytest -v -s --timeout 150 --durations=5 \
      tests/generation/test_static_decode.py ;;
  # training on the GPU: bf16 parameters against fp32, the fused Muon against the foreach one
  tests-train) step tests-train 330 python3 -m pytest -q -s -o faulthandler_timeout=280 --timeout 310 \
      tests/gpu/test_gpu_train.py ;;
  # the SiTU-GLU Triton kernels against the fp32 reference
  situtest) step situtest 120 python3 -m pytest -q -s --timeout 100 tests/gpu/test_gpu_numerics.py -k situ ;;
  # the KDA Triton backward against the fp32 reference
  tests-bwd) step tests-bwd 200 python3 -m pytest -q -s --timeout 150 tests/gpu -k "kda_triton_backward" ;;
  # the whole `tiny` model, CUDA bf16 against CPU fp32
  tests-model) step tests-model 200 python3 -m pytest -q -s --timeout 120 --durations=0 tests/gpu -k tiny_model ;;
  # the short conv's every launch option and the grouped experts against the fp32 / CPU references
  convtest) step convtest 150 python3 -m pytest -q -s --timeout 100 tests/gpu/test_gpu_numerics.py -k "conv or experts" ;;
  # the conv, router split, fused Muon and fused linear cross-entropy against their fp32 / fp64 references
  newtests) step newtests 240 python3 -m pytest -q -s --timeout 150 tests/gpu/test_gpu_numerics.py \
      tests/gpu/test_gpu_train.py -k "conv or router or fused_muon or linear_cross" ;;
  # the KDA Triton backward's self-check (bf16 inputs, then fp32) against autograd through the fp32 torch path
  kdabwd) step kdabwd 240 python3 -c "from k3.ops.kda.triton.selfcheck import gpu_selfcheck as g
print(g(dtypes=('bf16',)), flush=True); print(g(dtypes=('fp32',)))" ;;
  # --- KDA kernels against fla
  # the forward without gradients (prep + pipelined walk) at every K3 shape, per sequential-pass option set
  kdapipe) step kdapipe 290 python3 benchmarks/kda_triton.py --no-accuracy \
      --prep-configs '["default"]' --state-configs ${PIPE_CONFIGS:-nopipe,pipe4k,pipe8k,pipe8k_lpt,pipe4k_lpt} \
      --state-every-shape --shapes ${PIPE_SHAPES:-B1_T128K,B2_T32K,varlen,B8_T8K} --json "$OUT/kda_pipe.json" \
      --budget-s 260 ;;
  # fwd+bwd against fla at every K3 shape (one sequence of 8K / 32K / 128K tokens, the varlen batch), with both
  # sides' per-kernel CUDA times (BWDALL_ENVS: also ours under other environments); then fla's autotune packed
  bwdall) step bwdall $(( ${KDAFB_BUDGET:-420} + 30 )) python3 benchmarks/kda_triton.py --bwd-only \
      --shapes ${BWDALL_SHAPES:-B8_T8K,varlen,B2_T32K,B1_T128K} --json "$OUT/kda_triton_bwdall.json" \
      --budget-s ${KDAFB_BUDGET:-420} ${BWDALL_ENVS:+--ours-envs "$BWDALL_ENVS"}
    step pack 60 python3 benchmarks/fla_warmup.py --no-warm --pack "$OUT/autotune.tgz" ;;
  # fwd+bwd against fla at the `small` preset's KDA shape (B8 T4096, 8 heads of 128; fla's first backward here
  # autotunes for minutes); then fla's autotune packed
  bwdsmall) step bwdsmall 420 python3 benchmarks/kda_bwd_sweep.py --B 8 --T 4096 --H 8 --configs default --fla \
      --budget-s 20 --json "$OUT/kda_bwd_small.json"
    step pack 60 python3 benchmarks/fla_warmup.py --no-warm --pack "$OUT/autotune.tgz" ;;
  # the backward's inverse: block inversion (default) against the former repeated squaring, time (B1 T8K H96 and the
  # `small` shape, per kernel) and the collinear-key case through both against the fp64 reference
  bwdinv) step bwdinv 240 python3 benchmarks/kda_bwd_sweep.py --configs default,matrices_inv_pow --budget-s 60 \
      --json "$OUT/kda_bwd_inv.json"
    step bwdinv-small 200 python3 benchmarks/kda_bwd_sweep.py --B 8 --T 4096 --H 8 --configs default,matrices_inv_pow \
      --budget-s 60 --json "$OUT/kda_bwd_inv_small.json"
    step bwdinv-synth 120 python3 benchmarks/kda_blowup_replay.py synthetic ;;
  # gradient accuracy of our backward (per scratch dtype) and of fla against the fp64 token loop on the same inputs
  bwdacc) step bwdacc ${BWDACC_BUDGET:-300} python3 benchmarks/kda_bwd_accuracy.py ${BWDACC_ARGS:-} ;;
  # k3's dispatch of KDA, MoE, AttnRes and MLA attention against the kernels called directly / eager
  ops) step ops 200 python3 benchmarks/gpu_ops.py --quick --only kda,moe,attnres,attn --json "$OUT/gpu_ops.json" ;;
  # --- decode and prefill (`small` preset)
  # one-token decode step under a CUDA graph, batch 1, contexts 4K to 1M
  decode) step decode 90 python3 benchmarks/decode.py --device cuda --preset small --min-context 4096 \
      --max-context 1048576 --steps 10 --real-prefill-max 4096 --prefill-chunk 4096 --cuda-graph \
      --json "$OUT/decode_h200_graph.json" ;;
  # the same with the step compiled, at 4K and 1M
  decodec) step decodec 150 python3 benchmarks/decode.py --device cuda --preset small --contexts 4096,1048576 \
      --steps 10 --real-prefill-max 4096 --prefill-chunk 4096 --cuda-graph --compile-step \
      --json "$OUT/decode_h200_graph_compiled.json" ;;
  # batch 4 at 128K and 1M
  decodeb) step decodeb 150 python3 benchmarks/decode.py --device cuda --preset small --contexts 131072,1048576 \
      --batch 4 --steps 10 --cuda-graph --json "$OUT/decode_h200_graph_b4.json" ;;
  # per output token at 1M with (about) the largest batch each model's cache fits next to its weights on one H200:
  # hybrid 3.4 GB per row -> 28 rows (97 GB), all-MLA 13.5 GB per row -> 8 rows (110 GB); one model at a time
  decodemax) step decodemax-hybrid 150 python3 benchmarks/decode.py --device cuda --preset small --contexts 1048576 \
      --models hybrid --batch ${DECODEMAX_HYBRID:-28} --steps 10 --cuda-graph --json "$OUT/decode_h200_max_hybrid.json"
    step decodemax-mla 150 python3 benchmarks/decode.py --device cuda --preset small --contexts 1048576 \
      --models all-mla --batch ${DECODEMAX_MLA:-8} --steps 10 --cuda-graph --json "$OUT/decode_h200_max_mla.json" ;;
  # the `decode` stage with the Triton MLA decode kernel
  decodetri) step decodetri 120 env K3_MLA_DECODE=triton python3 benchmarks/decode.py --device cuda --preset small \
      --min-context 4096 --max-context 1048576 --steps 10 --real-prefill-max 4096 --prefill-chunk 4096 --cuda-graph \
      --json "$OUT/decode_h200_graph_mlatriton.json" ;;
  # the split-K Triton MLA decode kernel against the torch path, per launch option
  mladec) step mladec 120 python3 benchmarks/mla_decode.py --sweep --budget-s 105 --json "$OUT/mla_decode.json" ;;
  # a 1M-token chunked prefill, and one-shot prefills of 64K / 128K
  prefill) step prefill 240 python3 benchmarks/prefill.py --tokens 1048576 --chunk 131072 --one-shot 65536,131072 \
      --json "$OUT/prefill_1m.json" ;;
  # the longest training sequence (activation checkpointing) and one-shot prefill that fit, batch 1
  longest) step longest 90 python3 benchmarks/gpu_model.py --longest-train --longest-prefill --long-budget 40 --long-start 65536 ;;
  # --- the `small` training step (B8 T4096 unless stated)
  # fp32 weights + bf16 autocast, eager and compiled, B8 / B4 / B2, with a profile
  train) step train 200 python3 benchmarks/gpu_model.py --train --profile --batch 8,4,2 --seq 4096 --steps 5 \
      --compile none,modules ;;
  # bf16 parameters, torch fused AdamW, compiled modules (the reference step of the stages below)
  trainbf16) step trainbf16 300 python3 benchmarks/gpu_model.py --train --batch 8 --seq 4096 --steps 5 \
      --compile modules --bf16-params ;;
  # the same at batch 12
  trainbf16-b12) step trainbf16-b12 300 python3 benchmarks/gpu_model.py --train --batch 12 --seq 4096 --steps 5 \
      --compile modules --bf16-params ;;
  # `trainbf16` with our KDA Triton forward + backward instead of fla's (alternate with trainbf16 over two or three
  # runs each: a step moves by ±6% between processes)
  trainbf16-kdatriton) step trainbf16-kdatriton 300 env K3_BACKEND=kda:triton python3 benchmarks/gpu_model.py \
      --train --batch 8 --seq 4096 --steps 5 --compile modules --bf16-params ;;
  # `trainbf16` with the router logits as fp32 GEMMs (the control for the three-term bf16 split)
  trainbf16-router32) step trainbf16-router32 300 env K3_BACKEND=router:fp32 python3 benchmarks/gpu_model.py \
      --train --batch 8 --seq 4096 --steps 5 --compile modules --bf16-params ;;
  # `trainbf16` with the checkpointed chunked cross-entropy instead of the fused linear cross-entropy
  trainbf16-ckptce) step trainbf16-ckptce 300 env K3_FUSED_CE=0 python3 benchmarks/gpu_model.py --train --batch 8 \
      --seq 4096 --steps 5 --compile modules --bf16-params ;;
  # `trainbf16` with the MoE combine as Triton row gathers (opt-in)
  trainbf16-fused) step trainbf16-fused 300 env K3_BACKEND=moe_combine:triton python3 \
      benchmarks/gpu_model.py --train --batch 8 --seq 4096 --steps 5 --compile modules --bf16-params ;;
  # the trainer's recipe for bf16 parameters: Muon + AdamW with fp32 master weights (k3 train --param-dtype bf16)
  trainmaster) step trainmaster 300 python3 benchmarks/gpu_model.py --train --batch 8 --seq 4096 --steps 5 \
      --compile modules --bf16-params --optimizer k3 ;;
  # torch.profiler of the compiled step, with Muon + AdamW (profk3) / fused AdamW (profc)
  profk3) step profk3 260 python3 benchmarks/gpu_model.py --profile --profile-compile modules --batch 8 --seq 4096 --bf16-params --optimizer k3 ;;
  profc) step profc 200 python3 benchmarks/gpu_model.py --profile --profile-compile modules --batch 8 --seq 4096 --bf16-params ;;
  # --- single kernels
  # the optimizer step alone (MuonAdamW on all of `small`)
  optim) step optim 120 python3 benchmarks/optim_gpu.py --json "$OUT/optim_gpu.json" ;;
  # the short conv's forward / backward kernels against their tiled launches and Inductor
  conv) step conv 150 python3 benchmarks/conv_gpu.py --json "$OUT/conv_gpu.json" ;;
  # the MoE dispatch / combine kernels against Inductor
  moe) step moe 150 python3 benchmarks/moe_gpu.py --json "$OUT/moe_gpu.json" ;;
  # the SiTU-GLU kernels (hardware and exact tanh) against torch eager
  situ) step situ 120 python3 benchmarks/situ_gpu.py --json "$OUT/situ_gpu.json" ;;
  # --- vision, checkpoints, post-training
  # MoonViT-V2 at the released width (bf16, random weights): flash varlen vs per-image SDPA, then the tower's CUDA tests
  vision) step vision 200 python3 benchmarks/vision_tower.py --sizes 256 1024 2048 --batch 1 8 --reps 5 \
      --json "$OUT/vision_tower_h200.json"
    step vision-tests 120 python3 -m pytest -q -s --timeout 100 tests/vision/test_tower.py -k "varlen or cuda" ;;
  # routed experts kept packed as MXFP4 vs dequantised on load, `small`, bf16
  mxfp4) step mxfp4 150 python3 benchmarks/mxfp4_experts.py --device cuda --preset small --dtype bfloat16 \
      --json "$OUT/mxfp4_h200.json" ;;
  # the MXFP4 grouped GEMM (Triton, in-register dequantisation) against decode-then-GEMM and dequantise-on-load, at
  # the `small` and the released expert shapes (mxfp4gpu); its CUDA tests (mxfp4test)
  mxfp4gpu) step mxfp4gpu 200 python3 benchmarks/mxfp4_gpu.py --json "$OUT/mxfp4_gpu.json" ;;
  mxfp4test) step mxfp4test 120 python3 -m pytest -q -s --timeout 100 tests/gpu/test_gpu_mxfp4.py ;;
  # MTP self-speculative decoding on a `small` model trained here with one MTP block (fp32 decoding: exact match).
  # Our KDA kernels and the torch AttnRes: fla's first backward at this shape autotunes for over 5 min on a fresh machine
  mtp) step mtp ${MTP_BUDGET:-240} env K3_BACKEND=kda:triton,attnres:torch python3 benchmarks/mtp_speculative.py \
      --device cuda --preset small --steps ${MTP_STEPS:-40} --batch-tokens 8192 --seq-len 1024 --lr 3e-3 \
      --new-tokens 64 --prompts 4 --repeats 1 --compile none --dtype float32 --plain-static off \
      --json "$OUT/mtp_h200.json" ;;
  # the gate claim's kernel timing alone (bounded vs softplus gate, fla / ours / torch, one 8K sequence, 96 heads)
  gatekernel) step gatekernel 150 python3 benchmarks/claims/gate.py --device cuda --no-train \
      --kernel-shape 1,8192,96,128 --backends fla,triton,torch --out "$OUT/claims/gate_kernel" ;;
  # RL rollout and training tokens/s, `small` (untrained policy; no eval)
  rl) step rl 400 env K3_BACKEND=kda:triton,attnres:torch python3 benchmarks/posttrain_cpu.py --device cuda --preset small --throughput --out /tmp/pt_gpu \
      ${RL_ARGS:-} ;;
  # the full calculator task (the policy writes the call) on `tiny`: pre-training + SFT 200 steps, then 100 more SFT
  # steps on a fresh schedule (one 300-step schedule stays at the operand-copying plateau: docs/LOG.md, session 21),
  # then two RL recipes side by side from that SFT checkpoint (the micro recipe; the body at 1e-4 without the
  # final-norm LR). ~200 s of SFT; RL ~5 s a step plus the first steps' Triton compiles and two evals
  rlfull) R=/tmp/rlfull; C="--device cuda --preset tiny --no-calc-given-call --pt-steps 40 --skip-done ${RLFULL_ARGS:-}"
    export K3_BACKEND=kda:triton,attnres:torch
    step rlfull-sft 240 python3 benchmarks/posttrain_cpu.py $C --sft-steps 200 --rl-steps 0 --out $R/base1
    mkdir -p $R/base; ln -sfn $R/base1/sft $R/base/pt
    step rlfull-sft2 150 python3 benchmarks/posttrain_cpu.py $C --sft-steps 100 --rl-steps 0 --out $R/base
    for v in a b; do mkdir -p $R/$v; ln -sfn $R/base/pt $R/$v/pt; ln -sfn $R/base/sft $R/$v/sft; done
    C="$C --sft-steps 100"
    E="--rl-steps ${RL_STEPS:-60} --eval-prompts 128 --eval-samples 4"
    step rlfull-a ${RLFULL_BUDGET:-400} python3 benchmarks/posttrain_cpu.py $C $E --out $R/a --plot $R/a/curve.png &
    step rlfull-b ${RLFULL_BUDGET:-400} python3 benchmarks/posttrain_cpu.py $C $E --rl-lr 1e-4 --rl-norm-lr 0 --out $R/b \
      --plot $R/b/curve.png
    wait
    (cd /tmp && tar czf "$OUT/rlfull.tgz" --exclude='checkpoints' --exclude='final' --exclude='*.safetensors' rlfull)
    unset K3_BACKEND ;;
  # (`small` claim runs keep no checkpoint or final model: ~17 GB a run, and the machine's disk holds 64 GiB; KDA on
  # CLAIMS_KDA, default our Triton kernels: block inversion fixed the backward that blew `small` up, kda-stability)
  # The `small` claim runs train on the Python stdlib's source (benchmarks/claims/pysrc_corpus.py; here 2.4M
  # training tokens, generated on the machine; tokenizer and token cache built once before the jobs start): the
  # built-in corpus (~0.5M tokens) went round 3.5 times in 180 steps and `small` memorised it (train loss ~2 vs val
  # 5.3). `tiny` keeps the built-in.
  # The MLA-gate sink claim, `tiny` and `small` in one call, all jobs side by side: `tiny` 3 seeds (400 steps x 4K
  # tokens, seq 512), `small` 2 seeds (MLA_SMALL_STEPS (150) x 8K tokens, seq 2048, lr 2e-3; both points of a seed
  # in one job, 140-210 s a 150-step point, 48 GiB each; 491 s in all; MLA_SMALL_STEPS=0: `tiny` only).
  # Merge the seeds afterwards (any machine, from claims_results.tgz): `python benchmarks/claims/mla_gate.py --steps
  # 400 --seq-len 512 --batch-tokens 4096 --report-only --out DIR --merge DIR.1 DIR.2` and `... --preset small --steps
  # 150 --seq-len 2048 --batch-tokens 8192 --lr 2e-3 --data /tmp/pysrc.jsonl --seeds 2 --report-only --out SDIR
  # --merge SDIR.1` (docs/claims.md)
  claims-mla) M="mla_gate:--steps 400 --seq-len 512 --batch-tokens 4096 --seeds 1"
    S="mla_gate:--preset small --steps ${MLA_SMALL_STEPS:-150} --seq-len 2048 --batch-tokens 8192 --lr 2e-3 --seeds 1 \
--data /tmp/pysrc.jsonl"
    J="$M;$M --first-seed 1 --out /tmp/claims/mla_gate.1;$M --first-seed 2 --out /tmp/claims/mla_gate.2"
    if [ "${MLA_SMALL_STEPS:-150}" != 0 ]; then
      J="$J;$S --out /tmp/claims/mla_gate_small;$S --first-seed 1 --out /tmp/claims/mla_gate_small.1"
      step pysrc 240 python3 benchmarks/claims/pysrc_corpus.py /tmp/pysrc.jsonl --prepare small
    fi
    step claims-mla 520 env CLAIM_TIMEOUT=500 CLAIM_ARGS="--keep-outputs none" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      K3_BACKEND=kda:${CLAIMS_KDA:-triton},attnres:torch CLAIMS_PAR="$J" bash benchmarks/claims/run_gpu.sh ;;
  # The staged-context claim's cost half on `small` (2048 -> 16384 vs 16384 throughout, 100 steps x 16K tokens, and
  # the direct run cut to the staged run's FLOPs): one job alone (its wall times are compared too; eager `small` at
  # 16K tokens peaks at 79 GB, two side by side run out of memory), one seed a call (SEED=0, then SEED=1; ~400 s
  # each; merge with `python benchmarks/claims/stages.py --preset small --short 2048 --long 16384 --batch-tokens 16384
  # --steps 100 --lr 2e-3 --equal-flops --data /tmp/pysrc.jsonl --val-tokens 65536 --seeds 2 --report-only --out DIR
  # --merge DIR.0 DIR.1`; validation on 4 rows of 16384)
  claims-stages-small) step pysrc 240 python3 benchmarks/claims/pysrc_corpus.py /tmp/pysrc.jsonl --prepare small
    step claims-stages-small 550 env CLAIM_TIMEOUT=530 CLAIM_ARGS="--keep-outputs none" \
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True K3_BACKEND=kda:${CLAIMS_KDA:-triton},attnres:torch \
      CLAIMS_PAR="stages:--preset small --short 2048 --long 16384 --batch-tokens 16384 --steps 100 --lr 2e-3 \
--equal-flops --data /tmp/pysrc.jsonl --val-tokens 65536 --seeds 1 --first-seed ${SEED:-0} --out /tmp/claims/stages_small.${SEED:-0}" \
      bash benchmarks/claims/run_gpu.sh ;;
  # `small` training stability of the KDA paths: the same 80 steps (fp32 parameters + bf16 autocast, 4K tokens, seed
  # 1, lr 2e-3; the twenty-second session's run where our Triton backward's grad norm reached 7.7e7 at step 25 and the
  # loss went NaN from step 29, the torch path's max grad norm 13.1) side by side on kda:triton and kda:torch;
  # KDA_STABILITY_LAUNCH sets $K3_KDA_BWD_LAUNCH for the triton job ('{"matrices": {"INV": "pow"}}': the inverse of
  # that run). Prints max grad norm and skipped steps per job
  kda-stability) R=/tmp/kstab; rm -rf $R; mkdir -p $R
    C="--preset small --compile none --eval-every 0 --no-samples --no-tensorboard --no-progress --threads 2 --steps 80
       --batch-tokens 4096 --stages 2048:1 --lr 2e-3 --max-bad-steps 80 --param-dtype fp32 --seed 1"
    K3P='import sys; from k3.cli import main; sys.exit(main())'
    for b in triton torch; do
      step kda-stability-$b 300 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True K3_BACKEND=kda:$b,attnres:torch \
        K3_KDA_BWD_LAUNCH=${KDA_STABILITY_LAUNCH:-} python3 -c "$K3P" train $C --out $R/$b > $R/$b.log 2>&1 &
    done; wait
    python3 benchmarks/train_stability.py $R/triton $R/torch | tee -a "$OUT/log.txt"
    (cd /tmp && tar czf "$OUT/kstab.tgz" --exclude='final' --exclude='checkpoints' kstab) ;;
  # The AttnRes claim's `tiny` runs again (standard residual, block 1 = full, 2, 4; 3 seeds) with the activation-norm
  # probe that keeps documents apart: six jobs side by side, one seed and two variants each (~160 s); merge with
  # `python benchmarks/claims/attnres.py --block-sizes 1,2,4 --report-only --out DIR --merge DIR.*` (docs/claims.md)
  claims-attnres) J=""
    for s in 0 1 2; do
      J="$J;attnres:--block-sizes 1 --seeds 1 --first-seed $s --out /tmp/claims/attnres.a$s"
      J="$J;attnres:--block-sizes 2,4 --no-standard --seeds 1 --first-seed $s --out /tmp/claims/attnres.b$s"
    done
    step claims-attnres ${CLAIMS_BUDGET:-260} env CLAIM_TIMEOUT=${CLAIM_TIMEOUT:-240} CLAIMS_PAR="${J#;}" \
      bash benchmarks/claims/run_gpu.sh ;;
  # every design claim's `tiny` runs (benchmarks/claims/*.py, 3 seeds, side by side) + the gate kernel timing
  claims) step claims ${CLAIMS_BUDGET:-560} bash benchmarks/claims/run_gpu.sh ${CLAIMS:-} ;;
  # only pack fla's autotune winners in this machine's Triton cache
  pack) step pack 60 python3 benchmarks/fla_warmup.py --no-warm --pack "$OUT/autotune.tgz" ;;
  *) echo "unknown stage $stage" ;;
esac; done
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee -a "$OUT/log.txt"
