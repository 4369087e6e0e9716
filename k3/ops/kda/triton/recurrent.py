"""Decode: the token-by-token recurrence, state read and written once (kernel of `fwd.kda_recurrent_fwd`)."""
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
