"""Backward, stage 5: the intra-chunk backward per 16-row tile and K block, added into the state side's terms.
Math: bwd_common.py."""
from __future__ import annotations

import triton
import triton.language as tl

from .bwd_common import (_G_rows, _chunk_start, _dl_slice, _dot, _dot_p, _gate_bwd_rows, _last_G, _qk_cols, _ref_row, _row_factors,
    _split_pid, _stored_G)


@triton.jit
def _intra_grad_blocks(q, k, beta, cmat, nkp, gcs, rqk, g_ref, g_end, b_r, rr, r, i_h, o_kb, t0, t1, pc0, pp, scale, Ttot,
                H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, TS: tl.constexpr, BK: tl.constexpr,
                NKW: tl.constexpr, IEEE: tl.constexpr, PREC: tl.constexpr = "tf32"):
    """intra's BLK products for row tile r (rows rr, beta b_r, reference-row G g_ref), block by block of TS rows:
    (dAq[R, :] kc, dL[R, :] kc, dAq[:, R]^T qe + dL[:, R]^T ke) over the blocks s <= r (kc = kn e^(G_m - G)) and
    s >= r (qe / ke = q scale / kn times e^(G - G_m)), each [TS, BK] before the tile's own row factors. Exponents
    stay bounded as in the full-tile form: e^(G_m - G) <= 1 before the tile, <= e^(max(REF, TS-1-REF) |g|_max) in it."""
    tb = tl.arange(0, TS)
    dqa = tl.zeros([TS, BK], dtype=tl.float32)
    dka = tl.zeros_like(dqa)
    dca = tl.zeros_like(dqa)
    for s in range(0, r + 1):
        ts = s * TS + tb
        tok_s = t0.to(tl.int64) + ts
        m_s = tok_s < t1
        G_s = _G_rows(gcs, tok_s, m_s, i_h, o_kb, g_end, Ttot, K)
        rk_s = tl.load(rqk + (H + i_h) * Ttot + tok_s, mask=m_s, other=0.)
        kn_s = tl.load(k + (tok_s[:, None] * H + i_h) * K + o_kb[None, :], mask=m_s[:, None],
                       other=0.).to(tl.float32) * rk_s[:, None]
        kc = kn_s * tl.exp(g_ref[None, :] - G_s)
        a_rs = tl.load(cmat + pc0 + 2 * BT * BT + rr * BT + ts[None, :])            # dAq[R, block s]
        l_rs = _dl_slice(cmat, nkp, pc0, pp, rr, ts[None, :], b_r[:, None], NKW, BT)
        dqa += _dot_p(a_rs, kc, IEEE, PREC)
        dka += _dot_p(l_rs, kc, IEEE, PREC)
    for s in range(r, BT // TS):
        ts = s * TS + tb
        tok_s = t0.to(tl.int64) + ts
        m_s = tok_s < t1
        G_s = _G_rows(gcs, tok_s, m_s, i_h, o_kb, g_end, Ttot, K)
        rq_s, rk_s = _row_factors(rqk, tok_s, m_s, i_h, Ttot, H)
        b_s = tl.load(beta + tok_s * H + i_h, mask=m_s, other=0.).to(tl.float32)
        e_s = tl.exp(G_s - g_ref[None, :])
        _, qs_s, kn_s = _qk_cols(q, k, tok_s, m_s, i_h, o_kb, rq_s * scale, rk_s, H, K)
        qe = qs_s * e_s
        ke = kn_s * e_s
        a_cs = tl.load(cmat + pc0 + 2 * BT * BT + ts[None, :] * BT + rr)            # [j, t] = dAq[t, R_j]
        l_cs = _dl_slice(cmat, nkp, pc0, pp, ts[None, :], rr, b_s[None, :], NKW, BT)
        dca += _dot_p(a_cs, qe, IEEE, PREC) + _dot_p(l_cs, ke, IEEE, PREC)
    return dqa, dka, dca


@triton.jit
def kda_bwd_intra_grad_kernel(q, k, g, beta, A_log, dt_bias, cmat, nkp, gcs, rqk, x1s, x2s, dgis, dq, dk, dg, dal_part,
                       ddt_part, sqk, chunk_tok, chunk_end, scale, lower_bound, Ttot,
                       H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, TS: tl.constexpr, REF: tl.constexpr,
                       BK: tl.constexpr, NKW: tl.constexpr, IEEE: tl.constexpr, TPP: tl.constexpr,
                       FIN: tl.constexpr, SQK: tl.constexpr, USE_GATE: tl.constexpr, L2NORM: tl.constexpr,
                       INNER: tl.constexpr, BLK: tl.constexpr, RED: tl.constexpr = False, NSQ: tl.constexpr = 0,
                       PREC: tl.constexpr = "tf32"):
    """Intra-chunk backward, one program = one chunk, head, TPP consecutive TS-row tiles and BK columns (the chunk's
    columns are loaded once for the program's tiles). With m = a tile's reference row (decays factored through G_m
    as in `_intra_bwd`), for the tile's rows R:
    d(q scale)_R += e^(G_R - G_m) (dAq[R, :] (k e^(G_m - G))_{<= end of R}),   dk_row_R likewise from dL,
    dk_col_R = e^(G_m - G_R) (dAq[:, R]^T (q scale e^(G - G_m))_{>= start of R} + dL[:, R]^T (k e^(G - G_m))),
    then adds them to inter's terms (x1s: d(q scale) -> pre-norm dq, x2s: pre-norm dk, dgis: dG). Tiles go last to first.
    FIN (needs all of a chunk's tiles in the program, TPP = BT / TS) also finishes the columns (what gate_norm does
    otherwise; slower on the H200, off by default): dG -> dg by the suffix
    sum carried across the tiles, the gate (dg, this block's dA_log / ddt_bias partials), and dq / dk, or with the L2
    norm the pre-norm dq / dk in x1s / x2s plus this K block's row sums sum(qn dqn), sum(kn dkn) in sqk [2, K / BK, H,
    Ttot]; dgis is then not written. SQK (without FIN, with the L2 norm): those row sums into sqk as well, so that
    gate_norm finishes dq / dk in the same pass over the columns as dg (its ONEPASS). BLK (the default at one tile per
    program; any TPP, FIN too): each tile's products walk the chunk in TS-row blocks, only those its causal rows /
    columns reach (blocks <= r for the row side, >= r for the column side: on average 2.5 of 4 each), with [TS, BK]
    operands loaded per block in a loop (pipelined at num_stages > 1; 1 stage measured fastest) instead of [BT, BK]
    chunk tiles masked per tile. RED (not with FIN; inter's RED): the tile's terms are added into x1s / x2s / dgis by
    fp32 atomic adds (one per element: the sum is inter's + intra's, so the result does not depend on the order), never
    read back, so no load latency sits at the tile's end; SQK then stores row sums of its own terms only (inter stores
    its own; NSQ: the slots per q / k in sqk)."""
    NS: tl.constexpr = (BT // TS // TPP) * (K // BK)  # splits: tile groups x K blocks (grid order: `_split_pid`)
    NQS: tl.constexpr = NSQ if NSQ > 0 else K // BK  # row-sum slots per q / k in sqk
    i_c, i_h, t0, t1, o_t, tok, m_t, row, col, b_b = _chunk_start(chunk_tok, chunk_end, beta, H, BT, NS, INNER)
    i_s = _split_pid(NS, INNER)[1]
    i_kb = i_s // (BT // TS // TPP)
    r0 = (i_s % (BT // TS // TPP)) * TPP
    o_kb = i_kb * BK + tl.arange(0, BK)
    # the chunk's columns: G (rows past the end hold G of the last token: their g is 0), normalised q, k
    # G of the chunk's last token and (below) of each tile's reference row: [BK] loads, not reductions over rows
    if BLK:
        g_end = _last_G(gcs, i_h, o_kb, t0, t1, Ttot, K, BT)
    else:
        G, g_end = _stored_G(gcs, tok, m_t, i_h, o_kb, t0, t1, Ttot, K, BT)
        rq, rk = _row_factors(rqk, tok, m_t, i_h, Ttot, H)
        _, qs, kn = _qk_cols(q, k, tok, m_t, i_h, o_kb, rq * scale, rk, H, K)
    pc0 = (i_c * H + i_h).to(tl.int64) * 4 * BT * BT
    pp = (i_c * H + i_h).to(tl.int64) * NKW * BT
    carry = tl.zeros([BK], dtype=tl.float32)  # FIN: sum of dG over the rows after the current tile
    d_al = tl.sum(carry, 0)
    d_dt = tl.zeros([BK], dtype=tl.float32)
    for i_r in tl.static_range(TPP):
        r = r0 + TPP - 1 - i_r
        o_r = r * TS + tl.arange(0, TS)
        tok_r = t0.to(tl.int64) + o_r
        m_r = tok_r < t1
        g_ref = _ref_row(gcs, i_h, o_kb, t0, t1, g_end, r, Ttot, K, TS, REF)
        rr = o_r[:, None]
        b_r = tl.load(beta + tok_r * H + i_h, mask=m_r, other=0.).to(tl.float32)
        if BLK:
            dqa, dka, dca = _intra_grad_blocks(q, k, beta, cmat, nkp, gcs, rqk, g_ref, g_end, b_r, rr, r, i_h, o_kb, t0, t1,
                                        pc0, pp, scale, Ttot, H, K, BT, TS, BK, NKW, IEEE, PREC)
        else:
            upto = row < r * TS + TS
            start = row >= r * TS
            kc = tl.where(upto, kn * tl.exp(tl.where(upto, g_ref[None, :] - G, 0.)), 0.)
            e_from = tl.exp(tl.where(start, G - g_ref[None, :], 0.))
            qe = tl.where(start, qs * e_from, 0.)
            ke = tl.where(start, kn * e_from, 0.)
            # the tile's rows of dAq / dL and their columns (transposed): [TS, BT] slices
            daq_r = tl.load(cmat + pc0 + 2 * BT * BT + rr * BT + col)
            daq_c = tl.load(cmat + pc0 + 2 * BT * BT + col * BT + rr)          # [j, t] = dAq[t, r TS + j]
            dl_r = _dl_slice(cmat, nkp, pc0, pp, rr, col, b_r[:, None], NKW, BT)
            dl_c = _dl_slice(cmat, nkp, pc0, pp, col, rr, b_b[None, :], NKW, BT)
            dqa = _dot(daq_r, kc, IEEE)
            dka = _dot(dl_r, kc, IEEE)
            dca = _dot(daq_c, qe, IEEE) + _dot(dl_c, ke, IEEE)
        # rows R
        hr = (i_h * Ttot + tok_r[:, None]) * K + o_kb[None, :]
        G_r = _G_rows(gcs, tok_r, m_r, i_h, o_kb, g_end, Ttot, K)
        ef_r = tl.exp(G_r - g_ref[None, :])
        cf_r = tl.exp(g_ref[None, :] - G_r)
        dqp = ef_r * dqa
        dkr = ef_r * dka
        dkc = cf_r * dca
        pkr = (tok_r[:, None] * H + i_h) * K + o_kb[None, :]
        rq_r, rk_r = _row_factors(rqk, tok_r, m_r, i_h, Ttot, H)
        kn_r = tl.load(k + pkr, mask=m_r[:, None], other=0.).to(tl.float32) * rk_r[:, None]
        qn_r = tl.load(q + pkr, mask=m_r[:, None], other=0.).to(tl.float32) * rq_r[:, None]
        if RED:
            x1 = dqp * scale
            x2 = dkr + dkc
            dG = x1 * qn_r + kn_r * (dkr - dkc)
            tl.atomic_add(x1s + hr, x1, mask=m_r[:, None], sem="relaxed")
            tl.atomic_add(x2s + hr, x2, mask=m_r[:, None], sem="relaxed")
            tl.atomic_add(dgis + hr, dG, mask=m_r[:, None], sem="relaxed")
        else:
            x1 = (tl.load(x1s + hr, mask=m_r[:, None], other=0.) + dqp) * scale
            x2 = tl.load(x2s + hr, mask=m_r[:, None], other=0.) + dkr + dkc
            dG = tl.load(dgis + hr, mask=m_r[:, None], other=0.) + dqp * (qn_r * scale) + kn_r * (dkr - dkc)
        if FIN:
            dG = tl.where(m_r[:, None], dG, 0.)
            dgs = carry[None, :] + tl.sum(dG, 0)[None, :] - tl.cumsum(dG, axis=0) + dG
            carry += tl.sum(dG, 0)
            al, dt_cols = _gate_bwd_rows(g, A_log, dt_bias, dg, dgs, pkr, m_r, i_h, o_kb, lower_bound, K, USE_GATE)
            d_al += al
            d_dt += dt_cols
            if L2NORM:
                tl.store(sqk + (i_kb * H + i_h) * Ttot + tok_r, tl.sum(qn_r * x1, 1), mask=m_r)
                tl.store(sqk + (((K // BK) + i_kb) * H + i_h) * Ttot + tok_r, tl.sum(kn_r * x2, 1), mask=m_r)
                tl.store(x1s + hr, x1, mask=m_r[:, None])
                tl.store(x2s + hr, x2, mask=m_r[:, None])
            else:
                tl.store(dq + pkr, x1.to(dq.dtype.element_ty), mask=m_r[:, None])
                tl.store(dk + pkr, x2.to(dk.dtype.element_ty), mask=m_r[:, None])
        else:
            if not RED:
                tl.store(dgis + hr, dG, mask=m_r[:, None])
                tl.store(x1s + hr, x1, mask=m_r[:, None])
                tl.store(x2s + hr, x2, mask=m_r[:, None])
            if SQK:
                tl.store(sqk + (i_kb * H + i_h) * Ttot + tok_r, tl.sum(qn_r * x1, 1), mask=m_r)
                tl.store(sqk + ((NQS + i_kb) * H + i_h) * Ttot + tok_r, tl.sum(kn_r * x2, 1), mask=m_r)
    if FIN and USE_GATE:
        tl.store(dal_part + (i_c * H + i_h) * K + i_kb, d_al)
        tl.store(ddt_part + (i_c * H + i_h) * K + o_kb, d_dt)
