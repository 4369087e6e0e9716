"""Python side of the KDA chunk backward kernels (needs triton; imported lazily by the package __init__).

`kda_chunk_bwd` runs eight kernels (see kernels_bwd.py for the math):
1. kda_bwd_pmat_kernel    (chunk, head)              T, tril_-1(L), tril(Aq) (fp32 and intermediate dtype), norms,
                                                     the cumsum G (fp32, read by every later chunk kernel)
2. kda_bwd_pwu_kernel     (chunk, head, col. block)  q e^G, k e^(G_l - G), W, U (sequential passes' operands) and
                                                     without gv's PRE / DNU W, k e^(G_l - G) in fp32
3. kda_bwd_states_kernel  (sequence, head, V block)  forward: the start state of every 64-token chunk (scratch
                                                     dtype: bf16 at bf16 inputs, else fp32), and
                                                     u' = U - W S (gv's PRE)
4. kda_bwd_dstates_kernel (sequence, head, V block)  backward: dS at every chunk end (scratch dtype), dh0, and du'
                                                     (PRE)
5. kda_bwd_gv_kernel      (chunk, head)              value side: dv, dAq, dN (whole with DNU), the value part of
                                                     dbeta (and u', du' without PRE)
6. kda_bwd_gw_kernel      (chunk, head, K block)     state side: dXk, the state terms of dq / dk / dG (and their
                                                     L2-norm row sums with gi2's RED), its dbeta part (partial dN
                                                     without DNU)
7. kda_bwd_gi2_kernel     (chunk, head, tile, K blk) intra-chunk backward of each 16-row tile, added into gw's terms
                                                     (RED: by atomics)
8. kda_bwd_gfin_kernel    (chunk, head)              dbeta, dg (suffix sum, gate), dq / dk through the L2 norm
then sums the per-chunk partials of dA_log / ddt_bias in torch. `gpu_selfcheck()` compares against the torch
path on a CUDA device at K3 head shapes.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch

from . import kernels_bwd as _k
from .ops import FwdSave, _cu_cpu, _seq_tables, _walk_grid, _walk_order  # shared with the forward

BT = 64   # chunk length of the backward (one stored state per BT tokens) ...
BT_WIDE = 32  # ... and for K > 128: the grad kernel's [BT, K] fp32 tile operands must fit sm_90 shared memory


# steepest in-kernel gate lower_bound for pmat's 32-row tiles (factors <= e^(16 * 5) = e^80) and for its FACTOR
# (steps e^(-16 |g|) >= e^-80 between 16-row tiles' reference rows); below it, or with precomputed g (only known to
# be >= -10), pmat takes 16-row tiles with per-tile exponentials (factors <= e^(8 * 10) = e^80)
PTS32_MIN_LOG_DECAY = -5.0


def chunk_len(K: int) -> int:
    return BT if K <= 128 else BT_WIDE
TS = 16   # row tile inside a chunk: decay exponents factored through one reference row per tile
REF = 7   # reference row inside a tile: factored exponents <= max(REF, TS-1-REF) * |g|_max


def _pick_bv(V: int, nprog: int) -> int:
    """Value block of the sequential passes: split V while there are fewer programs than SMs (132 on an H200;
    B1 H96 at BV 64, 192 programs: states + dstates -0.5 ms against BV 32, tenth session)."""
    bv = min(V, 64)
    while bv > 16 and nprog * (V // bv) < 132:
        bv //= 2
    return bv


def _dstates_bv(K: int, V: int, nprog: int) -> tuple:
    """(BV, num_warps) of the dstates pass: 128 value columns on 8 warps (one program per (sequence, head) at V =
    128, one CTA per SM in 208 KB of shared memory) once BV 64 would need a second partial wave of its one-CTA
    programs (nprog > 66 on 132 SMs): at B1 H96 T8K 0.84 ms vs 1.10 at BV 64 (192 programs, two waves; twelfth
    session); per program BV 128 costs ~1.5x BV 64 for twice the columns, so it stays ahead at larger nprog too.
    Else `_pick_bv` on 4 warps. K > 128 (32-token chunks, wider tiles) keeps the latter."""
    if K <= 128 and V >= 128 and nprog > 66:
        return 128, 8
    return _pick_bv(V, nprog), 4


def launch_config(K: int, V: int, nprog: int, dtype: torch.dtype) -> dict:
    """Per-kernel launch parameters {kernel name: dict(BV=, BK=, num_warps=, num_stages=, maxnreg=)} at head dims K,
    V with nprog = N*H (sequence, head) pairs and token dtype `dtype`; also read by benchmarks/kda_bwd_static.py.
    Block sizes: the H200 sweep at B1 T8K H96 D128 (benchmarks/kda_bwd_sweep.py, benchmarks/RESULTS.md)."""
    lowp = dtype in (torch.bfloat16, torch.float16)
    det = torch.are_deterministic_algorithms_enabled()  # no atomics (gw's ATOMIC) under deterministic algorithms
    BV = _pick_bv(V, nprog)
    dBV, dW = _dstates_bv(K, V, nprog)
    # software-pipelining depth of the chunk loops: every stage buffers the [BT, K] tiles in shared memory
    # (sm_90 AOT compile at K = 128, fp32 intermediates: 96 KB at 1 stage, 224 KB at 2, 352 KB at 3)
    seq_stages = 2 if lowp else 1
    # maxnreg (every kernel): None, or a per-thread register cap for ptxas (more resident programs, maybe spills)
    cfg = dict(
        # prep in two kernels: 4.12 + 1.83 ms vs 6.78 ms as one (chunk, head) kernel (removed, fifth session)
        # INV_PREC: the 64 x 64 inverse's tensor-core precision at bf16/fp16 inputs (fp32 inputs: always "tf32x3"):
        # one-pass "tf32" 1.90 ms vs "tf32x3" 3.92 at gradients within 5e-4 of each other (ninth session)
        # BK: 64 1.68 ms vs 1.89 at 32 since the tf32 inverse (eleventh session; 4.48 vs 3.92 with the 3-pass one)
        # pmat writes the cumsum G (gcs) that pwu, gw and gi2 read instead of recomputing the gate and the cumsum
        # (twelfth session: gw 2.92 -> 2.47 ms, gi2 3.40 -> 3.01 with its reference rows loaded, pwu 1.37 -> 0.87,
        # pmat 1.69 -> 2.06); REFLOAD: pmat reads its tiles' reference rows of G back from there too instead of
        # reductions over G's rows: pmat 1.84 ms vs 2.06, backward 11.86 ms vs 12.06
        # FACTOR: two-level decays in the intra-chunk products (`_intra_fwd`): a [BT, BK] exponential pair per K block
        # instead of per row tile (thirteenth session: ncu put pmat at 30% issue use with FMUL / FADD / FSEL on its
        # [64, 64] tiles the most executed instructions): pmat 1.84 -> 1.78 ms
        # PTS: the row tile of pmat's decay-factored products, 16 or 32 (32 only with the L2 norm and the gate in the
        # kernel at lower_bound >= -5, whose normalised q / k and |g| <= 5 keep the e^80 factors of 32-row tiles
        # within fp32, else 16; FACTOR applies at 16 only: its steps between 32-row tiles' reference rows, e^-160 at
        # g = -5, would underflow). Fourteenth
        # session: 32 (per-tile exponentials, half the masked [64, 64] products; sm_90 static spill stack 184 -> 152
        # B, HMMA 144 -> 112): pmat 1.74 -> 1.45 ms, backward 10.17 -> 9.88 at B1 T8K H96 (at BK 32: 1.54, no spills)
        pmat=dict(BK=min(K, 64), num_warps=4, num_stages=1, INV_PREC="tf32", REFLOAD=True, FACTOR=True, PTS=32),
        # pwu at <= 168 registers (3 CTAs per SM, 128 B of spills at bf16 K = 128): 1.37 ms vs 1.67 (twelfth session;
        # the same caps on gi2, gw, gfin, gv lost)
        # INNER (pwu, gw, gi2): a chunk's column-block / tile programs are consecutive along grid axis 0 (they run
        # together and share in L2 what they all read) instead of axis 2 (one whole grid sweep apart: ncu, thirteenth
        # session, gw 7.8 GB of DRAM traffic at T8K, gi2 5.1, pwu 3.0, each reading its chunk's shared operands anew):
        # backward 11.68 -> 11.43 ms (pwu 0.87 -> 0.75, gw 2.47 -> 2.34, gi2 3.05 -> 3.02; at TPP 1 it is what makes
        # one tile per program pay, below)
        pwu=dict(BV=min(V, 64), BK=min(K, 64), num_warps=4, num_stages=1, INNER=True),
        # states / dstates at BV 16: 2.07 ms vs 1.04 (dstates)
        # the states pass on a high-priority side stream next to dstates (independent walks; a CONCURRENT option,
        # measured then removed, twelfth session): 13.28 ms vs 13.35, 13.57 vs 13.57 with dstates at BV 64
        # (fourteenth session, measured then removed again: the states pass on a high-priority side stream next to
        # dstates, 10.19 ms vs 10.24; with dstates at BV 64 / 4 warps 10.53, states at BV 32 10.25)
        # ORDERED: at varlen the sequences' walks longest first in a sequence-major grid (ops._walk_order; list
        # scheduling of the varlen 12-document 64K batch at H96: dstates' 1,152 programs on 132 slots 54,909
        # token-steps in grid order, 47,994 longest first; seventeenth session)
        states=dict(BV=BV, num_warps=4, num_stages=seq_stages, ORDERED=True),
        dstates=dict(BV=dBV, num_warps=dW, num_stages=seq_stages, ORDERED=True),
        # gv: BV 32 2.98 ms vs 4.19 at BV 16
        # PRE: u' / du' stored by the sequential passes (as fla keeps v_new / dv) and read by gv, instead of gv
        # forming them in fp32 against the stored states: gv 2.99 -> 0.98 ms (eleventh session). PRE_F32 (with PRE):
        # the passes' W S / (k e^(G_l - G)) dS products against the fp32 state as two bf16 halves (`_dot_split`), not
        # its bf16 rounding, which put dv at 9.2e-3 (over the 8e-3 bf16 line) in the interpreter's unit-state
        # small-head cases (6.4e-3 with it). Twelfth session, B1 T8K H96: backward 13.89 ms vs 15.33 without PRE,
        # 13.53 with PRE alone (as tf32 products of fp32 operands: 14.36, and NaN at BV 16 with triton 3.6); H200
        # selfcheck dq 3.07e-3, dv 2.44e-3 (2.76e-3 / 2.12e-3 without PRE). PRE=False: the former default
        # DNU: gv forms the whole dN as sum_V dXv u'^T (= dXv U^T + dXk W^T, since W S0 = U - u'), so gw adds no
        # part of dN (no dXk W^T product, no atomics, W not read) and pwu writes no fp32 copy of W (fifteenth
        # session: backward 9.76 -> 9.18 ms at B1 T8K H96, gw 2.19 -> 1.89, gv 0.99 -> 0.79, pwu 0.76 -> 0.66); then
        # BV 64 (gv lighter: no U): 0.71 ms vs 0.78 at BV 32
        gv=dict(BV=min(V, 64), BK=min(K, 32), num_warps=4, num_stages=1, PRE=True, PRE_F32=True, DNU=True),
        # gw: BK 64 / 4 warps 3.01 ms vs 3.78 at 8 warps (tenth session), 4.33 at BK 32 / 4 warps
        # ATOMIC: its per-K-block parts of dN / dbeta added into gv's (fp32 atomics) instead of stored for gi2 and
        # gfin to sum: 15.69 ms vs 15.70 (gi2 -0.16, gw +0.13; eleventh session); thirteenth session, with INNER
        # and the deeper pipeline: 10.77 ms vs 11.12 (gi2 2.97 -> 2.67, gfin 0.97 -> 0.91, gw 2.23 -> 2.18). The
        # atomics' order moves the sums' last bits from run to run: off under torch.use_deterministic_algorithms
        # EPI_ORDER: the epilogue stores / folds each term as soon as it is complete (fewer live tiles, spills)
        # (fourteenth session, measured then removed: gw forming its block of W from T itself instead of reading
        # pwu's fp32 copy, which pwu then did not write: gw 2.18 -> 2.51 ms, its spill stack 248 -> 464 B)
        gw=dict(BV=min(V, 32), BK=min(K, 64), num_warps=4, num_stages=2, ATOMIC=not det, INNER=True,
                EPI_ORDER=True),
        # gi2: BK 64 3.53 ms vs 4.87 at BK 32, 9.04 at BK 16; 2 warps 5.31 (the former per-chunk gi: 9.46)
        # TPP: row tiles per program (the chunk's columns loaded once for them; must divide BT / TS): all of a
        # chunk's, 3.52 ms vs 4.64 at one tile per program, 4.12 at two (ninth session); with INNER (a chunk's tile
        # programs side by side, its columns from L2 after the first) one tile: 2.62 ms vs 2.97 at all four, 3.22
        # at two (thirteenth session)
        # FIN: gi2 also finishes the columns (dg, gate, dq / dk; needs TPP = all): 7.23 ms vs 3.46 + 1.67 (gi2 + gfin)
        # BLK: the products block by block of 16 rows, only the blocks the tile's causal rows / columns reach, [16,
        # BK] operands per block (127 registers, 4 CTAs per SM): gi2 2.66 -> 2.13 ms, backward 10.73 -> 10.23
        # (thirteenth session; at 2 / 3 pipeline stages 2.40 / 2.28, capped at 96 registers 2.23). With more tiles
        # per program (fourteenth session, first allowed then): TPP 2 / 4 gi2 2.33 ms vs 2.10 at 1, FIN (TPP 4, 243
        # registers) 4.32 (backward 11.95 vs 10.15, gfin's part gone)
        # RED: gi2 adds its terms into gw's by fp32 atomic adds (one add per element onto gw's stored value, so the
        # result does not depend on their order: kept under deterministic algorithms) instead of reading and
        # rewriting them; gw stores the row sums of its own terms for gfin's one pass: gi2 1.92 -> 1.64 ms, gw 1.89 ->
        # 2.05, backward 9.04 -> 8.90 at B1 T8K H96 (fifteenth session; gw's row sums from x2 itself: 2.07, 8.98)
        # PREC (BLK): the tensor-core precision of the tile's products at bf16 / fp16 inputs: "tf32", or "split_b"
        # (the decayed q / k operands as their tf32 part plus the rest: two passes). Their tf32 rounding, shared by
        # every row a block feeds, makes dG's errors correlated along the chunk, so its suffix sum adds them up: in
        # the interpreter's GPU-rounding emulation (which gives the H200's numbers) ddt_bias 1.62e-2 -> 2.66e-3, dg
        # 4.76e-3 -> 3.17e-3, dA_log 6.06e-3 -> 4.61e-3 with "split_b" (dq / dk / dv unchanged; fla: ddt_bias
        # 6.19e-3). Sixteenth session, B1 T8K H96: gi2 1.63 -> 2.17 ms (backward 8.32 -> 8.85; 3-pass tf32 9.04):
        # opt-in for the gate's gradients
        gi2=dict(BK=min(K, 64), num_warps=4, num_stages=1, TPP=1, FIN=False, INNER=True, BLK=True, RED=True,
                 PREC="tf32"),
        # gfin (and gw) take the L2-norm row factors from pmat's rqk instead of re-reading q / k: 1.50 -> 1.28 ms
        # (gw 3.02 -> 2.96; eleventh session); then BK 64 1.22 ms vs 1.27 at 32
        # ONEPASS: gi2 stores the L2 norm's row-sum partials (as with its FIN) and gfin finishes dq / dk in its pass
        # over the columns for dg instead of a second pass re-reading q, k and the pre-norm gradients (thirteenth
        # session: ncu put gfin at 71% of the H200's DRAM bandwidth, 4.3 GB per backward at T8K; -1.2 GB predicted):
        # gfin 1.27 -> 0.97 ms, gi2 +0.15 (its row sums), backward 11.54 -> 11.43
        gfin=dict(BK=min(K, 64), num_warps=4, num_stages=1, ONEPASS=True),
        # not a kernel: the dtype of the gradient kernels' scratch W, k e^(G_l - G), u', du' and per-chunk states /
        # state gradients: "fp32", or "input" (the input dtype at bf16/fp16 inputs, as fla keeps h / dh and the WY
        # operands; fp32 inputs always fp32). "input": 16.41 ms vs 17.28 at dk / dv 2.95e-3 vs 2.04e-3 from the
        # fp32 path on the H200, but up to ~9e-3 (over the 8e-3 bf16 limit) in the interpreter's small-head cases:
        # opt-in. Only the parts (states alone 30.97 ms, W / u' alone 29.19: mixed-dtype dots spill) lost (tenth
        # session). "states": only the per-chunk states / state gradients at the input dtype (gw upcasts them after
        # its loads): 9.89-9.98 ms vs 10.16-10.25 at B1 T8K H96, H200 selfcheck dk 2.97e-3 vs 2.57e-3, but dk 8.6e-3
        # to 8.8e-3 (over the 8e-3 bf16 line) in the interpreter's bf16 cases at K 32 and 128 (fourteenth session):
        # opt-in. Sixteenth session: "input" the default at bf16 inputs: backward 8.95 -> 8.37 ms at B1 T8K H96
        # (states 0.63 -> 0.46, dstates 0.85 -> 0.59, gw 2.05 -> 1.91); the interpreter's small-head errors over the
        # line came from its fp32 -> bf16 casts, which truncate (the GPU rounds to nearest even): with GPU-like
        # rounding (triton_interp.emulate_gpu) it gives the H200's numbers on the same inputs (dk 3.23e-3 vs 3.23e-3,
        # fp32 scratch 2.62e-3 vs 2.68e-3), below fla's dq / dk / dv there (3.69e-3 / 3.89e-3 / 3.40e-3;
        # benchmarks/kda_bwd_accuracy.py). "fp32" stays for the last digits (dk 2.6e-3 vs 3.2e-3), and is the default
        # at fp16 inputs (a state or u' past 65504 would overflow fp16; bf16 has fp32's range)
        # FWD: a training forward's sequential pass stores the per-chunk states and u' (ops.FwdSave) at bf16 / fp16
        # inputs, so the backward runs no states pass and pwu no U (seventeenth session). Off at fp32 inputs: the
        # forward's products there are one-pass tf32 on a GPU, the states pass's are 3-pass
        scratch=dict(DTYPE="input" if dtype == torch.bfloat16 else "fp32", FWD=lowp),
    )
    for name, c in cfg.items():
        if name != "scratch":
            c["maxnreg"] = None
    if lowp and K <= 128:
        cfg["pwu"]["maxnreg"] = 168
        # gw's value loop 3 stages deep (104 KB of shared memory, still 2 CTAs per SM): 2.23 ms vs 2.33 at 2 (ncu:
        # 12.9% of its stall samples on the loop-head barrier waiting for the cp.async tiles; thirteenth session)
        cfg["gw"]["num_stages"] = 3
        # gi2 (BLK, one tile per program) under 96 registers: 5 CTAs per SM instead of 4 (sm_90 static: 125 -> 96
        # registers, 16 B of spills): gi2 2.09 -> 1.92 ms, backward 9.87 -> 9.68 at B1 T8K H96 (fourteenth session;
        # with 2 pipeline stages at 10.73 ms in the thirteenth: 10.32 vs 10.48 uncapped)
        cfg["gi2"]["maxnreg"] = 96
    return cfg


ENV_LAUNCH = "K3_KDA_BWD_LAUNCH"
SCRATCH = ("fp32", "input", "states")  # launch_config's scratch DTYPE options
# the kernels' pointer arguments that hold the input dtype (bf16 / fp16 inputs) under each scratch DTYPE, fp32 else
# (read by the sm_90 compile checks, which type every pointer as launched)
SCRATCH_PTRS = {"fp32": (), "input": ("states", "dstates", "uns", "dus", "ws", "ks"), "states": ("states", "dstates")}


def env_launch() -> dict:
    """Launch overrides from $K3_KDA_BWD_LAUNCH: JSON {kernel name: {param: value}} (e.g. '{"pmat": {"INV_PREC":
    "tf32"}}'), applied under a call's own `launch` argument; {} when unset."""
    raw = os.environ.get(ENV_LAUNCH, "").strip()
    if not raw:
        return {}
    try:
        val = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"${ENV_LAUNCH} is not valid JSON ({e}): {raw!r}") from None
    if not isinstance(val, dict) or not all(isinstance(v, dict) for v in val.values()):
        raise ValueError(f"${ENV_LAUNCH} must be a JSON object {{kernel: {{param: value}}}}, got {raw!r}")
    return val


# the on / off launch parameters (a string such as "false" would otherwise count as on)
BOOL_PARAMS = frozenset({"REFLOAD", "FACTOR", "INNER", "PRE", "PRE_F32", "ATOMIC", "EPI_ORDER", "FIN", "BLK",
                         "ONEPASS", "DNU", "RED", "FWD", "ORDERED"})


def apply_launch(lc: dict, *overrides) -> dict:
    """`launch_config` result lc with each override dict ({kernel: {param: value}}, None = none) applied in order;
    unknown kernels or parameters are refused by name. gi2's default BLK (with its one row tile per program) gives
    way to an override asking for TPP > 1 or FIN without asking for BLK (so those rows keep their former, full-tile
    products), and so does its default register cap (sized for one tile) unless maxnreg is asked for too; its
    default RED gives way to FIN unless RED is asked for too (then refused: they exclude each other)."""
    blk_asked = nreg_asked = red_asked = False
    for over in overrides:
        for name, params in (over or {}).items():
            if name not in lc:
                raise ValueError(f"kda_chunk_bwd: launch override for unknown kernel {name!r} (known: {sorted(lc)})")
            bad = sorted(set(params) - set(lc[name]))
            if bad:
                raise ValueError(f"kda_chunk_bwd: unknown launch parameter(s) {bad} for kernel {name!r} "
                                 f"(known: {sorted(lc[name])})")
            flags = sorted(n for n, v in params.items() if n in BOOL_PARAMS and not isinstance(v, bool))
            if flags:
                raise ValueError(f"kda_chunk_bwd: launch parameter(s) {flags} of kernel {name!r} take true / false, "
                                 f"got {[params[n] for n in flags]}")
            lc[name] = {**lc[name], **params}
            blk_asked |= name == "gi2" and "BLK" in params
            nreg_asked |= name == "gi2" and "maxnreg" in params
            red_asked |= name == "gi2" and "RED" in params
    gi2 = lc.get("gi2")
    if gi2 is not None and gi2["FIN"] and gi2.get("RED") and not red_asked:
        gi2 = lc["gi2"] = {**gi2, "RED": False}  # (FIN finishes the columns itself: nothing to add into)
    if gi2 is not None and (gi2["TPP"] != 1 or gi2["FIN"]):
        if gi2.get("BLK") and not blk_asked:
            gi2 = lc["gi2"] = {**gi2, "BLK": False}
        if not nreg_asked:
            lc["gi2"] = {**gi2, "maxnreg": None}
    return lc


def _split_grid(NC: int, H: int, NS: int, inner: bool) -> tuple:
    """Grid of a kernel whose (chunk, head) pairs are split NS ways (kernels_bwd._split_pid): (NC * NS, H, 1) with a
    chunk's splits consecutive (inner), else (NC, H, NS)."""
    return (NC * NS, H, 1) if inner else (NC, H, NS)


def _kw(cfg: dict, *drop) -> dict:
    """A kernel's launch keywords from its launch_config entry: without the entries in `drop` (not kernel
    parameters), and without maxnreg when it is None (no register cap)."""
    return {n: c for n, c in cfg.items() if n not in drop and not (n == "maxnreg" and c is None)}


def kernel_table(kb=_k):
    """(launch_config key, kernel, kind) of the backward kernels in launch order; kind: "chunk" (per chunk and head,
    the chunk constexprs) or "states"/"dstates" (the sequential passes)."""
    return [("pmat", kb.kda_bwd_pmat_kernel, "chunk"), ("pwu", kb.kda_bwd_pwu_kernel, "chunk"),
            ("states", kb.kda_bwd_states_kernel, "states"), ("dstates", kb.kda_bwd_dstates_kernel, "dstates"),
            ("gv", kb.kda_bwd_gv_kernel, "chunk"), ("gw", kb.kda_bwd_gw_kernel, "chunk"),
            ("gi2", kb.kda_bwd_gi2_kernel, "chunk"), ("gfin", kb.kda_bwd_gfin_kernel, "chunk")]


def _scratch_dtypes(lc: dict, dt: torch.dtype) -> tuple:
    """(per-chunk states dtype, u' / du' dtype) of a launch config at token compute dtype dt."""
    scr = lc["scratch"]["DTYPE"]
    sdt = dt if scr == "input" else torch.float32
    return (dt if scr == "states" else sdt), sdt


def fwd_save(K: int, V: int, dtype: torch.dtype, launch: Optional[dict] = None) -> Optional[FwdSave]:
    """The FwdSave a training forward should fill for this backward (its chunk length and scratch dtypes under the
    launch config, $K3_KDA_BWD_LAUNCH and `launch`), or None where the backward would not use one (scratch FWD off,
    or gv without PRE: u' is then formed in gv)."""
    lc = apply_launch(launch_config(K, V, 1, dtype), env_launch(), launch)
    if not (lc["scratch"]["FWD"] and lc["gv"]["PRE"]):
        return None
    dt = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    return FwdSave(chunk_len(K), *_scratch_dtypes(lc, dt))


def kda_chunk_bwd(q, k, v, g, beta, do, dht, scale: float, initial_state=None, cu_seqlens=None,
                  use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False, A_log=None,
                  dt_bias=None, lower_bound: Optional[float] = -5.0, launch: Optional[dict] = None,
                  saved: Optional[FwdSave] = None):
    """Gradients of chunk_kda's (o, final_state) given do [B,T,H,V] and dht [N,H,K,V] (or None = zero).

    Returns (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias): token gradients in their inputs' dtypes, dg w.r.t. g
    as given (the raw gate input f when use_gate_in_kernel), dh0 [N,H,K,V] fp32, dA_log [H] / ddt_bias [H*K] fp32
    (None without the gate). Inputs are validated and supported (see the package's `_unsupported`).
    launch: per-kernel overrides of `launch_config` ({kernel name: {param: value}}, for benchmarks). saved: the
    FwdSave the forward filled (`fwd_save`): its chunk tables, per-chunk states and u' replace the states pass (and
    pwu's U); one of another chunk length or dtypes than this backward's config is not used."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    Tt = B * T
    BT = chunk_len(K)
    if saved is not None and not (saved.filled and saved.bt == BT):
        saved = None
    # (the forward's tables and walk order: no second copy of cu_seqlens to the host, whose wait stalls the GPU)
    if saved is not None:
        (cu, ctok, cend, seq_chunk, N, NC), order = saved.tables, saved.order
    else:
        # (fixed-length batches: cached tables, no host boundaries to build, no order)
        cu_cpu = _cu_cpu(B, T, cu_seqlens) if cu_seqlens is not None else None
        cu, ctok, cend, seq_chunk, N, NC = _seq_tables(B, T, cu_seqlens, dev, BT, cu_cpu)
        order = _walk_order(cu_cpu, dev) if cu_cpu is not None else None
    qc, kc, vc, gc, bc, doc = (x.contiguous() for x in (q, k, v, g, beta, do))
    dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    ieee = dt == torch.float32
    upcast = dt != torch.float32 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    gate = bool(use_gate_in_kernel)
    if gate:
        a_log, dtb, lb = A_log.contiguous(), dt_bias.contiguous(), float(lower_bound)
    else:
        a_log = dtb = q.new_zeros(1, dtype=torch.float32)
        lb = 0.0
    const = dict(H=H, K=K, V=V, BT=BT, TS=TS, REF=REF, LOG2_TS=int(math.log2(TS)), LOG2_NB=int(math.log2(BT // TS)),
                 USE_GATE=gate, L2NORM=bool(use_qk_l2norm_in_kernel), IEEE=ieee)
    dq, dk, dg = torch.empty_like(qc), torch.empty_like(kc), torch.empty_like(gc)
    dv, dbeta = torch.empty_like(vc), torch.empty_like(bc)
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=torch.float32)
    dal_part = torch.zeros(max(NC, 1), H, K, device=dev, dtype=torch.float32)  # per chunk, head and gi2 K block
    ddt_part = torch.zeros(max(NC, 1), H, K, device=dev, dtype=torch.float32)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    dS0 = dht.float().contiguous() if dht is not None else None
    if NC == 0:
        dh0.copy_(dS0 if dS0 is not None else torch.zeros_like(dh0))
        dq.zero_(), dk.zero_(), dg.zero_(), dv.zero_(), dbeta.zero_()
    else:
        qg = torch.empty(H, Tt, K, device=dev, dtype=dt)
        kd, w = torch.empty_like(qg), torch.empty_like(qg)
        aq = torch.empty(H, Tt, BT, device=dev, dtype=dt)
        eg = torch.empty(NC, H, K, device=dev, dtype=torch.float32)
        lc = apply_launch(launch_config(K, V, N * H, dt), env_launch(), launch)
        tpp = lc["gi2"]["TPP"]
        if not isinstance(tpp, int) or tpp < 1 or (BT // TS) % tpp:
            raise ValueError(f"kda_chunk_bwd: gi2 TPP={tpp!r} must divide the {BT // TS} row tiles of a chunk")
        if not lc["gv"]["PRE"]:
            asked = {**env_launch().get("gv", {}), **((launch or {}).get("gv") or {})}
            if asked.get("PRE_F32"):
                raise ValueError("kda_chunk_bwd: gv PRE_F32 (how the sequential passes form u' / du' for gv) needs "
                                 "gv PRE")
            lc["gv"]["PRE_F32"] = False  # the default's PRE_F32 has nothing to act on without PRE
        for name, c in lc.items():
            n = c.get("maxnreg")
            if n is not None and not (isinstance(n, int) and 24 <= n <= 255):
                raise ValueError(f"kda_chunk_bwd: {name} maxnreg={n!r}: expected None or an int in [24, 255]")
        if lc["gi2"]["RED"] and lc["gi2"]["FIN"]:
            raise ValueError("kda_chunk_bwd: gi2 RED (its terms added by atomics) and FIN (it finishes the columns) "
                             "exclude each other")
        if lc["gi2"]["FIN"] and tpp != BT // TS:
            raise ValueError(f"kda_chunk_bwd: gi2 FIN needs all {BT // TS} row tiles of a chunk per program, TPP={tpp}")
        if lc["gi2"]["PREC"] not in ("tf32", "split_b"):
            raise ValueError(f"kda_chunk_bwd: gi2 PREC={lc['gi2']['PREC']!r} must be 'tf32' or 'split_b'")
        pts = lc["pmat"]["PTS"]
        if pts not in (16, 32):
            raise ValueError(f"kda_chunk_bwd: pmat PTS={pts!r} must be 16 or 32")
        # 32-row tiles need the normalised q / k and a gate bounded at -5 or above (the in-kernel gate's lower_bound:
        # e^(16 |g|) factors; precomputed g is only known to be >= -10, where e^160 overflows); a chunk has BT rows.
        # FACTOR's steps between 16-row tiles' reference rows, e^(-16 |g|), underflow below g = -5.4: the same bound
        if not (gate and lb >= PTS32_MIN_LOG_DECAY):
            lc["pmat"] = {**lc["pmat"], "PTS": TS, "FACTOR": False}
        elif not const["L2NORM"] or pts > BT:
            lc["pmat"] = {**lc["pmat"], "PTS": TS}
        scr = lc["scratch"]["DTYPE"]
        if scr not in SCRATCH:
            raise ValueError(f"kda_chunk_bwd: scratch DTYPE={scr!r} must be one of {SCRATCH}")
        # the per-chunk states' and the scratch's dtypes (the input dtype or fp32; fp32 at fp32 inputs either way)
        st_dt, sdt = _scratch_dtypes(lc, dt)
        if saved is not None and not (lc["gv"]["PRE"] and (saved.states.dtype, saved.uns.dtype) == (st_dt, sdt)):
            saved = None  # (config changed since the forward: the states pass recomputes them)
        if sdt != torch.float32 and lc["gv"]["BK"] > 32:
            # correct in the interpreter, but an illegal memory access on the H200 (triton 3.6, tenth session)
            raise ValueError(f"kda_chunk_bwd: gv BK={lc['gv']['BK']} with the bf16 scratch is refused (an illegal "
                             "memory access on the H200 with triton 3.6); use BK <= 32")
        # the gradient kernels' operands, fp32: T, tril_-1(L) (cmat slots 0, 1), W, k e^(G_l - G), tril(Aq), G, norms
        cmat = torch.empty(NC, H, 4, BT, BT, device=dev, dtype=torch.float32)
        f32_wk = sdt == torch.float32
        pre = bool(lc["gv"]["PRE"])
        sf32 = bool(lc["gv"]["PRE_F32"])
        # W / k e^(G_l - G) for the gradient kernels: fp32 copies, or the intermediate-dtype ones (w, kd); with gv's
        # PRE only gw reads W (not with gv's DNU either) and nothing k e^(G_l - G) (gw's fp32 x1s / x2s are then
        # allocated by _grads); the fp32 Aq only without PRE (gv forming du'; fourteenth session: pmat 1.78 -> 1.75
        # ms, backward 10.24 -> 10.16 at B1 T8K H96, and 201 MB less at T8K, 3.2 GB at T128K)
        if pre and lc["gv"]["DNU"]:
            ws = None  # (nothing reads W after the passes)
        else:
            ws = torch.empty(H, Tt, K, device=dev, dtype=torch.float32) if f32_wk else w
        ks = None if pre else torch.empty(H, Tt, K, device=dev, dtype=torch.float32) if f32_wk else kd
        aqf = cmat if pre else torch.empty(NC, H, BT, BT, device=dev, dtype=torch.float32)
        gcs = torch.empty(H, Tt, K, device=dev, dtype=torch.float32)
        rqk = torch.empty(2, H, Tt, device=dev, dtype=torch.float32)
        _k.kda_bwd_pmat_kernel[(NC, H)](
            qc, kc, gc, bc, a_log, dtb, aq, cmat, aqf, rqk, gcs, ctok, cend, float(scale), lb, Tt, **_kw(lc["pmat"]),
            AQF=not pre, **{n: c for n, c in const.items() if n != "V"})  # (PTS: checked above)
        pw = lc["pwu"]
        wsa = w if ws is None else ws  # (pwu's fp32 W / k e^(G_l - G) slots: unused without F32_W / F32_K)
        vcols = saved is None  # (with the forward's u' nothing reads U: pwu's value blocks do not run)
        u = torch.empty(H, Tt, V, device=dev, dtype=dt) if vcols else eg
        _k.kda_bwd_pwu_kernel[_split_grid(NC, H, K // pw["BK"] + vcols * (V // pw["BV"]), pw["INNER"])](
            qc, kc, vc, bc, qg, kd, w, u, eg, cmat, wsa, wsa if ks is None else ks, gcs, rqk, ctok, cend,
            float(scale), Tt, H=H, K=K, V=V, BT=BT, IEEE=ieee, F32_W=f32_wk and ws is not None,
            F32_K=f32_wk and not pre, VCOLS=vcols, **_kw(pw))
        if saved is not None:  # the forward's per-chunk states and u'
            states, uns = saved.states, saved.uns
            dstates = torch.empty_like(states)
        else:
            # the per-chunk states / state gradients: at the scratch dtype, or with "states" alone at the input dtype
            states = torch.empty(NC, H, K, V, device=dev, dtype=st_dt)
            dstates = torch.empty_like(states)
            # u', du': with gv's PRE stored by the sequential passes (du' once U, read by the forward pass alone, is
            # freed), else allocated by _grads once the passes' bf16 operands are freed (not to raise the peak)
            uns = torch.empty(H, Tt, V, device=dev, dtype=sdt) if pre else None
            grid, ordered = _walk_grid(N, H, V // lc["states"]["BV"], order, lc["states"]["ORDERED"])
            _k.kda_bwd_states_kernel[grid](
                kd, w, u, eg, h0 if h0 is not None else eg, states, uns if pre else eg, cu, seq_chunk, Tt,
                order if ordered else cu, H=H, K=K, V=V, BT=BT, HAS_H0=h0 is not None, IEEE=ieee, UPCAST=upcast,
                STORE_U=pre, SF32=sf32, **_kw(lc["states"], "ORDERED"), ORDERED=ordered)
        del u
        dus = torch.empty(H, Tt, V, device=dev, dtype=sdt) if pre else None
        grid, ordered = _walk_grid(N, H, V // lc["dstates"]["BV"], order, lc["dstates"]["ORDERED"])
        _k.kda_bwd_dstates_kernel[grid](
            qg, kd, w, aq, eg, doc, dS0 if dS0 is not None else eg, dstates, dh0, dus if pre else eg, cu, seq_chunk, Tt,
            order if ordered else cu, H=H, K=K, V=V, BT=BT, HAS_DHT=dS0 is not None, IEEE=ieee, UPCAST=upcast,
            STORE_U=pre, SF32=sf32, **_kw(lc["dstates"], "ORDERED"), ORDERED=ordered)
        del qg, kd, w, aq, eg
        _grads(qc, kc, vc, gc, bc, a_log, dtb, doc, ws, ks, aqf, gcs, rqk, states, dstates, uns, dus, cmat,
               dq, dk, dv, dg, dbeta, dal_part, ddt_part, ctok, cend, float(scale), lb, Tt, NC, lc, const, upcast)
    dA_log = ddt_bias = None
    if gate:
        dA_log = dal_part.sum((0, 2))
        ddt_bias = ddt_part.sum(0).reshape(H * K)
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias


def _nonfinite(**tensors) -> None:
    """Debug aid ($K3_KDA_BWD_CHECK=1): print the non-finite element count of each intermediate."""
    if os.environ.get("K3_KDA_BWD_CHECK", "0") not in ("", "0"):
        print("kda_bwd nonfinite:", {n: int((~torch.isfinite(t)).sum()) for n, t in tensors.items() if t is not None},
              flush=True)


def _grads(qc, kc, vc, gc, bc, a_log, dtb, doc, ws, ks, aqf, gcs, rqk, states, dstates, uns, dus, cmat,
           dq, dk, dv, dg, dbeta, dal_part, ddt_part, ctok, cend, scale, lb, Tt, NC, lc, const, upcast):
    """The gradient kernels gv, gw, gi2, gfin (kernels_bwd.py) after the prep and the sequential passes."""
    H, K, V, BT, ieee = const["H"], const["K"], const["V"], const["BT"], const["IEEE"]
    _nonfinite(T=cmat[:, :, 0], L=cmat[:, :, 1], ws=ws, ks=ks, aqf=aqf, states=states, dstates=dstates)
    dev = qc.device
    cdb = torch.empty(NC, H, BT, device=dev, dtype=torch.float32)
    if uns is None:  # the W / U scratch dtype
        uns, dus = (torch.empty(H, Tt, V, device=dev, dtype=ws.dtype) for _ in range(2))
    dnu = bool(lc["gv"]["DNU"])
    # (ws / ks: gv reads them only without PRE; uns stands in)
    _k.kda_bwd_gv_kernel[(NC, H)](vc, bc, doc, aqf, uns if ws is None else ws, uns if ks is None else ks, states,
                                  dstates, uns, dus, cmat, cdb, dv, ctok, cend, Tt, H=H, K=K, V=V, BT=BT, IEEE=ieee,
                                  UPCAST=upcast, **_kw(lc["gv"], "PRE_F32"))  # (PRE_F32: for the passes above)
    _nonfinite(uns=uns, dus=dus, dAq=cmat[:, :, 2], dNv=cmat[:, :, 3], cdb=cdb, dv=dv)
    BKW = lc["gw"]["BK"]
    NKB = K // BKW  # gw's K blocks, and how many per-block parts of dN (NKW) / dbeta (NDB) gi2 and gfin add up
    NDB = 0 if lc["gw"]["ATOMIC"] else NKB
    NKW = 0 if dnu else NDB
    # gw's fp32 outputs x1s / x2s take the places of the fp32 W / k e^(G_l - G) copies where there are such: gv
    # (done) reads them whole, gw reads only its own block of W before it writes x1s there (-2 x 4 B per token-head
    # and K column, 12.9 GB at B1 T128K H96 D128: fwd+bwd peak 103.6 GB there against fla's 97.0 on the H200,
    # eleventh session)
    f32 = ws is not None and ws.dtype == torch.float32
    x1s = ws if f32 else torch.empty(H, Tt, K, device=dev, dtype=torch.float32)
    x2s = ks if f32 and ks is not None else torch.empty(H, Tt, K, device=dev, dtype=torch.float32)
    dgis = torch.empty(H, Tt, K, device=dev, dtype=torch.float32)
    nkp = torch.empty(NC, H, NKW, BT, BT, device=dev, dtype=torch.float32) if NKW else cdb
    dbp = torch.empty(NC, H, NDB, BT, device=dev, dtype=torch.float32) if NDB else cdb
    gate = dict(USE_GATE=const["USE_GATE"], L2NORM=const["L2NORM"])
    BKI = lc["gi2"]["BK"]
    NKI = K // BKI
    # FIN: gi2 (all of a chunk's row tiles per program) also finishes the columns (dg, the gate, dq / dk or their
    # pre-norm form with row-sum partials sqk), leaving dbeta and the L2 norm's backward to gfin
    fused = bool(lc["gi2"]["FIN"])
    # RED: gi2 adds its terms into gw's by atomics; with the L2 norm gw and gi2 then store the row-sum partials of
    # their own terms (NSQ slots per q / k: gi2's NKI, then gw's NKB)
    red = bool(lc["gi2"]["RED"])
    # gfin's ONEPASS: gi2 (without FIN) stores the same row-sum partials (its SQK), so gfin finishes dq / dk in its one
    # pass over the columns
    onepass = bool(lc["gfin"]["ONEPASS"]) and not fused and const["L2NORM"]
    NSQ = NKI + NKB if red and onepass else NKI
    sqk = torch.empty(2, NSQ, H, Tt, device=dev, dtype=torch.float32) if (fused or onepass) and const["L2NORM"] \
        else cdb
    _k.kda_bwd_gw_kernel[_split_grid(NC, H, NKB, lc["gw"]["INNER"])](
        qc, kc, gcs, bc, doc, x1s if ws is None else ws, states, dstates, uns, dus, cmat, cdb, rqk, x1s, x2s, dgis,
        nkp, dbp, sqk, ctok, cend, scale, Tt, H=H, K=K, V=V, BT=BT, IEEE=ieee, UPCAST=upcast, DNW=not dnu, RED=red,
        NSQ=NSQ if red and onepass else 0, **_kw(lc["gw"]))
    _nonfinite(x1s=x1s, x2s=x2s, dgis=dgis, nkp=nkp, dbp=dbp)
    _k.kda_bwd_gi2_kernel[_split_grid(NC, H, (BT // const["TS"] // lc["gi2"]["TPP"]) * NKI, lc["gi2"]["INNER"])](
        qc, kc, gc, bc, a_log, dtb, cmat, nkp, gcs, rqk, x1s, x2s, dgis, dq, dk, dg, dal_part, ddt_part, sqk,
        ctok, cend, scale, lb, Tt, H=H, K=K, BT=BT, TS=const["TS"], REF=const["REF"], NKW=NKW, IEEE=ieee, SQK=onepass,
        NSQ=NSQ, **gate, **_kw(lc["gi2"]))
    _k.kda_bwd_gfin_kernel[(NC, H)](
        qc, kc, gc, bc, a_log, dtb, cmat, cdb, nkp, dbp, x1s, x2s, dgis, rqk, sqk, dq, dk, dg, dbeta, dal_part,
        ddt_part, ctok, cend, scale, lb, Tt, H=H, K=K, BT=BT, NKW=NKW, NDB=NDB, FUSED=fused, NKI=NSQ, **gate,
        **{**_kw(lc["gfin"]), "ONEPASS": onepass})


def gpu_selfcheck(T: int = 1000, H: int = 8, D: int = 128, seed: int = 0, device: str = "cuda",
                  dtypes: tuple = ("bf16", "fp32")) -> dict:
    """Triton backward vs autograd through the fp32 torch chunk path at K3 head shapes (raw gate in the kernel,
    L2 norm, initial state and dht; one plain and one varlen batch). Returns {"<case>.<grad>": relative RMSE},
    plus "ms.triton_bwd" / "ms.torch_bwd" wall times of one backward. bf16 cases should stay <= ~8e-3 for
    dq/dk/dv/dh0 and <= ~2e-2 for dg/dbeta/dA_log/ddt_bias; fp32 cases ~1e-5. dtypes: which input dtypes to run
    (the fp32 kernels' first compile is slow: minutes of ptxas)."""
    import os
    import time
    from .. import chunk_kda

    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dev)
    names = ("dq", "dk", "dv", "df", "dbeta", "dh0", "dA_log", "ddt_bias")
    res = {}

    def rr(a, b):
        a, b = a.double(), b.double()
        return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))

    def grads(backend, dtype, leaves, cu, do, dht, env=None):
        old = os.environ.get("K3_KDA_TRITON_BWD")
        if env is not None:
            os.environ["K3_KDA_TRITON_BWD"] = env
        try:
            xs = [x.detach().clone().to(dtype if i < 5 else torch.float32).requires_grad_()
                  for i, x in enumerate(leaves)]
            q, k, v, f, b, h0, al, db = xs
            o, S = chunk_kda(q, k, v, f, b, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=al, dt_bias=db,
                             backend=backend)
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            ((o.float() * do).sum() + (S * dht).sum()).backward()
            torch.cuda.synchronize(dev)
            ms = (time.perf_counter() - t) * 1e3
        finally:
            if env is not None:
                if old is None:
                    os.environ.pop("K3_KDA_TRITON_BWD", None)
                else:
                    os.environ["K3_KDA_TRITON_BWD"] = old
        return [x.grad for x in xs], ms

    for case, B, cu_list in (("plain", 2, None), ("varlen", 1, [0, 1, 300, 301, 2 * T - 1, 2 * T])):
        TT = T if cu_list is None else 2 * T
        N = B if cu_list is None else len(cu_list) - 1
        cu = None if cu_list is None else torch.tensor(cu_list, device=dev)
        leaves = [rnd(B, TT, H, D), rnd(B, TT, H, D), rnd(B, TT, H, D), rnd(B, TT, H, D) * 2,
                  torch.rand(B, TT, H, generator=gen).to(dev), rnd(N, H, D, D) * 0.1,
                  torch.rand(H, generator=gen).to(dev), rnd(H * D) * 0.5]
        do, dht = rnd(B, TT, H, D), rnd(N, H, D, D)
        for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            if tag not in dtypes:
                continue
            # the reference sees the same (rounded) inputs, in fp32
            rounded = [x.to(dtype).float() if i < 5 else x for i, x in enumerate(leaves)]
            ref, ms_ref = grads("torch", torch.float32, rounded, cu, do, dht)
            grads("triton", dtype, leaves, cu, do, dht)  # warm-up / compile
            got, ms = grads("triton", dtype, leaves, cu, do, dht)
            for n, a, b in zip(names, got, ref):
                res[f"{case}.{tag}.{n}"] = rr(a, b)
            res[f"{case}.{tag}.ms.triton_bwd"] = ms
            res[f"{case}.{tag}.ms.torch_path_bwd"] = ms_ref
            if tag == "bf16":
                _, ms_old = grads("triton", dtype, leaves, cu, do, dht, env="torch")
                res[f"{case}.{tag}.ms.torch_recompute_bwd"] = ms_old
    return res
