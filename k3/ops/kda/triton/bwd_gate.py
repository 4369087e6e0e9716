"""Backward, stage 6: per chunk, dbeta, dg through the suffix sum and the gate, dq / dk through the L2 norm and the q
scale. Math: bwd_common.py."""
from __future__ import annotations

import triton
import triton.language as tl

from .bwd_common import _chunk_start, _dl_slice, _gate_bwd_rows, _qk_cols, _row_factors


@triton.jit
def _grad_cols_start(rqk, tok, m_t, i_h, Ttot, H: tl.constexpr, BT: tl.constexpr):
    """Before a chunk's gradient column blocks (`_grad_cols_out`): the rows' L2-norm factors rq, rk (from the prep's
    rqk) and zeroed accumulators s_q, s_k (row sums for the norm's backward) and d_al (the dA_log partial)."""
    rq, rk = _row_factors(rqk, tok, m_t, i_h, Ttot, H)
    z = tl.zeros([BT], dtype=tl.float32)
    return rq, rk, z, z, tl.sum(z, 0)


@triton.jit
def _grad_cols_out(g, A_log, dt_bias, dq, dk, dg, ddt_part, dG, dqn, dkn, qn, kn, pk, m_t, i_c, i_h,
                   o_kb, lower_bound, d_al, s_q, s_k, H: tl.constexpr, K: tl.constexpr, USE_GATE: tl.constexpr,
                   L2NORM: tl.constexpr):
    """The end of one K-column block of a chunk's gradient: dG -> dg by the in-chunk suffix sum (g_t enters G_s for
    all s >= t), through the gate to df (with this chunk's dA_log / ddt_bias partials), and dq, dk: stored, or with
    the L2 norm (the pre-norm dqn / dkn stay where the caller read them) the row sums s_q, s_k the norm's backward
    needs. Returns the updated (d_al, s_q, s_k)."""
    dgs = tl.sum(dG, 0)[None, :] - tl.cumsum(dG, axis=0) + dG
    al, dt_cols = _gate_bwd_rows(g, A_log, dt_bias, dg, dgs, pk, m_t, i_h, o_kb, lower_bound, K, USE_GATE)
    if USE_GATE:
        d_al += al
        tl.store(ddt_part + (i_c * H + i_h) * K + o_kb, dt_cols)
    if L2NORM:
        s_q += tl.sum(qn * dqn, 1)
        s_k += tl.sum(kn * dkn, 1)
    else:
        tl.store(dq + pk, dqn.to(dq.dtype.element_ty), mask=m_t[:, None])
        tl.store(dk + pk, dkn.to(dk.dtype.element_ty), mask=m_t[:, None])
    return d_al, s_q, s_k


@triton.jit
def _grad_chunk_out(q, k, dq, dk, dbeta, dal_part, dqs, dks, tok, m_t, i_c, i_h, rq, rk, s_q, s_k, d_al, d_b, Ttot,
                    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, USE_GATE: tl.constexpr,
                    L2NORM: tl.constexpr):
    """The end of a chunk's gradient after its column blocks (`_grad_cols_out`): the dA_log partial, dbeta, and
    with the L2 norm dq / dk from the pre-norm gradients in dqs / dks."""
    if USE_GATE:
        tl.store(dal_part + (i_c * H + i_h) * K, d_al)
    tl.store(dbeta + tok * H + i_h, d_b.to(dbeta.dtype.element_ty), mask=m_t)
    if L2NORM:
        tl.debug_barrier()
        _l2norm_bwd_cols(q, k, dq, dk, dqs, dks, tok, m_t, i_h, rq, rk, s_q, s_k, Ttot, H, K, BK)


@triton.jit
def _sqk_sums(sqk, tok, m_t, i_h, Ttot, H: tl.constexpr, NKI: tl.constexpr):
    """The L2 norm backward's row sums s_q = sum_K qn dqn, s_k likewise, from intra's NKI per-K-block partials in sqk
    [2, NKI, H, Ttot]."""
    s_q = tl.load(sqk + i_h * Ttot + tok, mask=m_t, other=0.)
    s_k = tl.load(sqk + (NKI * H + i_h) * Ttot + tok, mask=m_t, other=0.)
    for j in tl.static_range(1, NKI):
        s_q += tl.load(sqk + (j * H + i_h) * Ttot + tok, mask=m_t, other=0.)
        s_k += tl.load(sqk + ((NKI + j) * H + i_h) * Ttot + tok, mask=m_t, other=0.)
    return s_q, s_k


@triton.jit
def _norm_cols(q, k, dqs, dks, tok, m_t, i_h, o_kb, rq, rk, Ttot, H: tl.constexpr, K: tl.constexpr):
    """Columns o_kb of a chunk: token-layout offsets pk, head-major offsets hkb, normalised q and k, and the
    pre-norm gradients stored in dqs / dks."""
    pk, qn, kn = _qk_cols(q, k, tok, m_t, i_h, o_kb, rq, rk, H, K)
    hkb = (i_h * Ttot + tok[:, None]) * K + o_kb[None, :]
    dqn = tl.load(dqs + hkb, mask=m_t[:, None], other=0.)
    dkn = tl.load(dks + hkb, mask=m_t[:, None], other=0.)
    return pk, hkb, qn, kn, dqn, dkn


@triton.jit
def _l2norm_bwd_cols(q, k, dq, dk, dqs, dks, tok, m_t, i_h, rq, rk, s_q, s_k, Ttot,
                     H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Backward of the q/k L2 norm, dx = r (dxn - xn sum_K(xn dxn)), from the pre-norm gradients dqs / dks
    (head-major fp32 scratch) and the row sums s_q = sum_K qn dqn, s_k likewise; BK columns at a time."""
    for kb in range(0, K // BK):
        pk, hkb, qn, kn, dqn, dkn = _norm_cols(q, k, dqs, dks, tok, m_t, i_h, kb * BK + tl.arange(0, BK), rq, rk,
                                               Ttot, H, K)
        tl.store(dq + pk, (rq[:, None] * (dqn - qn * s_q[:, None])).to(dq.dtype.element_ty), mask=m_t[:, None])
        tl.store(dk + pk, (rk[:, None] * (dkn - kn * s_k[:, None])).to(dk.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def kda_bwd_gate_norm_grad_kernel(q, k, g, beta, A_log, dt_bias, cmat, cdb, nkp, dbp, x1s, x2s, dgis, rqk, sqk,
                        dq, dk, dg, dbeta, dal_part, ddt_part, chunk_tok, chunk_end, scale, lower_bound, Ttot,
                        H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, NKW: tl.constexpr,
                        NDB: tl.constexpr, USE_GATE: tl.constexpr, L2NORM: tl.constexpr, FUSED: tl.constexpr,
                        NKI: tl.constexpr, ONEPASS: tl.constexpr):
    """After intra: per chunk and head, dbeta (value part + inter's NDB partials + sum_i dN_ti L_ti; dN with inter's NKW
    partials), and per BK columns dG -> dg (suffix sum, gate), dq / dk from the pre-norm gradients intra left in x1s /
    x2s. FUSED (intra finished the columns): with the L2 norm only dq / dk from x1s / x2s and intra's NKI row-sum
    partials in sqk. ONEPASS (intra's SQK wrote those partials, with intra's RED inter some of the NKI too; with the L2
    norm): dq / dk in the same pass over the columns as dg, instead of the row sums first and a second read of q /
    k / x1s / x2s."""
    i_c, i_h, t0, t1, o_t, tok, m_t, row, col, b_b = _chunk_start(chunk_tok, chunk_end, beta, H, BT)
    pc0 = (i_c * H + i_h).to(tl.int64) * 4 * BT * BT
    pp = (i_c * H + i_h).to(tl.int64) * NKW * BT
    d_n = _dl_slice(cmat, nkp, pc0, pp, row, col, 1., NKW, BT)
    d_b = tl.load(cdb + (i_c * H + i_h).to(tl.int64) * BT + o_t) + tl.sum(d_n * tl.load(cmat + pc0 + BT * BT + row * BT
                                                                                           + col), 1)
    for j in tl.static_range(NDB):
        d_b += tl.load(dbp + (i_c * H + i_h).to(tl.int64) * NDB * BT + j * BT + o_t)
    if FUSED:
        tl.store(dbeta + tok * H + i_h, d_b.to(dbeta.dtype.element_ty), mask=m_t)
        if L2NORM:
            rq, rk = _row_factors(rqk, tok, m_t, i_h, Ttot, H)
            s_q, s_k = _sqk_sums(sqk, tok, m_t, i_h, Ttot, H, NKI)
            _l2norm_bwd_cols(q, k, dq, dk, x1s, x2s, tok, m_t, i_h, rq, rk, s_q, s_k, Ttot, H, K, BK)
        return
    rq, rk, s_q, s_k, d_al = _grad_cols_start(rqk, tok, m_t, i_h, Ttot, H, BT)
    if ONEPASS and L2NORM:
        s_q, s_k = _sqk_sums(sqk, tok, m_t, i_h, Ttot, H, NKI)
        for kb in range(0, K // BK):
            o_kb = kb * BK + tl.arange(0, BK)
            pk, hkb, qn, kn, dqn, dkn = _norm_cols(q, k, x1s, x2s, tok, m_t, i_h, o_kb, rq, rk, Ttot, H, K)
            dG = tl.load(dgis + hkb, mask=m_t[:, None], other=0.)
            # the norm's backward as in _l2norm_bwd_cols, then stored (L2NORM=False) with the gate's part
            d_al, s_q, s_k = _grad_cols_out(g, A_log, dt_bias, dq, dk, dg, ddt_part, dG,
                                            rq[:, None] * (dqn - qn * s_q[:, None]),
                                            rk[:, None] * (dkn - kn * s_k[:, None]), qn, kn, pk, m_t, i_c, i_h, o_kb,
                                            lower_bound, d_al, s_q, s_k, H, K, USE_GATE, False)
        _grad_chunk_out(q, k, dq, dk, dbeta, dal_part, x1s, x2s, tok, m_t, i_c, i_h, rq, rk, s_q, s_k, d_al, d_b,
                        Ttot, H, K, BK, USE_GATE, False)
        return
    for kb in range(0, K // BK):
        o_kb = kb * BK + tl.arange(0, BK)
        pk, hkb, qn, kn, dqn, dkn = _norm_cols(q, k, x1s, x2s, tok, m_t, i_h, o_kb, rq, rk, Ttot, H, K)
        dG = tl.load(dgis + hkb, mask=m_t[:, None], other=0.)
        d_al, s_q, s_k = _grad_cols_out(g, A_log, dt_bias, dq, dk, dg, ddt_part, dG, dqn, dkn, qn, kn, pk,
                                        m_t, i_c, i_h, o_kb, lower_bound, d_al, s_q, s_k, H, K, USE_GATE, L2NORM)
    _grad_chunk_out(q, k, dq, dk, dbeta, dal_part, x1s, x2s, tok, m_t, i_c, i_h, rq, rk, s_q, s_k, d_al, d_b, Ttot,
                    H, K, BK, USE_GATE, L2NORM)
