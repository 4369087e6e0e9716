"""KDA's causal depthwise short convolution (kernel K = 4, SiLU) as two Triton kernels, forward and backward, for
training and prefill on CUDA: no carried state in or out, optional document resets (`cu_seqlens`, B = 1).

Why: in the compiled `small` training step (H200, B8 T4096, sixth session) the q/k/v convolutions of the 18 KDA
layers ran as Inductor kernels over fp32 shifted copies (cat with a zero history, slice_backward pads): ~34 ms per
step over 54 calls, where reading x and dy and writing y and dx once in bf16 is ~5 ms.

Forward, one program per (BT tokens, BC channels, sequence): y[t] = act(sum_j W[:, j] * x[t - (K-1) + j]), taps
before the token's document start read zero. Backward recomputes the pre-activation at the K shifted positions
t .. t + K-1 it needs (x re-read from cache), then dx[t] = sum_m W[:, K-1-m] * dpre[t + m] (same document) and the
program's partial dW[c, j] = sum_t dpre[t, c] * x[t - (K-1) + j, c], summed over programs in fp32 afterwards
(deterministic, no atomics). Math in fp32; x, y, dx in the activation dtype, dW in the weight's.
Opaque custom ops (`torch.ops.k3.conv1d_fwd/conv1d_bwd`): torch.compile launches them as written (see
activations_triton for why that matters). Selected by `K3_BACKEND=conv:triton` until timed on a GPU.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# (tokens, channels, warps) per program. sm_90 static counts (tests/ops/test_triton_sm90_compile.py compiles
# them; k3.ops.triton_sm90.stats): forward 114 registers, backward 206, no spills; 64 x 128 tiles spilled.
FWD = (32, 64, 4)
BWD = (32, 64, 4)


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
def _conv_bwd_kernel(x, wt, dy, dx, dwp, starts, T, C, sxb, sxt, sdb, sdt, sob, sot, K: tl.constexpr,
                     KP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, VARLEN: tl.constexpr, ACT: tl.constexpr):
    b = tl.program_id(2)
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    xb = x + b.to(tl.int64) * sxb
    db = dy + b.to(tl.int64) * sdb
    kk = tl.arange(0, KP)
    dxa = tl.zeros([BT, BC], dtype=tl.float32)
    dwa = tl.zeros([BC, KP], dtype=tl.float32)
    for m in tl.static_range(K):
        u = t + m                      # dpre at token u feeds dx[t] through tap K-1-m
        um = u < T
        if VARLEN:
            st = tl.load(starts + u, mask=um, other=0).to(tl.int64)
        else:
            st = tl.zeros([BT], dtype=tl.int64)
        pre = tl.zeros([BT, BC], dtype=tl.float32)
        for i in tl.static_range(K):
            src = u - (K - 1) + i
            ok = um & (src >= st)
            xv = tl.load(xb + src[:, None] * sxt + c[None, :], mask=ok[:, None] & cm[None, :],
                         other=0.).to(tl.float32)
            wi = tl.load(wt + c * K + i, mask=cm, other=0.).to(tl.float32)
            pre += xv * wi[None, :]
        g = tl.load(db + u[:, None] * sdt + c[None, :], mask=um[:, None] & cm[None, :], other=0.).to(tl.float32)
        if ACT:
            s = tl.sigmoid(pre)
            g = g * (s + pre * s * (1.0 - s))
        # tap K-1-m of token u reads x[t]: valid when t is in u's document
        okd = um & (t >= st)
        wm = tl.load(wt + c * K + (K - 1 - m), mask=cm, other=0.).to(tl.float32)
        dxa += tl.where(okd[:, None], g * wm[None, :], 0.)
        if m == 0:
            for j in tl.static_range(K):
                src = t - (K - 1) + j
                ok = um & (src >= st)
                xv = tl.load(xb + src[:, None] * sxt + c[None, :], mask=ok[:, None] & cm[None, :],
                             other=0.).to(tl.float32)
                col = tl.sum(g * xv, axis=0)                                  # [BC]
                dwa += tl.where(kk[None, :] == j, col[:, None], 0.)
    tm = t < T
    tl.store(dx + b.to(tl.int64) * sob + t[:, None] * sot + c[None, :], dxa.to(dx.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])
    tile = b * tl.num_programs(0) + tl.program_id(0)
    tl.store(dwp + tile.to(tl.int64) * C * KP + c[:, None] * KP + kk[None, :], dwa, mask=cm[:, None])


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


def conv1d_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, starts: Optional[torch.Tensor], act: bool):
    x, w = _check(x, w)
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    B, T, C = x.shape
    K = w.shape[1]
    KP = triton.next_power_of_2(K)
    dx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    bt, bc, nw = BWD
    nt = triton.cdiv(T, bt)
    dwp = torch.zeros(B * nt, C, KP, device=x.device, dtype=torch.float32)
    if dx.numel():
        grid = (nt, triton.cdiv(C, bc), B)
        _conv_bwd_kernel[grid](x, w, dy, dx, dwp, starts if starts is not None else x, T, C, x.stride(0),
                               x.stride(1), dy.stride(0), dy.stride(1), dx.stride(0), dx.stride(1), K=K, KP=KP,
                               BT=bt, BC=bc, VARLEN=starts is not None, ACT=act, num_warps=nw)
    return dx, dwp.sum(0)[:, :K].to(w.dtype).contiguous()


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
