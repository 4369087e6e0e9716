"""Backward, stage 3: the value side per chunk (dv, dAq, dN, the value part of dbeta). Math: bwd_common.py."""
from __future__ import annotations

import triton
import triton.language as tl

from .bwd_common import _chunk_start, _dot, _dot_s


@triton.jit
def _value_side(v, do, states, dstates, ws, ks, uns, dus, cmat, cdb, dv, Tm, AqT, b_b, tok, m_t, i_c, i_h, Ttot,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                BK: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PRE: tl.constexpr, DNU: tl.constexpr):
    """The value side of a chunk's gradient, given T, Aq^T (fp32, in registers) and W / k e^(G_l - G) in the fp32
    scratch ws / ks: per value block U = T diag(beta) v, u' = U - W S0, du' = Aq^T do + (k e^(G_l - G)) dS (K in BK
    blocks against the stored states), dv = diag(beta) T^T du'; stores u', du' (uns / dus), and per chunk
    tril(dAq) = tril(do u'^T), sum_V dXv U^T and sum_V dXv v (cmat slots 2, 3; cdb). PRE: u' / du' were stored by
    the sequential passes (their STORE_U): read from uns / dus instead of formed against the states. DNU: slot 3
    holds sum_V dXv u'^T, which is the whole dN's sum dXv U^T + dXk W^T (dXk = -T^T du' S0^T and W S0 = U - u', so
    dXk W^T = -dXv (U - u')^T): inter then adds no part of its own (and with PRE, U is not formed here at all)."""
    o_t = tl.arange(0, BT)
    row = o_t[:, None]
    col = o_t[None, :]
    TmT = tl.trans(Tm)
    d_aq = tl.zeros([BT, BT], dtype=tl.float32)
    d_n = tl.zeros([BT, BT], dtype=tl.float32)
    d_b = tl.zeros([BT], dtype=tl.float32)
    ps = (i_c * H + i_h).to(tl.int64) * K * V
    for iv in range(0, V // BV):
        o_v = iv * BV + tl.arange(0, BV)
        pv = (tok[:, None] * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + pv, mask=m_t[:, None], other=0.).to(tl.float32)
        b_do = tl.load(do + pv, mask=m_t[:, None], other=0.).to(tl.float32)
        if not (PRE and DNU):
            U = _dot(Tm, b_v * b_b[:, None], IEEE)
        hv = (i_h * Ttot + tok[:, None]) * V + o_v[None, :]
        if PRE:
            un = tl.load(uns + hv, mask=m_t[:, None], other=0.).to(tl.float32)
            du = tl.load(dus + hv, mask=m_t[:, None], other=0.).to(tl.float32)
        else:
            un = U
            du = _dot(AqT, b_do, IEEE)
            for jb in tl.static_range(K // BK):
                o_kb = jb * BK + tl.arange(0, BK)
                hkb = (i_h * Ttot + tok[:, None]) * K + o_kb[None, :]
                kv = ps + o_kb[:, None] * V + o_v[None, :]
                un -= _dot_s(tl.load(ws + hkb, mask=m_t[:, None], other=0.),
                             tl.load(states + kv).to(ws.dtype.element_ty), IEEE, UPCAST)
                du += _dot_s(tl.load(ks + hkb, mask=m_t[:, None], other=0.),
                             tl.load(dstates + kv).to(ks.dtype.element_ty), IEEE, UPCAST)
            tl.store(uns + hv, un, mask=m_t[:, None])
            tl.store(dus + hv, du, mask=m_t[:, None])
        d_aq += _dot(b_do, tl.trans(un), IEEE)
        dxv = _dot(TmT, du, IEEE)
        tl.store(dv + pv, (dxv * b_b[:, None]).to(dv.dtype.element_ty), mask=m_t[:, None])
        d_b += tl.sum(dxv * b_v, 1)
        if DNU:
            d_n += _dot(dxv, tl.trans(un), IEEE)
        else:
            d_n += _dot(dxv, tl.trans(U), IEEE)
    pc = (i_c * H + i_h).to(tl.int64) * 4 * BT * BT + row * BT + col
    tl.store(cmat + pc + 2 * BT * BT, tl.where(row >= col, d_aq, 0.))
    tl.store(cmat + pc + 3 * BT * BT, d_n)
    tl.store(cdb + (i_c * H + i_h).to(tl.int64) * BT + o_t, d_b)


@triton.jit
def kda_bwd_value_grad_kernel(v, beta, do, aqf, ws, ks, states, dstates, uns, dus, cmat, cdb, dv, chunk_tok, chunk_end, Ttot,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                      BK: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PRE: tl.constexpr,
                      DNU: tl.constexpr):
    """Value side: `_value_side` with T (cmat slot 0), Aq (aqf), W and k e^(G_l - G) (ws / ks) from the prep
    (fp32), or with PRE u' / du' as the sequential passes stored them (DNU: the whole dN from u'). One program = one
    chunk of one head."""
    i_c, i_h, t0, t1, o_t, tok, m_t, row, col, b_b = _chunk_start(chunk_tok, chunk_end, beta, H, BT)
    Tm = tl.load(cmat + (i_c * H + i_h).to(tl.int64) * 4 * BT * BT + row * BT + col)
    if PRE:  # (u' / du' from the sequential passes: no Aq^T do here)
        AqT = Tm
    else:
        AqT = tl.trans(tl.load(aqf + (i_c * H + i_h).to(tl.int64) * BT * BT + row * BT + col))
    _value_side(v, do, states, dstates, ws, ks, uns, dus, cmat, cdb, dv, Tm, AqT, b_b, tok, m_t, i_c, i_h, Ttot,
                H, K, V, BT, BV, BK, IEEE, UPCAST, PRE, DNU)
