"""Forward, stage 2: the sequential walk over chunks carrying the fp32 state and writing o (kernel of `fwd.py`)."""
from __future__ import annotations

import triton
import triton.language as tl

from .walk import _seq_walk_start, _walk_ids


@triton.jit
def kda_state_output_fwd_kernel(qg, kd, w, u, aqk, eg, o, h0, ht, cu, seq_chunk, Ttot, states, uns, save_chunk, save_off,
                         order, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, CU_STRIDE: tl.constexpr = 1,
                         SAVE: tl.constexpr = 0, ORDERED: tl.constexpr = False):
    """One program = one sequence, one head, BV value columns; walks the chunks carrying the fp32 state S [K, BV]:
    u' = U - W S;  o = (q e^G) S + Aqk u';  S <- e^{G_last} S + (k e^{G_last - G})^T u'.
    CU_STRIDE: see _seq_walk_start. SAVE > 0 (training: what the backward's states pass would recompute): every SAVE
    chunks, the state at the start of the backward's SAVE * BT-token chunk goes to states [C, H, K, V] at chunk
    save_chunk[i_n] + save_off + j // SAVE, and every chunk's u' to uns [H, Ttot, V] (their dtypes). ORDERED: the
    sequences in the order of `order` (`_walk_ids`)."""
    i_n, i_h, i_v = _walk_ids(order, V // BV, ORDERED)
    bos, eos, c0, nc, o_t, o_k, o_v, kv, ps, S = _seq_walk_start(cu, seq_chunk, h0, i_n, i_h, i_v, H, K, V, BT, BV,
                                                                 HAS_H0, CU_STRIDE)
    dt = w.dtype.element_ty
    if SAVE:
        cs = tl.load(save_chunk + i_n).to(tl.int64) + save_off
    for j in range(0, nc):
        if SAVE:
            if j % SAVE == 0:
                tl.store(states + ((cs + j // SAVE) * H + i_h) * K * V + kv, S.to(states.dtype.element_ty))
        tok = bos + j * BT + o_t
        m_t = tok < eos
        ik = (i_h * Ttot + tok[:, None]) * K + o_k[None, :]
        b_w = tl.load(w + ik, mask=m_t[:, None], other=0.)
        b_qg = tl.load(qg + ik, mask=m_t[:, None], other=0.)
        b_kd = tl.load(kd + ik, mask=m_t[:, None], other=0.)
        b_u = tl.load(u + (i_h * Ttot + tok[:, None]) * V + o_v[None, :], mask=m_t[:, None], other=0.).to(tl.float32)
        b_a = tl.load(aqk + (i_h * Ttot + tok[:, None]) * BT + o_t[None, :], mask=m_t[:, None], other=0.)
        b_e = tl.load(eg + ((c0 + j) * H + i_h) * K + o_k)
        s_lo = S.to(dt)
        b_vn = b_u - tl.dot(b_w, s_lo)
        vn_lo = b_vn.to(dt)
        b_o = tl.dot(b_qg, s_lo) + tl.dot(b_a, vn_lo)
        S = S * b_e[:, None] + tl.dot(tl.trans(b_kd), vn_lo)
        tl.store(o + (tok[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None])
        if SAVE:
            tl.store(uns + (i_h * Ttot + tok[:, None]) * V + o_v[None, :], b_vn.to(uns.dtype.element_ty),
                     mask=m_t[:, None])
    if STORE_HT:
        tl.store(ht + ps, S)
