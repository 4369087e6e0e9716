"""Causal depthwise short convolution (KDA's q/k/v conv, kernel 4) with carried state and document resets.

y[t, c] = act( sum_j W[c, j] * x[t - (K-1) + j, c] ), tap K-1 multiplies the current token; history before a
sequence/document start is the carried state (zeros by default). The state is the last K-1 *pre-activation*
inputs, [N, C, K-1], oldest first.

Packed sequences (`cu_seqlens`, B=1) are handled without a Python loop over documents: each document gets its own
K-1-slot prefix (its initial state) in an extended buffer, one depthwise conv runs over the buffer, and the token
outputs are gathered back.

Backends (k3.ops.dispatch, op family "conv"): "torch" (this file; the CPU default) and "triton"
(k3/ops/conv_triton.py: one forward and one backward kernel, for calls without carried state and kernel size 4,
e.g. training; CUDA or Triton's interpreter; the CUDA default). `backend=` or `K3_BACKEND=conv:torch|triton`
chooses.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from k3.ops import dispatch, f32


dispatch.register("conv", "torch", lambda: True, priority=0)
# the CUDA default (auto picks priority > 0 only on CUDA): the compiled `small` step on the H200 was 368.8 ms with
# the torch path under Inductor, 360.6 with the Triton kernels (benchmarks/RESULTS.md, seventh session)
dispatch.register("conv", "triton", dispatch.triton_runs, priority=10)


def _act(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"unknown activation {activation!r}")


def _dwconv(ext_BLC: torch.Tensor, W_CK: torch.Tensor) -> torch.Tensor:
    """Valid depthwise conv along dim 1 as K shifted multiply-adds (much faster than mkldnn's depthwise
    backward on CPU for K=4): out[:, t] = sum_j W[:, j] * ext[:, t + j]."""
    K = W_CK.shape[1]
    L = ext_BLC.shape[1] - K + 1
    y = ext_BLC[:, 0:L] * W_CK[:, 0]
    for j in range(1, K):
        y = y + ext_BLC[:, j:j + L] * W_CK[:, j]
    return y


def causal_conv1d(x_BTC: torch.Tensor, weight: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                  cu_seqlens: Optional[torch.Tensor] = None, activation: Optional[str] = "silu",
                  output_final_state: bool = False, backend: Optional[str] = None):
    """x [B,T,C]; weight [C,1,K] or [C,K]; initial_state [N,C,K-1]. Returns (y [B,T,C] in x.dtype, state|None).
    Math in fp32 (weights are fp32 in the release). `backend`: "torch" | "triton" (calls without state and
    with kernel size 4 only; others take the torch path)."""
    W_CK = weight.reshape(weight.shape[0], -1)
    C, K = W_CK.shape
    B, T, Cx = x_BTC.shape
    if Cx != C:
        raise ValueError(f"causal_conv1d: x has {Cx} channels, weight has {C}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"causal_conv1d: cu_seqlens needs batch size 1, got {B}")
        starts = cu_seqlens[:-1].long()
        N = starts.numel()
    else:
        N = B
    if initial_state is not None and tuple(initial_state.shape) != (N, C, K - 1):
        raise ValueError(f"causal_conv1d: initial_state must be [{N},{C},{K - 1}], got {tuple(initial_state.shape)}")
    if initial_state is None and not output_final_state and activation in (None, "silu", "swish") and K == 4 \
            and dispatch.resolve("conv", backend, x_BTC.device.type) == "triton":
        from k3.ops.conv_triton import causal_conv1d_triton
        return causal_conv1d_triton(x_BTC, W_CK, cu_seqlens, activation), None
    x32 = f32(x_BTC)
    if cu_seqlens is None:
        hist = f32(initial_state).transpose(1, 2) if initial_state is not None else x32.new_zeros(B, K - 1, C)
        ext_BLC = torch.cat([hist, x32], 1)                           # [B, K-1+T, C]
        y = _dwconv(ext_BLC, f32(W_CK))
        state = ext_BLC[:, -(K - 1):].transpose(1, 2).contiguous() if output_final_state else None
        return _act(y, activation).to(x_BTC.dtype), state
    # varlen: token t of document n sits at slot t + (n+1)*(K-1) of the extended buffer
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc_of_t = torch.repeat_interleave(torch.arange(N, device=x_BTC.device), lens)
    tok_slot = torch.arange(T, device=x_BTC.device) + (doc_of_t + 1) * (K - 1)
    ext = x32.new_zeros(T + N * (K - 1), C)
    ext = ext.index_copy(0, tok_slot, x32[0])
    if initial_state is not None:
        pre = (starts + torch.arange(N, device=x_BTC.device) * (K - 1)).unsqueeze(1) + torch.arange(K - 1, device=x_BTC.device)
        ext = ext.index_copy(0, pre.reshape(-1), f32(initial_state).transpose(1, 2).reshape(-1, C))
    y_full = _dwconv(F.pad(ext, (0, 0, K - 1, 0)).unsqueeze(0), f32(W_CK))[0]  # [T+N(K-1), C]
    y = y_full.index_select(0, tok_slot).unsqueeze(0)
    state = None
    if output_final_state:
        ends = cu_seqlens[1:].long() + (torch.arange(N, device=x_BTC.device) + 1) * (K - 1)   # exclusive end slot
        idx = ends.unsqueeze(1) - (K - 1) + torch.arange(K - 1, device=x_BTC.device)
        state = ext.index_select(0, idx.reshape(-1)).view(N, K - 1, C).transpose(1, 2).contiguous()
    return _act(y, activation).to(x_BTC.dtype), state


def causal_conv1d_reference(x_BTC, weight, initial_state=None, activation="silu"):
    """Token loop over one batch of equal-length sequences (the definition)."""
    W = weight.reshape(weight.shape[0], -1).double()
    C, K = W.shape
    B, T, _ = x_BTC.shape
    hist = initial_state.double() if initial_state is not None else torch.zeros(B, C, K - 1, dtype=torch.float64)
    buf = torch.cat([hist, x_BTC.double().transpose(1, 2)], 2)  # [B, C, K-1+T]
    ys = [(buf[:, :, t:t + K] * W).sum(-1) for t in range(T)]
    y = torch.stack(ys, 1)
    return _act(y, activation), buf[:, :, -(K - 1):]
