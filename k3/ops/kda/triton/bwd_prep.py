"""Backward, stage 1: the chunk matrices (T, tril_-1(L), tril(Aq), L2-norm factors, the cumsum G) and the WY operands
(q e^G, k e^(G_l - G), W, U) the later kernels read; nothing is recomputed after this. Math: bwd_common.py."""
from __future__ import annotations

import triton
import triton.language as tl

from .bwd_common import (_chunk_start, _dot, _gate_x_cols, _last_G, _qk_cols, _ref_row, _row_factors, _split_pid, _stored_G)


@triton.jit
def _tile_factors(G, g_ref, r, BT: tl.constexpr, TS: tl.constexpr):
    """For row tile r with reference-row values g_ref = G_m: (in_r [BT,1] rows of the tile, upto [BT,1] rows/cols
    up to the tile end, ef = e^(G - G_m) on the tile's rows (1 elsewhere), cf = e^(G_m - G) up to the tile end (1
    elsewhere))."""
    row = tl.arange(0, BT)[:, None]
    in_r = (row >= r * TS) & (row < r * TS + TS)
    upto = row < r * TS + TS
    ef = tl.exp(tl.where(in_r, G - g_ref[None, :], 0.))
    cf = tl.exp(tl.where(upto, g_ref[None, :] - G, 0.))
    return in_r, upto, ef, cf


@triton.jit
def _g_ref(G, gcs, i_h, o_kb, t0, t1, g_end, r, Ttot, K: tl.constexpr, BT: tl.constexpr, TS: tl.constexpr,
           REF: tl.constexpr, REFLOAD: tl.constexpr):
    """G at row tile r's reference row: loaded back from gcs (REFLOAD, `_ref_row`) or picked out of the [BT, BK]
    tile G by a reduction over its rows."""
    if REFLOAD:
        return _ref_row(gcs, i_h, o_kb, t0, t1, g_end, r, Ttot, K, TS, REF)
    else:
        return tl.sum(tl.where(tl.arange(0, BT)[:, None] == r * TS + REF, G, 0.), 0)


@triton.jit
def _intra_fwd(qs, kn, G, gcs, i_h, o_kb, t0, t1, g_end, Ttot, K: tl.constexpr, BT: tl.constexpr, TS: tl.constexpr,
               REF: tl.constexpr, IEEE: tl.constexpr, REFLOAD: tl.constexpr, FACTOR: tl.constexpr):
    """(Aq, L) [BT, BT] with Aq_ti = sum_c qs_tc kn_ic e^(G_tc - G_ic), L likewise with kn rows; unmasked
    (entries i > t inside a tile are junk, possibly inf: callers select with tl.where). REFLOAD: the tiles'
    reference rows of G read back from gcs (stored there, g_end its last row), else picked out of G by a reduction
    over its rows. FACTOR: two-level decays instead of two [BT, BK] exponentials per row tile: each row's decay from
    its own tile's reference row once (E = e^(G - G_ref(row)), |exponent| <= max(REF, TS-1-REF) |g|_max), and for
    tile r's products the rows of tile s <= r scaled by e^(G_m(r) - G_m(s)) = prod_{s < j <= r} D_j <= 1 with D_j =
    e^(G_m(j) - G_m(j-1)), the step between consecutive reference rows: per tile one multiply-and-select pass
    (F <- F D_r on the earlier tiles' rows, 1 on tile r's), no [BT, BK] exponential."""
    Aq = tl.zeros([BT, BT], dtype=tl.float32)
    L = tl.zeros([BT, BT], dtype=tl.float32)
    row = tl.arange(0, BT)[:, None]
    if FACTOR:
        rt = row // TS
        gr = tl.zeros_like(G)
        for s in tl.static_range(BT // TS):
            gr = tl.where(rt == s, _g_ref(G, gcs, i_h, o_kb, t0, t1, g_end, s, Ttot, K, BT, TS, REF, REFLOAD)[None, :],
                          gr)
        E = tl.exp(G - gr)
        QE = qs * E
        KE = kn * E
        KI = kn * tl.exp(gr - G)
        F = tl.zeros_like(G) + 1.
        g_prev = _g_ref(G, gcs, i_h, o_kb, t0, t1, g_end, 0, Ttot, K, BT, TS, REF, REFLOAD)
        for r in tl.static_range(BT // TS):
            if r > 0:
                g_r = _g_ref(G, gcs, i_h, o_kb, t0, t1, g_end, r, Ttot, K, BT, TS, REF, REFLOAD)
                F = tl.where(rt == r, 1., F * tl.exp(g_r - g_prev)[None, :])
                g_prev = g_r
            kc = tl.trans(tl.where(rt <= r, KI * F, 0.))
            in_r = rt == r
            Aq += _dot(tl.where(in_r, QE, 0.), kc, IEEE)
            L += _dot(tl.where(in_r, KE, 0.), kc, IEEE)
    else:
        for r in tl.static_range(BT // TS):
            g_ref = _g_ref(G, gcs, i_h, o_kb, t0, t1, g_end, r, Ttot, K, BT, TS, REF, REFLOAD)
            in_r, upto, ef, cf = _tile_factors(G, g_ref, r, BT, TS)
            kc = tl.trans(tl.where(upto, kn * cf, 0.))
            Aq += _dot(tl.where(in_r, qs * ef, 0.), kc, IEEE)
            L += _dot(tl.where(in_r, kn * ef, 0.), kc, IEEE)
    return Aq, L


@triton.jit
def _unit_lower_inv(Nm, BT: tl.constexpr, TS: tl.constexpr, LOG2_TS: tl.constexpr, LOG2_NB: tl.constexpr,
                    PREC: tl.constexpr):
    """(I + Nm)^-1 for strictly lower Nm [BT, BT] (fp32; tensor-core products at PREC: "tf32x3", 3-pass tf32, is
    ~fp32 accurate, "tf32" one pass; exact-fp32 FMA dots would hold whole 64-wide operand rows in registers).

    Split Nm = Nd + No into its TS-diagonal blocks and the rest. Xd = (I + Nd)^-1 = prod_j (I + (-Nd)^(2^j)) by
    repeated squaring (Nd^TS = 0), then with M = Xd No (block-nilpotent, M^(BT/TS) = 0):
    (I + N)^-1 = (I + M)^-1 Xd = prod_j (I + (-M)^(2^j)) Xd.
    matrices INV "pow" only (the default until the twenty-second session): the powers' entries can be thousands of
    times |(I + Nm)^-1| (nearly collinear keys, weak decay, beta near 1: Nd ~ the strictly lower all-ones matrix,
    |Nd^8| up to C(15, 7) = 6435), so one-pass tf32 loses T to cancellation there; `_blk_lower_inv` does not."""
    o = tl.arange(0, BT)
    row = o[:, None]
    col = o[None, :]
    eye = tl.where(row == col, 1., 0.)
    nd = tl.where((row // TS) == (col // TS), Nm, 0.)
    no = Nm - nd
    pw = -nd
    p = eye + pw
    for _ in tl.static_range(LOG2_TS - 1):
        pw = tl.dot(pw, pw, input_precision=PREC)
        p = p + tl.dot(p, pw, input_precision=PREC)
    pw = -tl.dot(p, no, input_precision=PREC)
    t = eye + pw
    for _ in tl.static_range(LOG2_NB - 1):
        pw = tl.dot(pw, pw, input_precision=PREC)
        t = t + tl.dot(t, pw, input_precision=PREC)
    return tl.dot(t, p, input_precision=PREC)


@triton.jit
def _blk_lower_inv(Nm, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr):
    """(I + Nm)^-1 for strictly lower Nm [BT, BT] by recursive 2x2 block inversion 2 -> 4 -> ... -> BT, as the forward
    does for its 16-row chunks: [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]], i.e. x <- x - x m x with m
    the lower-left half-blocks of Nm, two products per level (ten at BT = 64, as many as `_unit_lower_inv`). Only
    products of the inverse's own blocks: the tensor-core rounding (PREC) is relative to |(I + Nm)^-1|, which stays
    O(1) for the delta rule's unit keys and beta in [0, 1], so nearly collinear keys with weak decay (a run of one
    repeated token) keep ~1e-3 in one-pass tf32, where the powers of Nm (|Nm^8| up to C(15, 7) = 6435 there) lose
    everything to cancellation."""
    o = tl.arange(0, BT)
    row = o[:, None]
    col = o[None, :]
    x = tl.where(row == col, 1., 0.) - tl.where((row // 2) == (col // 2), Nm, 0.)  # the 2 x 2 blocks, exact
    for lv in tl.static_range(2, LOG2_BT + 1):
        m = tl.where(((row >> lv) == (col >> lv)) & ((row >> (lv - 1)) != (col >> (lv - 1))), Nm, 0.)
        x = x - tl.dot(tl.dot(x, m, input_precision=PREC), x, input_precision=PREC)
    return x


@triton.jit
def _lower_inv_at(Nm, BT: tl.constexpr, TS: tl.constexpr, LOG2_TS: tl.constexpr, LOG2_NB: tl.constexpr,
                  IEEE: tl.constexpr, INV_PREC: tl.constexpr, INV: tl.constexpr = "blk"):
    """(I + Nm)^-1 with the tensor-core precision INV_PREC at low-precision inputs (fp32 inputs, IEEE: always
    "tf32x3"); INV: "blk" (`_blk_lower_inv`, the default) or "pow" (`_unit_lower_inv`, repeated squaring: the default
    until the twenty-second session; in one-pass tf32 it returns garbage T, and gradients of 1e4-1e6 relative error,
    for chunks of nearly collinear keys with weak decay and beta near 1)."""
    if INV == "pow":
        if IEEE:
            return _unit_lower_inv(Nm, BT, TS, LOG2_TS, LOG2_NB, "tf32x3")
        else:
            return _unit_lower_inv(Nm, BT, TS, LOG2_TS, LOG2_NB, INV_PREC)
    else:
        if IEEE:
            return _blk_lower_inv(Nm, BT, LOG2_TS + LOG2_NB, "tf32x3")
        else:
            return _blk_lower_inv(Nm, BT, LOG2_TS + LOG2_NB, INV_PREC)


@triton.jit
def _prep_cols(q, k, g, A_log, dt_bias, tok, m_t, i_h, o_k, rq, rk, lower_bound,
               H: tl.constexpr, K: tl.constexpr, USE_GATE: tl.constexpr):
    """Columns o_k of one chunk of one head (rows past the sequence end are zero) with the in-kernel preprocessing,
    given the L2-norm row factors rq, rk: (qn, kn, gl, pk), qn = q rq, kn = k rk, gl = lb sigmoid(exp(A_log)
    (f + dt_bias)) (or the given log-decay; 0 on padding rows), pk the columns' addresses."""
    pk = (tok[:, None] * H + i_h) * K + o_k[None, :]
    b_q = tl.load(q + pk, mask=m_t[:, None], other=0.).to(tl.float32)
    b_k = tl.load(k + pk, mask=m_t[:, None], other=0.).to(tl.float32)
    if USE_GATE:
        b_g = lower_bound * tl.sigmoid(_gate_x_cols(g, A_log, dt_bias, pk, m_t, i_h, o_k, K))
    else:
        b_g = tl.load(g + pk, mask=m_t[:, None], other=0.).to(tl.float32)
    b_g = tl.where(m_t[:, None], b_g, 0.)
    return b_q * rq[:, None], b_k * rk[:, None], b_g, pk


@triton.jit
def _row_rnorms(q, k, tok, m_t, i_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr):
    """L2-norm row factors (rq, rk), r = (sum_K x^2 + 1e-6)^-1/2 summed over K in BK-column blocks (1 without the
    L2 norm)."""
    sq = tl.zeros(tok.shape, dtype=tl.float32)
    sk = tl.zeros(tok.shape, dtype=tl.float32)
    if L2NORM:
        for kb in range(0, K // BK):
            o_k = kb * BK + tl.arange(0, BK)
            pk = (tok[:, None] * H + i_h) * K + o_k[None, :]
            b_q = tl.load(q + pk, mask=m_t[:, None], other=0.).to(tl.float32)
            b_k = tl.load(k + pk, mask=m_t[:, None], other=0.).to(tl.float32)
            sq += tl.sum(b_q * b_q, 1)
            sk += tl.sum(b_k * b_k, 1)
        return tl.rsqrt(sq + 1e-6), tl.rsqrt(sk + 1e-6)
    else:
        return sq + 1., sk + 1.


@triton.jit
def _chunk_matrices(q, k, g, A_log, dt_bias, gcs, b_b, tok, m_t, i_h, t0, t1, scale, lower_bound, Ttot,
                    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, TS: tl.constexpr, REF: tl.constexpr,
                    LOG2_TS: tl.constexpr, LOG2_NB: tl.constexpr, BK: tl.constexpr, USE_GATE: tl.constexpr,
                    L2NORM: tl.constexpr, IEEE: tl.constexpr, INV_PREC: tl.constexpr, REFLOAD: tl.constexpr,
                    FACTOR: tl.constexpr, PTS: tl.constexpr = 16, INV: tl.constexpr = "blk"):
    """A chunk's (tril(Aq), tril_-1(L), T, rq, rk) in fp32 without a [BT, K] tile: Aq and L accumulate over
    BK-column blocks of the raw q, k (the L2 norm is a row / column scaling of both, applied after). Stores the
    cumsum G (fp32) into gcs for the later kernels (REFLOAD: reading its tiles' reference rows back from there).
    PTS > TS (with the L2 norm; FACTOR applies at PTS = TS only): the products' decays factored through PTS-row
    tiles (reference row PTS / 2 - 1: factors up to e^(PTS / 2 |g|_max), e^80 at PTS 32 and g >= -5, within fp32
    for the normalised q, k, which the products then take: the norms first), half the masked [BT, BT] products of
    16-row tiles."""
    o_t = tl.arange(0, BT)
    row = o_t[:, None]
    col = o_t[None, :]
    one = tl.zeros([BT], dtype=tl.float32) + 1.
    Aq = tl.zeros([BT, BT], dtype=tl.float32)
    L = tl.zeros([BT, BT], dtype=tl.float32)
    PREF: tl.constexpr = PTS // 2 - 1
    if PTS > TS:
        rq, rk = _row_rnorms(q, k, tok, m_t, i_h, H, K, BK, L2NORM)
        fq, fk = rq, rk
    else:
        fq, fk = one, one
    for kb in range(0, K // BK):
        o_kb = kb * BK + tl.arange(0, BK)
        b_q, b_k, b_g, pk = _prep_cols(q, k, g, A_log, dt_bias, tok, m_t, i_h, o_kb, fq, fk, lower_bound,
                                       H, K, USE_GATE)
        G = tl.cumsum(b_g, axis=0)
        hkb = (i_h * Ttot + tok[:, None]) * K + o_kb[None, :]
        tl.store(gcs + hkb, G, mask=m_t[:, None])
        g_end = tl.zeros([BK], dtype=tl.float32)  # (unused without REFLOAD)
        if REFLOAD:
            tl.debug_barrier()  # every thread's G rows in memory (visible to the CTA) before the reference-row loads
            g_end = _last_G(gcs, i_h, o_kb, t0, t1, Ttot, K, BT)
        if PTS > TS:  # (FACTOR's steps between 32-row tiles' reference rows, e^-160 at g = -5, would underflow)
            a_kb, l_kb = _intra_fwd(b_q, b_k, G, gcs, i_h, o_kb, t0, t1, g_end, Ttot, K, BT, PTS, PREF, IEEE,
                                    REFLOAD, False)
        else:
            a_kb, l_kb = _intra_fwd(b_q, b_k, G, gcs, i_h, o_kb, t0, t1, g_end, Ttot, K, BT, TS, REF, IEEE, REFLOAD,
                                    FACTOR)
        Aq += a_kb
        L += l_kb
    if PTS > TS:
        Aq = tl.where(row >= col, Aq * scale, 0.)
        L = tl.where(row > col, L, 0.)
    else:
        rq, rk = _row_rnorms(q, k, tok, m_t, i_h, H, K, BK, L2NORM)
        Aq = tl.where(row >= col, Aq * (rq * scale)[:, None] * rk[None, :], 0.)
        L = tl.where(row > col, L * rk[:, None] * rk[None, :], 0.)
    Tm = _lower_inv_at(b_b[:, None] * L, BT, TS, LOG2_TS, LOG2_NB, IEEE, INV_PREC, INV)
    return Aq, L, Tm, rq, rk


@triton.jit
def _prep_mats(q, k, g, A_log, dt_bias, aq_out, cmat, aqf, rqk, gcs, i_c, i_h, t0, t1, tok, m_t, b_b, scale,
               lower_bound, Ttot, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, TS: tl.constexpr,
               REF: tl.constexpr, LOG2_TS: tl.constexpr, LOG2_NB: tl.constexpr, BK: tl.constexpr,
               USE_GATE: tl.constexpr, L2NORM: tl.constexpr, IEEE: tl.constexpr, INV_PREC: tl.constexpr,
               REFLOAD: tl.constexpr, FACTOR: tl.constexpr, AQF: tl.constexpr, PTS: tl.constexpr,
               INV: tl.constexpr = "blk"):
    """Prep, chunk-wide part: Aq, L, T and the L2-norm factors (`_chunk_matrices`; INV_PREC: the inverse's
    tensor-core precision at low-precision inputs, INV its algorithm: `_lower_inv_at`), stored as T / tril_-1(L) (cmat slots 0, 1), tril(Aq) (aq_out
    in the intermediate dtype for dstates, and with AQF in fp32 (aqf) for value forming du' itself: without value's PRE),
    rq, rk (rqk) and the cumsum G (gcs)."""
    o_t = tl.arange(0, BT)
    row = o_t[:, None]
    col = o_t[None, :]
    Aq, L, Tm, rq, rk = _chunk_matrices(q, k, g, A_log, dt_bias, gcs, b_b, tok, m_t, i_h, t0, t1, scale, lower_bound,
                                        Ttot, H, K, BT, TS, REF, LOG2_TS, LOG2_NB, BK, USE_GATE, L2NORM, IEEE,
                                        INV_PREC, REFLOAD, FACTOR, PTS, INV)
    pc = (i_c * H + i_h).to(tl.int64) * 4 * BT * BT + row * BT + col
    tl.store(cmat + pc, Tm)
    tl.store(cmat + pc + BT * BT, L)
    tl.store(aq_out + (i_h * Ttot + tok[:, None]) * BT + col, Aq.to(aq_out.dtype.element_ty), mask=m_t[:, None])
    if AQF:
        tl.store(aqf + (i_c * H + i_h).to(tl.int64) * BT * BT + row * BT + col, Aq)
    tl.store(rqk + i_h * Ttot + tok, rq, mask=m_t)
    tl.store(rqk + (H + i_h) * Ttot + tok, rk, mask=m_t)


@triton.jit
def _prep_kcols(q, k, qg_out, kd_out, w_out, eg_out, ws, ks, gcs, Tm, rq, rk, b_b, i_c, i_h, t0, t1, tok, m_t, o_kb,
                scale, Ttot, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, IEEE: tl.constexpr,
                F32_W: tl.constexpr, F32_K: tl.constexpr):
    """Prep, one K-column block, from the cumsum G matrices stored (gcs): q e^G, k e^(G_l - G), W (intermediate dtype,
    for the sequential passes; W also fp32 with F32_W, k e^(G_l - G) with F32_K) and e^(G_l)."""
    dt = w_out.dtype.element_ty
    pk, qn, kn = _qk_cols(q, k, tok, m_t, i_h, o_kb, rq, rk, H, K)
    G, g_last = _stored_G(gcs, tok, m_t, i_h, o_kb, t0, t1, Ttot, K, BT)
    eG = tl.exp(G)
    hkb = (i_h * Ttot + tok[:, None]) * K + o_kb[None, :]
    tl.store(qg_out + hkb, (qn * scale * eG).to(dt), mask=m_t[:, None])
    b_kd = kn * tl.exp(g_last[None, :] - G)
    b_w = _dot(Tm, kn * eG * b_b[:, None], IEEE)
    tl.store(kd_out + hkb, b_kd.to(dt), mask=m_t[:, None])
    tl.store(w_out + hkb, b_w.to(dt), mask=m_t[:, None])
    # the fp32 scratch (else the gradient kernels read the intermediate-dtype copies above); k e^(G_l - G) only for
    # value forming du' itself (without its PRE)
    if F32_K:
        tl.store(ks + hkb, b_kd, mask=m_t[:, None])
    if F32_W:
        tl.store(ws + hkb, b_w, mask=m_t[:, None])
    tl.store(eg_out + (i_c * H + i_h) * K + o_kb, tl.exp(g_last))


@triton.jit
def _prep_vcols(v, u_out, Tm, b_b, i_h, tok, m_t, o_v, Ttot, H: tl.constexpr, V: tl.constexpr, IEEE: tl.constexpr):
    """Prep, one value-column block: U = T diag(beta) v (intermediate dtype)."""
    b_v = tl.load(v + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.).to(tl.float32)
    tl.store(u_out + (i_h * Ttot + tok[:, None]) * V + o_v[None, :],
             _dot(Tm, b_v * b_b[:, None], IEEE).to(u_out.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def kda_bwd_chunk_matrices_kernel(q, k, g, beta, A_log, dt_bias, aq_out, cmat, aqf, rqk, gcs, chunk_tok, chunk_end, scale,
                        lower_bound, Ttot, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, TS: tl.constexpr,
                        REF: tl.constexpr, LOG2_TS: tl.constexpr, LOG2_NB: tl.constexpr, BK: tl.constexpr,
                        USE_GATE: tl.constexpr, L2NORM: tl.constexpr, IEEE: tl.constexpr, INV_PREC: tl.constexpr,
                        REFLOAD: tl.constexpr, FACTOR: tl.constexpr, AQF: tl.constexpr, PTS: tl.constexpr,
                        INV: tl.constexpr = "blk"):
    """Prep part 1 (matrices), per (chunk, head): `_prep_mats` only."""
    i_c, i_h, t0, t1, o_t, tok, m_t, row, col, b_b = _chunk_start(chunk_tok, chunk_end, beta, H, BT)
    _prep_mats(q, k, g, A_log, dt_bias, aq_out, cmat, aqf, rqk, gcs, i_c, i_h, t0, t1, tok, m_t, b_b, scale,
               lower_bound, Ttot, H, K, BT, TS, REF, LOG2_TS, LOG2_NB, BK, USE_GATE, L2NORM, IEEE, INV_PREC, REFLOAD,
               FACTOR, AQF, PTS, INV)


@triton.jit
def kda_bwd_wy_kernel(q, k, v, beta, qg_out, kd_out, w_out, u_out, eg_out, cmat, ws, ks, gcs, rqk,
                       chunk_tok, chunk_end, scale, Ttot,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                       BK: tl.constexpr, IEEE: tl.constexpr, F32_W: tl.constexpr, F32_K: tl.constexpr,
                       INNER: tl.constexpr, VCOLS: tl.constexpr = True):
    """Prep part 2 (wy), per (chunk, head, column block j; grid order: `_split_pid`): j < K / BK: `_prep_kcols`
    for that K block, else `_prep_vcols` for value block j - K / BK; T, rq, rk, G read back from part 1. Without
    VCOLS (the forward saved u', so nothing reads U) only the K blocks run."""
    NS: tl.constexpr = K // BK + V // BV if VCOLS else K // BK
    i_c, i_h, t0, t1, o_t, tok, m_t, row, col, b_b = _chunk_start(chunk_tok, chunk_end, beta, H, BT, NS, INNER)
    Tm = tl.load(cmat + (i_c * H + i_h).to(tl.int64) * 4 * BT * BT + row * BT + col)
    j = _split_pid(NS, INNER)[1]
    if j < K // BK:
        rq, rk = _row_factors(rqk, tok, m_t, i_h, Ttot, H)
        _prep_kcols(q, k, qg_out, kd_out, w_out, eg_out, ws, ks, gcs, Tm, rq, rk, b_b, i_c, i_h, t0, t1, tok, m_t,
                    j * BK + tl.arange(0, BK), scale, Ttot, H, K, BT, IEEE, F32_W, F32_K)
    else:
        _prep_vcols(v, u_out, Tm, b_b, i_h, tok, m_t, (j - K // BK) * BV + tl.arange(0, BV), Ttot, H, V, IEEE)
