"""Launch parameters of the KDA Triton backward: `launch_config` (the defaults per shape and dtype), its overrides
(a call's `launch=`, $K3_KDA_BWD_LAUNCH) and their checks. Needs torch only.

Kernel keys (in launch order; the backward's stages, kernels in bwd_*.py):
  matrices  kda_bwd_chunk_matrices_kernel (chunk, head)           T, tril_-1(L), tril(Aq), norms, the cumsum G
  wy        kda_bwd_wy_kernel             (chunk, head, col block) q e^G, k e^(G_l - G), W, U
  states    kda_bwd_states_kernel         (sequence, head, V block) the state at every chunk start and u'
  dstates   kda_bwd_dstates_kernel        (sequence, head, V block) the state gradient at every chunk end, du', dh0
  value     kda_bwd_value_grad_kernel     (chunk, head)            dv, dAq, dN, the value part of dbeta
  inter     kda_bwd_inter_grad_kernel     (chunk, head, K block)   dXk, the state terms of dq / dk / dG, its dbeta
  intra     kda_bwd_intra_grad_kernel     (chunk, head, tile, K)   the intra-chunk backward, added into inter's terms
  gate_norm kda_bwd_gate_norm_grad_kernel (chunk, head)            dbeta, dg (suffix sum, gate), dq / dk (L2 norm)
  scratch   (not a kernel)                the scratch dtype and whether the forward's saved states are used
The former short keys (pmat, pwu, gv, gw, gi2, gfin) are accepted as aliases in overrides.
"""
from __future__ import annotations

from typing import Optional

import torch

from k3 import knobs

BT = 64   # chunk length of the backward (one stored state per BT tokens) ...
BT_WIDE = 32  # ... and for K > 128: the grad kernels' [BT, K] fp32 tile operands must fit sm_90 shared memory
TS = 16   # row tile inside a chunk: decay exponents factored through one reference row per tile
REF = 7   # reference row inside a tile: factored exponents <= max(REF, TS-1-REF) * |g|_max
# steepest in-kernel gate lower_bound for the matrices kernel's 32-row tiles (factors <= e^(16 * 5) = e^80) and for
# its FACTOR (steps e^(-16 |g|) >= e^-80 between 16-row tiles' reference rows); below it, or with precomputed g (only
# known to be >= -10), it takes 16-row tiles with per-tile exponentials (factors <= e^(8 * 10) = e^80)
PTS32_MIN_LOG_DECAY = -5.0
ENV_LAUNCH = "K3_KDA_BWD_LAUNCH"
SCRATCH = ("fp32", "input", "states")  # launch_config's scratch DTYPE options
# the kernels' pointer arguments that hold the input dtype (bf16 / fp16 inputs) under each scratch DTYPE, fp32 else
# (read by the sm_90 compile checks, which type every pointer as launched)
SCRATCH_PTRS = {"fp32": (), "input": ("states", "dstates", "uns", "dus", "ws", "ks"), "states": ("states", "dstates")}
# the former launch keys, accepted in overrides
KEY_ALIASES = {"pmat": "matrices", "pwu": "wy", "gv": "value", "gw": "inter", "gi2": "intra", "gfin": "gate_norm"}
# the on / off launch parameters (a string such as "false" would otherwise count as on)
BOOL_PARAMS = frozenset({"REFLOAD", "FACTOR", "INNER", "PRE", "PRE_F32", "ATOMIC", "EPI_ORDER", "FIN", "BLK",
                         "ONEPASS", "DNU", "RED", "FWD", "ORDERED"})


def chunk_len(K: int) -> int:
    return BT if K <= 128 else BT_WIDE


def _pick_bv(V: int, nprog: int) -> int:
    """Value block of the sequential passes: split V while there are fewer programs than SMs (132 on an H200)."""
    bv = min(V, 64)
    while bv > 16 and nprog * (V // bv) < 132:
        bv //= 2
    return bv


def _dstates_bv(K: int, V: int, nprog: int) -> tuple:
    """(BV, num_warps) of the dstates pass: 128 value columns on 8 warps (one program per (sequence, head) at V =
    128, one CTA per SM) once BV 64 would need a second partial wave of its one-CTA programs (nprog > 66 on 132 SMs;
    B1 H96 T8K: 0.84 ms vs 1.10 at BV 64). Else `_pick_bv` on 4 warps; K > 128 (32-token chunks) too."""
    if K <= 128 and V >= 128 and nprog > 66:
        return 128, 8
    return _pick_bv(V, nprog), 4


def launch_config(K: int, V: int, nprog: int, dtype: torch.dtype) -> dict:
    """Per-kernel launch parameters {kernel key: dict(BV=, BK=, num_warps=, num_stages=, maxnreg=, options)} at head
    dims K, V with nprog = N*H (sequence, head) pairs and token dtype `dtype`; also read by
    benchmarks/kda_bwd_static.py. Every value is the best of the H200 sweeps at B1 T8K H96 D128 bf16
    (benchmarks/kda_bwd_sweep.py; numbers and the options that lost: benchmarks/RESULTS.md, docs/LOG.md)."""
    lowp = dtype in (torch.bfloat16, torch.float16)
    det = torch.are_deterministic_algorithms_enabled()  # no order-dependent atomics (inter's ATOMIC) then
    BV = _pick_bv(V, nprog)
    dBV, dW = _dstates_bv(K, V, nprog)
    # software-pipelining depth of the chunk loops: every stage buffers [BT, K] tiles in shared memory
    seq_stages = 2 if lowp else 1
    cfg = dict(
        # INV_PREC: the 64 x 64 inverse's tensor-core precision at bf16 / fp16 inputs (fp32 inputs: always
        # "tf32x3"). INV: its algorithm, "blk" (recursive 2x2 block inversion: rounding relative to the inverse) or
        # "pow" (repeated squaring, the default until the twenty-second session: in one-pass tf32 its powers of N
        # cancel catastrophically for nearly collinear keys with weak decay and beta near 1, e.g. a run of one
        # repeated token, and T, hence every gradient, comes back as huge finite garbage: the `small` preset's grad
        # norm spikes of 1e5-1e10 and NaNs; both take ten 64 x 64 x 64 products). REFLOAD: the tiles' reference rows
        # of G read back from the stored cumsum. FACTOR: two-level decays in the intra-chunk products (one [BT, BK]
        # exponential pair per K block). PTS: row tile of the decay-factored products, 32 where the L2 norm and a gate
        # bounded at >= -5 keep e^80 factors in fp32, else 16 (kda_chunk_bwd narrows it per call)
        matrices=dict(BK=min(K, 64), num_warps=4, num_stages=1, INV_PREC="tf32", INV="blk", REFLOAD=True, FACTOR=True,
                      PTS=32),
        # INNER (wy, inter, intra): a chunk's column-block / tile programs are consecutive on grid axis 0, so they
        # run together and share what they all read in L2
        wy=dict(BV=min(V, 64), BK=min(K, 64), num_warps=4, num_stages=1, INNER=True),
        # ORDERED: at varlen the sequences' walks longest first in a sequence-major grid (tables._walk_order)
        states=dict(BV=BV, num_warps=4, num_stages=seq_stages, ORDERED=True),
        dstates=dict(BV=dBV, num_warps=dW, num_stages=seq_stages, ORDERED=True),
        # PRE: u' / du' stored by the sequential passes and read here (False: formed here in fp32 against the stored
        # states, ~1.7 ms slower). PRE_F32: the passes' products against the fp32 state as two bf16 halves, not its
        # bf16 rounding (dv 6.4e-3 vs 9.2e-3 in the interpreter's small-head cases). DNU: the whole dN as
        # sum_V dXv u'^T here (= dXv U^T + dXk W^T, since W S0 = U - u'), so inter adds no part of dN
        value=dict(BV=min(V, 64), BK=min(K, 32), num_warps=4, num_stages=1, PRE=True, PRE_F32=True, DNU=True),
        # ATOMIC: its per-K-block dbeta parts added into value's by fp32 atomics (order-dependent last bits: off
        # under torch.use_deterministic_algorithms). EPI_ORDER: the epilogue stores each term once complete
        inter=dict(BV=min(V, 32), BK=min(K, 64), num_warps=4, num_stages=2, ATOMIC=not det, INNER=True,
                   EPI_ORDER=True),
        # TPP: row tiles per program (divides BT / TS). FIN: it also finishes the columns (needs all tiles per
        # program; slower). BLK: the products block by block of 16 rows, only the blocks the tile's causal rows /
        # columns reach. RED: its terms added into inter's by fp32 atomic adds (one per element: order-independent,
        # kept under deterministic algorithms). PREC: "tf32", or "split_b" (the decayed q / k as tf32 part plus
        # rest, two passes: +0.5 ms, the gate's gradients several times more accurate: ddt_bias 1.6e-2 -> 2.7e-3)
        intra=dict(BK=min(K, 64), num_warps=4, num_stages=1, TPP=1, FIN=False, INNER=True, BLK=True, RED=True,
                   PREC="tf32"),
        # ONEPASS: intra stores the L2 norm's row-sum partials, so dq / dk are finished in the same pass as dg
        gate_norm=dict(BK=min(K, 64), num_warps=4, num_stages=1, ONEPASS=True),
        # DTYPE: the scratch W, k e^(G_l - G), u', du' and per-chunk states / state gradients: "input" (the input
        # dtype at bf16 inputs, as fla keeps them: the default, 8.37 vs 8.95 ms), "fp32" (the last digits: dk
        # 2.6e-3 vs 3.2e-3; the default at fp16 inputs, where a state past 65504 would overflow), or "states" (only
        # the states at the input dtype). FWD: a training forward's walk stores the per-chunk states and u'
        # (tables.FwdSave), so no states pass runs and wy forms no U; off at fp32 inputs (the forward's products are
        # one-pass tf32 there, the states pass's 3-pass)
        scratch=dict(DTYPE="input" if dtype == torch.bfloat16 else "fp32", FWD=lowp),
    )
    for name, c in cfg.items():
        if name != "scratch":
            c["maxnreg"] = None  # (every kernel: None, or a per-thread register cap for ptxas)
    if lowp and K <= 128:
        cfg["wy"]["maxnreg"] = 168  # 3 CTAs per SM (128 B of spills): 1.37 ms vs 1.67
        cfg["inter"]["num_stages"] = 3  # the value loop 3 deep (104 KB of shared memory, still 2 CTAs per SM)
        cfg["intra"]["maxnreg"] = 96  # 5 CTAs per SM instead of 4 (16 B of spills): 1.92 ms vs 2.09
    return cfg


def _canonical(over: Optional[dict]) -> dict:
    """An override with the former kernel keys (KEY_ALIASES) renamed; a key given under both names is refused."""
    out = {}
    for name, params in (over or {}).items():
        key = KEY_ALIASES.get(name, name)
        if key in out:
            raise ValueError(f"kda_chunk_bwd: launch override names kernel {key!r} twice ({name!r} is its alias)")
        out[key] = params
    return out


def env_launch() -> dict:
    """Launch overrides from $K3_KDA_BWD_LAUNCH: JSON {kernel key: {param: value}} (e.g. '{"intra": {"PREC":
    "split_b"}}'), applied under a call's own `launch` argument; {} when unset."""
    val = knobs.get(ENV_LAUNCH)          # parsed and checked ({kernel: {param: value}}) by k3.knobs
    return _canonical(val) if val else {}


def apply_launch(lc: dict, *overrides) -> dict:
    """`launch_config` result lc with each override dict ({kernel: {param: value}}, None = none) applied in order;
    unknown kernels or parameters are refused by name. intra's default BLK (with its one row tile per program) gives
    way to an override asking for TPP > 1 or FIN without asking for BLK (so those rows keep their full-tile
    products), and so does its default register cap (sized for one tile) unless maxnreg is asked for too; its
    default RED gives way to FIN unless RED is asked for too (then refused: they exclude each other)."""
    blk_asked = nreg_asked = red_asked = False
    for over in overrides:
        for name, params in _canonical(over).items():
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
            blk_asked |= name == "intra" and "BLK" in params
            nreg_asked |= name == "intra" and "maxnreg" in params
            red_asked |= name == "intra" and "RED" in params
    intra = lc.get("intra")
    if intra is not None and intra["FIN"] and intra.get("RED") and not red_asked:
        intra = lc["intra"] = {**intra, "RED": False}  # (FIN finishes the columns itself: nothing to add into)
    if intra is not None and (intra["TPP"] != 1 or intra["FIN"]):
        if intra.get("BLK") and not blk_asked:
            intra = lc["intra"] = {**intra, "BLK": False}
        if not nreg_asked:
            lc["intra"] = {**intra, "maxnreg": None}
    return lc


def scratch_dtypes(lc: dict, dt: torch.dtype) -> tuple:
    """(per-chunk states dtype, u' / du' dtype) of a launch config at token compute dtype dt."""
    scr = lc["scratch"]["DTYPE"]
    sdt = dt if scr == "input" else torch.float32
    return (dt if scr == "states" else sdt), sdt
