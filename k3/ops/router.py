"""The router's logits x @ W^T in fp32 precision from bf16 activations, as three bf16 tensor-core GEMM terms.

architecture.md §3.6 computes the router in fp32. With bf16 activations x is exact in bf16, and an fp32 W splits into three
bf16 parts W = W1 + W2 + W3 (each the bf16 rounding of what is left; the rest is below 2^-24 |W|). bf16 x bf16
products are exact in fp32, so x @ [W1 | W2 | W3]^T with fp32 accumulation and an fp32 result (cuBLAS's
`mm.dtype` on CUDA), summed over the three blocks, is the fp32 product up to accumulation order. Backward:
dW = dL^T x with dL split the same way (fp32 precision again); dx = dL @ W with two-term splits (dL1 W1 + dL2 W1 +
dL1 W2, ~16 significant bits) rounded once to x's bf16.

Why: on the H200 the compiled `small` step ran the router as fp32 SIMT GEMMs (sm80_xmma_gemm_f32f32 / cutlass
simt_sgemm): ~8.4 ms per step over 23 MoE layers, for 0.3 TFLOP, plus the fp32 copies of x (benchmarks/RESULTS.md,
2026-11-30 profile). Measured there: 377.5 ms per step with the fp32 router (`K3_BACKEND=router:fp32`), 360.6 with
this one; GPU numerics (tests/gpu): logits 1.0e-6 and dW 4.4e-6 from fp64, dx 1.66e-3 = one bf16 rounding.

Dispatch (op family "router"): "fp32" (f32(x) @ f32(W)^T, the reference; CPU default) and "split_bf16" (this
file; the CUDA default for bf16 activations; on CPU it runs with fp32 emulation of the bf16 GEMMs, for tests).
Opaque custom ops (`torch.ops.k3.router_logits` / `router_logits_bwd`) under torch.compile.
"""
from __future__ import annotations

import torch

from k3.ops import dispatch, f32, fp32_math, mm_acc32

dispatch.register("router", "fp32", lambda: True, priority=0)
dispatch.register("router", "split_bf16", lambda: True, priority=10)   # auto only on CUDA (dispatch rule)


def split3(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 a -> bf16 (a1, a2, a3) with a1 + a2 + a3 = a up to 2^-24 |a| (each the rounding of what is left)."""
    a = a.float()
    a1 = a.bfloat16()
    r = a - a1.float()
    a2 = r.bfloat16()
    return a1, a2, (r - a2.float()).bfloat16()


def _sum3(y: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """The three n-wide blocks of y along dim summed, smallest first."""
    a, b, c = torch.split(y, n, dim)
    return (c + b) + a


def _logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    E = w.shape[0]
    if w.dtype == torch.bfloat16:   # the weight is exact in bf16: one term
        return mm_acc32(x, w.t(), torch.float32)
    return _sum3(mm_acc32(x, torch.cat(split3(w)).t(), torch.float32), E, 1)


def _logits_bwd(x: torch.Tensor, w: torch.Tensor, dl: torch.Tensor):
    E = w.shape[0]
    d1, d2, d3 = split3(dl)
    dw = _sum3(mm_acc32(torch.cat([d1, d2, d3], 1).t(), x, torch.float32), E, 0)
    if w.dtype == torch.bfloat16:
        dx = mm_acc32(torch.cat([d1, d2], 1), torch.cat([w, w]), x.dtype)
    else:
        w1, w2, _ = split3(w)
        dx = mm_acc32(torch.cat([d1, d2, d1], 1), torch.cat([w1, w1, w2]), x.dtype)
    return dx, dw.to(w.dtype)


@torch.library.custom_op("k3::router_logits", mutates_args=())
def _logits_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _logits(x, w)


@_logits_op.register_fake
def _logits_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


@torch.library.custom_op("k3::router_logits_bwd", mutates_args=())
def _logits_bwd_op(x: torch.Tensor, w: torch.Tensor, dl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _logits_bwd(x, w, dl)


@_logits_bwd_op.register_fake
def _logits_bwd_fake(x, w, dl):
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(w, memory_format=torch.contiguous_format)


class _SplitLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.ops.k3.router_logits(x, w)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dl):
        x, w = ctx.saved_tensors
        dx, dw = torch.ops.k3.router_logits_bwd(x, w, dl.contiguous())
        return dx, dw


# auto dispatch takes the split only from this many rows: a decode step (a few rows) pays ~10 small kernels per
# layer for the split (W's three parts, concatenations, block sums) where its fp32 GEMM is a few microseconds
SPLIT_MIN_ROWS = 1024


@torch.compiler.assume_constant_result
def _env_forced() -> bool:
    return dispatch.env_choice("router") is not None


def use_split(x_Nd: torch.Tensor, weight_Ed: torch.Tensor, backend=None) -> bool:
    """The "split_bf16" path runs: bf16 activations, an fp32 / bf16 weight, and the backend named (argument or
    K3_BACKEND) or chosen automatically (CUDA) for at least SPLIT_MIN_ROWS rows."""
    if x_Nd.dtype != torch.bfloat16 or weight_Ed.dtype not in (torch.float32, torch.bfloat16):
        return False
    if backend is None and not _env_forced() and x_Nd.shape[0] < SPLIT_MIN_ROWS:
        return False
    return dispatch.resolve("router", backend, x_Nd.device.type) == "split_bf16"


def router_logits(x_Nd: torch.Tensor, weight_Ed: torch.Tensor, backend=None) -> torch.Tensor:
    """fp32 logits [N, E] of x [N, d] against the router weight [E, d]: the three-term bf16 GEMMs where
    `use_split`, else the fp32 (or fp64) product."""
    if use_split(x_Nd, weight_Ed, backend):
        return _SplitLogits.apply(x_Nd, weight_Ed)
    with fp32_math(x_Nd):
        return f32(x_Nd) @ f32(weight_Ed).t()


# ---------------------------------------------------------------------------------------------------- selection
def selection_scores(scores_NE: torch.Tensor, bias_E=None, num_expert_group: int = 1,
                     topk_group: int = 1) -> torch.Tensor:
    """The scores the top-k selection ranks: fp32 `scores + bias` (detached; the bias never enters the weights).
    Grouped selection (`num_expert_group` G > 1, DeepSeek-V3's "noaux_tc"): the E experts form G contiguous groups;
    a group's score is the sum of its two largest biased scores; the best `topk_group` groups are kept and every
    expert of the other groups is set to -inf, so the top-k that follows only picks kept experts."""
    sel_NE = scores_NE.detach() + f32(bias_E) if bias_E is not None else scores_NE.detach()
    if num_expert_group > 1:
        N, E = sel_NE.shape
        G = num_expert_group
        grp_NGm = sel_NE.view(N, G, E // G)
        gscore_NG = grp_NGm.topk(min(2, E // G), dim=-1).values.sum(-1)
        keep_NG = torch.zeros(N, G, dtype=torch.bool, device=sel_NE.device).scatter_(
            1, gscore_NG.topk(topk_group, dim=-1).indices, True)
        sel_NE = grp_NGm.masked_fill(~keep_NG.unsqueeze(-1), float("-inf")).view(N, E)
    return sel_NE


def expert_weights(scores_NE: torch.Tensor, topk_idx_Nk: torch.Tensor, renormalize: bool = True,
                   scaling: float = 1.0) -> torch.Tensor:
    """Combine weights of the selected experts from the (fp32, unbiased) scores: gathered, divided by their sum
    when `renormalize`, times `scaling`. Keeps the gradient path to the scores."""
    w_Nk = scores_NE.gather(1, topk_idx_Nk)
    if renormalize:
        w_Nk = w_Nk / (w_Nk.sum(-1, keepdim=True) + 1e-20)
    return w_Nk * scaling


def select_experts(scores_NE: torch.Tensor, bias_E, top_k: int, renormalize: bool = True, scaling: float = 1.0,
                   num_expert_group: int = 1, topk_group: int = 1):
    """The routing decision (architecture.md §3.6), the one definition used by the router, the static decoder, pinned-routing
    replay (`expert_weights`) and the balancers' cut-offs (`selection_scores`): indices = top-k (sorted,
    descending) of `selection_scores(scores, bias, groups)`; weights = `expert_weights(scores, indices)`.
    Shape-static (no host reads): CUDA-graph capturable. Returns (topk_idx [N, k] int64, topk_w [N, k] fp32)."""
    idx_Nk = torch.topk(selection_scores(scores_NE, bias_E, num_expert_group, topk_group), top_k, dim=-1,
                        sorted=True).indices
    return idx_Nk, expert_weights(scores_NE, idx_Nk, renormalize, scaling)
