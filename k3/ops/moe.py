"""MoE routing and routed-expert compute on stacked expert weights (architecture.md §3.6).

route: fp32 sigmoid scores (logits in fp32 precision, k3/ops/router.py); selection and weights by
k3.ops.router.select_experts (top-k of scores + bias, optionally grouped; weights = the selected *scores*
renormalised, the bias never enters them). experts_forward = three public stages, so that an expert-parallel
all-to-all can go between them without touching the math:
- dispatch_tokens: tokens sorted by expert (rows + a DispatchPlan: per-expert counts / offsets, the permutation);
- compute_experts: one grouped GEMM per projection over stacked [E, in, out] weights (`torch._grouped_mm`), or a
  padded batched GEMM fallback when the shapes are not 16-byte aligned; no Python loop over experts;
- combine_tokens: each expert output (in the activation dtype) times its fp32 weight, summed in fp32, cast back.
packed_experts_forward: the same with MXFP4-packed expert weights (inference): on CUDA one Triton grouped GEMM per
projection dequantising tiles in registers (k3/ops/mxfp4_triton.py), elsewhere dequantised per block of experts.
Permute and unpermute are row gathers whose backward is the gather by the inverse permutation (`_DispatchRows`,
`_PermuteRows`): no index_add / atomics, deterministic, and the k copies of a token's gradient are summed in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from k3.ops import dispatch, f32, fp32_math
from k3.ops.router import router_logits, select_experts

dispatch.register("moe", "grouped_mm", lambda: hasattr(torch, "_grouped_mm"), priority=0)
dispatch.register("moe", "padded_bmm", lambda: True, priority=-1)
dispatch.register("moe", "loop", lambda: True, priority=-10)  # per-token reference; tests only
# the combine and the dispatch backward as Triton row-gather kernels (k3/ops/moe_triton.py): opt-in until timed
dispatch.register("moe_combine", "torch", lambda: True, priority=0)
dispatch.register("moe_combine", "triton", dispatch.triton_runs, priority=-1)
# packed MXFP4 experts (inference): the grouped GEMM dequantising in registers (k3/ops/mxfp4_triton.py) on CUDA,
# the decode-then-GEMM torch path elsewhere
# (the CUDA default for bf16 / fp16: timed against the torch path on the H200, benchmarks/mxfp4_gpu.py)
dispatch.register("moe_packed", "triton", dispatch.triton_runs, priority=1)
dispatch.register("moe_packed", "torch", lambda: True, priority=0)


def route(x_Nd: torch.Tensor, weight_Ed: torch.Tensor, bias_E: Optional[torch.Tensor], top_k: int,
          renormalize: bool = True, scaling: float = 1.0, num_expert_group: int = 1, topk_group: int = 1):
    """Returns (topk_idx [N,k] int64, topk_weight [N,k] fp32, scores [N,E] fp32). Selection and weights:
    k3.ops.router.select_experts."""
    with fp32_math(x_Nd):
        scores_NE = torch.sigmoid(router_logits(x_Nd, weight_Ed))
    topk_idx_Nk, w_Nk = select_experts(scores_NE, bias_E, top_k, renormalize, scaling, num_expert_group,
                                       topk_group)
    return topk_idx_Nk, w_Nk, scores_NE


def _aligned(*dims_dtype) -> bool:
    *dims, dtype = dims_dtype
    el = torch.empty((), dtype=dtype).element_size()
    return all((d * el) % 16 == 0 for d in dims)


def _grouped_ok(x: torch.Tensor, l: int, M2: int) -> bool:
    """torch._grouped_mm covers this call: 16-byte aligned widths, and bf16 on CUDA or under torch.compile (its CUDA
    kernel and its fake-tensor rule take bf16 only; the CPU kernel also runs fp32 eagerly, not fp64)."""
    if x.dtype == torch.float64 or not _aligned(l, M2, M2 // 2, x.dtype):
        return False
    if x.dtype != torch.bfloat16 and (x.is_cuda or torch.compiler.is_compiling()):
        return False
    return True


def _gmm(x_AI, w_EIO, offs_E, counts_E, backend: str):
    if backend == "grouped_mm":
        return torch._grouped_mm(x_AI, w_EIO, offs=offs_E)
    # padded batched GEMM: [E, cap, I] @ [E, I, O]
    E = w_EIO.shape[0]
    cap = int(counts_E.max().item()) if counts_E.numel() else 0
    starts = offs_E.long() - counts_E.long()
    expert_of_a = torch.repeat_interleave(torch.arange(E, device=x_AI.device), counts_E.long())
    slot_a = torch.arange(x_AI.shape[0], device=x_AI.device) - starts[expert_of_a]
    flat = expert_of_a * cap + slot_a
    xp = x_AI.new_zeros(E * cap, x_AI.shape[1]).index_copy(0, flat, x_AI).view(E, cap, -1)
    return torch.bmm(xp, w_EIO).view(E * cap, -1).index_select(0, flat)


class _DispatchRows(torch.autograd.Function):
    """x_Al = x_Nl[order // k] (each token's row once per selected expert, in expert order). Backward: the k
    gradient rows of token n sit at inv[n*k : n*k + k]; gathered and summed in fp32 (index_select's own backward
    is an atomic index_add, in the activation dtype)."""

    @staticmethod
    def forward(ctx, x_Nl, tok_of_a, inv_A, k: int, triton_bwd: bool = False):
        ctx.save_for_backward(inv_A)
        ctx.k, ctx.triton_bwd = k, triton_bwd
        return x_Nl.index_select(0, tok_of_a)

    @staticmethod
    def backward(ctx, g_Al):
        (inv_A,) = ctx.saved_tensors
        if ctx.triton_bwd:
            from k3.ops.moe_triton import gather_rows_sum
            return gather_rows_sum(g_Al, inv_A, ctx.k), None, None, None, None
        g = g_Al.index_select(0, inv_A).view(-1, ctx.k, g_Al.shape[-1])
        return f32(g).sum(1).to(g_Al.dtype), None, None, None, None


class _PermuteRows(torch.autograd.Function):
    """y[idx] for a permutation idx; backward: the gather by its inverse inv (index_select's own backward is an
    index_add)."""

    @staticmethod
    def forward(ctx, y, idx, inv):
        ctx.save_for_backward(inv)
        return y.index_select(0, idx)

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return g.index_select(0, inv), None, None


@dataclass
class DispatchPlan:
    """What `combine_tokens` (and the expert GEMMs) need from `dispatch_tokens`: rows are in expert order.
    order [A] (A = N*k): token-major slot of each expert-ordered row; inv [A]: the inverse permutation (row of
    slot n*k + j); tok_of_row [A]: the token of each row; counts [E] int64 / offsets [E] int32 (cumulative ends)
    per expert; num_tokens N, top_k k; triton: the dispatch backward and the combine run as Triton row gathers."""
    order: torch.Tensor
    inv: torch.Tensor
    tok_of_row: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    num_tokens: int
    top_k: int
    triton: bool = False


def dispatch_tokens(x_Nl: torch.Tensor, topk_idx_Nk: torch.Tensor, num_experts: int,
                    combine_backend: Optional[str] = None):
    """Permute tokens to experts: (x_Al [N*k, l] = each token's row once per selected expert, rows grouped by
    expert in ascending expert order and token order within an expert; the DispatchPlan). Differentiable in x
    (backward: the k gradient rows of each token gathered and summed in fp32). An expert-parallel all-to-all goes
    between this and `compute_experts` (send rows by `plan.counts`)."""
    N, k = topk_idx_Nk.shape
    flat_e = topk_idx_Nk.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    tok_of_a = order // k
    # counts by scatter_add: bincount's output size depends on the data (a host sync on CUDA, a graph break)
    if flat_e.is_cuda or torch.compiler.is_compiling():
        counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat_e.device).scatter_add_(
            0, flat_e, torch.ones_like(flat_e))
    else:  # CPU eager: bincount is much faster than scatter_add_ here, and there is no device sync to avoid
        counts_E = torch.bincount(flat_e, minlength=num_experts)
    offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
    # inverse permutation: slot n*k + j of the token-major layout sits at row inv_A[n*k + j] of the expert order
    inv_A = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    tri = dispatch.resolve("moe_combine", combine_backend, x_Nl.device.type) == "triton"
    x_Al = _DispatchRows.apply(x_Nl, tok_of_a, inv_A, k, tri)
    return x_Al, DispatchPlan(order, inv_A, tok_of_a, counts_E, offs_E, N, k, tri)


def compute_experts(x_Al: torch.Tensor, counts_E: torch.Tensor, offsets_E: torch.Tensor,
                    gate_up_El2M: torch.Tensor, down_EMl: torch.Tensor, glu: Callable,
                    backend: Optional[str] = None, glu_packed: Optional[Callable] = None) -> torch.Tensor:
    """The local experts on rows grouped by expert (counts_E rows for expert e, ending at offsets_E[e], int32):
    y_a = glu(x_a W1_e, x_a W3_e) W2_e, one grouped GEMM per projection (`backend` "grouped_mm" or "padded_bmm";
    "grouped_mm" falls back to "padded_bmm" for shapes / dtypes it does not cover). Output [A, l] in x's dtype."""
    l = x_Al.shape[1]
    M2 = gate_up_El2M.shape[2]
    name = dispatch.resolve("moe", backend, x_Al.device.type)
    if name == "loop":
        name = "padded_bmm"
    if name == "grouped_mm" and not _grouped_ok(x_Al, l, M2):
        name = "padded_bmm"
    h_A2M = _gmm(x_Al, gate_up_El2M.to(x_Al.dtype), offsets_E, counts_E, name)
    if glu_packed is not None:
        a_AM = glu_packed(h_A2M)
    else:
        g, u = h_A2M.chunk(2, dim=-1)
        a_AM = glu(g, u)
    return _gmm(a_AM.contiguous(), down_EMl.to(x_Al.dtype), offsets_E, counts_E, name)


def combine_tokens(y_Al: torch.Tensor, plan: DispatchPlan, topk_w_Nk: torch.Tensor) -> torch.Tensor:
    """Unpermute and combine: out[n] = sum_j w[n, j] * y[row of slot (n, j)], the k terms of a token in slot
    order, in fp32 (weights fp32), cast to y's dtype. Output [N, l]."""
    N, k, l = plan.num_tokens, plan.top_k, y_Al.shape[-1]
    if plan.triton:
        from k3.ops.moe_triton import Combine
        return Combine.apply(y_Al, plan.inv, plan.order, topk_w_Nk).to(y_Al.dtype)
    # unpermute (a gather; its backward gathers by `order`) and combine the k outputs of each token in a fixed
    # order, in fp32
    y_Nkl = _PermuteRows.apply(y_Al, plan.inv, plan.order).view(N, k, l)
    out = (f32(y_Nkl) * f32(topk_w_Nk).unsqueeze(-1)).sum(1)
    return out.to(y_Al.dtype)


def experts_forward(x_Nl: torch.Tensor, topk_idx_Nk: torch.Tensor, topk_w_Nk: torch.Tensor,
                    gate_up_El2M: torch.Tensor, down_EMl: torch.Tensor, glu: Callable,
                    backend: Optional[str] = None, combine_backend: Optional[str] = None,
                    glu_packed: Optional[Callable] = None) -> torch.Tensor:
    """sum_k w[n,k] * W2_e(glu(W1_e x, W3_e x)) for the selected experts e = topk_idx[n,k]. Output [N, l].
    `backend`: the expert GEMMs ("grouped_mm", "padded_bmm", "loop"); `combine_backend`: the combine and the
    dispatch backward ("torch", "triton"); `glu_packed(h)`: the same activation taking the packed [g | u] output
    (k3.ops.activations.situ_glu_packed: one gradient tensor, no concatenation).
    = combine_tokens(compute_experts(dispatch_tokens(...))): the seam for expert parallelism."""
    name = dispatch.resolve("moe", backend, x_Nl.device.type)
    if name == "loop":
        return experts_forward_reference(x_Nl, topk_idx_Nk, topk_w_Nk, gate_up_El2M, down_EMl, glu)
    x_Al, plan = dispatch_tokens(x_Nl, topk_idx_Nk, gate_up_El2M.shape[0], combine_backend)
    y_Al = compute_experts(x_Al, plan.counts, plan.offsets, gate_up_El2M, down_EMl, glu, name, glu_packed)
    return combine_tokens(y_Al, plan, topk_w_Nk).to(x_Nl.dtype)


def experts_forward_reference(x_Nl, topk_idx_Nk, topk_w_Nk, gate_up_El2M, down_EMl, glu):
    """Per-token, per-selected-expert loop (the definition)."""
    N, l = x_Nl.shape
    out = torch.zeros(N, l, dtype=torch.float32, device=x_Nl.device)
    rows = []
    for n in range(N):
        acc = torch.zeros(l, dtype=torch.float32, device=x_Nl.device)
        for j in range(topk_idx_Nk.shape[1]):
            e = int(topk_idx_Nk[n, j])
            h = x_Nl[n] @ gate_up_El2M[e].to(x_Nl.dtype)
            g, u = h.chunk(2, -1)
            y = glu(g, u) @ down_EMl[e].to(x_Nl.dtype)
            acc = acc + f32(y) * f32(topk_w_Nk[n, j])
        rows.append(acc)
    return torch.stack(rows).to(x_Nl.dtype) if rows else out.to(x_Nl.dtype)


# ------------------------------------------------------------------------------------------ packed MXFP4 experts
def packed_experts_forward(x_Nl: torch.Tensor, topk_idx_Nk: torch.Tensor, topk_w_Nk: torch.Tensor,
                           gate_up_packed: torch.Tensor, gate_up_scale: torch.Tensor,
                           down_packed: torch.Tensor, down_scale: torch.Tensor, glu: Callable,
                           block_bytes: int = 32 << 20, backend: Optional[str] = None) -> torch.Tensor:
    """The routed experts with MXFP4 weights kept packed (inference): same math as `experts_forward` on the
    dequantised weights, which are decoded on the fly, one block of *selected* experts at a time, into a scratch
    buffer of at most ~`block_bytes` (docs/architecture.md §4.3; decoding is exact, so results equal the
    dequantise-on-load model's up to GEMM blocking).

    gate_up_packed [E, 2M, l/2] / gate_up_scale [E, 2M, l/32]: W1 (rows 0..M-1) and W3 (rows M..2M-1) as
    [out, in]; down_packed [E, l, M/2] / down_scale [E, l, M/32]: W2. Output [N, l] in x's dtype. No autograd
    through the weights (they are not parameters).

    `backend` (op family "moe_packed"; else K3_BACKEND, else auto): "triton" = one grouped GEMM per projection over
    the dispatched rows that reads the packed bytes and dequantises tiles in registers (k3/ops/mxfp4_triton.py: no
    decoded weight in memory, no host sync; the CUDA default for bf16 / fp16 activations, fp32 on request);
    "torch" = the block decode above (the default elsewhere; other dtypes always)."""
    E, M2, _ = gate_up_packed.shape
    dt = x_Nl.dtype
    name = dispatch.resolve("moe_packed", backend, x_Nl.device.type)
    if name == "triton" and (dt in (torch.bfloat16, torch.float16)
                             or (dt == torch.float32 and (backend or dispatch.env_choice("moe_packed")) == "triton")):
        from k3.ops import mxfp4_triton  # noqa: F401  (registers torch.ops.k3.mxfp4_grouped_mm)
        x_Al, plan = dispatch_tokens(x_Nl, topk_idx_Nk, E)
        h_A2M = torch.ops.k3.mxfp4_grouped_mm(x_Al, plan.offsets, gate_up_packed, gate_up_scale, dt)
        g, u = h_A2M.chunk(2, dim=-1)
        a_AM = glu(g, u).contiguous()
        y_Al = torch.ops.k3.mxfp4_grouped_mm(a_AM, plan.offsets, down_packed, down_scale, dt)
        return combine_tokens(y_Al, plan, topk_w_Nk).to(dt)
    if name == "triton":
        dispatch.log_once("moe_packed", "torch", x_Nl.device.type, f"{dt} activations")
    from k3.checkpoint.mxfp4 import mxfp4_decode
    l = x_Nl.shape[1]
    x_Al, plan = dispatch_tokens(x_Nl, topk_idx_Nk, E)
    counts = plan.counts.tolist()  # host copy: the loop below walks only the experts that got tokens
    starts = [0] * E
    acc = 0
    for e in range(E):
        starts[e], acc = acc, acc + counts[e]
    active = [e for e in range(E) if counts[e]]
    per_expert = (M2 * l + l * (M2 // 2)) * torch.empty((), dtype=dt).element_size()
    step = max(1, block_bytes // max(per_expert, 1))
    y_Al = x_Al.new_empty(x_Al.shape[0], l)
    nb = min(step, len(active))
    buf1 = x_Al.new_empty(nb, M2, l)       # decode scratch, reused by every block of this call
    buf2 = x_Al.new_empty(nb, l, M2 // 2)
    for b0 in range(0, len(active), step):
        blk = active[b0:b0 + step]
        sel = torch.tensor(blk, device=x_Nl.device)
        W1 = mxfp4_decode(gate_up_packed.index_select(0, sel), gate_up_scale.index_select(0, sel), dtype=dt,
                          out=buf1[:len(blk)])
        W2 = mxfp4_decode(down_packed.index_select(0, sel), down_scale.index_select(0, sel), dtype=dt,
                          out=buf2[:len(blk)])
        # the block's experts are consecutive in expert order, so their rows are one contiguous range: one
        # padded batched GEMM per projection over the block (as compute_experts' "padded_bmm")
        r0, r1 = starts[blk[0]], starts[blk[-1]] + counts[blk[-1]]
        cnt = torch.tensor([counts[e] for e in blk], device=x_Nl.device)
        offs = torch.cumsum(cnt, 0).to(torch.int32)
        h = _gmm(x_Al[r0:r1], W1.transpose(1, 2), offs, cnt, "padded_bmm")       # [rows, 2M]
        g, u = h.chunk(2, dim=-1)
        y_Al[r0:r1] = _gmm(glu(g, u).contiguous(), W2.transpose(1, 2), offs, cnt, "padded_bmm")  # [rows, l]
    return combine_tokens(y_Al, plan, topk_w_Nk).to(dt)
