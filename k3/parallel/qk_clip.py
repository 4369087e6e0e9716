"""QK-clip (K2 MuonClip) on FSDP-sharded MLA weights (issue #30 §5).

`k3.train.optim.qk_clip` scales whole q_b_proj / kv_b_proj rows with a plain [rows, 1] tensor, which cannot
multiply a DTensor shard. `sharded_qk_clip` computes the same per-head factors from the per-head max logits
(max-reduced over the data ranks: every rank saw different tokens) and scales each rank's local rows in place
(their global row offset from the DTensor layout), and the fp32 masters where the optimizer keeps them.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from k3.errors import K3ConfigError

__all__ = ["sharded_qk_clip"]


def _local_rows(W):
    """(local tensor, first global row) of a dim-0-sharded DTensor (or a plain tensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if not isinstance(W, DTensor):
        return W, 0
    _, off = compute_local_shape_and_global_offset(W.shape, W.device_mesh, W.placements)
    return W.to_local(), off[0]


@torch.no_grad()
def sharded_qk_clip(model, tau: float = 100.0, group=None, optimizer=None) -> int:
    """Same contract as k3.train.optim.qk_clip (returns the number of clipped heads); `group`: where the max
    logits are reduced (default: the world = all data ranks)."""
    clipped = 0
    for mod in model.modules():
        S = getattr(mod, "last_max_logit", None)
        if S is None:
            continue
        qw, kvw = getattr(mod, "q_b_proj", None) or getattr(mod, "q_proj", None), getattr(mod, "kv_b_proj", None)
        if qw is None or kvw is None:
            continue
        H = int(mod.num_heads)
        n, r, v = int(mod.qk_nope_head_dim), int(mod.qk_rope_head_dim), int(mod.v_head_dim)
        S = S.detach().float().reshape(-1).clone()
        if S.numel() != H:
            raise K3ConfigError(f"last_max_logit has {S.numel()} entries for {H} heads")
        if dist.is_initialized():
            dist.all_reduce(S, op=dist.ReduceOp.MAX, group=group)
        over = S > tau
        k = int(over.sum())
        if k:
            clipped += k
            gamma = torch.where(over, tau / S.clamp_min(1e-30), torch.ones_like(S))
            sq = gamma.sqrt()
            q_scale = torch.cat([sq[:, None].expand(H, n), gamma[:, None].expand(H, r)], 1).reshape(-1)
            kv_scale = torch.cat([sq[:, None].expand(H, n), torch.ones(H, v, device=S.device)], 1).reshape(-1)
            for lin, scale in ((qw, q_scale), (kvw, kv_scale)):
                W = lin.weight
                if W.shape[0] != scale.numel():
                    raise K3ConfigError(f"{type(mod).__name__}: weight rows {W.shape[0]} != {scale.numel()}")
                targets = [W]
                if optimizer is not None and hasattr(optimizer, "master"):
                    M = optimizer.master(W)
                    if M is not W:
                        targets = [M, W]
                src = None
                for T in targets:
                    loc, row0 = _local_rows(T)
                    s = scale[row0:row0 + loc.shape[0]].to(loc.device).view(-1, *([1] * (loc.ndim - 1)))
                    if src is None:
                        loc.copy_((loc.float() * s).to(loc.dtype))
                        src = loc
                    else:   # the parameter becomes the rounding of its scaled master
                        loc.copy_(src.to(loc.dtype))
        mod.last_max_logit = torch.minimum(S, torch.full_like(S, tau))
    return clipped
