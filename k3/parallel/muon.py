"""Per-head Muon on FSDP/EP-sharded parameters (issue #30 §5).

Newton–Schulz needs whole matrices (whole heads, whole experts), but FSDP2 keeps dim-0 shards. `ShardedMuonAdamW`
is `k3.train.optim.MuonAdamW` with the orthogonalisation distributed over each sharding group:

    1. momentum on the local shards (elementwise, as before; the buffers are DTensors like the parameters);
    2. every Muon tensor gets an owner rank in its sharding group (largest first, round-robin);
    3. one all-to-all per group sends each shard to its tensor's owner, which rebuilds the whole matrices;
    4. each owner orthogonalises its tensors with `k3.train.optim.orthogonalize_many` (the single-process
       per-head / per-expert block code, batched over the owned tensors of one block shape);
    5. one all-to-all sends every rank its rows of the results; the update is applied to the local shards.

So each rank orthogonalises about 1/W of the matrices, and the bytes moved are two copies of the Muon parameters,
like one FSDP all-gather + reduce-scatter. HSDP replicas (Replicate mesh dims) each do the same work. Routed expert
tensors under EP are [E/ep, ...] slices sharded over `efsdp`; their blocks are per expert, so orthogonalising the
slice is orthogonalising those experts. The result equals single-process Muon up to fp32 rounding of the batched
Newton–Schulz. AdamW groups are untouched (they run on the DTensor shards directly).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from k3.errors import K3ConfigError
from k3.train.optim import MuonAdamW, orthogonalize_many

__all__ = ["ShardedMuonAdamW", "build_sharded_optimizer", "orthogonalize_sharded"]


def _shard_info(u):
    """(mesh, mesh dim of the Shard(0) placement) of a DTensor, or None for a plain tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    if not isinstance(u, DTensor):
        return None
    dims = [i for i, pl in enumerate(u.placements) if isinstance(pl, Shard)]
    others = [pl for pl in u.placements if not isinstance(pl, (Shard, Replicate))]
    if len(dims) > 1 or others or (dims and u.placements[dims[0]].dim != 0):
        raise K3ConfigError(f"sharded Muon: placements {u.placements} not supported (one Shard(0) + Replicate)")
    if not dims:
        return None
    return u.device_mesh, dims[0]


def orthogonalize_sharded(us: list, orthos: list, steps: int = 5, dtype=None) -> list:
    """orthogonalize_many() of DTensor (or plain) tensors `us`; returns fp32 DTensors with each input's layout.
    Collective over every sharding group involved: every rank of a group must call it with the same tensors."""
    from torch.distributed.tensor import DTensor
    outs: list = [None] * len(us)
    by_group: dict = {}
    plain = []
    for i, u in enumerate(us):
        info = _shard_info(u)
        if info is None:
            plain.append(i)
        else:
            mesh, d = info
            by_group.setdefault((id(mesh), d), (mesh, d, []))[2].append(i)
    if plain:
        res = orthogonalize_many([us[i].full_tensor() if isinstance(us[i], DTensor) else us[i] for i in plain],
                                 [orthos[i] for i in plain], steps=steps, dtype=dtype)
        for i, o in zip(plain, res):
            u = us[i]
            outs[i] = (DTensor.from_local(o, u.device_mesh, u.placements, run_check=False)
                       if isinstance(u, DTensor) else o)
    for _, (mesh, d, idx) in sorted(by_group.items(), key=lambda kv: kv[0][1]):
        _orthogonalize_group(us, orthos, idx, mesh, d, steps, dtype, outs)
    return outs


def _orthogonalize_group(us, orthos, idx, mesh, d, steps, dtype, outs):
    from torch.distributed.tensor import DTensor
    group = mesh.get_group(d)
    W, me = mesh.size(d), mesh.get_local_rank(d)
    dev = us[idx[0]].to_local().device
    # owners: largest first, round-robin (deterministic on every rank of the group)
    order = sorted(idx, key=lambda i: (-us[i].numel(), i))
    owner = {i: n % W for n, i in enumerate(order)}
    geo = {}
    for i in idx:
        S = tuple(us[i].shape)
        c = math.ceil(S[0] / W)
        rest = math.prod(S[1:])
        geo[i] = (S, c, rest)

    def padded_local(i):
        S, c, rest = geo[i]
        loc = us[i].to_local().float().reshape(-1, rest)
        if loc.shape[0] < c:
            loc = torch.cat([loc, loc.new_zeros(c - loc.shape[0], rest)])
        return loc.reshape(-1)

    mine = [i for i in idx if owner[i] == me]
    size_of = {o: sum(geo[i][1] * geo[i][2] for i in idx if owner[i] == o) for o in range(W)}
    # 1. shards -> owners
    send = torch.cat([padded_local(i) for o in range(W) for i in idx if owner[i] == o] or
                     [torch.zeros(0, device=dev)])
    recv = torch.empty(W * size_of[me], device=dev)
    dist.all_to_all_single(recv, send, [size_of[me]] * W, [size_of[o] for o in range(W)], group=group)
    recv = recv.view(W, size_of[me]) if size_of[me] else recv.view(W, 0)
    fulls, off = [], 0
    for i in mine:
        S, c, rest = geo[i]
        part = recv[:, off:off + c * rest].reshape(W * c, rest)[:S[0]]
        fulls.append(part.reshape(S))
        off += c * rest
    # 2. owners orthogonalise their whole tensors (single-process block code)
    res = orthogonalize_many(fulls, [orthos[i] for i in mine], steps=steps, dtype=dtype) if mine else []
    # 3. rows -> every rank
    back = []
    for s in range(W):
        for i, o in zip(mine, res):
            S, c, rest = geo[i]
            flat = o.reshape(S[0], rest)
            if flat.shape[0] < W * c:
                flat = torch.cat([flat, flat.new_zeros(W * c - flat.shape[0], rest)])
            back.append(flat[s * c:(s + 1) * c].reshape(-1))
    send2 = torch.cat(back) if back else torch.zeros(0, device=dev)
    recv2 = torch.empty(sum(size_of[o] for o in range(W)), device=dev)
    dist.all_to_all_single(recv2, send2, [size_of[o] for o in range(W)], [size_of[me]] * W, group=group)
    off = 0
    for o in range(W):
        for i in idx:
            if owner[i] != o:
                continue
            S, c, rest = geo[i]
            u = us[i]
            n_loc = u.to_local().shape[0]
            loc = recv2[off:off + c * rest].view(c, rest)[:n_loc].reshape(u.to_local().shape)
            outs[i] = DTensor.from_local(loc, u.device_mesh, u.placements, shape=u.shape, stride=u.stride(),
                                         run_check=False)
            off += c * rest


class ShardedMuonAdamW(MuonAdamW):
    """MuonAdamW for sharded (DTensor) parameters: Muon's Newton–Schulz distributed as described in the module
    doc; everything else as MuonAdamW. Build it with `build_sharded_optimizer` (same arguments as
    k3.train.optim.build_optimizer)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        if self.fused:
            raise K3ConfigError("sharded Muon: the fused Triton Muon step (K3_MUON_FUSED=1) is single-device only")

    def _muon_groups(self, groups: list) -> None:
        # every rank must reach the same collectives: keep params without grads (zero momentum step) out only if
        # they lack grads everywhere -- with FSDP every sharded param gets a (possibly zero) grad on every rank
        todo = [(g, *self._momentum(g)) for g in groups]
        todo = [t for t in todo if t[1]]
        for steps in sorted({g["ns_steps"] for g, _, _ in todo}):
            part = [t for t in todo if t[0]["ns_steps"] == steps]
            dirs = iter(orthogonalize_sharded([u for _, _, us in part for u in us],
                                              [g["ortho"] for g, ps, _ in part for _ in ps], steps=steps,
                                              dtype=self.ns_dtype))
            for group, ps, _ in part:
                self._apply(ps, [next(dirs) for _ in ps], group["lr"], group["weight_decay"])


def build_sharded_optimizer(model, **kw) -> ShardedMuonAdamW:
    """k3.train.optim.build_optimizer's groups, as a ShardedMuonAdamW (fused Muon off)."""
    from k3.train.optim import build_optimizer
    kw.setdefault("fused", False)
    opt = build_optimizer(model, **kw)
    groups = []
    for g in opt.param_groups:
        g = dict(g)
        names = g.pop("param_names", None)
        g["params"] = list(zip(names, g["params"])) if names else list(g["params"])
        groups.append(g)
    sharded = ShardedMuonAdamW(groups, lr=opt.defaults["lr"], weight_decay=opt.defaults["weight_decay"],
                               momentum=opt.defaults["momentum"], nesterov=opt.defaults["nesterov"],
                               ns_steps=opt.defaults["ns_steps"], betas=opt.defaults["betas"],
                               eps=opt.defaults["eps"], ns_dtype=opt.ns_dtype, master_weights=opt.master_weights,
                               fused=False)
    return sharded
