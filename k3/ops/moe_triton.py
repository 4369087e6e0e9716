"""The MoE combine and the dispatch backward as Triton row-gather kernels (CUDA; Triton's interpreter in tests).

Both are out[n] = sum_j w[n, j] * y[idx[n*k + j]] over the k rows of token n in expert order (w = 1 for the
dispatch backward), summed in fp32, written once in the activation dtype. Why: in the compiled `small` step (H200,
B8 T4096, sixth session) Inductor's fused gather + fp32 sum kernels took 0.36 ms (combine) and 0.32 ms (dispatch
backward) per MoE layer for [262144, 512] bf16 rows, ~3x what moving the rows once costs (~0.12 ms).
The combine's backward: dy[a] = w[order[a]] * dout[order[a] // k] (the same gather kernel with k = 1) and
dw[n, j] = <dout[n], y[idx[n*k + j]]> (`gather_dot`: the dout tile loaded once, the k rows reduced against it).
H200 (seventh session): the first version (dy as torch ops, which Inductor fused inside the compiled backward
graph; gather_dot re-reading dout once per expert in 128-column pieces over 2048 programs) made the compiled step
17 ms slower than Inductor's combine; the cause was not measured. Both pieces were rewritten (dy through the
gather kernel, gather_dot with one dout load); eighth session (benchmarks/moe_gpu.py): the kernels run at 3.2-5.7
TB/s and the combine forward takes 0.083 ms against Inductor's 0.351, but the compiled step moved by -2.1 ms,
inside its run-to-run spread.
Opaque custom ops (`torch.ops.k3.moe_gather_sum`, `k3.moe_gather_dot`); backend "triton" of the dispatch family
"moe_combine" (k3/ops/moe.py), opt-in (`K3_BACKEND=moe_combine:triton`): its step-level gain is not established.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BN, BL, NW = 16, 128, 4     # tokens, channels, warps per program (gather_sum)
DOT_ROWS = 4096            # gather_dot: BN * next_pow2(width) elements per program, 4 warps (BN = 8 at width 512)


@triton.jit
def _gather_sum_kernel(m_y, m_idx, m_w, m_out, n_tok, width, s_y, s_o, KT: tl.constexpr, HAS_W: tl.constexpr,
                       BN: tl.constexpr, BL: tl.constexpr):
    n = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    c = tl.program_id(1) * BL + tl.arange(0, BL)
    nm = n < n_tok
    m = nm[:, None] & (c < width)[None, :]
    acc = tl.zeros([BN, BL], dtype=tl.float32)
    for j in tl.static_range(KT):
        row = tl.load(m_idx + n * KT + j, mask=nm, other=0).to(tl.int64)
        v = tl.load(m_y + row[:, None] * s_y + c[None, :], mask=m, other=0.).to(tl.float32)
        if HAS_W:
            v = v * tl.load(m_w + n * KT + j, mask=nm, other=0.).to(tl.float32)[:, None]
        acc += v
    tl.store(m_out + n[:, None] * s_o + c[None, :], acc.to(m_out.dtype.element_ty), mask=m)


@triton.jit
def _gather_dot_kernel(m_y, m_idx, m_d, m_dots, n_tok, width, s_y, s_d, KT: tl.constexpr, KP: tl.constexpr,
                       BN: tl.constexpr, BW: tl.constexpr):
    """dots[n, j] = <d[n], y[idx[n*k + j]]>: the d tile [BN, BW] (BW >= width, a power of two) is loaded once and
    the k gathered rows are reduced against it."""
    n = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    nm = n < n_tok
    c = tl.arange(0, BW)
    m = nm[:, None] & (c < width)[None, :]
    g = tl.load(m_d + n[:, None] * s_d + c[None, :], mask=m, other=0.).to(tl.float32)
    kk = tl.arange(0, KP)
    acc = tl.zeros([BN, KP], dtype=tl.float32)
    for j in tl.static_range(KT):
        row = tl.load(m_idx + n * KT + j, mask=nm, other=0).to(tl.int64)
        v = tl.load(m_y + row[:, None] * s_y + c[None, :], mask=m, other=0.).to(tl.float32)
        acc += tl.where(kk[None, :] == j, tl.sum(v * g, axis=1)[:, None], 0.)
    tl.store(m_dots + n[:, None] * KT + kk[None, :], acc, mask=nm[:, None] & (kk < KT)[None, :])


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gather_sum(y: torch.Tensor, idx: torch.Tensor, w: Optional[torch.Tensor], k: int,
               out_dtype: torch.dtype) -> torch.Tensor:
    """[N, L] = sum_j w[n, j] * y[idx[n*k + j]] (w None: 1), fp32 sums; idx [N*k] int, w [N, k]."""
    y = _rows(y)
    N, L = idx.numel() // k, y.shape[1]
    out = torch.empty(N, L, device=y.device, dtype=out_dtype)
    if out.numel():
        grid = (triton.cdiv(N, BN), triton.cdiv(L, BL))
        _gather_sum_kernel[grid](y, idx.contiguous(), w.contiguous() if w is not None else y, out, N, L,
                                 y.stride(0), out.stride(0), KT=k, HAS_W=w is not None, BN=BN, BL=BL,
                                 num_warps=NW)
    return out


def gather_dot(y: torch.Tensor, idx: torch.Tensor, d: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 [N, k]: <d[n], y[idx[n*k + j]]>."""
    y, d = _rows(y), _rows(d)
    N, L = d.shape
    out = torch.empty(N, k, device=y.device, dtype=torch.float32)
    if out.numel():
        bw = triton.next_power_of_2(L)
        bn = max(1, min(64, DOT_ROWS // bw))
        _gather_dot_kernel[(triton.cdiv(N, bn),)](y, idx.contiguous(), d, out, N, L, y.stride(0), d.stride(0),
                                                  KT=k, KP=triton.next_power_of_2(k), BN=bn, BW=bw, num_warps=NW)
    return out


@torch.library.custom_op("k3::moe_gather_sum", mutates_args=())
def gather_sum_op(y: torch.Tensor, idx: torch.Tensor, w: Optional[torch.Tensor], k: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    return gather_sum(y, idx, w, k, out_dtype)


@gather_sum_op.register_fake
def _gather_sum_fake(y, idx, w, k, out_dtype):
    return torch.empty(idx.shape[0] // k, y.shape[1], device=y.device, dtype=out_dtype)


@torch.library.custom_op("k3::moe_gather_dot", mutates_args=())
def gather_dot_op(y: torch.Tensor, idx: torch.Tensor, d: torch.Tensor, k: int) -> torch.Tensor:
    return gather_dot(y, idx, d, k)


@gather_dot_op.register_fake
def _gather_dot_fake(y, idx, d, k):
    return torch.empty(d.shape[0], k, device=y.device, dtype=torch.float32)


class Combine(torch.autograd.Function):
    """out [N, l] (y's dtype) = sum_j w[n, j] * y_Al[inv[n*k + j]] in fp32; `order` is the inverse of `inv`."""

    @staticmethod
    def forward(ctx, y_Al, inv_A, order_A, w_Nk):
        k = w_Nk.shape[1]
        ctx.save_for_backward(y_Al, inv_A, order_A, w_Nk)
        return torch.ops.k3.moe_gather_sum(y_Al, inv_A, w_Nk, k, y_Al.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        y_Al, inv_A, order_A, w_Nk = ctx.saved_tensors
        k = w_Nk.shape[1]
        dy = None
        if ctx.needs_input_grad[0]:   # dy[a] = w[order[a]] * dout[order[a] // k]: the same kernel, one row each
            dy = torch.ops.k3.moe_gather_sum(dout, order_A // k, w_Nk.reshape(-1).index_select(0, order_A)
                                             .unsqueeze(1), 1, y_Al.dtype)
        dw = torch.ops.k3.moe_gather_dot(y_Al, inv_A, dout, k).to(w_Nk.dtype) if ctx.needs_input_grad[3] else None
        return dy, None, None, dw


def gather_rows_sum(g_Al: torch.Tensor, inv_A: torch.Tensor, k: int) -> torch.Tensor:
    """The dispatch backward: [N, l] = sum_j g_Al[inv[n*k + j]] in fp32, g's dtype."""
    return torch.ops.k3.moe_gather_sum(g_Al, inv_A, None, k, g_Al.dtype)
