"""Backward, stage 4: the state side per chunk and K block (dXk, the state terms of dq / dk / dG, their L2-norm row
sums, its part of dbeta). Math: bwd_common.py."""
from __future__ import annotations

import triton
import triton.language as tl

from .bwd_common import _chunk_start, _dot, _dot_s, _qk_cols, _row_factors, _split_pid, _stored_G


@triton.jit
def _inter_dbeta(cdb, dbp, pp, i_c, i_h, o_t, dbx, H: tl.constexpr, BT: tl.constexpr, ATOMIC: tl.constexpr):
    """inter's part of dbeta for its K block, sum_K dXk k e^G (dbx = dXk k e^G): stored per K block, or ATOMIC added
    into value's part. Returns that row sum."""
    rs = tl.sum(dbx, 1)
    if ATOMIC:
        tl.atomic_add(cdb + (i_c * H + i_h).to(tl.int64) * BT + o_t, rs, sem="relaxed")
    else:
        tl.store(dbp + pp + o_t, rs)
    return rs


@triton.jit
def kda_bwd_inter_grad_kernel(q, k, gcs, beta, do, ws, states, dstates, uns, dus, cmat, cdb, rqk,
                      x1s, x2s, dgis, nkp, dbp, sqk, chunk_tok, chunk_end, scale, Ttot,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                      BK: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, ATOMIC: tl.constexpr,
                      INNER: tl.constexpr, EPI_ORDER: tl.constexpr, DNW: tl.constexpr, RED: tl.constexpr = False,
                      NSQ: tl.constexpr = 0):
    """State side. One program = one chunk of one head and BK columns of K, with S0 / dS the chunk's stored
    start state / end-state gradient: dW = -du' S0^T, dXk = T^T dW, d(q e^G) = do S0^T, d(k e^(G_l-G)) = u' dS^T
    and sum_V S0 dS. Writes (fp32) x1s = d(q e^G) e^G, x2s = dXk beta e^G + d(k e^(G_l-G)) e^(G_l-G) (the inter-
    chunk parts of d(q scale) and d(kn)), dgis = their dG terms (the G_l one on the last token), and per K block
    nkp = dXk W^T (part of dN) and dbp = sum_K dXk k e^G (part of dbeta); ATOMIC: those two added into value's dN
    (cmat slot 3) and dbeta part (cdb) instead (fp32 atomics: the sum's order, so its last bits, vary between runs).
    The L2-norm row factors and the cumsum G come from the prep (rqk, gcs); grid order: `_split_pid`. Without DNW
    (value's DNU: its dN is already whole) no part of dN here, and W is not read. RED (intra's RED: intra then adds its
    terms to these by atomics, without reading them): x1s is stored scaled (d(q scale)), and with NSQ > 0 (the L2
    norm) this block's row sums sum_K qn x1, sum_K kn x2 go into sqk slots NSQ - K / BK + block of [2, NSQ, H,
    Ttot] (intra's own in the first slots), as gate_norm's one pass needs them (EPI_ORDER's order)."""
    i_c, i_h, t0, t1, o_t, tok, m_t, row, col, b_b = _chunk_start(chunk_tok, chunk_end, beta, H, BT, K // BK, INNER)
    i_k = _split_pid(K // BK, INNER)[1]
    o_kb = i_k * BK + tl.arange(0, BK)
    ps = (i_c * H + i_h).to(tl.int64) * K * V
    d_w = tl.zeros([BT, BK], dtype=tl.float32)
    d_qg = tl.zeros([BT, BK], dtype=tl.float32)
    d_kd = tl.zeros([BT, BK], dtype=tl.float32)
    d_gl = tl.zeros([BK], dtype=tl.float32)
    for iv in range(0, V // BV):
        o_v = iv * BV + tl.arange(0, BV)
        hv = (i_h * Ttot + tok[:, None]) * V + o_v[None, :]
        du = tl.load(dus + hv, mask=m_t[:, None], other=0.)
        un = tl.load(uns + hv, mask=m_t[:, None], other=0.)
        b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None],
                       other=0.).to(dus.dtype.element_ty)
        kv = ps + o_kb[:, None] * V + o_v[None, :]
        S0 = tl.load(states + kv).to(dus.dtype.element_ty)  # (bf16 states with the "states" scratch: upcast)
        dS = tl.load(dstates + kv).to(dus.dtype.element_ty)
        d_w -= _dot_s(du, tl.trans(S0), IEEE, UPCAST)
        d_qg += _dot_s(b_do, tl.trans(S0), IEEE, UPCAST)
        d_kd += _dot_s(un, tl.trans(dS), IEEE, UPCAST)
        d_gl += tl.sum(S0.to(tl.float32) * dS.to(tl.float32), 1)
    pc = (i_c * H + i_h).to(tl.int64) * 4 * BT * BT + row * BT + col
    dxk = _dot(tl.trans(tl.load(cmat + pc)), d_w, IEEE)
    hkb = (i_h * Ttot + tok[:, None]) * K + o_kb[None, :]
    pp = ((i_c * H + i_h).to(tl.int64) * (K // BK) + i_k) * BT
    if DNW:
        b_w = tl.load(ws + hkb, mask=m_t[:, None], other=0.).to(tl.float32)
        if ATOMIC:
            tl.atomic_add(cmat + pc + 3 * BT * BT, _dot(dxk, tl.trans(b_w), IEEE), sem="relaxed")
        else:
            tl.store(nkp + pp * BT + row * BT + col, _dot(dxk, tl.trans(b_w), IEEE))
    rq, rk = _row_factors(rqk, tok, m_t, i_h, Ttot, H)
    G, g_last = _stored_G(gcs, tok, m_t, i_h, o_kb, t0, t1, Ttot, K, BT)
    eG = tl.exp(G)
    # (x1s may be ws itself, the fp32 scratch: this program's block of W is its last reader, so every thread's load
    # of it above comes before any store: the barriers below)
    if EPI_ORDER:
        # each [BT, BK] term stored or folded into dgi as soon as it is complete, so that fewer tiles are live at
        # once (sm_90 static: 280 B of spill stack against 312 in the order below)
        pk = (tok[:, None] * H + i_h) * K + o_kb[None, :]
        qn = tl.load(q + pk, mask=m_t[:, None], other=0.).to(tl.float32) * rq[:, None]
        x1 = d_qg * eG
        tl.debug_barrier()
        if RED:
            # (the row sums of inter's own terms: sum_K qn x1 is that of dgi's first term, sum_K kn x2 = beta sum_K dbx
            # + sum_K dkk, from tiles formed anyway)
            x1 = x1 * scale
            tl.store(x1s + hkb, x1, mask=m_t[:, None])
            dgi = x1 * qn
            if NSQ > 0:
                tl.store(sqk + ((NSQ - K // BK + i_k) * H + i_h) * Ttot + tok, tl.sum(dgi, 1), mask=m_t)
        else:
            tl.store(x1s + hkb, x1, mask=m_t[:, None])
            dgi = x1 * (qn * scale)
        kn = tl.load(k + pk, mask=m_t[:, None], other=0.).to(tl.float32) * rk[:, None]
        keg = kn * eG
        dbx = dxk * keg
        rs_dbx = _inter_dbeta(cdb, dbp, pp, i_c, i_h, o_t, dbx, H, BT, ATOMIC)
        dgi += dbx * b_b[:, None]
        x2 = dxk * (b_b[:, None] * eG)
        ed = tl.exp(g_last[None, :] - G)
        kd = kn * ed
        x2 += d_kd * ed
        tl.store(x2s + hkb, x2, mask=m_t[:, None])
        dkk = d_kd * kd
        if RED and NSQ > 0:
            tl.store(sqk + ((2 * NSQ - K // BK + i_k) * H + i_h) * Ttot + tok, b_b * rs_dbx + tl.sum(dkk, 1),
                     mask=m_t)
        dgi -= dkk
        d_gl = d_gl * tl.exp(g_last) + tl.sum(dkk, 0)
    else:
        pk, qn, kn = _qk_cols(q, k, tok, m_t, i_h, o_kb, rq, rk, H, K)
        ed = tl.exp(g_last[None, :] - G)
        keg = kn * eG
        dbx = dxk * keg
        _inter_dbeta(cdb, dbp, pp, i_c, i_h, o_t, dbx, H, BT, ATOMIC)
        x1 = d_qg * eG * scale if RED else d_qg * eG
        kd = kn * ed
        dgi = x1 * (qn if RED else qn * scale) + dbx * b_b[:, None] - d_kd * kd
        d_gl = d_gl * tl.exp(g_last) + tl.sum(d_kd * kd, 0)
        x2 = dxk * (b_b[:, None] * eG) + d_kd * ed
        tl.debug_barrier()
        tl.store(x1s + hkb, x1, mask=m_t[:, None])
        tl.store(x2s + hkb, x2, mask=m_t[:, None])
        if RED and NSQ > 0:
            tl.store(sqk + ((NSQ - K // BK + i_k) * H + i_h) * Ttot + tok, tl.sum(qn * x1, 1), mask=m_t)
            tl.store(sqk + ((2 * NSQ - K // BK + i_k) * H + i_h) * Ttot + tok, tl.sum(kn * x2, 1), mask=m_t)
    # on the chunk's last token (rows past a sequence end are not stored; their g is 0, so G there is G_l)
    dgi += tl.where(row == tl.minimum(t1 - t0, BT) - 1, d_gl[None, :], 0.)
    tl.store(dgis + hkb, dgi, mask=m_t[:, None])
