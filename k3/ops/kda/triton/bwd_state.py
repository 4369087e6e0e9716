"""Backward, stage 2: the sequential walks: the state at every chunk start and u' (forward), the state gradient at every
chunk end, du' and dh0 (reverse). Math: bwd_common.py."""
from __future__ import annotations

import triton
import triton.language as tl

from .walk import _seq_walk_start, _walk_ids
from .bwd_common import _dot_lp, _dot_split


@triton.jit
def kda_bwd_states_kernel(kd, w, u, eg, h0, states, uns, cu, seq_chunk, Ttot, order,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                          HAS_H0: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, STORE_U: tl.constexpr,
                          SF32: tl.constexpr, ORDERED: tl.constexpr = False):
    """One program = one sequence, one head, BV value columns; forward over the chunks, storing each chunk's
    start state (fp32) and carrying S <- e^(G_l) S + (k e^(G_l - G))^T (U - W S). STORE_U: also stores u' = U - W S
    (from the intermediate-dtype operands) into uns [H, Ttot, V]. SF32: W S against the fp32 state as two
    intermediate-dtype halves (`_dot_split`) instead of its intermediate-dtype rounding. ORDERED: `_walk_ids`."""
    i_n, i_h, i_v = _walk_ids(order, V // BV, ORDERED)
    bos, eos, c0, nc, o_t, o_k, o_v, kv, ps, S = _seq_walk_start(cu, seq_chunk, h0, i_n, i_h, i_v, H, K, V, BT, BV,
                                                                 HAS_H0)
    dt = w.dtype.element_ty
    for j in range(0, nc):
        tl.store(states + ((c0 + j) * H + i_h) * K * V + kv, S.to(states.dtype.element_ty))
        tok = bos + j * BT + o_t
        m_t = tok < eos
        hk = (i_h * Ttot + tok[:, None]) * K + o_k[None, :]
        b_w = tl.load(w + hk, mask=m_t[:, None], other=0.)
        b_kd = tl.load(kd + hk, mask=m_t[:, None], other=0.)
        b_u = tl.load(u + (i_h * Ttot + tok[:, None]) * V + o_v[None, :], mask=m_t[:, None], other=0.)
        b_e = tl.load(eg + ((c0 + j) * H + i_h) * K + o_k)
        if SF32:
            b_vn = b_u.to(tl.float32) - _dot_split(b_w, S, dt, IEEE, UPCAST)
        else:
            b_vn = b_u.to(tl.float32) - _dot_lp(b_w, S.to(dt), IEEE, UPCAST)
        if STORE_U:
            tl.store(uns + (i_h * Ttot + tok[:, None]) * V + o_v[None, :], b_vn.to(uns.dtype.element_ty),
                     mask=m_t[:, None])
        S = S * b_e[:, None] + _dot_lp(tl.trans(b_kd), b_vn.to(dt), IEEE, UPCAST)


@triton.jit
def kda_bwd_dstates_kernel(qg, kd, w, aq, eg, do, dht, dstates, dh0, dus, cu, seq_chunk, Ttot, order,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                           HAS_DHT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, STORE_U: tl.constexpr,
                           SF32: tl.constexpr, ORDERED: tl.constexpr = False):
    """One program = one sequence, one head, BV value columns; backward over the chunks carrying the fp32 state
    gradient dS (starting from dht): stores dS at each chunk's end, then
    du' = Aq^T do + (k e^(G_l - G)) dS;  dS <- e^(G_l) dS + (q e^G)^T do - W^T du'.  Finally dh0 = dS.
    STORE_U: also stores du' into dus [H, Ttot, V]. SF32: (k e^(G_l - G)) dS against the fp32 dS (`_dot_split`).
    ORDERED: `_walk_ids`."""
    i_n, i_h, i_v = _walk_ids(order, V // BV, ORDERED)
    bos, eos, c0, nc, o_t, o_k, o_v, kv, ps, dS = _seq_walk_start(cu, seq_chunk, dht, i_n, i_h, i_v, H, K, V, BT,
                                                                  BV, HAS_DHT)
    dt = w.dtype.element_ty
    for jj in range(0, nc):
        j = nc - 1 - jj
        tl.store(dstates + ((c0 + j) * H + i_h) * K * V + kv, dS.to(dstates.dtype.element_ty))
        tok = bos + j * BT + o_t
        m_t = tok < eos
        hk = (i_h * Ttot + tok[:, None]) * K + o_k[None, :]
        b_qg = tl.load(qg + hk, mask=m_t[:, None], other=0.)
        b_kd = tl.load(kd + hk, mask=m_t[:, None], other=0.)
        b_w = tl.load(w + hk, mask=m_t[:, None], other=0.)
        b_a = tl.load(aq + (i_h * Ttot + tok[:, None]) * BT + o_t[None, :], mask=m_t[:, None], other=0.)
        b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.).to(dt)
        b_e = tl.load(eg + ((c0 + j) * H + i_h) * K + o_k)
        if SF32:
            b_du = _dot_lp(tl.trans(b_a), b_do, IEEE, UPCAST) + _dot_split(b_kd, dS, dt, IEEE, UPCAST)
        else:
            b_du = _dot_lp(tl.trans(b_a), b_do, IEEE, UPCAST) + _dot_lp(b_kd, dS.to(dt), IEEE, UPCAST)
        if STORE_U:
            tl.store(dus + (i_h * Ttot + tok[:, None]) * V + o_v[None, :], b_du.to(dus.dtype.element_ty),
                     mask=m_t[:, None])
        dS = dS * b_e[:, None] + _dot_lp(tl.trans(b_qg), b_do, IEEE, UPCAST) \
            - _dot_lp(tl.trans(b_w), b_du.to(dt), IEEE, UPCAST)
    tl.store(dh0 + ps, dS)
