"""Triton kernels of the KDA chunk backward (imported lazily: needs triton). Design: package docstring.

Per head, a chunk of C (= BT = 64) tokens with state S0 [K, V] at its start, log-decay cumsum G (inclusive,
chunk-local) and G_l = G of the chunk's last row, is (WY/UT form of the delta rule):
    L_ti  = sum_c k_tc k_ic e^(G_tc - G_ic)   (i < t),      N = diag(beta) L,   T = (I + N)^-1,
    Aq_ti = sum_c q_tc k_ic e^(G_tc - G_ic)   (i <= t),
    W = T diag(beta) (k e^G),   U = T diag(beta) v,   u' = U - W S0,
    o = (q e^G) S0 + Aq u',     S_C = e^(G_l) S0 + (k e^(G_l - G))^T u'.
With do (grad of o) and dS (grad of S_C), the chunk's gradients are
    du' = Aq^T do + (k e^(G_l - G)) dS,           dS0 = e^(G_l) dS + (q e^G)^T do - W^T du'   (sequential part)
    dAq = tril(do u'^T),  d(q e^G) = do S0^T,  d(k e^(G_l-G)) = u' dS^T,  dW = -du' S0^T,  dU = du',
    dXv = T^T dU, dXk = T^T dW  (X* = the right-hand sides diag(beta)[k e^G | v]),
    dN = -tril_-1(dXv U^T + dXk W^T),  dL = diag(beta) dN,
    dbeta_t = sum(dXk k e^G)_t + sum(dXv v)_t + sum_i dN_ti L_ti,
and each pairwise matrix M_ti = sum_c a_tc b_ic e^(G_tc - G_ic) sends da = (dM (b e^-G)) e^G to its rows,
db = (dM^T (a e^G)) e^-G to its columns and a da - b db to dG; dg is the suffix sum of dG inside the chunk.

Decays in a 64-token chunk span up to 64*|g| (320 at the K3 bound): every pairwise product is formed per 16-row
tile r with the tile's reference row m_r = 16r + REF, e^(G_t - G_i) = e^(G_t - G_m) e^(G_m - G_i), columns up to the
tile end only. Row factors are <= e^(REF |g|), column factors <= 1 before the tile and <= e^((15 - REF) |g|)
inside it (<= e^40 for g >= -5), so nothing overflows; factors that underflow belong to terms that are < 1e-30.

Layouts: token tensors [Ttot, H, D] (Ttot = B*T, sequences from cu); per-token intermediates of the sequential
passes head-major [H, Ttot, D]; per-chunk states [NC, H, K, V] fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _seq_walk_start, _walk_ids


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; IEEE: exact fp32 products (fp32 inputs), else tensor-core default (tf32/bf16)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _dot_p(a, b, IEEE: tl.constexpr, PREC: tl.constexpr):
    """`_dot` of fp32 operands at low-precision inputs with the tensor-core precision PREC: "tf32" (one pass: both
    operands keep 11 significant bits), or "split_b" (b as its tf32 part plus the rest, two passes: b at ~22 bits, a
    at tf32); fp32 inputs (IEEE) exact as in `_dot`."""
    if PREC == "split_b" and not IEEE:
        b_hi = (b.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        return tl.dot(a, b_hi, input_precision="tf32") + tl.dot(a, b - b_hi, input_precision="tf32")
    else:
        return _dot(a, b, IEEE)


@triton.jit
def _dot_lp(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Dot of the sequential passes (operands in the intermediate dtype). UPCAST (the Triton CPU interpreter, whose
    tl.dot multiplies the raw bits of bf16/fp16 tensors) does the same math in fp32: low-precision products are
    exact in fp32 and tensor cores accumulate in fp32, so only the summation order differs from the GPU."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        # fp32 intermediates: 3-pass tf32 on tensor cores (~fp32 accuracy); "ieee" FMA dots of these [BT, K] x
        # [K, BV] tiles need up to ~290 KB of shared memory on sm_90 (AOT-compiled), over the 227 KB limit
        return tl.dot(a, b, input_precision="tf32x3")
    else:
        return tl.dot(a, b)


@triton.jit
def _dot_split(a, s, dt: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a s for an intermediate-dtype a and an fp32 state s, with s as two intermediate-dtype halves (s_hi = s
    rounded, s_lo = the rounding error, rounded): two low-precision tensor-core products summed in fp32, ~16
    mantissa bits of s where one product against s.to(dt) keeps 8 (and a tf32 product of fp32 operands 11, at
    twice the shared-memory bytes). At fp32 intermediates (IEEE) it is `_dot_lp` of s itself."""
    if IEEE:
        return _dot_lp(a, s, IEEE, UPCAST)
    else:
        s_hi = s.to(dt)
        s_lo = (s - s_hi.to(tl.float32)).to(dt)
        return _dot_lp(a, s_hi, IEEE, UPCAST) + _dot_lp(a, s_lo, IEEE, UPCAST)


@triton.jit
def _dot_s(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Dot of gradient-kernel scratch operands (fp32, or the input dtype with the "input" scratch): `_dot`, in fp32
    under the interpreter (UPCAST: its tl.dot multiplies the raw bits of bf16/fp16 tensors)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return _dot(a, b, IEEE)


@triton.jit
def _gate_x_cols(g, A_log, dt_bias, pk, m_t, i_h, o_k, K: tl.constexpr):
    """Gate pre-activation x = exp(A_log[h]) (f + dt_bias[h]) of a chunk's rows at the columns o_k (pk: their
    addresses; zero rows past the end)."""
    b_f = tl.load(g + pk, mask=m_t[:, None], other=0.).to(tl.float32)
    dtb = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
    return tl.exp(tl.load(A_log + i_h).to(tl.float32)) * (b_f + dtb[None, :])


@triton.jit
def _split_pid(NS: tl.constexpr, INNER: tl.constexpr):
    """(chunk index, split index) of a kernel whose (chunk, head) pairs are split NS ways (K / V column blocks, row
    tiles): INNER, the splits of one chunk are consecutive programs along axis 0 (grid (NC * NS, H)), so that they
    run together and what they all read (u' / du', dAq / dN, T) comes from DRAM once and from L2 after; else the
    split is axis 2 (grid (NC, H, NS)): a chunk's splits run one whole grid sweep apart."""
    if INNER:
        return tl.program_id(0) // NS, tl.program_id(0) % NS
    else:
        return tl.program_id(0), tl.program_id(2)


@triton.jit
def _chunk_start(chunk_tok, chunk_end, beta, H: tl.constexpr, BT: tl.constexpr, NS: tl.constexpr = 1,
                 INNER: tl.constexpr = False):
    """Prologue of the (chunk, head) kernels: program ids, the chunk's token range [t0, t1), row offsets o_t, token
    indices tok (int64) and their mask, the [BT, 1] / [1, BT] row and column indices, and beta of the rows (fp32,
    0 past the end). NS, INNER: a split kernel's grid (`_split_pid`)."""
    i_c, i_s = _split_pid(NS, INNER)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_tok + i_c)
    t1 = tl.load(chunk_end + i_c)
    o_t = tl.arange(0, BT)
    tok = (t0 + o_t).to(tl.int64)
    m_t = tok < t1
    b_b = tl.load(beta + tok * H + i_h, mask=m_t, other=0.).to(tl.float32)
    return i_c, i_h, t0, t1, o_t, tok, m_t, o_t[:, None], o_t[None, :], b_b


@triton.jit
def _ref_row(gcs, i_h, o_kb, t0, t1, g_end, r, Ttot, K: tl.constexpr, TS: tl.constexpr, REF: tl.constexpr):
    """G_m at row tile r's reference row m = r TS + REF from the stored cumsum (gcs), g_end past the sequence end:
    a [BK] load (an L1 / L2 hit), not a reduction of G over its rows (a cross-warp exchange with barriers)."""
    t_ref = t0 + r * TS + REF
    g_ref = tl.load(gcs + (i_h * Ttot + t_ref.to(tl.int64)) * K + o_kb, mask=t_ref + 0 * o_kb < t1, other=0.)
    return tl.where(t_ref < t1, g_ref, g_end)


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
    ~fp32 accurate, "tf32" one pass; the former exact-fp32 FMA dots held whole 64-wide operand rows in registers,
    255 registers and kilobytes of spills per thread in the kernels calling this at K = 128,
    benchmarks/kda_bwd_static.py).

    Split Nm = Nd + No into its TS-diagonal blocks and the rest. Xd = (I + Nd)^-1 = prod_j (I + (-Nd)^(2^j)) by
    repeated squaring (Nd^TS = 0), then with M = Xd No (block-nilpotent, M^(BT/TS) = 0):
    (I + N)^-1 = (I + M)^-1 Xd = prod_j (I + (-M)^(2^j)) Xd."""
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
def _lower_inv_at(Nm, BT: tl.constexpr, TS: tl.constexpr, LOG2_TS: tl.constexpr, LOG2_NB: tl.constexpr,
                  IEEE: tl.constexpr, INV_PREC: tl.constexpr):
    """`_unit_lower_inv` at INV_PREC for low-precision inputs; fp32 inputs (IEEE) always take "tf32x3"."""
    if IEEE:
        return _unit_lower_inv(Nm, BT, TS, LOG2_TS, LOG2_NB, "tf32x3")
    else:
        return _unit_lower_inv(Nm, BT, TS, LOG2_TS, LOG2_NB, INV_PREC)


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
def _last_G(gcs, i_h, o_kb, t0, t1, Ttot, K: tl.constexpr, BT: tl.constexpr):
    """G_l, the stored cumsum (gcs) at the chunk's last token, columns o_kb: a [BK] load (an L1 / L2 hit), not a
    reduction of G over its rows (a cross-warp exchange with a barrier)."""
    t_last = t0 + tl.minimum(t1 - t0, BT) - 1
    return tl.load(gcs + (i_h * Ttot + t_last.to(tl.int64)) * K + o_kb, mask=t_last + 0 * o_kb >= t0, other=0.)


@triton.jit
def _stored_G(gcs, tok, m_t, i_h, o_kb, t0, t1, Ttot, K: tl.constexpr, BT: tl.constexpr):
    """Columns o_kb of a chunk's cumsum G as the prep stored it (gcs, fp32), rows past the sequence end holding G
    of the chunk's last token, and that last row G_l (`_last_G`): ([BT, BK], [BK])."""
    g_end = _last_G(gcs, i_h, o_kb, t0, t1, Ttot, K, BT)
    return _G_rows(gcs, tok, m_t, i_h, o_kb, g_end, Ttot, K), g_end


@triton.jit
def _G_rows(gcs, tok, m, i_h, o_kb, g_end, Ttot, K: tl.constexpr):
    """Rows tok (mask m) of the stored cumsum G at columns o_kb, rows past the sequence end holding g_end (G of the
    chunk's last token: their g is 0)."""
    G = tl.load(gcs + (i_h * Ttot + tok[:, None]) * K + o_kb[None, :], mask=m[:, None], other=0.)
    return tl.where(m[:, None], G, g_end[None, :])


@triton.jit
def _qk_cols(q, k, tok, m_t, i_h, o_kb, rq, rk, H: tl.constexpr, K: tl.constexpr):
    """Columns o_kb of a chunk's q and k (token layout, rows past the end zero) times their L2-norm row factors:
    (pk their addresses, qn, kn)."""
    pk = (tok[:, None] * H + i_h) * K + o_kb[None, :]
    qn = tl.load(q + pk, mask=m_t[:, None], other=0.).to(tl.float32) * rq[:, None]
    kn = tl.load(k + pk, mask=m_t[:, None], other=0.).to(tl.float32) * rk[:, None]
    return pk, qn, kn


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
def _row_factors(rqk, tok, m, i_h, Ttot, H: tl.constexpr):
    """The L2-norm row factors (rq, rk) the prep stored in rqk [2, H, Ttot] at tokens tok (0 where m is false)."""
    return (tl.load(rqk + i_h * Ttot + tok, mask=m, other=0.),
            tl.load(rqk + (H + i_h) * Ttot + tok, mask=m, other=0.))


@triton.jit
def _chunk_matrices(q, k, g, A_log, dt_bias, gcs, b_b, tok, m_t, i_h, t0, t1, scale, lower_bound, Ttot,
                    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, TS: tl.constexpr, REF: tl.constexpr,
                    LOG2_TS: tl.constexpr, LOG2_NB: tl.constexpr, BK: tl.constexpr, USE_GATE: tl.constexpr,
                    L2NORM: tl.constexpr, IEEE: tl.constexpr, INV_PREC: tl.constexpr, REFLOAD: tl.constexpr,
                    FACTOR: tl.constexpr, PTS: tl.constexpr = 16):
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
    Tm = _lower_inv_at(b_b[:, None] * L, BT, TS, LOG2_TS, LOG2_NB, IEEE, INV_PREC)
    return Aq, L, Tm, rq, rk


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
    dXk W^T = -dXv (U - u')^T): gw then adds no part of its own (and with PRE, U is not formed here at all)."""
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


# ---------------------------------------------------------------------------------------------------------------
# Gradient kernels. The prep (pmat + pwu) keeps T, tril_-1(L), tril(Aq) (and without gv's PRE / DNU W and
# k e^(G_l - G)) in fp32, so no chunk is recomputed; the work is split so that each kernel holds few tiles (several
# programs per SM):
#   gv (chunk, head)           value side (`_value_side`): (u', du',) dv, dAq, dN (whole with DNU, else its value
#                              part) and the value part of dbeta
#   gw (chunk, head, K block)  the state side per K block: dW -> dXk, d(q e^G), d(k e^(G_l - G)), their dG terms,
#                              dbeta per K block (and without DNU the partial dN dXk W^T)
#   gi2 (chunk, head, tile, K block) + gfin (chunk, head): the intra-chunk backward from dAq and dL = diag(beta) dN,
#                              dG -> dg (gate), dq, dk through the L2 norm
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def kda_bwd_gv_kernel(v, beta, do, aqf, ws, ks, states, dstates, uns, dus, cmat, cdb, dv, chunk_tok, chunk_end, Ttot,
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


@triton.jit
def _gw_dbeta(cdb, dbp, pp, i_c, i_h, o_t, dbx, H: tl.constexpr, BT: tl.constexpr, ATOMIC: tl.constexpr):
    """gw's part of dbeta for its K block, sum_K dXk k e^G (dbx = dXk k e^G): stored per K block, or ATOMIC added
    into gv's part. Returns that row sum."""
    rs = tl.sum(dbx, 1)
    if ATOMIC:
        tl.atomic_add(cdb + (i_c * H + i_h).to(tl.int64) * BT + o_t, rs, sem="relaxed")
    else:
        tl.store(dbp + pp + o_t, rs)
    return rs


@triton.jit
def kda_bwd_gw_kernel(q, k, gcs, beta, do, ws, states, dstates, uns, dus, cmat, cdb, rqk,
                      x1s, x2s, dgis, nkp, dbp, sqk, chunk_tok, chunk_end, scale, Ttot,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                      BK: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, ATOMIC: tl.constexpr,
                      INNER: tl.constexpr, EPI_ORDER: tl.constexpr, DNW: tl.constexpr, RED: tl.constexpr = False,
                      NSQ: tl.constexpr = 0):
    """State side. One program = one chunk of one head and BK columns of K, with S0 / dS the chunk's stored
    start state / end-state gradient: dW = -du' S0^T, dXk = T^T dW, d(q e^G) = do S0^T, d(k e^(G_l-G)) = u' dS^T
    and sum_V S0 dS. Writes (fp32) x1s = d(q e^G) e^G, x2s = dXk beta e^G + d(k e^(G_l-G)) e^(G_l-G) (the inter-
    chunk parts of d(q scale) and d(kn)), dgis = their dG terms (the G_l one on the last token), and per K block
    nkp = dXk W^T (part of dN) and dbp = sum_K dXk k e^G (part of dbeta); ATOMIC: those two added into gv's dN
    (cmat slot 3) and dbeta part (cdb) instead (fp32 atomics: the sum's order, so its last bits, vary between runs).
    The L2-norm row factors and the cumsum G come from the prep (rqk, gcs); grid order: `_split_pid`. Without DNW
    (gv's DNU: its dN is already whole) no part of dN here, and W is not read. RED (gi2's RED: gi2 then adds its
    terms to these by atomics, without reading them): x1s is stored scaled (d(q scale)), and with NSQ > 0 (the L2
    norm) this block's row sums sum_K qn x1, sum_K kn x2 go into sqk slots NSQ - K / BK + block of [2, NSQ, H,
    Ttot] (gi2's own in the first slots), as gfin's one pass needs them (EPI_ORDER's order)."""
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
            # (the row sums of gw's own terms: sum_K qn x1 is that of dgi's first term, sum_K kn x2 = beta sum_K dbx
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
        rs_dbx = _gw_dbeta(cdb, dbp, pp, i_c, i_h, o_t, dbx, H, BT, ATOMIC)
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
        _gw_dbeta(cdb, dbp, pp, i_c, i_h, o_t, dbx, H, BT, ATOMIC)
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


@triton.jit
def _grad_cols_start(rqk, tok, m_t, i_h, Ttot, H: tl.constexpr, BT: tl.constexpr):
    """Before a chunk's gradient column blocks (`_grad_cols_out`): the rows' L2-norm factors rq, rk (from the prep's
    rqk) and zeroed accumulators s_q, s_k (row sums for the norm's backward) and d_al (the dA_log partial)."""
    rq, rk = _row_factors(rqk, tok, m_t, i_h, Ttot, H)
    z = tl.zeros([BT], dtype=tl.float32)
    return rq, rk, z, z, tl.sum(z, 0)


@triton.jit
def _gate_bwd_rows(g, A_log, dt_bias, dg, dgs, pk, m, i_h, o_kb, lower_bound, K: tl.constexpr,
                   USE_GATE: tl.constexpr):
    """Stores dg of some rows (m: their mask, pk: their token-layout addresses at the columns o_kb) from dgs, the
    gradient w.r.t. the log-decay: through the gate (df) when USE_GATE, else dgs itself. Returns the rows' dA_log
    partial (scalar) and ddt_bias partial per column (0 without the gate)."""
    if USE_GATE:
        x = _gate_x_cols(g, A_log, dt_bias, pk, m, i_h, o_kb, K)
        s = tl.sigmoid(x)
        dx = tl.where(m[:, None], dgs * (lower_bound * s * (1. - s)), 0.)
        df = dx * tl.exp(tl.load(A_log + i_h).to(tl.float32))
        tl.store(dg + pk, df.to(dg.dtype.element_ty), mask=m[:, None])
        return tl.sum(tl.sum(dx * x, 1), 0), tl.sum(df, 0)
    else:
        tl.store(dg + pk, dgs.to(dg.dtype.element_ty), mask=m[:, None])
        z = tl.zeros(dgs.shape, dtype=tl.float32)
        return tl.sum(tl.sum(z, 1), 0), tl.sum(z, 0)


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
    """The L2 norm backward's row sums s_q = sum_K qn dqn, s_k likewise, from gi2's NKI per-K-block partials in sqk
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
def _prep_mats(q, k, g, A_log, dt_bias, aq_out, cmat, aqf, rqk, gcs, i_c, i_h, t0, t1, tok, m_t, b_b, scale,
               lower_bound, Ttot, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, TS: tl.constexpr,
               REF: tl.constexpr, LOG2_TS: tl.constexpr, LOG2_NB: tl.constexpr, BK: tl.constexpr,
               USE_GATE: tl.constexpr, L2NORM: tl.constexpr, IEEE: tl.constexpr, INV_PREC: tl.constexpr,
               REFLOAD: tl.constexpr, FACTOR: tl.constexpr, AQF: tl.constexpr, PTS: tl.constexpr):
    """Prep, chunk-wide part: Aq, L, T and the L2-norm factors (`_chunk_matrices`; INV_PREC: the inverse's
    tensor-core precision at low-precision inputs), stored as T / tril_-1(L) (cmat slots 0, 1), tril(Aq) (aq_out
    in the intermediate dtype for dstates, and with AQF in fp32 (aqf) for gv forming du' itself: without gv's PRE),
    rq, rk (rqk) and the cumsum G (gcs)."""
    o_t = tl.arange(0, BT)
    row = o_t[:, None]
    col = o_t[None, :]
    Aq, L, Tm, rq, rk = _chunk_matrices(q, k, g, A_log, dt_bias, gcs, b_b, tok, m_t, i_h, t0, t1, scale, lower_bound,
                                        Ttot, H, K, BT, TS, REF, LOG2_TS, LOG2_NB, BK, USE_GATE, L2NORM, IEEE,
                                        INV_PREC, REFLOAD, FACTOR, PTS)
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
    """Prep, one K-column block, from the cumsum G pmat stored (gcs): q e^G, k e^(G_l - G), W (intermediate dtype,
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
    # gv forming du' itself (without its PRE)
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
def kda_bwd_pmat_kernel(q, k, g, beta, A_log, dt_bias, aq_out, cmat, aqf, rqk, gcs, chunk_tok, chunk_end, scale,
                        lower_bound, Ttot, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, TS: tl.constexpr,
                        REF: tl.constexpr, LOG2_TS: tl.constexpr, LOG2_NB: tl.constexpr, BK: tl.constexpr,
                        USE_GATE: tl.constexpr, L2NORM: tl.constexpr, IEEE: tl.constexpr, INV_PREC: tl.constexpr,
                        REFLOAD: tl.constexpr, FACTOR: tl.constexpr, AQF: tl.constexpr, PTS: tl.constexpr):
    """Prep part 1 (pmat), per (chunk, head): `_prep_mats` only."""
    i_c, i_h, t0, t1, o_t, tok, m_t, row, col, b_b = _chunk_start(chunk_tok, chunk_end, beta, H, BT)
    _prep_mats(q, k, g, A_log, dt_bias, aq_out, cmat, aqf, rqk, gcs, i_c, i_h, t0, t1, tok, m_t, b_b, scale,
               lower_bound, Ttot, H, K, BT, TS, REF, LOG2_TS, LOG2_NB, BK, USE_GATE, L2NORM, IEEE, INV_PREC, REFLOAD,
               FACTOR, AQF, PTS)


@triton.jit
def kda_bwd_pwu_kernel(q, k, v, beta, qg_out, kd_out, w_out, u_out, eg_out, cmat, ws, ks, gcs, rqk,
                       chunk_tok, chunk_end, scale, Ttot,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                       BK: tl.constexpr, IEEE: tl.constexpr, F32_W: tl.constexpr, F32_K: tl.constexpr,
                       INNER: tl.constexpr, VCOLS: tl.constexpr = True):
    """Prep part 2 (pwu), per (chunk, head, column block j; grid order: `_split_pid`): j < K / BK: `_prep_kcols`
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


# ---------------------------------------------------------------------------------------------------------------
# The intra-chunk backward per tile: gi2 per (chunk, head, 16-row tile, K block)
# computes everything that lands on the tile's rows, reading only [16, BT] slices of dAq / dL; gfin per
# (chunk, head) does what needs whole chunks (the suffix sum of dG, the gate, dbeta, the L2 norm).
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _dl_slice(cmat, nkp, pc0, pp, rows, cols, b_rows, NKW: tl.constexpr, BT: tl.constexpr):
    """dL = diag(beta) (-tril_-1(dN)) at the index grids rows x cols (any shape), dN = cmat slot 3 + the gw
    partials; b_rows: beta at `rows`."""
    d = tl.load(cmat + pc0 + 3 * BT * BT + rows * BT + cols)
    for j in tl.static_range(NKW):
        d += tl.load(nkp + (pp + j * BT) * BT + rows * BT + cols)
    return tl.where(rows > cols, -d, 0.) * b_rows


@triton.jit
def _gi2_blocks(q, k, beta, cmat, nkp, gcs, rqk, g_ref, g_end, b_r, rr, r, i_h, o_kb, t0, t1, pc0, pp, scale, Ttot,
                H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, TS: tl.constexpr, BK: tl.constexpr,
                NKW: tl.constexpr, IEEE: tl.constexpr, PREC: tl.constexpr = "tf32"):
    """gi2's BLK products for row tile r (rows rr, beta b_r, reference-row G g_ref), block by block of TS rows:
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
def kda_bwd_gi2_kernel(q, k, g, beta, A_log, dt_bias, cmat, nkp, gcs, rqk, x1s, x2s, dgis, dq, dk, dg, dal_part,
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
    then adds them to gw's terms (x1s: d(q scale) -> pre-norm dq, x2s: pre-norm dk, dgis: dG). Tiles go last to first.
    FIN (needs all of a chunk's tiles in the program, TPP = BT / TS) also finishes the columns (what gfin does
    otherwise; 7.23 ms vs 3.46 + 1.67 for gi2 + gfin on the H200, tenth session: off by default): dG -> dg by the suffix
    sum carried across the tiles, the gate (dg, this block's dA_log / ddt_bias partials), and dq / dk, or with the L2
    norm the pre-norm dq / dk in x1s / x2s plus this K block's row sums sum(qn dqn), sum(kn dkn) in sqk [2, K / BK, H,
    Ttot]; dgis is then not written. SQK (without FIN, with the L2 norm): those row sums into sqk as well, so that
    gfin finishes dq / dk in the same pass over the columns as dg (its ONEPASS). BLK (the default at one tile per
    program; any TPP, FIN too): each tile's products walk the chunk in TS-row blocks, only those its causal rows /
    columns reach (blocks <= r for the row side, >= r for the column side: on average 2.5 of 4 each), with [TS, BK]
    operands loaded per block in a loop (pipelined at num_stages > 1; 1 stage measured fastest) instead of [BT, BK]
    chunk tiles masked per tile. RED (not with FIN; gw's RED): the tile's terms are added into x1s / x2s / dgis by
    fp32 atomic adds (one per element: the sum is gw's + gi2's, so the result does not depend on the order), never
    read back, so no load latency sits at the tile's end; SQK then stores row sums of its own terms only (gw stores
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
            dqa, dka, dca = _gi2_blocks(q, k, beta, cmat, nkp, gcs, rqk, g_ref, g_end, b_r, rr, r, i_h, o_kb, t0, t1,
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


@triton.jit
def kda_bwd_gfin_kernel(q, k, g, beta, A_log, dt_bias, cmat, cdb, nkp, dbp, x1s, x2s, dgis, rqk, sqk,
                        dq, dk, dg, dbeta, dal_part, ddt_part, chunk_tok, chunk_end, scale, lower_bound, Ttot,
                        H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, NKW: tl.constexpr,
                        NDB: tl.constexpr, USE_GATE: tl.constexpr, L2NORM: tl.constexpr, FUSED: tl.constexpr,
                        NKI: tl.constexpr, ONEPASS: tl.constexpr):
    """After gi2: per chunk and head, dbeta (value part + gw's NDB partials + sum_i dN_ti L_ti; dN with gw's NKW
    partials), and per BK columns dG -> dg (suffix sum, gate), dq / dk from the pre-norm gradients gi2 left in x1s /
    x2s. FUSED (gi2 finished the columns): with the L2 norm only dq / dk from x1s / x2s and gi2's NKI row-sum
    partials in sqk. ONEPASS (gi2's SQK wrote those partials, with gi2's RED gw some of the NKI too; with the L2
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
