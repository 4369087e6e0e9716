"""Shared helpers of the KDA chunk backward's kernels (bwd_*.py; imported lazily: needs triton), and the math they implement.

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
def _row_factors(rqk, tok, m, i_h, Ttot, H: tl.constexpr):
    """The L2-norm row factors (rq, rk) the prep stored in rqk [2, H, Ttot] at tokens tok (0 where m is false)."""
    return (tl.load(rqk + i_h * Ttot + tok, mask=m, other=0.),
            tl.load(rqk + (H + i_h) * Ttot + tok, mask=m, other=0.))


@triton.jit
def _dl_slice(cmat, nkp, pc0, pp, rows, cols, b_rows, NKW: tl.constexpr, BT: tl.constexpr):
    """dL = diag(beta) (-tril_-1(dN)) at the index grids rows x cols (any shape), dN = cmat slot 3 + the inter
    partials; b_rows: beta at `rows`."""
    d = tl.load(cmat + pc0 + 3 * BT * BT + rows * BT + cols)
    for j in tl.static_range(NKW):
        d += tl.load(nkp + (pp + j * BT) * BT + rows * BT + cols)
    return tl.where(rows > cols, -d, 0.) * b_rows


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
