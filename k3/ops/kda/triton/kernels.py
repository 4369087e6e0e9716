"""Triton kernels for KDA (imported lazily: this module needs triton). See package docstring for the design.

Layouts: token tensors are flattened to [Ttot, H, D] (Ttot = B*T, sequences given by cu [N+1]); the per-token
intermediates of the chunk path are head-major [H, Ttot, D] so the sequential pass reads contiguous tiles.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gate(f, a_log, dtb, lower_bound, USE_GATE: tl.constexpr):
    """raw gate input f [.., K] -> log-decay; identity when USE_GATE is off."""
    if USE_GATE:
        x = tl.exp(a_log) * (f + dtb[None, :])
        return lower_bound * tl.sigmoid(x)
    else:
        return f


@triton.jit
def kda_prep_fwd_kernel(q, k, v, g, beta, A_log, dt_bias,
                        qg_out, kd_out, w_out, u_out, aqk_out, eg_out,
                        chunk_tok, chunk_end, scale, lower_bound, Ttot,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, REF: tl.constexpr,
                        USE_GATE: tl.constexpr, L2NORM: tl.constexpr):
    """One program = one BT-token chunk of one head. Fuses gate, chunk-local cumsum, L2 norm, scale, beta, the
    intra-chunk matrices (dense tl.dot: decays factored through reference row REF, exponents <= REF*|g|) and the
    unit-lower inverse (I + diag(beta) L)^-1 by repeated squaring (exact: N^BT = 0)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_tok + i_c)
    t1 = tl.load(chunk_end + i_c)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    tok = (t0 + o_t).to(tl.int64)
    m_t = tok < t1
    pk = (tok[:, None] * H + i_h) * K + o_k[None, :]
    pv = (tok[:, None] * H + i_h) * V + o_v[None, :]
    b_q = tl.load(q + pk, mask=m_t[:, None], other=0.).to(tl.float32)
    b_k = tl.load(k + pk, mask=m_t[:, None], other=0.).to(tl.float32)
    b_v = tl.load(v + pv, mask=m_t[:, None], other=0.).to(tl.float32)
    b_f = tl.load(g + pk, mask=m_t[:, None], other=0.).to(tl.float32)
    b_b = tl.load(beta + tok * H + i_h, mask=m_t, other=0.).to(tl.float32)
    if USE_GATE:
        a_log = tl.load(A_log + i_h).to(tl.float32)
        dtb = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
    else:
        a_log = 0.
        dtb = tl.zeros([K], dtype=tl.float32)
    b_g = tl.where(m_t[:, None], _gate(b_f, a_log, dtb, lower_bound, USE_GATE), 0.)
    b_G = tl.cumsum(b_g, axis=0)
    if L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None]
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    b_q = b_q * scale
    row = o_t[:, None]
    col = o_t[None, :]
    g_ref = tl.sum(tl.where(row == REF, b_G, 0.), 0)
    g_last = tl.sum(tl.where(row == BT - 1, b_G, 0.), 0)
    e_row = tl.exp(b_G - g_ref[None, :])
    k_col = b_k * tl.exp(g_ref[None, :] - b_G)
    a_qk = tl.dot(b_q * e_row, tl.trans(k_col))
    a_kk = tl.dot(b_k * e_row, tl.trans(k_col))
    a_qk = tl.where(row >= col, a_qk, 0.)
    n = tl.where(row > col, a_kk * b_b[:, None], 0.)
    # (I + n)^-1 = (I - n)(I + n^2)(I + n^4)(I + n^8) for BT = 16 (n nilpotent)
    p = tl.where(row == col, 1., 0.) - n
    n2 = tl.dot(n, n, input_precision="ieee")
    p = p + tl.dot(p, n2, input_precision="ieee")
    if BT > 4:
        n4 = tl.dot(n2, n2, input_precision="ieee")
        p = p + tl.dot(p, n4, input_precision="ieee")
        if BT > 8:
            n8 = tl.dot(n4, n4, input_precision="ieee")
            p = p + tl.dot(p, n8, input_precision="ieee")
    e_g = tl.exp(b_G)
    b_w = tl.dot(p, b_k * e_g * b_b[:, None])
    b_u = tl.dot(p, b_v * b_b[:, None])
    b_qg = b_q * e_g
    b_kd = b_k * tl.exp(g_last[None, :] - b_G)
    dt = w_out.dtype.element_ty
    ik = (i_h * Ttot + tok[:, None]) * K + o_k[None, :]
    iv = (i_h * Ttot + tok[:, None]) * V + o_v[None, :]
    ia = (i_h * Ttot + tok[:, None]) * BT + o_t[None, :]
    tl.store(qg_out + ik, b_qg.to(dt), mask=m_t[:, None])
    tl.store(kd_out + ik, b_kd.to(dt), mask=m_t[:, None])
    tl.store(w_out + ik, b_w.to(dt), mask=m_t[:, None])
    tl.store(u_out + iv, b_u.to(dt), mask=m_t[:, None])
    tl.store(aqk_out + ia, a_qk.to(dt), mask=m_t[:, None])
    tl.store(eg_out + (i_c * H + i_h) * K + o_k, tl.exp(g_last))


@triton.jit
def _walk_ids(order, NV: tl.constexpr, ORDERED: tl.constexpr):
    """(sequence, head, value block) of a sequential pass's program. ORDERED: the grid is (H * NV, N) and slot n walks
    sequence order[n], so with order = the sequences longest first every head's programs of the longest sequence come
    first in the launch order (the block scheduler starts programs in grid order; longest-first list scheduling
    keeps a long document's walks out of the last wave). Else the grid is (N, H, NV)."""
    if ORDERED:
        hv = tl.program_id(0)
        i_n = tl.load(order + tl.program_id(1))
        i_h = hv // NV
        i_v = hv % NV
    else:
        i_n = tl.program_id(0)
        i_h = tl.program_id(1)
        i_v = tl.program_id(2)
    return i_n, i_h, i_v


@triton.jit
def _seq_walk_start(cu, seq_chunk, s0, i_n, i_h, i_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr, CU_STRIDE: tl.constexpr = 1):
    """Prologue of the sequential (per sequence, head, value block) kernels: the sequence's token range
    [bos, eos), its first global chunk c0 and chunk count nc, the row/column offsets, kv = the [K, BV] block's
    offsets inside one K x V matrix, and the carried fp32 matrix S read from s0[n, h] (zeros without HAS_S0).
    CU_STRIDE 1: cu holds N + 1 boundaries (sequence n = [cu[n], cu[n+1])); 2: cu holds N (start, end) pairs, so
    the ranges need not touch (the pipelined forward walks one time piece of every sequence per launch)."""
    bos = tl.load(cu + i_n * CU_STRIDE).to(tl.int64)
    eos = tl.load(cu + i_n * CU_STRIDE + 1).to(tl.int64)
    c0 = tl.load(seq_chunk + i_n).to(tl.int64)
    nc = (eos - bos + BT - 1) // BT
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    kv = o_k[:, None].to(tl.int64) * V + o_v[None, :]
    ps = (i_n * H + i_h).to(tl.int64) * K * V + kv
    if HAS_S0:
        S = tl.load(s0 + ps).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    return bos, eos, c0, nc, o_t, o_k, o_v, kv, ps, S


@triton.jit
def kda_state_fwd_kernel(qg, kd, w, u, aqk, eg, o, h0, ht, cu, seq_chunk, Ttot, states, uns, save_chunk, save_off,
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


@triton.jit
def _st16_load(qg, kd, w, u, aqk, eg, bos, eos, c0, nc, j, i_h, o_t, o_k, o_v, Ttot, H: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr):
    """Tiles of chunk j of the sequence (all rows masked off, e^G_last = 1, when j >= nc: a no-op step)."""
    tok = bos + j * BT + o_t
    m_t = tok < eos
    ik = (i_h * Ttot + tok[:, None]) * K + o_k[None, :]
    b_w = tl.load(w + ik, mask=m_t[:, None], other=0.)
    b_qg = tl.load(qg + ik, mask=m_t[:, None], other=0.)
    b_kd = tl.load(kd + ik, mask=m_t[:, None], other=0.)
    b_u = tl.load(u + (i_h * Ttot + tok[:, None]) * V + o_v[None, :], mask=m_t[:, None], other=0.)
    b_a = tl.load(aqk + (i_h * Ttot + tok[:, None]) * BT + o_t[None, :], mask=m_t[:, None], other=0.)
    b_e = tl.load(eg + ((c0 + j) * H + i_h) * K + o_k, mask=(j + 0 * o_k) < nc, other=1.)
    return b_w, b_qg, b_kd, b_u, b_a, b_e


@triton.jit
def _st16_step(S, b_w, b_qg, b_kd, b_u, b_a, b_e, OUT_LATE: tl.constexpr, FOLD: tl.constexpr):
    """One chunk of the sequential pass: (new fp32 state, fp32 output tile). The chain that feeds the next chunk is
    S -> bf16 -> W S -> u' = U - W S -> bf16 -> Kd^T u' -> S e + Kd^T u'. OUT_LATE: the output dots are issued after
    the state update (they do not feed it). FOLD: o = (qg - Aqk W) S + Aqk U, so the output needs only the old state
    and the tiles (Aqk W and Aqk U are off the chain); else o = qg S + Aqk u'."""
    dt = b_w.dtype
    s_lo = S.to(dt)
    b_vn = b_u.to(tl.float32) - tl.dot(b_w, s_lo)
    vn_lo = b_vn.to(dt)
    if not OUT_LATE:
        if FOLD:
            b_q2 = (b_qg.to(tl.float32) - tl.dot(b_a, b_w)).to(dt)
            b_o = tl.dot(b_q2, s_lo) + tl.dot(b_a, b_u)
        else:
            b_o = tl.dot(b_qg, s_lo) + tl.dot(b_a, vn_lo)
    S = S * b_e[:, None] + tl.dot(tl.trans(b_kd), vn_lo)
    if OUT_LATE:
        if FOLD:
            b_q2 = (b_qg.to(tl.float32) - tl.dot(b_a, b_w)).to(dt)
            b_o = tl.dot(b_q2, s_lo) + tl.dot(b_a, b_u)
        else:
            b_o = tl.dot(b_qg, s_lo) + tl.dot(b_a, vn_lo)
    return S, b_o


@triton.jit
def _st16_store(o, b_o, bos, eos, j, i_h, o_t, o_v, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    tok = bos + j * BT + o_t
    tl.store(o + (tok[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=(tok < eos)[:, None])


@triton.jit
def kda_state16_fwd_kernel(qg, kd, w, u, aqk, eg, o, h0, ht, cu, seq_chunk, Ttot,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                           HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, CH: tl.constexpr, PREFETCH: tl.constexpr,
                           OUT_LATE: tl.constexpr, FOLD: tl.constexpr, CU_STRIDE: tl.constexpr = 1):
    """kda_state_fwd_kernel with latency options (ops.STATE_CFG_DEFAULT / kda_chunk_fwd(state_cfg=...)), same
    arithmetic. CH (1 or 2): chunks per loop iteration (the second one of a pair past the sequence end is a masked
    no-op). PREFETCH: the next iteration's tiles are loaded into registers before this iteration's dots (a hand
    pipeline, launched with num_stages=1); else the loads are at the top of the iteration (triton's own pipeliner
    may stage them with num_stages > 1). OUT_LATE, FOLD: see _st16_step. CU_STRIDE: _seq_walk_start."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos, eos, c0, nc, o_t, o_k, o_v, kv, ps, S = _seq_walk_start(cu, seq_chunk, h0, i_n, i_h, i_v, H, K, V, BT, BV,
                                                                 HAS_H0, CU_STRIDE)
    if PREFETCH:
        w0, q0, k0, u0, a0, e0 = _st16_load(qg, kd, w, u, aqk, eg, bos, eos, c0, nc, 0, i_h, o_t, o_k, o_v, Ttot,
                                            H, K, V, BT)
        if CH == 2:
            w1, q1, k1, u1, a1, e1 = _st16_load(qg, kd, w, u, aqk, eg, bos, eos, c0, nc, 1, i_h, o_t, o_k, o_v,
                                                Ttot, H, K, V, BT)
        for j in range(0, nc, CH):
            cw0, cq0, ck0, cu0, ca0, ce0 = w0, q0, k0, u0, a0, e0
            w0, q0, k0, u0, a0, e0 = _st16_load(qg, kd, w, u, aqk, eg, bos, eos, c0, nc, j + CH, i_h, o_t, o_k,
                                                o_v, Ttot, H, K, V, BT)
            if CH == 2:
                cw1, cq1, ck1, cu1, ca1, ce1 = w1, q1, k1, u1, a1, e1
                w1, q1, k1, u1, a1, e1 = _st16_load(qg, kd, w, u, aqk, eg, bos, eos, c0, nc, j + 3, i_h, o_t, o_k,
                                                    o_v, Ttot, H, K, V, BT)
            S, b_o = _st16_step(S, cw0, cq0, ck0, cu0, ca0, ce0, OUT_LATE, FOLD)
            _st16_store(o, b_o, bos, eos, j, i_h, o_t, o_v, H, V, BT)
            if CH == 2:
                S, b_o = _st16_step(S, cw1, cq1, ck1, cu1, ca1, ce1, OUT_LATE, FOLD)
                _st16_store(o, b_o, bos, eos, j + 1, i_h, o_t, o_v, H, V, BT)
    else:
        for j in range(0, nc, CH):
            cw0, cq0, ck0, cu0, ca0, ce0 = _st16_load(qg, kd, w, u, aqk, eg, bos, eos, c0, nc, j, i_h, o_t, o_k, o_v,
                                                      Ttot, H, K, V, BT)
            if CH == 2:
                cw1, cq1, ck1, cu1, ca1, ce1 = _st16_load(qg, kd, w, u, aqk, eg, bos, eos, c0, nc, j + 1, i_h, o_t,
                                                          o_k, o_v, Ttot, H, K, V, BT)
            S, b_o = _st16_step(S, cw0, cq0, ck0, cu0, ca0, ce0, OUT_LATE, FOLD)
            _st16_store(o, b_o, bos, eos, j, i_h, o_t, o_v, H, V, BT)
            if CH == 2:
                S, b_o = _st16_step(S, cw1, cq1, ck1, cu1, ca1, ce1, OUT_LATE, FOLD)
                _st16_store(o, b_o, bos, eos, j + 1, i_h, o_t, o_v, H, V, BT)
    if STORE_HT:
        tl.store(ht + ps, S)


@triton.jit
def kda_recurrent_fwd_kernel(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu, scale, lower_bound,
                             H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                             USE_GATE: tl.constexpr, L2NORM: tl.constexpr, HAS_H0: tl.constexpr,
                             STORE_HT: tl.constexpr):
    """Token-by-token recurrence (decode): one program = one sequence, one head, BV value columns. The fp32 state
    is read once and written once; ht may alias h0 (in-place update)."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    ps = ((i_n * H + i_h) * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :]
    if HAS_H0:
        S = tl.load(h0 + ps).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    if USE_GATE:
        a_log = tl.load(A_log + i_h).to(tl.float32)
        dtb = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
    else:
        a_log = 0.
        dtb = tl.zeros([K], dtype=tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + o_v).to(tl.float32)
        b_f = tl.load(g + (t * H + i_h) * K + o_k).to(tl.float32)
        b_b = tl.load(beta + t * H + i_h).to(tl.float32)
        b_g = tl.sum(_gate(b_f[None, :], a_log, dtb, lower_bound, USE_GATE), 0)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
        b_q = b_q * scale
        S = S * tl.exp(b_g)[:, None]
        pred = tl.sum(b_k[:, None] * S, 0)
        S = S + (b_b * b_k)[:, None] * (b_v - pred)[None, :]
        b_o = tl.sum(b_q[:, None] * S, 0)
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty))
    if STORE_HT:
        tl.store(ht + ps, S)


# ---------------------------------------------------------------------------------------------------------------
# 64-token chunks (variants "c64", "c64s", "c64f"; see ops.py). A chunk is four 16-row tiles a = 0..3. Inside
# tile a, c = in-tile inclusive cumsum of g and s_a = its total, so with P_a = s_0 + .. + s_{a-1} the chunk cumsum
# is G = P_a + c. Every decay e^(G_t - G_i) (i <= t) is formed from factors whose exponents stay bounded for
# g >= -10 per token:
#   same tile:    e^(c_t - c_m) * e^(c_m - c_i), m = row MID of the tile: |exponent| <= 8*10 = 80 < 88 (fp32)
#   tile b < a:   (q_t e^(c_t)) * e^(P_a - P_b - s_b) * (k_i e^(s_b - c_i)): all three factors <= 1.
# A factor <= 1 that underflows only drops terms that are themselves below e^-87 times the others.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_in(q, k, v, g, beta, tok, m_t, i_h, o_k, o_v, a_log, dtb, scale, lower_bound,
             H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, USE_GATE: tl.constexpr, L2NORM: tl.constexpr):
    """Rows `tok` of head i_h in fp32: (scale * l2norm(q), l2norm(k), v, log-decay g, beta), zero on masked rows
    (g = 0 there, so cumsums carry through padding unchanged)."""
    pk = (tok[:, None] * H + i_h) * K + o_k[None, :]
    b_q = tl.load(q + pk, mask=m_t[:, None], other=0.).to(tl.float32)
    b_k = tl.load(k + pk, mask=m_t[:, None], other=0.).to(tl.float32)
    b_v = tl.load(v + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.).to(tl.float32)
    b_f = tl.load(g + pk, mask=m_t[:, None], other=0.).to(tl.float32)
    b_b = tl.load(beta + tok * H + i_h, mask=m_t, other=0.).to(tl.float32)
    b_g = tl.where(m_t[:, None], _gate(b_f, a_log, dtb, lower_bound, USE_GATE), 0.)
    if L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None]
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    return b_q * scale, b_k, b_v, b_g, b_b


@triton.jit
def _inv16(n, INV_PREC: tl.constexpr):
    """(I + n)^-1 for strictly lower 16x16 n: (I - n)(I + n^2)(I + n^4)(I + n^8), exact since n^16 = 0."""
    r = tl.arange(0, 16)
    p = tl.where(r[:, None] == r[None, :], 1., 0.) - n
    n2 = tl.dot(n, n, input_precision=INV_PREC)
    p = p + tl.dot(p, n2, input_precision=INV_PREC)
    n4 = tl.dot(n2, n2, input_precision=INV_PREC)
    p = p + tl.dot(p, n4, input_precision=INV_PREC)
    n8 = tl.dot(n4, n4, input_precision=INV_PREC)
    return p + tl.dot(p, n8, input_precision=INV_PREC)


@triton.jit
def _tile_local(b_q, b_k, b_g, b_b, MID: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr):
    """Everything of one 16-row tile that needs only the tile itself, with c = in-tile cumsum of g:
    s = c_15 (tile total); q e^c, k e^c (rows for later-tile blocks, factors <= 1); k e^(s - c) (columns for
    later row tiles, <= 1); the diagonal blocks Aqk[t,i] = sum_K q_t k_i e^(c_t - c_i) (i <= t) and
    n = diag(beta) Akk (i < t), via the reference row MID; and x = (I + n)^-1."""
    r = tl.arange(0, 16)
    row = r[:, None]
    col = r[None, :]
    c = tl.cumsum(b_g, 0)
    s = tl.sum(b_g, 0)
    c_mid = tl.sum(tl.where(row == MID, c, 0.), 0)
    e_up = tl.exp(c - c_mid[None, :])
    e_dn = tl.exp(c_mid[None, :] - c)
    k_dn = b_k * e_dn
    a_qk = tl.dot(b_q * e_up, tl.trans(k_dn), input_precision=PREC)
    a_kk = tl.dot(b_k * e_up, tl.trans(k_dn), input_precision=PREC)
    a_qk = tl.where(row >= col, a_qk, 0.)
    n = tl.where(row > col, a_kk * b_b[:, None], 0.)
    x = _inv16(n, INV_PREC)
    e_c = e_up * tl.exp(c_mid)[None, :]        # e^c       = e^(c - c_m) e^(c_m)
    e_r = e_dn * tl.exp(s - c_mid)[None, :]    # e^(s - c) = e^(c_m - c) e^(s - c_m)
    return s, b_q * e_c, b_k * e_c, b_k * e_r, a_qk, n, x


@triton.jit
def _off(qs_a, ks_a, col_b, b_a, PREC: tl.constexpr):
    """Block (a, b < a): Aqk = (q e^c)_a col_b^T and n = diag(beta_a) (k e^c)_a col_b^T, where col_b =
    (k e^(s - c))_b e^(P_a - P_b - s_b) already carries the decay across the tiles in between."""
    a_qk = tl.dot(qs_a, tl.trans(col_b), input_precision=PREC)
    n = tl.dot(ks_a, tl.trans(col_b), input_precision=PREC) * b_a[:, None]
    return a_qk, n


@triton.jit
def _st_rows(p, rows, m_t, o_d, D: tl.constexpr, val):
    tl.store(p + rows[:, None] * D + o_d[None, :], val.to(p.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _st_aqk(p, rows, m_t, b0, b1, b2, b3):
    """One 16-row block row of the 64x64 Aqk (row stride 64): the four 16x16 blocks b0..b3."""
    r = tl.arange(0, 16)
    pa = p + rows[:, None] * 64 + r[None, :]
    dt = p.dtype.element_ty
    tl.store(pa, b0.to(dt), mask=m_t[:, None])
    tl.store(pa + 16, b1.to(dt), mask=m_t[:, None])
    tl.store(pa + 32, b2.to(dt), mask=m_t[:, None])
    tl.store(pa + 48, b3.to(dt), mask=m_t[:, None])


@triton.jit
def _prep64(q, k, v, g, beta, a_log, dtb, scale, lower_bound, t0, t1, i_h, qg_p, kd_p, w_p, u_p, a_p, row0,
            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, USE_GATE: tl.constexpr, L2NORM: tl.constexpr,
            PREC: tl.constexpr, INV_PREC: tl.constexpr):
    """One 64-token chunk [t0, min(t0 + 64, t1)) of head i_h. Writes, at rows row0 + (0..63) of the given
    (already offset) buffers, with G the chunk cumsum of g, T = (I + diag(beta) L)^-1:
      qg = q e^G;  kd = k e^(G_last - G);  W = T diag(beta) (k e^G);  U = T diag(beta) v;
      Aqk[t, i] = sum_K q_t k_i e^(G_t - G_i) (i <= t, zero above the diagonal).
    T is never formed: block forward substitution Y_a = x_a (R_a - sum_{b<a} n_ab Y_b) over the 16-row tiles,
    x_a = (I + n_aa)^-1. Returns e^(G_last) [K]."""
    r = tl.arange(0, 16)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    z = tl.zeros([16, 16], dtype=tl.float32)
    # tile 0 (P_0 = 0)
    tok = t0 + r
    m0 = tok < t1
    rw0 = row0 + r
    b_q, b_k, b_v, b_g, b_0 = _tile_in(q, k, v, g, beta, tok, m0, i_h, o_k, o_v, a_log, dtb, scale, lower_bound,
                                       H, K, V, USE_GATE, L2NORM)
    s0, qs0, ks0, ke0, a00, n00, x0 = _tile_local(b_q, b_k, b_g, b_0, 7, PREC, INV_PREC)
    _st_aqk(a_p, rw0, m0, a00, z, z, z)
    _st_rows(qg_p, rw0, m0, o_k, K, qs0)
    w0 = tl.dot(x0, ks0 * b_0[:, None], input_precision=PREC)
    u0 = tl.dot(x0, b_v * b_0[:, None], input_precision=PREC)
    _st_rows(w_p, rw0, m0, o_k, K, w0)
    _st_rows(u_p, rw0, m0, o_v, V, u0)
    # tile 1 (P_1 = s0)
    tok = t0 + 16 + r
    m1 = tok < t1
    rw1 = rw0 + 16
    b_q, b_k, b_v, b_g, b_1 = _tile_in(q, k, v, g, beta, tok, m1, i_h, o_k, o_v, a_log, dtb, scale, lower_bound,
                                       H, K, V, USE_GATE, L2NORM)
    s1, qs1, ks1, ke1, a11, n11, x1 = _tile_local(b_q, b_k, b_g, b_1, 7, PREC, INV_PREC)
    a10, n10 = _off(qs1, ks1, ke0, b_1, PREC)
    _st_aqk(a_p, rw1, m1, a10, a11, z, z)
    e_p = tl.exp(s0)[None, :]
    _st_rows(qg_p, rw1, m1, o_k, K, qs1 * e_p)
    w1 = tl.dot(x1, ks1 * e_p * b_1[:, None] - tl.dot(n10, w0, input_precision=PREC), input_precision=PREC)
    u1 = tl.dot(x1, b_v * b_1[:, None] - tl.dot(n10, u0, input_precision=PREC), input_precision=PREC)
    _st_rows(w_p, rw1, m1, o_k, K, w1)
    _st_rows(u_p, rw1, m1, o_v, V, u1)
    # tile 2 (P_2 = s0 + s1)
    tok = t0 + 32 + r
    m2 = tok < t1
    rw2 = rw0 + 32
    b_q, b_k, b_v, b_g, b_2 = _tile_in(q, k, v, g, beta, tok, m2, i_h, o_k, o_v, a_log, dtb, scale, lower_bound,
                                       H, K, V, USE_GATE, L2NORM)
    s2, qs2, ks2, ke2, a22, n22, x2 = _tile_local(b_q, b_k, b_g, b_2, 7, PREC, INV_PREC)
    a20, n20 = _off(qs2, ks2, ke0 * tl.exp(s1)[None, :], b_2, PREC)
    a21, n21 = _off(qs2, ks2, ke1, b_2, PREC)
    _st_aqk(a_p, rw2, m2, a20, a21, a22, z)
    e_p = tl.exp(s0 + s1)[None, :]
    _st_rows(qg_p, rw2, m2, o_k, K, qs2 * e_p)
    w2 = tl.dot(x2, ks2 * e_p * b_2[:, None] - tl.dot(n20, w0, input_precision=PREC)
                - tl.dot(n21, w1, input_precision=PREC), input_precision=PREC)
    u2 = tl.dot(x2, b_v * b_2[:, None] - tl.dot(n20, u0, input_precision=PREC)
                - tl.dot(n21, u1, input_precision=PREC), input_precision=PREC)
    _st_rows(w_p, rw2, m2, o_k, K, w2)
    _st_rows(u_p, rw2, m2, o_v, V, u2)
    # tile 3 (P_3 = s0 + s1 + s2)
    tok = t0 + 48 + r
    m3 = tok < t1
    rw3 = rw0 + 48
    b_q, b_k, b_v, b_g, b_3 = _tile_in(q, k, v, g, beta, tok, m3, i_h, o_k, o_v, a_log, dtb, scale, lower_bound,
                                       H, K, V, USE_GATE, L2NORM)
    s3, qs3, ks3, ke3, a33, n33, x3 = _tile_local(b_q, b_k, b_g, b_3, 7, PREC, INV_PREC)
    a30, n30 = _off(qs3, ks3, ke0 * tl.exp(s1 + s2)[None, :], b_3, PREC)
    a31, n31 = _off(qs3, ks3, ke1 * tl.exp(s2)[None, :], b_3, PREC)
    a32, n32 = _off(qs3, ks3, ke2, b_3, PREC)
    _st_aqk(a_p, rw3, m3, a30, a31, a32, a33)
    e_p = tl.exp(s0 + s1 + s2)[None, :]
    _st_rows(qg_p, rw3, m3, o_k, K, qs3 * e_p)
    w3 = tl.dot(x3, ks3 * e_p * b_3[:, None] - tl.dot(n30, w0, input_precision=PREC)
                - tl.dot(n31, w1, input_precision=PREC) - tl.dot(n32, w2, input_precision=PREC),
                input_precision=PREC)
    u3 = tl.dot(x3, b_v * b_3[:, None] - tl.dot(n30, u0, input_precision=PREC)
                - tl.dot(n31, u1, input_precision=PREC) - tl.dot(n32, u2, input_precision=PREC),
                input_precision=PREC)
    _st_rows(w_p, rw3, m3, o_k, K, w3)
    _st_rows(u_p, rw3, m3, o_v, V, u3)
    # k e^(G_last - G) = (k e^(s_a - c)) e^(s_{a+1} + .. + s_3)
    _st_rows(kd_p, rw0, m0, o_k, K, ke0 * tl.exp(s1 + s2 + s3)[None, :])
    _st_rows(kd_p, rw1, m1, o_k, K, ke1 * tl.exp(s2 + s3)[None, :])
    _st_rows(kd_p, rw2, m2, o_k, K, ke2 * tl.exp(s3)[None, :])
    _st_rows(kd_p, rw3, m3, o_k, K, ke3)
    return tl.exp(s0 + s1 + s2 + s3)


@triton.jit
def kda_prep64_fwd_kernel(q, k, v, g, beta, A_log, dt_bias, qg_out, kd_out, w_out, u_out, aqk_out, eg_out,
                          chunk_tok, chunk_end, scale, lower_bound, Ttot,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, USE_GATE: tl.constexpr,
                          L2NORM: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr):
    """One program = one 64-token chunk of one head (see `_prep64`); intermediates head-major [H, Ttot, D],
    e^(G_last) to eg_out [NC, H, K]."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_tok + i_c).to(tl.int64)
    t1 = tl.load(chunk_end + i_c).to(tl.int64)
    o_k = tl.arange(0, K)
    if USE_GATE:
        a_log = tl.load(A_log + i_h).to(tl.float32)
        dtb = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
    else:
        a_log = 0.
        dtb = tl.zeros([K], dtype=tl.float32)
    hk = i_h.to(tl.int64) * Ttot
    e_last = _prep64(q, k, v, g, beta, a_log, dtb, scale, lower_bound, t0, t1, i_h,
                     qg_out + hk * K, kd_out + hk * K, w_out + hk * K, u_out + hk * V, aqk_out + hk * 64, t0,
                     H, K, V, USE_GATE, L2NORM, PREC, INV_PREC)
    tl.store(eg_out + (i_c * H + i_h) * K + o_k, e_last)


@triton.jit
def kda_state_h_kernel(kd, w, u, eg, hs, vn, h0, ht, cu, seq_chunk, Ttot,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                       HAS_H0: tl.constexpr, STORE_HT: tl.constexpr):
    """Lean sequential pass of the 3-phase split ("c64s"): one program = one sequence, head and BV value columns.
    Per chunk it stores the incoming state S_j (input dtype) to hs [NC, H, K, V] and u' = U - W S_j to vn
    [H, Ttot, V], then S <- e^(G_last) S + (k e^(G_last - G))^T u'. No output here (see kda_out_kernel)."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos, eos, c0, nc, o_t, o_k, o_v, kv, ps, S = _seq_walk_start(cu, seq_chunk, h0, i_n, i_h, i_v, H, K, V, BT, BV,
                                                                 HAS_H0)
    dt = w.dtype.element_ty
    for j in range(0, nc):
        tok = bos + j * BT + o_t
        m_t = tok < eos
        ik = (i_h * Ttot + tok[:, None]) * K + o_k[None, :]
        iv = (i_h * Ttot + tok[:, None]) * V + o_v[None, :]
        b_w = tl.load(w + ik, mask=m_t[:, None], other=0.)
        b_kd = tl.load(kd + ik, mask=m_t[:, None], other=0.)
        b_u = tl.load(u + iv, mask=m_t[:, None], other=0.).to(tl.float32)
        b_e = tl.load(eg + ((c0 + j) * H + i_h) * K + o_k)
        s_lo = S.to(dt)
        tl.store(hs + (((c0 + j) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], s_lo)
        vn_lo = (b_u - tl.dot(b_w, s_lo)).to(dt)
        tl.store(vn + iv, vn_lo, mask=m_t[:, None])
        S = S * b_e[:, None] + tl.dot(tl.trans(b_kd), vn_lo)
    if STORE_HT:
        tl.store(ht + ps, S)


@triton.jit
def kda_out_kernel(qg, aqk, hs, vn, o, chunk_tok, chunk_end, Ttot,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """Output of the 3-phase split, parallel over (chunk, head, value block): o = (q e^G) S_j + Aqk u'."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    t0 = tl.load(chunk_tok + i_c).to(tl.int64)
    t1 = tl.load(chunk_end + i_c).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    tok = t0 + o_t
    m_t = tok < t1
    b_qg = tl.load(qg + (i_h * Ttot + tok[:, None]) * K + o_k[None, :], mask=m_t[:, None], other=0.)
    b_a = tl.load(aqk + (i_h * Ttot + tok[:, None]) * BT + o_t[None, :], mask=m_t[:, None], other=0.)
    b_vn = tl.load(vn + (i_h * Ttot + tok[:, None]) * V + o_v[None, :], mask=m_t[:, None], other=0.)
    b_h = tl.load(hs + ((i_c.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :])
    b_o = tl.dot(b_qg, b_h) + tl.dot(b_a, b_vn)
    tl.store(o + (tok[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def kda_fused64_fwd_kernel(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu, scr, scale, lower_bound,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, USE_GATE: tl.constexpr,
                           L2NORM: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr,
                           HAS_H0: tl.constexpr, STORE_HT: tl.constexpr):
    """Single-kernel forward ("c64f"): one program = one sequence and head (all V columns), walking its 64-token
    chunks: `_prep64` writes the chunk's qg, kd, W, U, Aqk to this program's private scratch rows (reused every
    chunk, so they stay in L2 and HBM traffic is about the inputs and o only), a CTA barrier, then the same state
    step as kda_state_fwd_kernel. Must run with num_stages=1: the scratch loads of chunk j+1 must not be
    prefetched before chunk j+1 has written them."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    nc = (eos - bos + 63) // 64
    o_t = tl.arange(0, 64)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    if USE_GATE:
        a_log = tl.load(A_log + i_h).to(tl.float32)
        dtb = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
    else:
        a_log = 0.
        dtb = tl.zeros([K], dtype=tl.float32)
    ps = ((i_n * H + i_h) * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :]
    if HAS_H0:
        S = tl.load(h0 + ps).to(tl.float32)
    else:
        S = tl.zeros([K, V], dtype=tl.float32)
    # scratch of this program: qg, kd, w [64, K], u [64, V], aqk [64, 64], contiguous
    base = scr + (i_n * H + i_h).to(tl.int64) * (64 * (3 * K + V + 64))
    s_qg = base
    s_kd = base + 64 * K
    s_w = base + 128 * K
    s_u = base + 192 * K
    s_a = s_u + 64 * V
    dt = scr.dtype.element_ty
    for j in range(0, nc):
        t0 = bos + j * 64
        b_e = _prep64(q, k, v, g, beta, a_log, dtb, scale, lower_bound, t0, eos, i_h, s_qg, s_kd, s_w, s_u, s_a,
                      0, H, K, V, USE_GATE, L2NORM, PREC, INV_PREC)
        tl.debug_barrier()
        tok = t0 + o_t
        m_t = tok < eos
        ik = o_t[:, None] * K + o_k[None, :]
        b_w = tl.load(s_w + ik, mask=m_t[:, None], other=0., cache_modifier=".cg")
        b_qg = tl.load(s_qg + ik, mask=m_t[:, None], other=0., cache_modifier=".cg")
        b_kd = tl.load(s_kd + ik, mask=m_t[:, None], other=0., cache_modifier=".cg")
        b_u = tl.load(s_u + o_t[:, None] * V + o_v[None, :], mask=m_t[:, None], other=0.,
                      cache_modifier=".cg").to(tl.float32)
        b_a = tl.load(s_a + o_t[:, None] * 64 + o_t[None, :], mask=m_t[:, None], other=0., cache_modifier=".cg")
        s_lo = S.to(dt)
        vn_lo = (b_u - tl.dot(b_w, s_lo)).to(dt)
        b_o = tl.dot(b_qg, s_lo) + tl.dot(b_a, vn_lo)
        S = S * b_e[:, None] + tl.dot(tl.trans(b_kd), vn_lo)
        tl.store(o + (tok[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None])
        tl.debug_barrier()
    if STORE_HT:
        tl.store(ht + ps, S)


# ---------------------------------------------------------------------------------------------------------------
# "c16p": a faster 16-token prep, same intermediates as kda_prep_fwd_kernel (consumed by kda_state_fwd_kernel with
# BT = 16). Diagnosis from sm_90 compiles on a CPU (benchmarks/kda_triton.py --static): the old prep holds 246
# registers per thread (its [16, 128] fp32 dot operands are replicated in every warp: 64 registers each), so only
# 2 programs (8 warps, 2 chunks) are resident per SM to hide a long chain of loads, 49 barriers and dependent dots;
# and it issues 10,144 warp-instructions per chunk (the 4 warps all redo the 16-row dots). Changes, each selectable
# (constexpr or launch option) so one GPU run can time them separately (options: ops.PREP16P_DEFAULT; one sweep row
# per change with a predicted time: benchmarks/kda_triton.py PREP16P_SWEEP):
#  - fewer warps per chunk (2, or 1 with K blocks) and a register cap (maxnreg): 8-16 resident programs per SM;
#  - C chunks of one head per tile, as 3-D [C, 16, D] tensors with batched tl.dot (Triton puts the warps of a 3-D
#    dot on the batch axis: one warp per chunk when num_warps == C);
#  - KB: K in blocks (two passes: Aqk/Akk/norms, then qg/kd/W with the gate recomputed): no [16, K] tile live;
#  - LOOP tiles per program in a loop, optionally with the next tile's raw inputs loaded before the current tile is
#    computed (PREFETCH: a manual software pipeline that hides the HBM latency at low occupancy);
#  - the unit-lower inverse by recursive 2x2 block inversion on tf32 tensor cores (stable: products of inverse
#    blocks, never powers of n), optionally one Newton step with a tf32x3 residual; "ieee" = the old squaring;
#  - two full-tile exponentials instead of four (log2 domain: exp2 of G - G_ref and G_ref - G, every other decay
#    from these times a per-chunk [K] vector), and no chunk-table loads for equal-length sequences;
#  - grid order heads-fastest (HEAD_FAST): programs running together read whole token rows (all heads, H*D*2 B
#    contiguous) of q, k, v, g; chunks-fastest, they read 256-B pieces H*D*2 B apart and the rest of each DRAM page
#    is fetched again much later, by the programs of the other heads.
# ---------------------------------------------------------------------------------------------------------------

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _p16_rows(chunk_tok, chunk_end, NC, Tseq, NCT, T0, gi, gend, C: tl.constexpr, VARLEN: tl.constexpr,
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
def _p16_load(q, k, v, g, beta, tok, m, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
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
    "ieee": repeated squaring with fp32 FMA dots, as kda_prep_fwd_kernel."""
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
def _p16_tile(b_q, b_k, b_v, b_f, b_b, o_c, m_c, tok, m, i_h, a2, dtb, lb2, scale,
              qg_out, kd_out, w_out, u_out, aqk_out, eg_out, Ttot,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, REF: tl.constexpr, USE_GATE: tl.constexpr,
              L2NORM: tl.constexpr, QK_PREC: tl.constexpr, INV: tl.constexpr):
    """Prep of C chunks (rows tok [C, 16]) of head i_h from their raw inputs; same outputs as kda_prep_fwd_kernel.
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
def _p16_gate_cumsum(b_f, dtb, a2, lb2, m3, USE_GATE: tl.constexpr):
    """Raw gate input [C, 16, BK] -> chunk-local inclusive cumsum of the log-decay, in log2 units."""
    f = b_f.to(tl.float32)
    if USE_GATE:
        g2 = lb2 / (1. + tl.exp2(-(f + dtb[None, None, :]) * a2))
    else:
        g2 = f * LOG2E
    return tl.cumsum(tl.where(m3, g2, 0.), axis=1)


@triton.jit
def _p16_cols_G(g, dt_bias, th, cols, i_h, a2, lb2, m3, K: tl.constexpr, BK: tl.constexpr, USE_GATE: tl.constexpr):
    """K-blocked c16p prep: the addresses pk of columns `cols` of the [C, 16] tiles and their in-tile cumsum G
    (base-2 log-decay, `_p16_gate_cumsum`)."""
    pk = th[:, :, None] * K + cols[None, None, :]
    if USE_GATE:
        dtb = tl.load(dt_bias + i_h * K + cols).to(tl.float32)
    else:
        dtb = tl.zeros([BK], dtype=tl.float32)
    return pk, _p16_gate_cumsum(tl.load(g + pk, mask=m3, other=0.), dtb, a2, lb2, m3, USE_GATE)


@triton.jit
def _p16_tile_kb(q, k, v, g, beta, dt_bias, o_c, m_c, tok, m, i_h, a2, lb2, scale,
                 qg_out, kd_out, w_out, u_out, aqk_out, eg_out, Ttot,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, REF: tl.constexpr, USE_GATE: tl.constexpr,
                 L2NORM: tl.constexpr, QK_PREC: tl.constexpr, INV: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr):
    """_p16_tile over K in blocks of BK columns (every decay is per column; only the L2 norms and the Aqk / Akk sums
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
        pk, G = _p16_cols_G(g, dt_bias, th, cols, i_h, a2, lb2, m3, K, BK, USE_GATE)
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
        pk, G = _p16_cols_G(g, dt_bias, th, cols, i_h, a2, lb2, m3, K, BK, USE_GATE)
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
def kda_prep16p_fwd_kernel(q, k, v, g, beta, A_log, dt_bias, qg_out, kd_out, w_out, u_out, aqk_out, eg_out,
                           chunk_tok, chunk_end, NC, NP, Tseq, NCT, T0, scale, lower_bound, Ttot,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, LOOP: tl.constexpr,
                           REF: tl.constexpr, HEAD_FAST: tl.constexpr, VARLEN: tl.constexpr, PIECE: tl.constexpr,
                           USE_GATE: tl.constexpr, L2NORM: tl.constexpr, QK_PREC: tl.constexpr, INV: tl.constexpr,
                           PREFETCH: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr):
    """c16p prep: one program = one head and LOOP consecutive groups of C 16-token chunks (NP programs per head,
    1-D grid of H * NP, heads fastest when HEAD_FAST). Intermediates as kda_prep_fwd_kernel.

    Predictions, prep alone at B8 T8K H96 D128 bf16 on the H200 (old prep 12.4 ms; its memory floor ~2.8 ms), from
    sm_90 compiles on a CPU (benchmarks/kda_triton.py --static) and an issue/latency model calibrated on the old
    prep (details and one row per option: PREP16P_SWEEP there; ranges about +-40%):
      old prep: 246 registers -> 2 programs (8 warps) per SM, 10,144 warp-instructions per chunk      12.4 ms
      old structure + two exps instead of four + no chunk table (4 warps, "ieee", chunks-fastest)    8.2 ms
        (166 registers -> 3 programs per SM; most of the gain is occupancy)
      + block inverse on tensor cores 8.0; + heads-fastest grid 7.9
      default: 1 chunk on 2 warps, maxnreg 128 (8 programs / 16 warps per SM, 6,080 instr.)       4.9 ms
      K blocks of 32 on one warp, maxnreg 128 (16 programs per SM, 6,552 instr.)                 5.3 ms
      2 chunks on 4 warps, maxnreg 128 5.9; whole-K tiles without a cap on 2 warps 7.1
      "blkn" +0.2 ms; qk "bf16" -0.1 ms (and ~5e-3 more error: not a default candidate)."""
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
            o_c, m_c, tok, m = _p16_rows(chunk_tok, chunk_end, NC, Tseq, NCT, T0, g0 + j, g0 + LOOP, C, VARLEN,
                                         PIECE)
            _p16_tile_kb(q, k, v, g, beta, dt_bias, o_c, m_c, tok, m, i_h, a2, lb2, scale,
                         qg_out, kd_out, w_out, u_out, aqk_out, eg_out, Ttot, H, K, V, REF, USE_GATE, L2NORM,
                         QK_PREC, INV, KB, VB)
    elif PREFETCH:
        o_c, m_c, tok, m = _p16_rows(chunk_tok, chunk_end, NC, Tseq, NCT, T0, g0, g0 + LOOP, C, VARLEN, PIECE)
        b_q, b_k, b_v, b_f, b_b = _p16_load(q, k, v, g, beta, tok, m, i_h, H, K, V)
        for j in range(LOOP):
            o_c2, m_c2, tok2, m2 = _p16_rows(chunk_tok, chunk_end, NC, Tseq, NCT, T0, g0 + j + 1, g0 + LOOP, C,
                                             VARLEN, PIECE)
            n_q, n_k, n_v, n_f, n_b = _p16_load(q, k, v, g, beta, tok2, m2, i_h, H, K, V)
            _p16_tile(b_q, b_k, b_v, b_f, b_b, o_c, m_c, tok, m, i_h, a2, dtb, lb2, scale,
                      qg_out, kd_out, w_out, u_out, aqk_out, eg_out, Ttot, H, K, V, REF, USE_GATE, L2NORM, QK_PREC,
                      INV)
            o_c, m_c, tok, m = o_c2, m_c2, tok2, m2
            b_q, b_k, b_v, b_f, b_b = n_q, n_k, n_v, n_f, n_b
    else:
        for j in range(LOOP):
            o_c, m_c, tok, m = _p16_rows(chunk_tok, chunk_end, NC, Tseq, NCT, T0, g0 + j, g0 + LOOP, C, VARLEN,
                                         PIECE)
            b_q, b_k, b_v, b_f, b_b = _p16_load(q, k, v, g, beta, tok, m, i_h, H, K, V)
            _p16_tile(b_q, b_k, b_v, b_f, b_b, o_c, m_c, tok, m, i_h, a2, dtb, lb2, scale,
                      qg_out, kd_out, w_out, u_out, aqk_out, eg_out, Ttot, H, K, V, REF, USE_GATE, L2NORM, QK_PREC,
                      INV)
