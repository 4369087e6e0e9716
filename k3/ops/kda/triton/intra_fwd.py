"""Forward, stage 1: the chunk-parallel prep of 16-token chunks (kernel of `fwd.py`): gate, chunk-local cumsum, q / k
L2 norm, the intra-chunk matrices Aqk / Akk, the unit-lower inverse T, W, U and the decayed q / k for the walk."""
from __future__ import annotations

import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------------------------
# Design (the default launch: ops config `fwd.PREP_DEFAULT`, one 16-token chunk per program on 2 warps, whole-K tiles):
#  - the unit-lower inverse by recursive 2x2 block inversion on tf32 tensor cores ("blk": products of inverse blocks,
#    never powers of n, so near-collinear keys stay accurate); "ieee" = repeated squaring with fp32 FMA dots (the
#    accuracy reference), "blkn" = "blk" plus one Newton step;
#  - two full-tile exponentials per chunk (log2 domain: exp2 of G - G_ref and G_ref - G, every other decay from these
#    times a per-chunk [K] vector), and no chunk-table loads for equal-length sequences;
#  - heads-fastest grid (HEAD_FAST): programs running together read whole token rows of q, k, v, g;
#  - options kept for tuning studies (`prep_cfg`): C chunks per tile as 3-D batched dots, LOOP tiles per program
#    (PREFETCH: the next tile's loads before the current tile's compute), KB: K in blocks (two passes), maxnreg.
# Measurements of every option set: benchmarks/RESULTS.md and docs/LOG.md.
# ---------------------------------------------------------------------------------------------------------------

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _intra_rows(chunk_tok, chunk_end, NC, Tseq, NCT, T0, gi, gend, C: tl.constexpr, VARLEN: tl.constexpr,
              PIECE: tl.constexpr):
    """Chunk group gi = chunks gi*C .. gi*C + C - 1: chunk ids [C], their mask, token rows [C, 16] (int64) and the
    row mask (all false unless gi < gend, so a prefetch past the program's range reads nothing)."""
    o_c = gi * C + tl.arange(0, C)
    m_c = (o_c < NC) & (o_c < gend * C)  # gi < gend, as a vector compare
    if VARLEN:
        t0 = tl.load(chunk_tok + o_c, mask=m_c, other=0).to(tl.int64)
        t1 = tl.load(chunk_end + o_c, mask=m_c, other=0).to(tl.int64)
    else:  # B sequences of Tseq tokens, NCT chunks each (PIECE: from token T0 of each, a pipelined time piece)
        s = o_c // NCT
        t0 = s.to(tl.int64) * Tseq + (o_c - s * NCT) * 16
        if PIECE:
            t0 += T0
        t1 = tl.where(m_c, (s + 1).to(tl.int64) * Tseq, 0)
    tok = t0[:, None] + tl.arange(0, 16)[None, :]
    return o_c, m_c, tok, tok < t1[:, None]


@triton.jit
def _intra_load(q, k, v, g, beta, tok, m, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Raw (input dtype) q, k, g [C, 16, K], v [C, 16, V], beta [C, 16] of head i_h at rows tok; 0 where masked."""
    m3 = m[:, :, None]
    th = tok * H + i_h
    pk = th[:, :, None] * K + tl.arange(0, K)[None, None, :]
    b_q = tl.load(q + pk, mask=m3, other=0.)
    b_k = tl.load(k + pk, mask=m3, other=0.)
    b_f = tl.load(g + pk, mask=m3, other=0.)
    b_v = tl.load(v + th[:, :, None] * V + tl.arange(0, V)[None, None, :], mask=m3, other=0.)
    b_b = tl.load(beta + th, mask=m, other=0.)
    return b_q, b_k, b_v, b_f, b_b


@triton.jit
def _blk_level(x, n, ri, ci, B: tl.constexpr, PREC: tl.constexpr):
    """One level of recursive block inversion: x = (I + n)^-1 on the diagonal (B/2)-blocks -> on the B-blocks.
    [[A, 0], [c, D]]^-1 = [[A^-1, 0], [-D^-1 c A^-1, D^-1]]: x - x m x with m = n on the lower-left half-blocks."""
    m = tl.where(((ri // B == ci // B) & (ri // (B // 2) != ci // (B // 2)))[None, :, :], n, 0.)
    return x - tl.dot(tl.dot(x, m, input_precision=PREC), x, input_precision=PREC)


@triton.jit
def _inv16_batched(n, INV: tl.constexpr):
    """(I + n)^-1 for a batch [C, 16, 16] of strictly lower n.
    "blk": recursive 2x2 block inversion 2 -> 4 -> 8 -> 16 (six tf32 16x16x16 dots, depth 6); errors are relative to
           the inverse blocks, so tf32 stays ~1e-3 even for nearly collinear keys with weak decay, where repeated
           squaring in tf32 loses everything to cancellation (|n^8| >> |(I + n)^-1|).
    "blkn": "blk" then one Newton step x <- x + x (I - (I + n) x), residual with a tf32x3 dot (fp32-level).
    "ieee": repeated squaring with fp32 FMA dots (exact: n^16 = 0)."""
    r = tl.arange(0, 16)
    ri = r[:, None]
    ci = r[None, :]
    eye = tl.where(ri == ci, 1., 0.)[None, :, :]
    if INV == "ieee":
        p = eye - n
        n2 = tl.dot(n, n, input_precision="ieee")
        p = p + tl.dot(p, n2, input_precision="ieee")
        n4 = tl.dot(n2, n2, input_precision="ieee")
        p = p + tl.dot(p, n4, input_precision="ieee")
        n8 = tl.dot(n4, n4, input_precision="ieee")
        p = p + tl.dot(p, n8, input_precision="ieee")
    else:
        p = eye - tl.where((ri // 2 == ci // 2)[None, :, :], n, 0.)
        p = _blk_level(p, n, ri, ci, 4, "tf32")
        p = _blk_level(p, n, ri, ci, 8, "tf32")
        p = _blk_level(p, n, ri, ci, 16, "tf32")
        if INV == "blkn":
            res = eye - p - tl.dot(n, p, input_precision="tf32x3")
            p = p + tl.dot(p, res, input_precision="tf32")
    return p


@triton.jit
def _intra_tile(b_q, b_k, b_v, b_f, b_b, o_c, m_c, tok, m, i_h, a2, dtb, lb2, scale,
              qg_out, kd_out, w_out, u_out, aqk_out, eg_out, Ttot,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, REF: tl.constexpr, USE_GATE: tl.constexpr,
              L2NORM: tl.constexpr, QK_PREC: tl.constexpr, INV: tl.constexpr):
    """Prep of C chunks (rows tok [C, 16]) of head i_h from their raw inputs; the outputs of kda_intra_wy_fwd_kernel.
    Log-decays are kept in log2 units (g2 = g log2 e), so every decay is one exp2."""
    r = tl.arange(0, 16)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    m3 = m[:, :, None]
    f = b_f.to(tl.float32)
    if USE_GATE:  # lower_bound * sigmoid(e^A_log (f + dt_bias)), times log2 e (folded into lb2 and a2)
        g2 = lb2 / (1. + tl.exp2(-(f + dtb[None, None, :]) * a2))
    else:
        g2 = f * LOG2E
    g2 = tl.where(m3, g2, 0.)
    G = tl.cumsum(g2, axis=1)
    ref = tl.sum(tl.where(r[None, :, None] == REF, G, 0.), axis=1)     # [C, K]
    last = tl.sum(g2, axis=1)                                           # = G of row 15 (padding rows are 0)
    E = tl.exp2(G - ref[:, None, :])     # e^(G - G_ref), exponent in [-80, 70] (natural units) for g >= -10
    Ei = tl.exp2(ref[:, None, :] - G)    # e^(G_ref - G)
    e_ref = tl.exp2(ref)[:, None, :]
    b_q = b_q.to(tl.float32)
    b_k = b_k.to(tl.float32)
    if L2NORM:
        b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q, 2) + 1e-6) * scale)[:, :, None]
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 2) + 1e-6)[:, :, None]
    else:
        b_q = b_q * scale
    qr = b_q * E                         # q e^(G - G_ref)
    kr = b_k * E                         # k e^(G - G_ref)
    kc = b_k * Ei                        # k e^(G_ref - G)
    kct = tl.permute(kc, (0, 2, 1))
    if QK_PREC == "bf16":
        kct16 = kct.to(tl.bfloat16)
        a_qk = tl.dot(qr.to(tl.bfloat16), kct16)
        a_kk = tl.dot(kr.to(tl.bfloat16), kct16)
    else:
        a_qk = tl.dot(qr, kct, input_precision=QK_PREC)
        a_kk = tl.dot(kr, kct, input_precision=QK_PREC)
    dt = w_out.dtype.element_ty
    hrow = i_h.to(tl.int64) * Ttot + tok                                # [C, 16] int64
    ik = hrow[:, :, None] * K + o_k[None, None, :]
    tl.store(qg_out + ik, (qr * e_ref).to(dt), mask=m3)                # q e^G
    tl.store(kd_out + ik, (kc * tl.exp2(last - ref)[:, None, :]).to(dt), mask=m3)   # k e^(G_last - G)
    row = r[None, :, None]
    col = r[None, None, :]
    bf = b_b.to(tl.float32)
    a_qk = tl.where(row >= col, a_qk, 0.)
    tl.store(aqk_out + hrow[:, :, None] * 16 + col, a_qk.to(dt), mask=m3)
    n = tl.where(row > col, a_kk * bf[:, :, None], 0.)
    tb = _inv16_batched(n, INV) * bf[:, None, :]                      # T diag(beta)
    b_w = tl.dot(tb, kr * e_ref, input_precision="tf32")               # T diag(beta) k e^G
    tl.store(w_out + ik, b_w.to(dt), mask=m3)
    b_u = tl.dot(tb, b_v.to(tl.float32), input_precision="tf32")       # T diag(beta) v
    tl.store(u_out + hrow[:, :, None] * V + o_v[None, None, :], b_u.to(dt), mask=m3)
    tl.store(eg_out + (o_c.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :], tl.exp2(last), mask=m_c[:, None])


@triton.jit
def _intra_gate_cumsum(b_f, dtb, a2, lb2, m3, USE_GATE: tl.constexpr):
    """Raw gate input [C, 16, BK] -> chunk-local inclusive cumsum of the log-decay, in log2 units."""
    f = b_f.to(tl.float32)
    if USE_GATE:
        g2 = lb2 / (1. + tl.exp2(-(f + dtb[None, None, :]) * a2))
    else:
        g2 = f * LOG2E
    return tl.cumsum(tl.where(m3, g2, 0.), axis=1)


@triton.jit
def _intra_cols_G(g, dt_bias, th, cols, i_h, a2, lb2, m3, K: tl.constexpr, BK: tl.constexpr, USE_GATE: tl.constexpr):
    """K-blocked prep: the addresses pk of columns `cols` of the [C, 16] tiles and their in-tile cumsum G
    (base-2 log-decay, `_intra_gate_cumsum`)."""
    pk = th[:, :, None] * K + cols[None, None, :]
    if USE_GATE:
        dtb = tl.load(dt_bias + i_h * K + cols).to(tl.float32)
    else:
        dtb = tl.zeros([BK], dtype=tl.float32)
    return pk, _intra_gate_cumsum(tl.load(g + pk, mask=m3, other=0.), dtb, a2, lb2, m3, USE_GATE)


@triton.jit
def _intra_tile_kb(q, k, v, g, beta, dt_bias, o_c, m_c, tok, m, i_h, a2, lb2, scale,
                 qg_out, kd_out, w_out, u_out, aqk_out, eg_out, Ttot,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, REF: tl.constexpr, USE_GATE: tl.constexpr,
                 L2NORM: tl.constexpr, QK_PREC: tl.constexpr, INV: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr):
    """_intra_tile over K in blocks of BK columns (every decay is per column; only the L2 norms and the Aqk / Akk sums
    couple the columns), so no [16, K] tile is ever live: a first pass accumulates the raw Aqk, Akk and the row
    sums of squares, the L2 norms are applied to the 16x16 results as row/column scales, then a second pass
    reloads q, k, g (L2-resident), recomputes gate and cumsum, and writes qg, kd, W, e^G_last; U in blocks of BV
    value columns. Twice the gate/cumsum work and loads from L2, for far fewer live registers (occupancy)."""
    C: tl.constexpr = tok.shape[0]
    r = tl.arange(0, 16)
    o_b = tl.arange(0, BK)
    m3 = m[:, :, None]
    th = tok * H + i_h                                                  # [C, 16] int64 row of (token, head)
    hrow = i_h.to(tl.int64) * Ttot + tok                                # [C, 16] row of the head-major outputs
    a_qk = tl.zeros([C, 16, 16], dtype=tl.float32)
    a_kk = tl.zeros([C, 16, 16], dtype=tl.float32)
    sq_q = tl.zeros([C, 16], dtype=tl.float32)
    sq_k = tl.zeros([C, 16], dtype=tl.float32)
    for kb in tl.static_range(0, K, BK):
        cols = kb + o_b
        pk, G = _intra_cols_G(g, dt_bias, th, cols, i_h, a2, lb2, m3, K, BK, USE_GATE)
        ref = tl.sum(tl.where(r[None, :, None] == REF, G, 0.), axis=1)[:, None, :]
        b_q = tl.load(q + pk, mask=m3, other=0.).to(tl.float32)
        b_k = tl.load(k + pk, mask=m3, other=0.).to(tl.float32)
        if L2NORM:
            sq_q += tl.sum(b_q * b_q, 2)
            sq_k += tl.sum(b_k * b_k, 2)
        E = tl.exp2(G - ref)
        kct = tl.permute(b_k * tl.exp2(ref - G), (0, 2, 1))
        if QK_PREC == "bf16":
            kct16 = kct.to(tl.bfloat16)
            a_qk = tl.dot((b_q * E).to(tl.bfloat16), kct16, a_qk)
            a_kk = tl.dot((b_k * E).to(tl.bfloat16), kct16, a_kk)
        else:
            a_qk = tl.dot(b_q * E, kct, a_qk, input_precision=QK_PREC)
            a_kk = tl.dot(b_k * E, kct, a_kk, input_precision=QK_PREC)
    if L2NORM:
        rq = tl.rsqrt(sq_q + 1e-6) * scale
        rk = tl.rsqrt(sq_k + 1e-6)
    else:
        rq = tl.full([C, 16], scale, dtype=tl.float32)
        rk = tl.full([C, 16], 1., dtype=tl.float32)
    row = r[None, :, None]
    col = r[None, None, :]
    dt = w_out.dtype.element_ty
    a_qk = tl.where(row >= col, a_qk * rq[:, :, None] * rk[:, None, :], 0.)
    tl.store(aqk_out + hrow[:, :, None] * 16 + col, a_qk.to(dt), mask=m3)
    bf = tl.load(beta + th, mask=m, other=0.).to(tl.float32)
    n = tl.where(row > col, a_kk * (bf * rk)[:, :, None] * rk[:, None, :], 0.)
    t = _inv16_batched(n, INV)
    tbk = t * (bf * rk)[:, None, :]                                     # T diag(beta rk): W from unnormalised k
    for kb in tl.static_range(0, K, BK):
        cols = kb + o_b
        pk, G = _intra_cols_G(g, dt_bias, th, cols, i_h, a2, lb2, m3, K, BK, USE_GATE)
        last = tl.sum(tl.where(r[None, :, None] == 15, G, 0.), axis=1)  # [C, BK]
        e_g = tl.exp2(G)
        ik = hrow[:, :, None] * K + cols[None, None, :]
        b_q = tl.load(q + pk, mask=m3, other=0.).to(tl.float32)
        tl.store(qg_out + ik, (b_q * e_g * rq[:, :, None]).to(dt), mask=m3)
        b_k = tl.load(k + pk, mask=m3, other=0.).to(tl.float32)
        tl.store(kd_out + ik, (b_k * tl.exp2(last[:, None, :] - G) * rk[:, :, None]).to(dt), mask=m3)
        b_w = tl.dot(tbk, b_k * e_g, input_precision="tf32")
        tl.store(w_out + ik, b_w.to(dt), mask=m3)
        tl.store(eg_out + (o_c.to(tl.int64)[:, None] * H + i_h) * K + cols[None, :], tl.exp2(last),
                 mask=m_c[:, None])
    tbv = t * bf[:, None, :]
    for vb in tl.static_range(0, V, BV):
        cols = vb + tl.arange(0, BV)
        b_v = tl.load(v + th[:, :, None] * V + cols[None, None, :], mask=m3, other=0.).to(tl.float32)
        b_u = tl.dot(tbv, b_v, input_precision="tf32")
        tl.store(u_out + hrow[:, :, None] * V + cols[None, None, :], b_u.to(dt), mask=m3)


@triton.jit
def kda_intra_wy_fwd_kernel(q, k, v, g, beta, A_log, dt_bias, qg_out, kd_out, w_out, u_out, aqk_out, eg_out,
                           chunk_tok, chunk_end, NC, NP, Tseq, NCT, T0, scale, lower_bound, Ttot,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, LOOP: tl.constexpr,
                           REF: tl.constexpr, HEAD_FAST: tl.constexpr, VARLEN: tl.constexpr, PIECE: tl.constexpr,
                           USE_GATE: tl.constexpr, L2NORM: tl.constexpr, QK_PREC: tl.constexpr, INV: tl.constexpr,
                           PREFETCH: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr):
    """One program = one head and LOOP consecutive groups of C 16-token chunks (NP programs per head, 1-D grid of
    H * NP, heads fastest when HEAD_FAST). Writes q e^G, k e^(G_last - G), W, U, Aqk ([H, Ttot, .], input dtype or
    fp32) and e^(G_last) per chunk (fp32) for `kda_state_output_fwd_kernel`."""
    pid = tl.program_id(0)
    if HEAD_FAST:
        i_h = pid % H
        i_p = pid // H
    else:
        i_p = pid % NP
        i_h = pid // NP
    o_k = tl.arange(0, K)
    if USE_GATE:
        a2 = tl.exp(tl.load(A_log + i_h).to(tl.float32)) * LOG2E
        dtb = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
    else:
        a2 = 0.
        dtb = tl.zeros([K], dtype=tl.float32)
    lb2 = lower_bound * LOG2E
    g0 = i_p * LOOP
    if KB < K:  # K-blocked tiles (loads inside the tile's passes; no prefetch)
        for j in range(LOOP):
            o_c, m_c, tok, m = _intra_rows(chunk_tok, chunk_end, NC, Tseq, NCT, T0, g0 + j, g0 + LOOP, C, VARLEN,
                                         PIECE)
            _intra_tile_kb(q, k, v, g, beta, dt_bias, o_c, m_c, tok, m, i_h, a2, lb2, scale,
                         qg_out, kd_out, w_out, u_out, aqk_out, eg_out, Ttot, H, K, V, REF, USE_GATE, L2NORM,
                         QK_PREC, INV, KB, VB)
    elif PREFETCH:
        o_c, m_c, tok, m = _intra_rows(chunk_tok, chunk_end, NC, Tseq, NCT, T0, g0, g0 + LOOP, C, VARLEN, PIECE)
        b_q, b_k, b_v, b_f, b_b = _intra_load(q, k, v, g, beta, tok, m, i_h, H, K, V)
        for j in range(LOOP):
            o_c2, m_c2, tok2, m2 = _intra_rows(chunk_tok, chunk_end, NC, Tseq, NCT, T0, g0 + j + 1, g0 + LOOP, C,
                                             VARLEN, PIECE)
            n_q, n_k, n_v, n_f, n_b = _intra_load(q, k, v, g, beta, tok2, m2, i_h, H, K, V)
            _intra_tile(b_q, b_k, b_v, b_f, b_b, o_c, m_c, tok, m, i_h, a2, dtb, lb2, scale,
                      qg_out, kd_out, w_out, u_out, aqk_out, eg_out, Ttot, H, K, V, REF, USE_GATE, L2NORM, QK_PREC,
                      INV)
            o_c, m_c, tok, m = o_c2, m_c2, tok2, m2
            b_q, b_k, b_v, b_f, b_b = n_q, n_k, n_v, n_f, n_b
    else:
        for j in range(LOOP):
            o_c, m_c, tok, m = _intra_rows(chunk_tok, chunk_end, NC, Tseq, NCT, T0, g0 + j, g0 + LOOP, C, VARLEN,
                                         PIECE)
            b_q, b_k, b_v, b_f, b_b = _intra_load(q, k, v, g, beta, tok, m, i_h, H, K, V)
            _intra_tile(b_q, b_k, b_v, b_f, b_b, o_c, m_c, tok, m, i_h, a2, dtb, lb2, scale,
                      qg_out, kd_out, w_out, u_out, aqk_out, eg_out, Ttot, H, K, V, REF, USE_GATE, L2NORM, QK_PREC,
                      INV)
