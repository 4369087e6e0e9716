"""Python side of the KDA Triton kernels (needs triton; imported lazily by the package __init__)."""
from __future__ import annotations

from typing import Optional

import torch

from . import kernels as _k

BT = 16   # chunk (= tile) length: exp(+-cumsum) inside a tile stays within fp32 range for g >= -10
REF = 7   # reference row inside a tile: factored exponents are at most max(REF, BT-1-REF) * |g|_max


def _seq_tables(B: int, T: int, cu_seqlens: Optional[torch.Tensor], device):
    """(cu int32 [N+1] on device, chunk_tok/chunk_end int32 [NC], seq_chunk int32 [N+1], N, NC)."""
    if cu_seqlens is None:
        cu_cpu = torch.arange(B + 1, dtype=torch.int64) * T
    else:
        cu_cpu = cu_seqlens.detach().to("cpu", torch.int64)
    lens = cu_cpu[1:] - cu_cpu[:-1]
    nch = (lens + BT - 1) // BT
    N = lens.numel()
    seq_chunk = torch.zeros(N + 1, dtype=torch.int64)
    seq_chunk[1:] = torch.cumsum(nch, 0)
    NC = int(seq_chunk[-1])
    seq_of = torch.repeat_interleave(torch.arange(N), nch)
    j = torch.arange(NC) - seq_chunk[:-1][seq_of]
    chunk_tok = cu_cpu[:-1][seq_of] + j * BT
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
    """Value-column block of the sequential pass: split V when there are too few (sequence, head) programs.

    H200, B8 T8K H96 D128 bf16: BV=128 17.2 ms, 64 18.4 ms, 32 21.2 ms for the whole forward (fewer re-reads of
    the K-wide intermediates win while there are >= 2 programs per SM); smaller N*H is unmeasured."""
    bv = min(V, 128)
    while bv > 16 and nprog * (V // bv) < 264:
        bv //= 2
    return bv


def kda_chunk_fwd(q, k, v, g, beta, scale: float, initial_state=None, output_final_state: bool = False,
                  cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                  A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0, bv: Optional[int] = None,
                  prep_only: bool = False):
    """Chunked forward: (o [B,T,H,V] v.dtype, final state [N,H,K,V] fp32 or None). Inputs validated/supported.
    prep_only (benchmarks): run the parallel per-chunk kernel only and return (None, None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    Tt = B * T
    cu, ctok, cend, seq_chunk, N, NC = _seq_tables(B, T, cu_seqlens, dev)
    qc, kc, vc, gc, bc = (x.contiguous() for x in (q, k, v, g, beta))
    dt = _interm_dtype(q)
    qg = torch.empty(H, Tt, K, device=dev, dtype=dt)
    kd, w = torch.empty_like(qg), torch.empty_like(qg)
    u = torch.empty(H, Tt, V, device=dev, dtype=dt)
    aqk = torch.empty(H, Tt, BT, device=dev, dtype=dt)
    eg = torch.empty(max(NC, 1), H, K, device=dev, dtype=torch.float32)
    a_log, dtb, lb = _gate_args(q, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    o = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    if NC > 0:
        _k.kda_prep_fwd_kernel[(NC, H)](
            qc, kc, vc, gc, bc, a_log, dtb, qg, kd, w, u, aqk, eg, ctok, cend, float(scale), lb, Tt,
            H=H, K=K, V=V, BT=BT, REF=REF, USE_GATE=bool(use_gate_in_kernel), L2NORM=bool(use_qk_l2norm_in_kernel),
            num_warps=4)
    if prep_only:
        return None, None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    BV = bv or _pick_bv(V, N * H)
    if N > 0:
        _k.kda_state_fwd_kernel[(N, H, V // BV)](
            qg, kd, w, u, aqk, eg, o, h0 if h0 is not None else eg, ht if ht is not None else eg, cu, seq_chunk, Tt,
            H=H, K=K, V=V, BT=BT, BV=BV, HAS_H0=h0 is not None, STORE_HT=ht is not None, num_warps=4,
            num_stages=2)
    return o, ht


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
