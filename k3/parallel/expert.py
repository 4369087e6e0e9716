"""Expert parallelism for LatentMoE, applied from outside the model (issue #30 §3).

`apply_expert_parallel(model, ep_mesh)` replaces each LatentMoE's `experts` (StackedExperts, [E, ...] weights)
with an `EPExperts` holding only this rank's E/ep experts (rank r of the ep group owns experts
[r·E/ep, (r+1)·E/ep)), and overrides that LatentMoE instance's `forward` so the routed-expert call goes through
`EPExperts.forward`:

    1. sort the (token, expert) pairs by expert (the same sort `experts_forward` does); the rows bound for ep rank r
       are then contiguous;
    2. exchange the per-expert counts (one all-to-all of E int64), then the rows (one all-to-all with uneven
       splits) -- in the routed experts' latent width l, so a token's dispatch costs k·l, not k·d;
    3. run the local experts on the received rows with today's `k3.ops.moe.experts_forward` (each row routed to
       its one local expert with weight 1: the grouped GEMM + SiTU-GLU path of the single-device model);
    4. the reverse all-to-all, then each token's k outputs are combined with its fp32 routing weights in a fixed
       order, as `experts_forward` does.

No capacity factor, nothing dropped. Autograd runs through both all-to-alls (`_AllToAll`: the backward is the
all-to-all with the splits swapped). A rank whose experts receive no rows still produces (zero) gradients for
them, so FSDP's reduce-scatter over the expert group matches on every rank.

Self-contained on purpose: when `experts_forward` is split into dispatch -> compute -> combine, `EPExperts.forward`
becomes dispatch -> all-to-all -> compute -> all-to-all -> combine on those seams and the forward override goes.
"""
from __future__ import annotations

import types
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from k3.errors import K3ConfigError
from k3.ops import f32
from k3.ops.moe import _DispatchRows, _PermuteRows, experts_forward

__all__ = ["EPExperts", "apply_expert_parallel", "is_ep_param", "EP_PARAM_FLAG"]

EP_PARAM_FLAG = "_k3_ep"   # attribute set on EP expert parameters: (ep_rank, ep_size, num_experts)


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single of rows; backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits: list, in_splits: list, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        gi = g.new_empty((sum(ctx.in_splits),) + tuple(g.shape[1:]))
        dist.all_to_all_single(gi, g.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return gi, None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list, in_splits: list, group) -> torch.Tensor:
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class EPExperts(nn.Module):
    """This rank's slice of a StackedExperts: `gate_up_proj` [E/ep, l, 2M], `down_proj` [E/ep, M, l] (parameter
    names as in StackedExperts, so optimizer routing and initialisation are unchanged)."""

    def __init__(self, num_experts: int, latent: int, inter: int, ep_rank: int, ep_size: int, group,
                 device=None, dtype=None):
        super().__init__()
        if num_experts % ep_size:
            raise K3ConfigError(f"ep: num_experts = {num_experts} is not divisible by ep = {ep_size}")
        self.num_experts, self.ep_rank, self.ep_size, self.group = num_experts, ep_rank, ep_size, group
        self.num_local = num_experts // ep_size
        kw = dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, latent, 2 * inter, **kw))
        self.down_proj = nn.Parameter(torch.empty(self.num_local, inter, latent, **kw))
        self.mark_params()

    def mark_params(self) -> None:
        """Flag the current parameter objects as EP slices (again after fully_shard, which replaces them)."""
        for p in (self.gate_up_proj, self.down_proj):
            setattr(p, EP_PARAM_FLAG, (self.ep_rank, self.ep_size, self.num_experts))
            p._k3_ep_group = self.group

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_local

    def extra_repr(self):
        E, l, M2 = self.gate_up_proj.shape
        return (f"local_experts={E} (experts {self.first_expert}..{self.first_expert + E - 1} of "
                f"{self.num_experts}), latent={l}, inter={M2 // 2}, ep={self.ep_size}")

    def forward(self, x_Nl: torch.Tensor, topk_idx_Nk: torch.Tensor, topk_w_Nk: torch.Tensor, glu: Callable,
                backend: Optional[str] = None, glu_packed: Optional[Callable] = None) -> torch.Tensor:
        N, l = x_Nl.shape
        k = topk_idx_Nk.shape[1]
        E, ep, El = self.num_experts, self.ep_size, self.num_local
        flat_e = topk_idx_Nk.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        tok_of_a = order // k
        inv_A = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        counts_E = torch.zeros(E, dtype=torch.int64, device=flat_e.device).scatter_add_(
            0, flat_e, torch.ones_like(flat_e))
        # recv_counts[s, j]: rows ep rank s sends to local expert j
        recv_counts = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts, counts_E, group=self.group)
        both = torch.cat([counts_E.view(ep, El).sum(1), recv_counts.view(ep, El).sum(1)]).tolist()  # one sync
        send_splits, recv_splits = both[:ep], both[ep:]
        x_Al = _DispatchRows.apply(x_Nl, tok_of_a, inv_A, k)
        x_Rl = all_to_all_rows(x_Al, recv_splits, send_splits, self.group)
        gate_up, down = self.gate_up_proj, self.down_proj
        if x_Rl.shape[0]:
            local_e = torch.repeat_interleave(torch.arange(El, device=x_Rl.device).repeat(ep),
                                              recv_counts.to(x_Rl.device))
            ones = torch.ones(x_Rl.shape[0], 1, dtype=torch.float32, device=x_Rl.device)
            y_Rl = experts_forward(x_Rl, local_e[:, None], ones, gate_up, down, glu, backend=backend,
                                   glu_packed=glu_packed)
        else:   # no rows for my experts: still give them (zero) gradients, so every rank reduces the same params
            y_Rl = x_Rl.new_zeros((0, l)) + (gate_up.sum() + down.sum()).to(x_Rl.dtype) * 0
        y_Al = all_to_all_rows(y_Rl, send_splits, recv_splits, self.group)
        y_Nkl = _PermuteRows.apply(y_Al, inv_A, order).view(N, k, l)
        out = (f32(y_Nkl) * f32(topk_w_Nk).unsqueeze(-1)).sum(1)
        return out.to(x_Nl.dtype)


def _ep_latent_moe_forward(self, x_BTd):
    """LatentMoE.forward with the routed experts called as a module (EPExperts)."""
    from k3.ops.activations import situ_glu
    shape = x_BTd.shape
    x_Nd = x_BTd.reshape(-1, shape[-1])
    topk_idx_Nk, topk_w_Nk, _ = self.gate(x_Nd)
    x_Nl = self.routed_expert_down_proj(x_Nd)
    u_Nl = self.experts(x_Nl, topk_idx_Nk, topk_w_Nk, self.glu, backend=self.expert_backend,
                        glu_packed=self.glu_packed if self._glu is situ_glu else None)
    out = self.routed_expert_up_proj(self.routed_expert_norm(u_Nl))
    if self.shared_experts is not None:
        out = out + self.shared_experts(x_Nd)
    return out.view(shape)


def is_ep_param(p) -> bool:
    return getattr(p, EP_PARAM_FLAG, None) is not None


def apply_expert_parallel(model: nn.Module, ep_mesh) -> list:
    """Swap every LatentMoE's experts for this rank's EPExperts slice (see module doc). Run it on the `meta` model
    before FSDP; a materialised model's expert slice is copied over. Returns the EPExperts modules."""
    from k3.nn.moe import LatentMoE, StackedExperts
    group = ep_mesh.get_group()
    ep_size, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    swapped = []
    for name, m in model.named_modules():
        if not isinstance(m, LatentMoE):
            continue
        old = m.experts
        if not isinstance(old, StackedExperts):
            raise K3ConfigError(f"{name}.experts is {type(old).__name__}, expected StackedExperts (applied twice?)")
        E, l, M2 = old.gate_up_proj.shape
        new = EPExperts(E, l, M2 // 2, ep_rank, ep_size, group, device=old.gate_up_proj.device,
                        dtype=old.gate_up_proj.dtype)
        if old.gate_up_proj.device.type != "meta":
            with torch.no_grad():
                sl = slice(new.first_expert, new.first_expert + new.num_local)
                new.gate_up_proj.copy_(old.gate_up_proj[sl])
                new.down_proj.copy_(old.down_proj[sl])
        m.experts = new
        m.forward = types.MethodType(_ep_latent_moe_forward, m)
        swapped.append(new)
    return swapped
