"""The "triton" backend of `chunk_kda`: our own Triton kernels for K3's bounded-decay KDA.

Per chunk with cumsum G of g, T = (I + diag(beta) L)^-1, L_ti = sum_K k_t k_i e^(G_t - G_i) (i < t):
W = T diag(beta)(k e^G), U = T diag(beta) v, Aqk_ti = sum_K q_t k_i e^(G_t - G_i) (i <= t); then per chunk
u' = U - W S, o = (q e^G) S + Aqk u', S <- e^(G_last) S + (k e^(G_last - G))^T u' with the fp32 state S.

Files, one per stage (kernels need triton and are imported on first use; host code in fwd.py / bwd.py):
  chunk.py      chunk_kda_triton, its autograd function, TritonKDAConfig / triton_config, the decode entry point
  fwd.py        forward host code: launch configs, chunk tables, the pipelined (time-piece) forward
  intra_fwd.py  forward 1, parallel over 16-token chunks: gate, cumsum, L2 norm, Aqk / Akk (decays factored through
                a reference row: exponents <= 8|g| <= 80 for g >= -10), T by recursive 2x2 block inversion on tf32
                tensor cores, W, U
  state_fwd.py  forward 2, sequential per (sequence, head, value block): the fp32 state walk writing o, and for
                training the state every 64 tokens and u' for the backward (tables.FwdSave). Packed documents of
                unequal lengths are walked longest first; at most 384 (sequence, head) pairs run in 8K-token time
                pieces, the walk of piece p on a high-priority stream next to the prep of piece p + 1
  recurrent.py  decode: the token recurrence, state read and written once (optionally in place)
  tables.py     chunk tables, walk order, FwdSave (shared by forward and backward)
  walk.py       prologue of the sequential walks (shared by forward and backward)
  bwd.py        backward host code (eight kernels on 64-token chunks, WY form, nothing recomputed);
                bwd_config.py its launch parameters ($K3_KDA_BWD_LAUNCH); the math in bwd_common.py
  bwd_prep.py   backward 1: T (64 x 64, recursive 2x2 block inversion as in the forward: repeated squaring
                cancelled in one-pass tf32 for runs of nearly collinear keys), tril_-1(L), tril(Aq), norms, the
                stored cumsum G; q e^G, k e^(G_l - G), W, U
  bwd_state.py  backward 2: the state at every chunk start and u' (skipped when the forward saved them), the state
                gradient at every chunk end, du' and dh0
  bwd_value.py  backward 3: dv, dAq, dN, the value part of dbeta
  bwd_inter.py  backward 4: dXk and the state-side terms of dq / dk / dG, its part of dbeta
  bwd_intra.py  backward 5: the intra-chunk backward per 16-row tile, added into 4's terms by fp32 atomics
  bwd_gate.py   backward 6: dbeta, dg through the suffix sum and the gate, dq / dk through the L2 norm
Memory of the backward: two K x V states per 64 tokens and head (bf16 at bf16 inputs: 1 KiB per token-head at
K = V = 128; fp32 at fp16 / fp32 inputs) plus ~6 KB of scratch per token-head at K = V = 128.
Measured on the H200 (benchmarks/RESULTS.md): forward 1.6-2.1x fla's at H96 D128; backward 7.65 ms at B1 T8K H96
D128, fwd+bwd 1.33-1.38x fla's in one process.

Choices (TritonKDAConfig, per call `config=` or `with triton_config(...)`; the environment fills what they leave):
backward "triton" or "torch" (recompute through the torch chunk path and autograd: the reference / fallback;
$K3_KDA_TRITON_BWD), the backward's launch overrides ($K3_KDA_BWD_LAUNCH, JSON, e.g. '{"intra": {"PREC":
"split_b"}}': more accurate gate gradients for +0.5 ms; '{"scratch": {"DTYPE": "fp32"}}': fp32 scratch at bf16
inputs), the forward walk's options ($K3_KDA_STATE_CFG, e.g. '{"pipe": 0}') and its prep's (`prep_cfg`).

Notable:
- Imports without triton or CUDA: triton is imported the first time `available()` says yes.
- What the kernels do not cover falls back to the torch backend, logged once: fp64 inputs, K or V not a power of
  two in [16, 256], an unbounded gate (lower_bound None) or lower_bound < -10, and precomputed g steeper than -10.
- This package does not register itself: k3.ops.kda registers it (the dependency points one way).
"""
from __future__ import annotations

from .chunk import (MIN_LOG_DECAY, ChunkKDATritonFunction, TritonKDAConfig, available, chunk_kda_triton,
                    current_config, fused_recurrent_kda_triton, triton_config)

__all__ = ["available", "chunk_kda_triton", "fused_recurrent_kda_triton", "TritonKDAConfig", "triton_config",
           "current_config", "ChunkKDATritonFunction", "MIN_LOG_DECAY"]
