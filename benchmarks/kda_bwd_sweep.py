"""Time the KDA Triton backward (k3/ops/kda/triton/bwd.py) kernel by kernel on one GPU: the default launch
and one change of it per row, at a K3 head shape (H=96, D=128, bf16, gate + L2 norm in the kernel, 64-token chunks).

    python benchmarks/kda_bwd_sweep.py [--T 8192] [--B 1] [--budget-s 150] [--json PATH] [--fla]

Per configuration: the backward alone (`kda_chunk_bwd`, do_bench median), each kernel's CUDA time (one call under
torch.profiler), non-finite counts, and each gradient's relative RMSE against the first configuration's (a broken
option shows up here; the accuracy against the fp32 reference is tests/gpu's selfcheck). Also times our forward
once, so fwd + bwd can be set against fla's fwd+bwd; --fla times fla's chunk_kda(safe_gate=True) fwd+bwd on
the same inputs after the sweep (its first backward at a new shape autotunes for minutes, so it goes last: the
sweep's rows are printed and saved before). Rows are printed as they finish; configurations left when --budget-s
runs out are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from _common import sibling


# (name, launch overrides {kernel: {param: value}}): the default launch (the reference row), then one change per row
CONFIGS = [  # most informative first: the budget cuts the tail
    ("default", {}),
    # twenty-second session: matrices's inverse by repeated squaring (INV "pow", the default until then; wrong in
    # one-pass tf32 for nearly collinear keys) against the block inversion (the default since), same ten products
    ("matrices_inv_pow", {"matrices": {"INV": "pow"}}),
    # fifteenth session: gv forming the whole dN from u' (DNU, the default since) against gw adding its dXk W^T part
    # (atomics, pwu's fp32 copy of W, gv forming U): B1 T8K H96, 9.18 ms vs 9.76 (gw 2.19 -> 1.89, gv 0.99 -> 0.79,
    # pwu 0.76 -> 0.66); then gv at BV 64 (its default since) 9.05 vs 9.12 (gv 0.78 -> 0.71). Measured then removed,
    # at 9.11-9.18 ms: gw + gi2 as one kernel per (chunk, head, 16-row tile, K block) (gwi: each tile's state-side
    # products [16, V] x [V, BK] against the chunk's states, du' over all rows through T[:, R]; sm_90 static 168
    # registers, no spills, 3 CTAs per SM) 10.88 (gwi 5.52 against gw + gi2 3.82; capped at 128 registers 10.69, BV
    # 64 11.61, BK 32 12.15, 2 stages 11.36, tiles along grid axis 2 13.92): each tile re-reads the chunk's states
    # and du' (4x the L2 traffic of gw); gw + gfin as one kernel per (chunk, head) after gi2 (gwf: the K blocks in a
    # loop, the scratch read once, pre-norm dq / dk rewritten in place; sm_90 static 255 registers, 1.8 KB of spill
    # stack at BK 64 / 4 warps) 12.60 (gwf 6.78 against gw + gfin 2.80; 8 warps 11.45, BK 32 11.94, BK 32 / 8 warps
    # 12.75, BK 32 / 3 stages 11.70, 1 stage 12.15): serial K blocks at 2 CTAs per SM; gw after gi2, gi2 storing only
    # its own parts and gw adding them (gi2 1.92 -> 1.43 without its scratch reads, but gw 1.89 -> 3.46: 960 B of
    # spill stack, its three extra [64, 64] reads) 10.19, with gv at BV 64 10.11, gw at 2 stages 10.30, gi2 capped
    # at 128 10.34. Also: gw at 2 stages 9.28, gw at BK 32 9.43
    # (measured then removed, at 9.08 ms: gi2 loading its tile's rows of gw's terms before its products (EARLY) 9.22,
    # gi2 2.06 vs 1.94, at 128 registers / uncapped 9.25 / 9.22; gw capped at 168 at 2 stages 10.73, gw 3.55; gv at BV
    # 32 9.16)
    # gi2 adding its terms by atomics (RED, the default since) against reading and rewriting them: 8.90 ms vs 9.04
    # (gi2 1.92 -> 1.64, gw 1.89 -> 2.05 with its row sums; those from x2 itself: 2.07, 8.98); gi2 RED capped at 80
    # registers 9.06 (gi2 1.79); pmat at 2 stages 9.08 vs 9.08, pwu uncapped 9.11-9.12, states at 3 stages 9.15
    # sixteenth session (B1 T8K H96): the scratch and per-chunk states in the input dtype (the default since at bf16 /
    # fp16 inputs) against the fp32 scratch: 8.37 ms vs 8.95 (states 0.63 -> 0.46, dstates 0.85 -> 0.59, gw 2.05 ->
    # 1.91); the states alone in bf16 8.63. At the bf16 default (8.36-8.37 ms): gw on 8 warps 8.52-8.55 (gw 2.12; 213
    # registers, 1 CTA per SM), 8 warps at 4 stages 8.49, 8 warps at BV 64 / 2 stages 8.49, 8 warps capped at 128
    # registers 8.42 (gw 1.99), 4 stages 8.37, 2 stages 8.57, BV 64 8.87; states at BV 32 8.55, at BV 128 / 8 warps
    # 8.50; dstates at 1 stage 8.77, at BV 64 / 4 warps 8.49. Measured then removed (fp32 scratch, 8.90-8.98 ms): gi2's
    # column-side [16, 16] blocks of dAq / dL loaded row-contiguous and transposed in the dot instead of gathered
    # transposed (ncu: gi2 at 84% of its L1 throughput) 8.93 vs 8.90 (gi2 1.66 vs 1.64); gw's do tile loaded
    # transposed so that its fp32 tiles take 16-byte-per-thread cp.async layouts instead of bf16's 32 bytes in two
    # copies (ncu: 40% of gw's L2 sectors excess, Triton's coalescing takes the largest vector of the slice) 8.98 vs
    # 8.98 (gw 2.05 vs 2.06): neither kernel was bound by those transfers
    # gi2's products with the decayed q / k as tf32 part plus rest (PREC "split_b", opt-in: the gate's gradients
    # several times more accurate) 8.85 ms vs 8.32 (gi2 2.17 vs 1.63), capped at 128 registers 8.91, 3-pass tf32
    # (removed) 9.04
    ("gi2_split_b", {"intra": {"PREC": "split_b"}}),
    ("scr_fp32", {"scratch": {"DTYPE": "fp32"}}),
    ("gw_w8_r128", {"inter": {"num_warps": 8, "maxnreg": 128}}),
    ("gi2_no_red", {"intra": {"RED": False}}),
    ("pmat_s2", {"matrices": {"num_stages": 2}}),
    ("pwu_uncapped", {"wy": {"maxnreg": None}}),
    ("states_s3", {"states": {"num_stages": 3}}),
    ("dn_parts", {"value": {"DNU": False}}),
    ("gv_bv32", {"value": {"BV": 32}}),
    ("dnu_gw_s2", {"inter": {"num_stages": 2}}),
    ("dnu_gw_bk32", {"inter": {"BK": 32}}),
    # fourteenth session, measured then removed (B1 T8K H96, default 10.22-10.25 ms in the same processes): the prep's
    # matrices by row tiles (prow per (chunk, head, 16-row tile) with [16, K] operands block by block + pinv per
    # (chunk, head) for the inverse): 11.10 ms (prow 2.26 + pinv 0.39 against pmat 1.78), its tile's q / k rows as
    # one [32, K] operand 11.24, at 8 warps 13.06; pmat without the inverse (pinv after it) 10.60 (pmat 1.73 + pinv
    # 0.39), at BK 32 10.45 (1.57 + 0.39), at 8 warps 11.24; the gradient scratch x1s / x2s / dgis in bf16 9.66 (gw
    # 2.00, gi2 1.71) but dg 3.0e-2 / ddt_bias 8.7e-2 from the default (over the 2e-2 line), x1s / x2s alone 10.21.
    # Kept: pmat at BK 32 / 8 warps with FACTOR (10.39 / 11.71: slower), the per-chunk states / state gradients alone
    # in bf16 (scratch DTYPE "states", opt-in: 9.98 ms, H200 selfcheck dk 2.97e-3 vs 2.57e-3, interpreter small-head
    # dk 8.8e-3), gv at BV 64 (10.25) / 8 warps (11.01). Also measured then removed: the states pass on a side stream
    # next to dstates 10.19 ms vs 10.24 (with dstates at BV 64 10.53), gw forming its block of W from T instead of
    # reading pwu's fp32 copy 10.39 vs 10.16 (gw 2.18 -> 2.51, spill stack 248 -> 464 B)
    # gi2's BLK products with several row tiles per program (tiles last to first), and with FIN (the suffix sum of
    # dG carried across the tiles, the gate, dq / dk or their pre-norm form in gi2; gfin keeps dbeta and the L2
    # norm): sm_90 static TPP 4 158 registers / 3 CTAs per SM, with FIN 243 / 2 (BLK TPP 1: 125 / 4). Measured at
    # 10.15 ms (gi2 2.10): TPP 2 / 4 10.37 / 10.36 (gi2 2.33), FIN 11.95 (gi2 4.32), FIN at BK 32 13.52
    ("gi2_blk_tpp2", {"intra": {"BLK": True, "TPP": 2}}),
    ("gi2_blk_tpp4", {"intra": {"BLK": True, "TPP": 4}}),
    ("gi2_blk_fin", {"intra": {"BLK": True, "TPP": 4, "FIN": True}}),
    ("gi2_blk_fin_bk32", {"intra": {"BLK": True, "TPP": 4, "FIN": True, "BK": 32}}),
    ("gi2_blk_fin_scr_states", {"intra": {"BLK": True, "TPP": 4, "FIN": True}, "scratch": {"DTYPE": "states"}}),
    # pmat's decay-factored products through 32-row tiles (PTS 32, the default since: normalised q / k first,
    # per-tile exponentials) against 16-row tiles with FACTOR (the former default): at 10.17 ms, PTS 32 9.88 (pmat
    # 1.74 -> 1.45), PTS 32 at BK 32 9.92 (1.54); gfin on 8 warps (sm_90 static 192 registers, no spills, 1 CTA per
    # SM) 10.45-10.48 (gfin 1.23 vs 0.91); pmat at BK 32 with 16-row tiles 10.25
    ("pmat_pts16", {"matrices": {"PTS": 16}}),
    # (measured then removed: each 32-row tile's products from its own rows reloaded, [32, 64] accumulators joined
    # at the end (sm_90 static spill stack 152 -> 48 B, at BK 32 none): at 9.69 ms 9.88 (pmat 1.64 vs 1.45), at BK
    # 32 10.10 (1.87))
    # gi2 (BLK) at BK 32 (sm_90 static 70 registers, 7 CTAs per SM), capped at 96 registers (5 CTAs, 16 B of
    # spills; the default since), at BK 128 on 8 warps (121 registers, 2 CTAs). At 9.87 ms (gi2 2.09, uncapped):
    # BK 32 9.95 (2.18), the cap 9.68 (1.92), BK 128 10.00 (2.27); capped at 80 (6 CTAs, 96 B of spills) 9.88 (2.11)
    # against 9.69 capped at 96
    # register caps for 3 CTAs per SM (sm_90 static): gv at 168 (96 B of spills), gfin at 168 (200 B), pmat at 168
    # (608 B). At 9.68 ms: 9.71-9.72 (gv 1.00 vs 0.98), 9.75 (gfin 0.97 vs 0.91), 9.89-9.94 (pmat 1.70 vs 1.45)
    ("gv_r168", {"value": {"maxnreg": 168}}),
    ("gfin_r168", {"gate_norm": {"maxnreg": 168}}),
    ("pmat_r168", {"matrices": {"maxnreg": 168}}),
    ("gi2_blk_bk32", {"intra": {"BK": 32}}),
    ("gi2_uncapped", {"intra": {"maxnreg": None}}),
    ("gi2_r80", {"intra": {"maxnreg": 80}}),
    ("gi2_blk_bk128_w8", {"intra": {"BK": 128, "num_warps": 8}}),
    ("pmat_bk32", {"matrices": {"BK": 32}}),
    ("pmat_w8", {"matrices": {"num_warps": 8}}),
    ("scr_states", {"scratch": {"DTYPE": "states"}}),
    ("gv_bv64", {"value": {"BV": 64}}),
    ("gv_w8", {"value": {"num_warps": 8}}),
    # thirteenth session: gfin's one pass (ONEPASS, from gi2's row-sum partials) against its second pass over the
    # columns, and a chunk's column-block / tile programs next to each other on grid axis 0 (INNER) against axis 2
    ("gfin_two_pass", {"gate_norm": {"ONEPASS": False}}),
    ("splits_outer", {"wy": {"INNER": False}, "inter": {"INNER": False}, "intra": {"INNER": False}}),
    ("pwu_outer", {"wy": {"INNER": False}}),
    ("gw_outer", {"inter": {"INNER": False}}),
    ("gi2_outer", {"intra": {"INNER": False}}),
    ("both_off", {"gate_norm": {"ONEPASS": False}, "wy": {"INNER": False}, "inter": {"INNER": False},
                  "intra": {"INNER": False}}),
    # thirteenth session: gw's epilogue storing each term as soon as it is complete (EPI_ORDER; sm_90 static stack
    # 312 -> 280 B), and deeper pipelining of its value loop (ncu: 12.9% of its stall samples on the loop-head barrier
    # waiting for the cp.async tiles; 3 stages 104 KB, 2 CTAs per SM; BV 16 at 4 stages 78 KB)
    # (at 11.34 ms: gw_epi_off 11.41, gw 2.42 vs 2.33; gw 3 stages 11.23, gw 2.23: the default since at bf16 / fp16
    # K <= 128; gw_bv16_s4 11.62, gw_bv16_s3 11.69)
    # thirteenth session: pmat's two-level decays (FACTOR, default) against per-tile exponentials
    ("pmat_factor_off", {"matrices": {"FACTOR": False}}),  # (at 11.12 ms: 11.23, pmat 1.84 vs 1.78)
    # gw's dN / dbeta parts added into gv's with atomics (ATOMIC, the default since: 10.77 vs 11.12 at TPP 4; at
    # TPP 1 10.62 vs 10.89)
    ("gw_no_atomic", {"inter": {"ATOMIC": False}}),
    ("gw_epi_off", {"inter": {"EPI_ORDER": False}}),
    ("gw_s2", {"inter": {"num_stages": 2}}),
    ("gw_bv16_s4", {"inter": {"BV": 16, "num_stages": 4}}),
    ("gw_bv16_s3", {"inter": {"BV": 16, "num_stages": 3}}),
    # twelfth session: the default since is gv's PRE + PRE_F32 (the sequential passes store u' / du', formed against
    # the fp32 state as two bf16 halves; 13.89 ms): without PRE (the default until then, 15.33), PRE against the
    # state's bf16 rounding (13.53, opt-in accuracy class of the bf16 scratch), and both on the bf16 scratch preset
    # (the eleventh session's rows gv_pre / scr_preset_pre / gv_pre_f32 / scr_preset_pre_f32; gv_pre_f32 measured
    # 14.36 ms as tf32 products of fp32 operands, NaN at BV 16)
    ("no_pre", {"value": {"PRE": False}}),
    # twelfth session: register caps (maxnreg) for more resident programs per SM where the sm_90 static compile
    # spills little (benchmarks/kda_bwd_static.py; gi2 / gw / gfin / pmat run 2 CTAs of 4 warps at 255 registers).
    # At 13.33 ms: pwu_r168 13.07 (pwu 1.67 -> 1.37; its default since), every other row slower (gi2 3.40 -> 3.85-
    # 4.42, gw 2.92 -> 3.24, gfin 1.22 -> 1.26, gv 0.98 -> 1.00)
    ("pwu_r128", {"wy": {"maxnreg": 128}}),                   # 4 CTAs, 416 B: 13.33 vs 13.06 (pwu 1.61)
    ("pmat_r168", {"matrices": {"maxnreg": 168}}),                 # 3 CTAs, 504 B: 13.22 vs 13.06 (pmat 1.82)
    ("gi2_bk32_r168", {"intra": {"BK": 32, "maxnreg": 168}}),     # 3 CTAs / SM, 24 B of spills
    ("gi2_w8_r128", {"intra": {"num_warps": 8, "maxnreg": 128}}),  # 2 CTAs of 8 warps, 104 B
    ("gi2_bk32_r128", {"intra": {"BK": 32, "maxnreg": 128}}),     # 4 CTAs, 256 B
    ("gfin_w8_r128", {"gate_norm": {"num_warps": 8, "maxnreg": 128}}),  # 2 CTAs of 8 warps, 128 B
    ("gw_bk32_r168", {"inter": {"BK": 32, "maxnreg": 168}}),       # 3 CTAs, 120 B
    ("gv_r168", {"value": {"maxnreg": 168}}),
    ("gfin_w8", {"gate_norm": {"num_warps": 8}}),  # 246 registers, no spills, 1 CTA of 8 warps: 12.45 vs 12.20 (1.41 ms)
    # twelfth session: with pmat storing G for pwu / gw / gi2 (12.06 ms: pmat 2.06, pwu 0.87), pmat reading its
    # tiles' reference rows back from there (REFLOAD) 11.86 ms (pmat 1.84; the default since), pwu uncapped 12.06
    ("pmat_reduce", {"matrices": {"REFLOAD": False}}),
    ("pwu_uncapped", {"wy": {"maxnreg": None}}),
    # twelfth session, measured then removed: gw's and gi2's partial gradients of d(q scale) / d(kn) (x1s, x2s) in
    # bf16 (a scratch PARTS option): 13.19 ms vs 13.34 (gi2 -0.09, gfin -0.03), 12.29 vs 12.45 on the bf16 scratch
    # preset, at H200 selfcheck dq / dk 3.49e-3 / 3.46e-3 (3.07e-3 / 2.59e-3) and ~1.1e-2 dk in the interpreter's
    # small-head bf16 cases; dgis in bf16 too put ddt_bias at 0.11 there. Their traffic is not what holds gi2 back
    # twelfth session: the sequential passes with PRE + PRE_F32 at BV 64 (states 0.62 ms, dstates 1.10: 192 programs,
    # dstates at one CTA per SM in 160 KB of shared memory, so two waves), 13.57 ms: dstates at BV 128 on 8 warps
    # (96 programs, one wave) 13.27, the default since (dstates 0.84); the states pass on a side stream next to
    # dstates (independent walks; a CONCURRENT option, removed after) 13.57, and 13.28 vs 13.35 at the new default;
    # dstates at one stage (96 KB: two CTAs per SM, 8 B of spills) 13.49, with the side stream 13.41; both passes at
    # BV 32 13.97, with the side stream 13.83
    ("dstates_bv64", {"dstates": {"BV": 64, "num_warps": 4}}),
    ("dstates_bv64_s1", {"dstates": {"BV": 64, "num_warps": 4, "num_stages": 1}}),
    ("seq_bv32", {"states": {"BV": 32}, "dstates": {"BV": 32, "num_warps": 4}}),
    ("pre_bf16_state", {"value": {"PRE_F32": False}}),
    ("scr_preset_no_pre", {"scratch": {"DTYPE": "input"}, "value": {"BV": 64, "PRE": False}}),
    ("scr_preset_pre_bf16_state", {"scratch": {"DTYPE": "input"}, "value": {"BV": 64, "PRE_F32": False}}),
    # eleventh session: gw adds its per-K-block dN / dbeta parts into gv's with fp32 atomics (gi2 and gfin then read
    # one dN instead of three sources), alone, with gw's launch changes, and on the bf16 scratch preset
    ("gw_atomic", {"inter": {"ATOMIC": True}}),
    ("gw_atomic_s1", {"inter": {"ATOMIC": True, "num_stages": 1}}),
    ("scr_preset", {"scratch": {"DTYPE": "input"}, "value": {"BV": 64}}),
    ("scr_preset_atomic", {"scratch": {"DTYPE": "input"}, "value": {"BV": 64}, "inter": {"ATOMIC": True}}),
    # tenth session: the gradient kernels' scratch (W, k e^(G_l - G), u', du', states, dS) in bf16 instead of fp32:
    # 16.41 ms vs 17.28 (opt-in: its accuracy); only the states or only W / u' in bf16 (measured, then removed:
    # 30.97 / 29.19 ms, the mixed-dtype dots spill)
    ("scratch_input", {"scratch": {"DTYPE": "input"}}),
    # tenth session: launch changes on top of the bf16 scratch (its tiles take half the registers / shared memory)
    ("scr_gv_bv64", {"scratch": {"DTYPE": "input"}, "value": {"BV": 64}}),
    ("scr_gv_bk64", {"scratch": {"DTYPE": "input"}, "value": {"BK": 64}}),
    ("scr_gw_w4", {"scratch": {"DTYPE": "input"}, "inter": {"num_warps": 4}}),
    ("scr_gw_bv64", {"scratch": {"DTYPE": "input"}, "inter": {"BV": 64}}),
    ("scr_gw_s3", {"scratch": {"DTYPE": "input"}, "inter": {"num_stages": 3}}),
    ("scr_states_bv64", {"scratch": {"DTYPE": "input"}, "states": {"BV": 64}, "dstates": {"BV": 64}}),
    # the same two launch changes with the fp32 scratch
    ("gw_w4", {"inter": {"num_warps": 4}}),
    ("states_bv64", {"states": {"BV": 64}, "dstates": {"BV": 64}}),
    # all three winners above together (gw at 4 warps and the states at BV 64 are the default since; the bf16
    # scratch with gv at BV 64 is ops_bwd.SCRATCH_INPUT_LAUNCH)
    ("scr_tuned", {"scratch": {"DTYPE": "input"}, "value": {"BV": 64}, "inter": {"num_warps": 4}, "states": {"BV": 64},
                   "dstates": {"BV": 64}}),
    # tenth session: gi2 also finishing the columns (gate, suffix sum, dq / dk): 7.23 ms vs 3.46 + 1.67 (gi2 + gfin)
    ("gi2_fin", {"intra": {"FIN": True, "TPP": 4}}),
    # ninth session: the default's pmat inverse went from 3-pass to one-pass tf32 (3.92 -> 1.90 ms); the former
    # default and the losing row-tile products (measured, then removed: pmat 6.21 ms, 3.67 with the tf32 inverse)
    ("pmat_tf32x3", {"matrices": {"INV_PREC": "tf32x3"}}),
    # gi2 with TPP row tiles per program (the chunk's columns loaded once for them; the default is all four since
    # the ninth session: 3.52 ms vs 4.64 at TPP 1, 4.12 at 2, 3.92 at 4 / BK 32, 5.56 at 2 / BK 32); gw at BK 32 /
    # 8 warps (static sm_90 159 regs, no spills; measured 5.90 ms vs 3.81). Thirteenth session, with a chunk's tile
    # programs side by side (INNER): TPP 1 2.62 ms vs 2.97 at 4, 3.22 at 2 (backward 10.81 / 11.12 / 11.40): TPP 1 is
    # the default since (with ATOMIC: 10.62 vs 10.84 at 4, 11.14 at 2)
    # thirteenth session, last call: gi2 walking the chunk in 16-row blocks (BLK; sm_90 static 127 registers, 10 KB of
    # shared memory, 4 CTAs per SM at 1 stage; 19 KB at 2, 29 KB at 3; capped at 96 registers 5 CTAs, 24 B of spills).
    # At 10.73 ms (gi2 2.66): BLK 10.23 (gi2 2.13; the default since), 2 stages 10.48, 3 stages 10.38, 2 stages at 96
    # registers 10.32
    ("gi2_no_blk", {"intra": {"BLK": False}}),
    ("gi2_blk_s2", {"intra": {"BLK": True, "num_stages": 2}}),
    ("gi2_blk_s3", {"intra": {"BLK": True, "num_stages": 3}}),
    ("gi2_blk_s2_r96", {"intra": {"BLK": True, "num_stages": 2, "maxnreg": 96}}),
    ("gi2_tpp4", {"intra": {"TPP": 4}}),
    # at TPP 1 (sm_90 static): BK 32 90 registers, 5 CTAs per SM; 8 warps 102 registers; BK 128 on 8 warps 128
    # registers, 1 CTA; and gw at BK 32 / 3 stages 195 registers, no spills. Measured at 10.62 ms (gi2 2.50, gw
    # 2.18): gi2_bk32 10.95 (gi2 2.85), gi2_w8 11.23 (3.11), gi2_bk128_w8 11.72 (3.62), gw_bk32_s3 11.04 (gw 2.60);
    # and gfin_bk32 10.92 (gfin 1.20 vs 0.91, in its one pass)
    ("gi2_bk32", {"intra": {"BK": 32}}),
    ("gi2_w8", {"intra": {"num_warps": 8}}),
    ("gi2_bk128_w8", {"intra": {"BK": 128, "num_warps": 8}}),
    ("gw_bk32_s3", {"inter": {"BK": 32, "num_stages": 3}}),
    ("gi2_tpp2", {"intra": {"TPP": 2}}),
    ("gi2_tpp4_bk32", {"intra": {"TPP": 4, "BK": 32}}),
    ("gw_bk32_w8", {"inter": {"BK": 32, "num_warps": 8}}),
    ("gw_w8", {"inter": {"num_warps": 8}}),  # the default until the tenth session (3.78 ms vs 3.01 at 4 warps)
    # (ninth session, measured then removed: gv loading T, T^T and Aq^T in every value block, 3.26 ms vs 2.98)
    ("gw_s1", {"inter": {"num_stages": 1}}),  # 4.32 ms vs 3.82 (ninth session)
    ("gv_bk64", {"value": {"BK": 64}}),
    ("gi2_bk128", {"intra": {"BK": 128}}),
    ("gi2_bk64_w8", {"intra": {"num_warps": 8}}),
    # eleventh session: pmat and gfin at BK 64 became the default (1.68 vs 1.89 ms, 1.22 vs 1.27): the former BK 32
    ("gfin_bk32", {"gate_norm": {"BK": 32}}),
    ("pwu_bk128_bv128", {"wy": {"BK": 128, "BV": 128}}),
    ("gw_bv64", {"inter": {"BV": 64}}),
]


def k3_inputs(B: int, T: int, H: int, D: int):
    """The backward's benchmark inputs on the GPU (seed 0): bf16 q, k, v, raw gate f, beta (post-sigmoid), do
    [B, T, H, D]; the chunk_kda keywords (gate + L2 norm in the kernel, A_log, dt_bias, lower bound -5) and the
    scale. Returns (q, k, v, f, beta, do, kw, scale); shared with kda_bwd_ncu.py."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v, f, do = (r(B, T, H, D).bfloat16() for _ in range(5))
    beta = r(B, T, H).sigmoid().bfloat16()
    A_log = torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=gen))
    dt_bias = r(H * D) * 0.1
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    return q, k, v, f, beta, do, kw, D ** -0.5


def shape_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--B / --T / --H / --D (default B1 T8192 H96 D128, a K3 head shape); shared with kda_bwd_ncu.py."""
    for name, default in (("--B", 1), ("--T", 8192), ("--H", 96), ("--D", 128)):
        ap.add_argument(name, type=int, default=default)
    return ap


def main():
    ap = shape_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--configs", default=None, help="comma list of names from CONFIGS (default: all)")
    ap.add_argument("--fla", action="store_true", help="then time fla's fwd+bwd on the same inputs")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "kda_bwd_sweep.json"))
    args = ap.parse_args()
    import torch
    from triton.testing import do_bench
    from k3.ops.kda.triton import bwd as ops_bwd, fwd as fwd_ops
    kernel_breakdown = sibling("kda_triton").kernel_breakdown

    t0 = time.time()
    names = set(args.configs.split(",")) if args.configs else None
    B, T, H, D = args.B, args.T, args.H, args.D
    q, k, v, f, beta, do, kw, scale = k3_inputs(B, T, H, D)
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, B=B, T=T, H=H, D=D, rows=[])
    fwd = lambda: fwd_ops.kda_chunk_fwd(q, k, v, f, beta, scale, output_final_state=True, **kw)
    fwd()
    res["ours_fwd_ms"] = do_bench(fwd, warmup=10, rep=50, return_mode="median")
    print(f"forward {res['ours_fwd_ms']:.2f} ms", flush=True)
    ref = None
    for name, launch in CONFIGS:
        if names is not None and name not in names:
            continue
        row = dict(config=name, launch=launch)
        if time.time() - t0 > args.budget_s:
            row["error"] = "skipped: time budget"
            res["rows"].append(row)
            continue
        bwd = lambda: ops_bwd.kda_chunk_bwd(q, k, v, f, beta, do, None, scale, launch=launch, **kw)
        try:
            t1 = time.time()
            got = bwd()
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.time() - t1, 1)
            row["bwd_ms"] = do_bench(bwd, warmup=5, rep=30, return_mode="median")
            row["fwd_bwd_ms"] = row["bwd_ms"] + res["ours_fwd_ms"]
            row["kernels_ms"] = kernel_breakdown(bwd)
            grads = dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"), got))
            row["nonfinite"] = {n: int((~torch.isfinite(x)).sum()) for n, x in grads.items()
                                if x is not None and not torch.isfinite(x).all()}
            if ref is None:
                ref = grads
            else:
                row["rr_vs_first"] = {
                    n: float((a.double() - ref[n].double()).pow(2).mean().sqrt()
                             / ref[n].double().pow(2).mean().sqrt().clamp_min(1e-30))
                    for n, a in grads.items() if a is not None}
        except Exception as e:  # noqa: BLE001 - one bad option must not end the sweep
            row["error"] = repr(e)[:300]
        row["t_s"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
        torch.cuda.empty_cache()
    ok = [x for x in res["rows"] if "bwd_ms" in x]
    if ok:
        print("| config | bwd ms | fwd+bwd ms | top kernels (ms) |\n|---|---|---|---|")
        for x in ok:
            top = ", ".join(f"{n.replace('kda_bwd_', '').replace('_kernel', '')} {t:.2f}"
                            for n, t in list(x["kernels_ms"].items())[:6])
            print(f"| {x['config']} | {x['bwd_ms']:.2f} | {x['fwd_bwd_ms']:.2f} | {top} |", flush=True)
    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=1)
    if args.fla and ok:
        from fla.ops.kda import chunk_kda as fla_chunk
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, f, beta)]
        fb = lambda: fla_chunk(*leaves, scale=scale, safe_gate=True, **kw)[0].backward(do)
        t1 = time.time()
        fb()
        torch.cuda.synchronize()
        res["fla_first_call_s"] = round(time.time() - t1, 1)
        res["fla_fwd_bwd_ms"] = do_bench(fb, warmup=5, rep=30, return_mode="median")
        best = min(ok, key=lambda x: x["fwd_bwd_ms"])
        res["speedup_fwd_bwd_default"] = res["fla_fwd_bwd_ms"] / ok[0]["fwd_bwd_ms"]
        res["speedup_fwd_bwd_best"] = res["fla_fwd_bwd_ms"] / best["fwd_bwd_ms"]
        print(f"fla fwd+bwd {res['fla_fwd_bwd_ms']:.2f} ms (first call {res['fla_first_call_s']} s); ours "
              f"{ok[0]['fwd_bwd_ms']:.2f} (default, x{res['speedup_fwd_bwd_default']:.2f}), best {best['config']} "
              f"{best['fwd_bwd_ms']:.2f} (x{res['speedup_fwd_bwd_best']:.2f})", flush=True)
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
