"""Python side of the KDA Triton kernels (needs triton; imported lazily by the package __init__)."""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import kernels as _k

# Forward variants (see the package docstring and benchmarks/kda_triton.py for the design and predictions):
#   c16   two kernels on 16-token chunks (prep, then a sequential pass that also writes o)
#   c64   two kernels on 64-token chunks (prep64, then the same sequential pass with 64-token steps)
#   c64s  three kernels on 64-token chunks (prep64, lean sequential pass storing states and u', parallel output)
#   c64f  one kernel per (sequence, head): prep64 into an L2-resident scratch + the 64-token state step
FWD_VARIANTS = ("c16", "c64", "c64s", "c64f")
DEFAULT_FWD = "c16"  # one-line switch once the H200 numbers are in; K3_KDA_TRITON_FWD overrides per process
ENV_FWD = "K3_KDA_TRITON_FWD"

BT = 16   # chunk (= tile) length of c16: exp(+-cumsum) inside a tile stays within fp32 range for g >= -10
REF = 7   # reference row inside a tile: factored exponents are at most max(REF, BT-1-REF) * |g|_max
BT64 = 64  # chunk of the c64* variants (four 16-row tiles, same reference row)
N_SM = 132  # H200; only used to size the value blocks of the sequential passes


def fwd_variant(variant: Optional[str] = None) -> str:
    """The forward variant to run: the argument, else $K3_KDA_TRITON_FWD, else DEFAULT_FWD."""
    name = (variant or os.environ.get(ENV_FWD, "").strip() or DEFAULT_FWD).lower()
    if name not in FWD_VARIANTS:
        raise ValueError(f"variant: expected one of {FWD_VARIANTS} (argument or ${ENV_FWD}), got {name!r}")
    return name


def _seq_tables(B: int, T: int, cu_seqlens: Optional[torch.Tensor], device, bt: int = BT):
    """(cu int32 [N+1] on device, chunk_tok/chunk_end int32 [NC], seq_chunk int32 [N+1], N, NC) for bt-token
    chunks: chunk c covers tokens [chunk_tok[c], min(chunk_tok[c] + bt, chunk_end[c])), sequence-major order."""
    if cu_seqlens is None:
        cu_cpu = torch.arange(B + 1, dtype=torch.int64) * T
    else:
        cu_cpu = cu_seqlens.detach().to("cpu", torch.int64)
    lens = cu_cpu[1:] - cu_cpu[:-1]
    nch = (lens + bt - 1) // bt
    N = lens.numel()
    seq_chunk = torch.zeros(N + 1, dtype=torch.int64)
    seq_chunk[1:] = torch.cumsum(nch, 0)
    NC = int(seq_chunk[-1])
    seq_of = torch.repeat_interleave(torch.arange(N), nch)
    j = torch.arange(NC) - seq_chunk[:-1][seq_of]
    chunk_tok = cu_cpu[:-1][seq_of] + j * bt
    chunk_end = cu_cpu[1:][seq_of]
    to = lambda x: x.to(torch.int32).to(device, non_blocking=True)
    return to(cu_cpu), to(chunk_tok), to(chunk_end), to(seq_chunk), N, NC


def _interm_dtype(q):
    return q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _gate_args(q, use_gate, A_log, dt_bias, lower_bound):
    if use_gate:
        return A_log.contiguous(), dt_bias.contiguous(), float(lower_bound)
    dummy = q.new_zeros(1, dtype=torch.float32)
    return dummy, dummy, 0.0


def _pick_bv(V: int, nprog: int) -> int:
    """Value-column block of the c16 sequential pass: split V when there are too few (sequence, head) programs.

    H200, B8 T8K H96 D128 bf16: BV=128 17.2 ms, 64 18.4 ms, 32 21.2 ms for the whole forward (fewer re-reads of
    the K-wide intermediates win while there are >= 2 programs per SM); smaller N*H is unmeasured."""
    bv = min(V, 128)
    while bv > 16 and nprog * (V // bv) < 264:
        bv //= 2
    return bv


def _pick_bv64(V: int, nprog: int) -> int:
    """Value block of the 64-token sequential passes (c64, c64s): at most 64 (the [64, BV] fp32 accumulators and
    the [K, BV] state share one warpgroup's registers), halved down to 16 until there are >= 3 programs per SM
    (a step is a chain of two dependent wgmma's: latency is hidden by other programs). Unmeasured guess."""
    bv = min(V, 64)
    while bv > 16 and nprog * (V // bv) < 3 * N_SM:
        bv //= 2
    return bv


def kda_chunk_fwd(q, k, v, g, beta, scale: float, initial_state=None, output_final_state: bool = False,
                  cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                  A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0, variant: Optional[str] = None,
                  bv: Optional[int] = None, num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                  prep_warps: Optional[int] = None, prec: str = "tf32", prep_only: bool = False):
    """Chunked forward: (o [B,T,H,V] v.dtype, final state [N,H,K,V] fp32 or None). Inputs validated/supported.

    variant: one of FWD_VARIANTS (default: fwd_variant()). Tuning knobs (None = heuristic): bv, num_warps and
    num_stages of the sequential kernel (c64f: of the fused kernel; bv is ignored there, its num_stages is
    always 1), prep_warps of the parallel prep kernel. prec: tl.dot input precision of the c64* prep products
    ("tf32", "tf32x3" or "ieee"; the 16x16 diagonal-block inverses are always "ieee"). prep_only (benchmarks): run the
    parallel prep kernel only and return (None, None)."""
    name = fwd_variant(variant)
    if bv is not None and (bv < 16 or bv & (bv - 1)):
        raise ValueError(f"bv: expected a power of two >= 16, got {bv!r}")
    bv = None if bv is None else min(bv, v.shape[-1])
    if prec not in ("tf32", "tf32x3", "ieee"):
        raise ValueError(f"prec: expected 'tf32', 'tf32x3' or 'ieee', got {prec!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if name == "c64f" and prep_only:
        raise ValueError("prep_only: c64f has no separate prep kernel")
    bt = BT if name == "c16" else BT64
    cu, ctok, cend, seq_chunk, N, NC = _seq_tables(B, T, cu_seqlens, q.device, bt)
    ins = tuple(x.contiguous() for x in (q, k, v, g, beta))
    gate = _gate_args(q, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    flags = dict(USE_GATE=bool(use_gate_in_kernel), L2NORM=bool(use_qk_l2norm_in_kernel))
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    ht = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    if name == "c64f":
        _fwd_fused(ins, gate, flags, float(scale), o, h0, ht, cu, N, prec, num_warps)
        return o, ht
    inter = _prep(name, ins, gate, flags, float(scale), ctok, cend, NC, prec, prep_warps)
    if prep_only:
        return None, None
    if N == 0:
        return o, ht
    qg, kd, w, u, aqk, eg = inter
    Tt = B * T
    dummy = eg
    state = dict(HAS_H0=h0 is not None, STORE_HT=ht is not None)
    if name in ("c16", "c64"):
        BV = bv or (_pick_bv(V, N * H) if name == "c16" else _pick_bv64(V, N * H))
        _k.kda_state_fwd_kernel[(N, H, V // BV)](
            qg, kd, w, u, aqk, eg, o, h0 if h0 is not None else dummy, ht if ht is not None else dummy, cu,
            seq_chunk, Tt, H=H, K=K, V=V, BT=bt, BV=BV, **state, num_warps=num_warps or 4,
            num_stages=num_stages or 2)
        return o, ht
    # c64s: lean sequential pass (states + u'), then the chunk-parallel output
    BV = bv or _pick_bv64(V, N * H)
    hs = torch.empty(max(NC, 1), H, K, V, device=q.device, dtype=w.dtype)
    vn = torch.empty(H, Tt, V, device=q.device, dtype=w.dtype)
    _k.kda_state_h_kernel[(N, H, V // BV)](
        kd, w, u, eg, hs, vn, h0 if h0 is not None else dummy, ht if ht is not None else dummy, cu, seq_chunk, Tt,
        H=H, K=K, V=V, BT=bt, BV=BV, **state, num_warps=num_warps or 4, num_stages=num_stages or 2)
    BVo = min(V, 128)
    if NC > 0:
        _k.kda_out_kernel[(NC, H, V // BVo)](qg, aqk, hs, vn, o, ctok, cend, Tt, H=H, K=K, V=V, BT=bt, BV=BVo,
                                             num_warps=4, num_stages=2)
    return o, ht


def _prep(name, ins, gate, flags, scale, ctok, cend, NC, prec, prep_warps):
    """Run the chunk-parallel prep kernel; returns the intermediates (qg, kd, w, u, aqk, eg)."""
    q, k, v, g, beta = ins
    B, T, H, K = q.shape
    V = v.shape[-1]
    Tt = B * T
    dev = q.device
    dt = _interm_dtype(q)
    bt = BT if name == "c16" else BT64
    qg = torch.empty(H, Tt, K, device=dev, dtype=dt)
    kd, w = torch.empty_like(qg), torch.empty_like(qg)
    u = torch.empty(H, Tt, V, device=dev, dtype=dt)
    aqk = torch.empty(H, Tt, bt, device=dev, dtype=dt)
    eg = torch.empty(max(NC, 1), H, K, device=dev, dtype=torch.float32)
    a_log, dtb, lb = gate
    if NC > 0:
        if name == "c16":
            _k.kda_prep_fwd_kernel[(NC, H)](
                q, k, v, g, beta, a_log, dtb, qg, kd, w, u, aqk, eg, ctok, cend, scale, lb, Tt,
                H=H, K=K, V=V, BT=BT, REF=REF, **flags, num_warps=prep_warps or 4)
        else:
            _k.kda_prep64_fwd_kernel[(NC, H)](
                q, k, v, g, beta, a_log, dtb, qg, kd, w, u, aqk, eg, ctok, cend, scale, lb, Tt,
                H=H, K=K, V=V, **flags, PREC=prec, INV_PREC="ieee", num_warps=prep_warps or 8)
    return qg, kd, w, u, aqk, eg


def _fwd_fused(ins, gate, flags, scale, o, h0, ht, cu, N, prec, num_warps):
    """c64f: one program per (sequence, head) with a private [64, 3K + V + 64] scratch (input dtype)."""
    q, k, v, g, beta = ins
    B, T, H, K = q.shape
    V = v.shape[-1]
    if N == 0:
        return
    scr = torch.empty(N * H * 64 * (3 * K + V + 64), device=q.device, dtype=_interm_dtype(q))
    a_log, dtb, lb = gate
    dummy = scr
    _k.kda_fused64_fwd_kernel[(N, H)](
        q, k, v, g, beta, a_log, dtb, o, h0 if h0 is not None else dummy, ht if ht is not None else dummy, cu, scr,
        scale, lb, H=H, K=K, V=V, **flags, PREC=prec, INV_PREC="ieee", HAS_H0=h0 is not None,
        STORE_HT=ht is not None, num_warps=num_warps or 8, num_stages=1)


def kda_recurrent_fwd(q, k, v, g, beta, scale: float, initial_state=None, output_final_state: bool = False,
                      cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                      A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0, inplace: bool = False,
                      bv: Optional[int] = None):
    """Token recurrence (decode). With inplace=True the fp32 initial_state [N,H,K,V] (contiguous) is updated in place
    and returned as the final state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    if cu_seqlens is None:
        cu = (torch.arange(B + 1, dtype=torch.int32) * T).to(dev)
        N = B
    else:
        cu = cu_seqlens.to(dev, torch.int32)
        N = cu.numel() - 1
    qc, kc, vc, gc, bc = (x.contiguous() for x in (q, k, v, g, beta))
    a_log, dtb, lb = _gate_args(q, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    o = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    if inplace:
        if initial_state is None or initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
            raise ValueError("initial_state: in-place decode needs a contiguous fp32 state [N,H,K,V]")
        h0 = ht = initial_state
    else:
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    BV = bv or min(V, 32)
    dummy = o
    if N > 0:
        _k.kda_recurrent_fwd_kernel[(N, H, V // BV)](
            qc, kc, vc, gc, bc, a_log, dtb, o, h0 if h0 is not None else dummy, ht if ht is not None else dummy, cu,
            float(scale), lb, H=H, K=K, V=V, BV=BV, USE_GATE=bool(use_gate_in_kernel),
            L2NORM=bool(use_qk_l2norm_in_kernel), HAS_H0=h0 is not None, STORE_HT=ht is not None, num_warps=4)
    return o, ht
