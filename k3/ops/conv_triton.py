"""KDA's causal depthwise short convolution (kernel K = 4, SiLU) as two Triton kernels, forward and backward, for
training and prefill on CUDA: no carried state in or out, optional document resets (`cu_seqlens`, B = 1).

Why: in the compiled `small` training step (H200, B8 T4096, sixth session) the q/k/v convolutions of the 18 KDA
layers ran as Inductor kernels over fp32 shifted copies (cat with a zero history, slice_backward pads): ~34 ms per
step over 54 calls, where reading x and dy and writing y and dx once in bf16 is ~5 ms.

Forward (any K), one program per (BT tokens, BC channels, sequence): y[t] = act(sum_j W[:, j] * x[t - (K-1) + j]),
taps before the token's document start read zero. Backward (K = 4), one program per (SPAN tokens, BC channels,
sequence), BT tokens at a time: the x tiles at t-3 .. t+3 loaded once, the pre-activation rebuilt at t .. t+3,
dx[t] = sum_m W[:, 3-m] * dpre[t + m] (same document), and the program's partial dW[c, j] = sum_t dpre[t, c] *
x[t - 3 + j, c], summed over programs in fp32 afterwards (deterministic, no atomics). Launch options with BT = 1
run the same math one token row at a time with a rolling window of four x rows and four dpre rows in registers
(each x and dy row read once); triton.autotune picks among both kinds on the first GPU call (`bwd_configs(kind)` lists
each kind, for timing). Math in fp32; x, y, dx in the activation dtype, dW in the weight's.
Opaque custom ops (`torch.ops.k3.conv1d_fwd/conv1d_bwd`): torch.compile launches them as written (see
activations_triton for why that matters). The CUDA default of k3.ops.conv (`K3_BACKEND=conv:torch` for the torch
path).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


# (tokens, channels, warps) per program. sm_90 static counts (tests/ops/test_triton_sm90_compile.py compiles
# them; k3.ops.triton_sm90.stats): forward 114 registers, no spills; 64 x 128 tiles spilled.
FWD = (32, 64, 4)
# The backward: SPAN tokens per program (the partial-dW granularity), BT at a time; its (BT, BC, warps) is picked
# by triton.autotune on the first call on a GPU among BWD_CONFIGS (the first one under the interpreter). All compile
# for sm_90 without spills (CI test): 96-128 registers at 4 elements per thread and tile, ~170 at 8.
# H200, B8 T4096 C1024 bf16 (benchmarks/RESULTS.md, 2026-11-30): the first backward (one 32 x 64 tile per program,
# x re-read at each of 16 tap positions, 206 registers) 0.76 ms; this one 0.377 ms dense / 0.490 varlen with
# (8, 64, 2) picked (the other options 0.49-1.01 ms). The compiled `small` step: 368.8 ms with the torch path
# under Inductor, 360.6 with these kernels.
# BT = 1 launches the rolling backward (_conv4_bwd_roll: one token row at a time, each x and dy row read once; it
# competes in the same autotune, so a GPU's first call keeps the faster). H200, ninth session (B8 T4096 C1024
# bf16): 0.129 ms dense / 0.140 varlen with (1, 256, 4) / (1, 256, 2) picked, against 0.371 / 0.482 for the best
# tiled option (the eighth session's profiled step spent 18.5 ms in the tiled backward over 54 calls).
SPAN = 64
BWD_CONFIGS = [(8, 64, 4), (16, 64, 8), (16, 64, 4), (32, 64, 8), (8, 128, 4), (16, 128, 8), (64, 64, 8),
               (8, 64, 2), (1, 128, 1), (1, 256, 2), (1, 256, 4), (1, 512, 4)]


@triton.jit
def _conv_fwd_kernel(x, wt, y, starts, T, C, sxb, sxt, syb, syt, K: tl.constexpr, BT: tl.constexpr,
                     BC: tl.constexpr, VARLEN: tl.constexpr, ACT: tl.constexpr):
    b = tl.program_id(2)
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm = t < T
    cm = c < C
    if VARLEN:
        st = tl.load(starts + t, mask=tm, other=0).to(tl.int64)
    else:
        st = tl.zeros([BT], dtype=tl.int64)
    xb = x + b.to(tl.int64) * sxb
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        src = t - (K - 1) + j
        ok = tm & (src >= st)
        xv = tl.load(xb + src[:, None] * sxt + c[None, :], mask=ok[:, None] & cm[None, :], other=0.).to(tl.float32)
        wj = tl.load(wt + c * K + j, mask=cm, other=0.).to(tl.float32)
        acc += xv * wj[None, :]
    if ACT:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + b.to(tl.int64) * syb + t[:, None] * syt + c[None, :], acc.to(y.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])


@triton.jit
def _sel(xv, pos, st, VARLEN: tl.constexpr):
    """A [BT, BC] tile of x at positions pos, zero where pos lies before the token's document start st."""
    if VARLEN:
        xv = tl.where((pos >= st)[:, None], xv, 0.)
    return xv


@triton.jit
def _tap(xv, wv, pos, st, VARLEN: tl.constexpr):
    """One tap's product w * x[pos] ([BC] weights times a [BT, BC] tile), within the document."""
    return _sel(xv, pos, st, VARLEN) * wv[None, :]


@triton.jit
def _dact(pre, g, ACT: tl.constexpr):
    """dL/dpre from dL/dy = g at pre-activation pre (SiLU when ACT)."""
    if ACT:
        sg = tl.sigmoid(pre)
        g = g * (sg + pre * sg * (1.0 - sg))
    return g


@triton.jit
def _conv4_bwd_roll(x, dy, dx, dwp, starts, T, C, sxb, sdb, sob, b, c, cm, w0, w1, w2, w3, SXT: tl.constexpr,
                    SDT: tl.constexpr, SOT: tl.constexpr, SPAN: tl.constexpr, BC: tl.constexpr,
                    VARLEN: tl.constexpr, ACT: tl.constexpr):
    """The backward one token row at a time (launch option BT = 1): each x and dy row of the program's span is
    loaded once (plus 3 + 3 rows of overlap with the neighbours) and kept in a rolling window of the last four x
    rows and dpre rows ([BC] fp32 vectors), so global traffic is ~one read of x and dy and one write of dx.
    Row u = s + i: pre[u] = sum_j w_j x[u-3+j] (x before u's document start read as zero), dpre[u] = dy[u] act'(pre),
    dW[:, j] += dpre[u] x[u-3+j] for u in the span, dx[u-3] = w3 dpre[u-3] + w2 dpre[u-2] + w1 dpre[u-1] + w0 dpre[u]
    (each term only when that row's document contains u-3)."""
    s = tl.program_id(0) * SPAN
    px = x + b.to(tl.int64) * sxb + c
    pd = dy + b.to(tl.int64) * sdb + c
    po = dx + b.to(tl.int64) * sob + c
    s64 = s.to(tl.int64)
    sv = s + 0 * c   # row positions as [BC] vectors: masks are vectors (the interpreter refuses scalar ones)
    xa = tl.load(px + (s64 - 3) * SXT, mask=cm & (sv >= 3), other=0.).to(tl.float32)   # x[u-3] at u = s
    xb = tl.load(px + (s64 - 2) * SXT, mask=cm & (sv >= 2), other=0.).to(tl.float32)
    xc = tl.load(px + (s64 - 1) * SXT, mask=cm & (sv >= 1), other=0.).to(tl.float32)
    da = tl.zeros([BC], dtype=tl.float32)   # dpre[u-3], dpre[u-2], dpre[u-1]; their document starts sb, sc
    db = tl.zeros([BC], dtype=tl.float32)
    dc = tl.zeros([BC], dtype=tl.float32)
    sb = s * 0
    sc = s * 0
    dw0 = tl.zeros([BC], dtype=tl.float32)
    dw1 = tl.zeros([BC], dtype=tl.float32)
    dw2 = tl.zeros([BC], dtype=tl.float32)
    dw3 = tl.zeros([BC], dtype=tl.float32)
    for i in range(SPAN + 3):
        u = s + i
        um = (sv + i) < T
        xd = tl.load(px + u.to(tl.int64) * SXT, mask=cm & um, other=0.).to(tl.float32)
        g = tl.load(pd + u.to(tl.int64) * SDT, mask=cm & um, other=0.).to(tl.float32)
        if VARLEN:
            st = tl.load(starts + u, mask=u < T, other=0)
            ya = tl.where(u - 3 >= st, xa, 0.)
            yb = tl.where(u - 2 >= st, xb, 0.)
            yc = tl.where(u - 1 >= st, xc, 0.)
        else:
            st = s * 0
            ya, yb, yc = xa, xb, xc
        dp = _dact(w0 * ya + w1 * yb + w2 * yc + w3 * xd, g, ACT)
        dpo = tl.where(sv + i < s + SPAN, dp, 0.)   # rows past the span: their dW belongs to the next program
        dw0 += dpo * ya
        dw1 += dpo * yb
        dw2 += dpo * yc
        dw3 += dpo * xd
        t = u - 3
        if VARLEN:   # dpre[t+m] reaches x[t] only within t+m's document
            acc = w3 * da + tl.where(sb <= t, w2 * db, 0.) + tl.where(sc <= t, w1 * dc, 0.) \
                + tl.where(st <= t, w0 * dp, 0.)
        else:
            acc = w3 * da + w2 * db + w1 * dc + w0 * dp
        tl.store(po + t.to(tl.int64) * SOT, acc.to(dx.dtype.element_ty),
                 mask=cm & (sv + i >= s + 3) & (sv + i - 3 < T))
        xa, xb, xc = xb, xc, xd
        da, db, dc = db, dc, dp
        sb, sc = sc, st
    base = dwp + (b * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * C * 4 + c * 4
    tl.store(base + 0, dw0, mask=cm)
    tl.store(base + 1, dw1, mask=cm)
    tl.store(base + 2, dw2, mask=cm)
    tl.store(base + 3, dw3, mask=cm)


@triton.jit
def _conv4_bwd_kernel(x, wt, dy, dx, dwp, starts, T, C, sxb, sdb, sob, SXT: tl.constexpr, SDT: tl.constexpr,
                      SOT: tl.constexpr, SPAN: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      VARLEN: tl.constexpr, ACT: tl.constexpr):
    """Kernel size 4. One program: SPAN tokens (BT at a time) x BC channels of one sequence. The x tiles at the
    seven shifts t-3 .. t+3 are each loaded once per BT block (one pointer tile; the shifts are constant offsets,
    the token strides being constexpr) and dpre at t+m (m = 0..3) is rebuilt from them. Writes dx and the
    program's partial dW [BC, 4] (fp32). BT = 1 runs _conv4_bwd_roll instead (one row at a time, rolling window)."""
    b = tl.program_id(2)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    w0 = tl.load(wt + c * 4 + 0, mask=cm, other=0.).to(tl.float32)
    w1 = tl.load(wt + c * 4 + 1, mask=cm, other=0.).to(tl.float32)
    w2 = tl.load(wt + c * 4 + 2, mask=cm, other=0.).to(tl.float32)
    w3 = tl.load(wt + c * 4 + 3, mask=cm, other=0.).to(tl.float32)
    if BT == 1:
        _conv4_bwd_roll(x, dy, dx, dwp, starts, T, C, sxb, sdb, sob, b, c, cm, w0, w1, w2, w3, SXT, SDT, SOT, SPAN,
                        BC, VARLEN, ACT)
    else:
        _conv4_bwd_tiles(x, dy, dx, dwp, starts, T, C, sxb, sdb, sob, b, c, cm, w0, w1, w2, w3, SXT, SDT, SOT, SPAN,
                         BT, BC, VARLEN, ACT)


@triton.jit
def _conv4_bwd_tiles(x, dy, dx, dwp, starts, T, C, sxb, sdb, sob, b, c, cm, w0, w1, w2, w3, SXT: tl.constexpr,
                     SDT: tl.constexpr, SOT: tl.constexpr, SPAN: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     VARLEN: tl.constexpr, ACT: tl.constexpr):
    """The backward on [BT, BC] tiles (launch options with BT > 1): see _conv4_bwd_kernel."""
    dw0 = tl.zeros([BC], dtype=tl.float32)
    dw1 = tl.zeros([BC], dtype=tl.float32)
    dw2 = tl.zeros([BC], dtype=tl.float32)
    dw3 = tl.zeros([BC], dtype=tl.float32)
    r = tl.arange(0, BT)
    for sub in range(SPAN // BT):
        t0 = tl.program_id(0) * SPAN + sub * BT                       # first token of this block
        t = t0 + r
        loc_x = r[:, None] * SXT + c[None, :]                          # int32 offsets inside the block
        px = x + (b.to(tl.int64) * sxb + t0.to(tl.int64) * SXT) + loc_x
        pd = dy + (b.to(tl.int64) * sdb + t0.to(tl.int64) * SDT) + (r[:, None] * SDT + c[None, :])
        xm3 = tl.load(px - 3 * SXT, mask=((t >= 3) & (t - 3 < T))[:, None] & cm[None, :], other=0.).to(tl.float32)
        xm2 = tl.load(px - 2 * SXT, mask=((t >= 2) & (t - 2 < T))[:, None] & cm[None, :], other=0.).to(tl.float32)
        xm1 = tl.load(px - SXT, mask=((t >= 1) & (t - 1 < T))[:, None] & cm[None, :], other=0.).to(tl.float32)
        x0 = tl.load(px, mask=(t < T)[:, None] & cm[None, :], other=0.).to(tl.float32)
        dxa = tl.zeros([BT, BC], dtype=tl.float32)
        for m in tl.static_range(4):
            u = t + m                                  # dpre at token u feeds dx[t] through tap 3-m
            um = u < T
            if VARLEN:
                st = tl.load(starts + u, mask=um, other=0)
            else:
                st = tl.zeros([BT], dtype=tl.int32)
            # the tiles at t+1, t+2, t+3 take the registers of those at t-3, t-2, t-1 once these are used up
            if m == 1:
                xm3 = tl.load(px + SXT, mask=um[:, None] & cm[None, :], other=0.).to(tl.float32)
            if m == 2:
                xm2 = tl.load(px + 2 * SXT, mask=um[:, None] & cm[None, :], other=0.).to(tl.float32)
            if m == 3:
                xm1 = tl.load(px + 3 * SXT, mask=um[:, None] & cm[None, :], other=0.).to(tl.float32)
            # the four taps of token u = t+m read x at t+m-3 .. t+m
            if m == 0:
                pre = _tap(xm3, w0, t - 3, st, VARLEN) + _tap(xm2, w1, t - 2, st, VARLEN) \
                    + _tap(xm1, w2, t - 1, st, VARLEN) + _tap(x0, w3, t, st, VARLEN)
            elif m == 1:
                pre = _tap(xm2, w0, t - 2, st, VARLEN) + _tap(xm1, w1, t - 1, st, VARLEN) \
                    + _tap(x0, w2, t, st, VARLEN) + _tap(xm3, w3, t + 1, st, VARLEN)
            elif m == 2:
                pre = _tap(xm1, w0, t - 1, st, VARLEN) + _tap(x0, w1, t, st, VARLEN) \
                    + _tap(xm3, w2, t + 1, st, VARLEN) + _tap(xm2, w3, t + 2, st, VARLEN)
            else:
                pre = _tap(x0, w0, t, st, VARLEN) + _tap(xm3, w1, t + 1, st, VARLEN) \
                    + _tap(xm2, w2, t + 2, st, VARLEN) + _tap(xm1, w3, t + 3, st, VARLEN)
            g = _dact(pre, tl.load(pd + m * SDT, mask=um[:, None] & cm[None, :], other=0.).to(tl.float32), ACT)
            if m == 0:   # dW[:, j] += sum_t dpre[t] * x[t-3+j] (same document)
                dw0 += tl.sum(_sel(xm3, t - 3, st, VARLEN) * g, axis=0)
                dw1 += tl.sum(_sel(xm2, t - 2, st, VARLEN) * g, axis=0)
                dw2 += tl.sum(_sel(xm1, t - 1, st, VARLEN) * g, axis=0)
                dw3 += tl.sum(x0 * g, axis=0)
                wm = w3
            elif m == 1:
                wm = w2
            elif m == 2:
                wm = w1
            else:
                wm = w0
            if VARLEN:   # tap 3-m of token u reads x[t]: only when t is in u's document
                g = tl.where((t >= st)[:, None], g, 0.)
            dxa += g * wm[None, :]
        po = dx + (b.to(tl.int64) * sob + t0.to(tl.int64) * SOT) + (r[:, None] * SOT + c[None, :])
        tl.store(po, dxa.to(dx.dtype.element_ty), mask=(t < T)[:, None] & cm[None, :])
    base = dwp + (b * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * C * 4 + c * 4
    tl.store(base + 0, dw0, mask=cm)
    tl.store(base + 1, dw1, mask=cm)
    tl.store(base + 2, dw2, mask=cm)
    tl.store(base + 3, dw3, mask=cm)


BWD_KINDS = {"auto": lambda bt: True, "tiles": lambda bt: bt > 1, "roll": lambda bt: bt == 1}


def bwd_configs(kind: str = "auto") -> list:
    """The launch options of the backward: all of BWD_CONFIGS ("auto", what the autotuned kernel below chooses
    from), only the tiled ones ("tiles") or only the rolling ones ("roll", for timing each kind)."""
    kind = kind.strip().lower() or "auto"
    if kind not in BWD_KINDS:
        raise ValueError(f"bwd_configs: kind must be one of {sorted(BWD_KINDS)}, got {kind!r}")
    return [cfg for cfg in BWD_CONFIGS if BWD_KINDS[kind](cfg[0])]


def _bwd_configs():
    from k3.ops.dispatch import triton_interpreting
    cfgs = bwd_configs()
    return [triton.Config(dict(BT=bt, BC=bc), num_warps=nw) for bt, bc, nw in (cfgs[:1] if triton_interpreting()
                                                                                  else cfgs)]


_conv4_bwd_tuned = triton.autotune(configs=_bwd_configs(),
                                   key=["C", "SXT", "SDT", "VARLEN", "ACT"])(_conv4_bwd_kernel)


def token_starts(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """int32 [T]: the first token of each token's document (no host sync)."""
    cu = cu_seqlens.to(torch.int64)
    doc = torch.searchsorted(cu, torch.arange(T, device=cu.device), right=True) - 1
    return cu[doc.clamp(0, cu.numel() - 2)].to(torch.int32)


def _check(x: torch.Tensor, w: torch.Tensor):
    if x.dim() != 3 or w.dim() != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"conv1d triton: x [B, T, C] and weight [C, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous(), w.contiguous()


def conv1d_fwd(x: torch.Tensor, w: torch.Tensor, starts: Optional[torch.Tensor], act: bool) -> torch.Tensor:
    x, w = _check(x, w)
    B, T, C = x.shape
    y = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    if y.numel():
        bt, bc, nw = FWD
        grid = (triton.cdiv(T, bt), triton.cdiv(C, bc), B)
        _conv_fwd_kernel[grid](x, w, y, starts if starts is not None else x, T, C, x.stride(0), x.stride(1),
                               y.stride(0), y.stride(1), K=w.shape[1], BT=bt, BC=bc, VARLEN=starts is not None,
                               ACT=act, num_warps=nw)
    return y


def conv1d_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, starts: Optional[torch.Tensor], act: bool,
               config: Optional[tuple] = None):
    """(dx in x's dtype, dW in w's). `config` (BT, BC, warps) launches one of the backward's launch options
    directly (tests, benchmarks/conv_gpu.py); by default triton.autotune picks among BWD_CONFIGS."""
    x, w = _check(x, w)
    if w.shape[1] != 4:
        raise ValueError(f"conv1d triton backward: kernel size 4 only, got {w.shape[1]} (use the torch backend)")
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    B, T, C = x.shape
    dx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    nt = triton.cdiv(T, SPAN)
    dwp = torch.empty(B * nt, C, 4, device=x.device, dtype=torch.float32)
    if not dx.numel():
        return dx, torch.zeros_like(w)
    args = (x, w, dy, dx, dwp, starts if starts is not None else x, T, C, x.stride(0), dy.stride(0), dx.stride(0))
    kw = dict(SXT=x.stride(1), SDT=dy.stride(1), SOT=dx.stride(1), SPAN=SPAN, VARLEN=starts is not None, ACT=act)
    if config is None:
        _conv4_bwd_tuned[lambda meta: (nt, triton.cdiv(C, meta["BC"]), B)](*args, **kw)
    else:
        bt, bc, nw = config
        _conv4_bwd_kernel[(nt, triton.cdiv(C, bc), B)](*args, BT=bt, BC=bc, num_warps=nw, **kw)
    return dx, dwp.sum(0).to(w.dtype)


@torch.library.custom_op("k3::conv1d_fwd", mutates_args=())
def conv1d_fwd_op(x: torch.Tensor, w: torch.Tensor, starts: Optional[torch.Tensor], act: bool) -> torch.Tensor:
    return conv1d_fwd(x, w, starts, act)


@conv1d_fwd_op.register_fake
def _conv1d_fwd_fake(x, w, starts, act):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("k3::conv1d_bwd", mutates_args=())
def conv1d_bwd_op(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, starts: Optional[torch.Tensor],
                  act: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return conv1d_bwd(x, w, dy, starts, act)


@conv1d_bwd_op.register_fake
def _conv1d_bwd_fake(x, w, dy, starts, act):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(w, memory_format=torch.contiguous_format))


class _Conv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, starts, act):
        ctx.save_for_backward(x, w, starts)
        ctx.act = act
        return torch.ops.k3.conv1d_fwd(x, w, starts, act)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w, starts = ctx.saved_tensors
        dx, dw = torch.ops.k3.conv1d_bwd(x, w, dy, starts, ctx.act)
        return dx, dw, None, None


def causal_conv1d_triton(x_BTC: torch.Tensor, W_CK: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                         activation: Optional[str] = "silu") -> torch.Tensor:
    """y [B, T, C] in x's dtype (no state in or out); what k3.ops.conv.causal_conv1d calls for backend "triton"."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unknown activation {activation!r}")
    starts = token_starts(cu_seqlens, x_BTC.shape[1]) if cu_seqlens is not None else None
    return _Conv1d.apply(x_BTC, W_CK, starts, activation is not None)
