"""Chunked linear + cross-entropy whose gradient is formed in the forward pass ("fused linear cross-entropy").

sum over tokens of CE(h W^T, y), ignoring y = -100, in token chunks of C: per chunk the logits [C, V] are formed
once, their fp32 log-sum-exp gives the loss, and the gradient of the summed loss with respect to the logits,
softmax - onehot (zero rows for ignored tokens, rounded to the logits' dtype as autograd's cast would), goes
straight into dh = g W and dW += g^T h (fp32 accumulation). Backward only scales the stored dh / dW by the
incoming gradient. Three GEMMs per chunk instead of four: the checkpointed chunked loss (K3ForCausalLM's eval
path) recomputes each chunk's logits in backward; neither keeps [C, V] logits alive beyond its chunk.
Math: the same as `F.cross_entropy(f32(h W^T), y, reduction="sum")` and its autograd gradient; dW is summed over
chunks in fp32 (the checkpointed path sums chunk gradients in the weight's dtype).
Why: the lm_head of `small` (V = 32768, d = 1024) is ~2.2 TFLOP per GEMM at B8 T4096: ~3.4 ms on the H200 per
recomputation, plus the recomputed log-softmax kernels (~1.4 ms per step in the sixth session's kernel list).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from k3.ops import mm_acc32

IGNORE_INDEX = -100


def ce_chunk_grad(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed CE of the chunk in fp32 (fp64 for fp64 logits), d(sum)/d(logits) in the logits' dtype).
    `k3.compile_model` swaps in a compiled copy (K3ForCausalLM.ce_grad): one pass over the 16-bit logits for the
    statistics, one for g."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    valid = y != IGNORE_INDEX
    yv = torch.where(valid, y, torch.zeros_like(y))
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, yv.unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
    onehot = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == yv.unsqueeze(1)
    g = torch.exp(x - lse.unsqueeze(1)) - onehot.to(x.dtype)
    g = torch.where(valid.unsqueeze(1), g, torch.zeros_like(g))
    return loss, g.to(logits.dtype)


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, y, chunk: int, grad_fn, cdtype: torch.dtype):
        N = h.shape[0]
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(cdtype)
            acc = torch.float64 if cdtype == torch.float64 else torch.float32
            total = torch.zeros((), dtype=acc, device=h.device)
            dh = torch.empty_like(h) if h.requires_grad else h.new_zeros(())     # only what backward returns
            dw = torch.zeros(weight.shape if weight.requires_grad else (), dtype=acc, device=h.device)
            for s in range(0, N, chunk):
                hc = h[s:s + chunk].to(cdtype)
                loss_c, g = grad_fn(hc @ w.t(), y[s:s + chunk])
                total = total + loss_c
                if h.requires_grad:
                    dh[s:s + chunk].copy_(g @ w)
                if weight.requires_grad:
                    dw += mm_acc32(g.t(), hc)
        ctx.save_for_backward(dh, dw)
        ctx.wdtype = weight.dtype
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        dh, dw = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        # the scale (1 / n, accumulation weights) in fp32 at least: rounded to bf16 it would bias every gradient
        sc = torch.promote_types(dh.dtype, torch.float32)
        return ((dh.to(sc) * go.to(sc)).to(dh.dtype) if need_h else None,
                (dw * go.to(dw.dtype)).to(ctx.wdtype) if need_w else None, None, None, None, None)


def linear_cross_entropy_sum(h_Nd: torch.Tensor, weight_Vd: torch.Tensor, y_N: torch.Tensor, chunk: int,
                             grad_fn: Optional[Callable] = None) -> torch.Tensor:
    """Summed CE of h @ weight^T against y (ignore -100), chunks of `chunk` tokens (0: one chunk), gradient formed
    in the forward pass (module doc). The GEMMs run in h's dtype, or autocast's when it is on (as `lm_head(h)`
    would). Only for a loss that is back-propagated: its forward does the backward's GEMMs."""
    if h_Nd.dim() != 2 or weight_Vd.dim() != 2 or h_Nd.shape[1] != weight_Vd.shape[1] \
            or y_N.shape != h_Nd.shape[:1]:
        raise ValueError(f"linear_cross_entropy_sum: h [N, d], weight [V, d], y [N]; got {tuple(h_Nd.shape)}, "
                         f"{tuple(weight_Vd.shape)}, {tuple(y_N.shape)}")
    dev = h_Nd.device.type
    cdtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) and h_Nd.dtype != torch.float64 \
        else h_Nd.dtype
    return _LinearCE.apply(h_Nd, weight_Vd, y_N, int(chunk) or max(1, h_Nd.shape[0]), grad_fn or ce_chunk_grad,
                           cdtype)
