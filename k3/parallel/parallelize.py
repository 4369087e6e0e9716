"""Parallelise a K3ForCausalLM from outside (issue #30 §2): EP, activation checkpointing, torch.compile, FSDP2.

    dims = ParallelDims(dp_shard=-1, ep=2, world_size=dist.get_world_size(), num_experts=cfg.num_experts)
    pm = build_mesh(dims, "cuda")
    model = build_meta_model(cfg)                        # no storage anywhere
    parallelize_model(model, pm, param_dtype=torch.bfloat16)
    materialize(model, "cuda", seed=0)                   # each rank allocates and initialises its shards only
    ...
    out = model(ids, labels=labels)
    loss = global_mean_loss(out, pm)                     # this rank's share of the mean over ALL target tokens
    loss.backward()                                      # FSDP sums gradient shards over the data ranks
    clip_grad_norm_(model.parameters(), 1.0)             # global norm over DTensor grads of every mesh

FSDP2 units: each decoder layer (and, under EP, its routed experts on their own `expert_fsdp` mesh), the
embedding, [final norm + lm_head] (kept unsharded from the norm's forward until the loss has read lm_head.weight),
the root (the AttnRes output mix). `MixedPrecisionPolicy(param_dtype, reduce_dtype)`: bf16 params / fp32 reduce on
CUDA by default, fp32 on CPU.

Gradient reduction is a SUM over data ranks (`set_gradient_divide_factor(1)`): the loss of each rank is already
its share of the global mean (local sum / global token count), so the summed gradient is exactly the gradient of
the global-batch loss -- also for the routed experts under EP, whose gradient arrives through the all-to-all from
every rank of the ep group and is then summed over `efsdp`.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from k3.errors import K3ConfigError
from k3.parallel.expert import EP_PARAM_FLAG, apply_expert_parallel, is_ep_param
from k3.parallel.mesh import ParallelMesh

__all__ = ["build_meta_model", "parallelize_model", "materialize", "init_weights", "load_full_state_dict",
           "gather_full", "full_state_dict", "global_token_count", "global_mean_loss", "clip_grad_norm_"]


def build_meta_model(cfg) -> nn.Module:
    """K3ForCausalLM on the `meta` device (shapes only, nothing allocated, no init)."""
    from k3.model import K3ForCausalLM
    with torch.device("meta"):
        return K3ForCausalLM(cfg, init=False)


def refresh_ep_flags(model: nn.Module) -> None:
    """Re-flag the EP expert parameters (fully_shard and to_empty replace parameter objects)."""
    from k3.parallel.expert import EPExperts
    for m in model.modules():
        if isinstance(m, EPExperts):
            m.mark_params()


def _fsdp_modules(model: nn.Module):
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def parallelize_model(model: nn.Module, pmesh: ParallelMesh, *, param_dtype: Optional[torch.dtype] = None,
                      reduce_dtype: Optional[torch.dtype] = torch.float32, activation_checkpointing: bool = False,
                      compile: str = "none", reshard_after_forward: bool = True) -> nn.Module:
    """Apply, in this order: expert parallelism (ep > 1), context parallelism (cp > 1), activation checkpointing, torch.compile
    (`compile`: "none" | "modules" | "layers", k3.compile.compile_model), FSDP2. In place; returns the model.
    `param_dtype` None: bf16 on CUDA meshes, the parameters' own dtype on CPU."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    dims = pmesh.dims
    cfg = model.config
    dims.check_model(cfg)
    if model.config.tie_word_embeddings:
        raise K3ConfigError("parallelize_model: tie_word_embeddings=true is not supported (K3 has a separate "
                            "lm_head)")
    if param_dtype is None and pmesh.device_type == "cuda":
        param_dtype = torch.bfloat16
    if pmesh.device_type == "cpu" and reduce_dtype is not None and param_dtype is None:
        reduce_dtype = None
    # 1. expert parallelism
    if dims.ep_enabled:
        apply_expert_parallel(model, pmesh.ep)
    # 1b. context parallelism: KDA state passing, conv halos, MLA latent all-gather (k3.parallel.context)
    if dims.cp_enabled:
        from k3.parallel.context import ContextParallel, apply_context_parallel
        model._k3_cp = ContextParallel.from_mesh(pmesh)
        apply_context_parallel(model, model._k3_cp)
    # 2. activation checkpointing: the model's own per-layer checkpoint (non-reentrant; FSDP2 re-gathers on recompute)
    if activation_checkpointing:
        model.set_gradient_checkpointing(True)
    # 3. per-module / per-layer compile (before FSDP, as TorchTitan does)
    if compile and compile != "none":
        from k3.compile import compile_model
        compile_model(model, mode=compile)
    # 4. FSDP2
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = dict(mp_policy=mp)
    inner = model.model
    for layer in inner.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if dims.ep_enabled and moe is not None:
            fully_shard(moe.experts, mesh=pmesh.expert_fsdp, reshard_after_forward=reshard_after_forward, **kw)
        fully_shard(layer, mesh=pmesh.fsdp, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(inner.embed_tokens, mesh=pmesh.fsdp, reshard_after_forward=reshard_after_forward, **kw)
    # the loss reads lm_head.weight directly (fused CE): the group stays unsharded after the norm's forward
    fully_shard([inner.norm, model.lm_head], mesh=pmesh.fsdp, reshard_after_forward=False, **kw)
    fully_shard(model, mesh=pmesh.fsdp, reshard_after_forward=reshard_after_forward, **kw)
    refresh_ep_flags(model)
    for m in _fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)
        if pmesh.device_type == "cpu":   # gloo has neither AVG nor PREMUL_SUM
            m.set_force_sum_reduction_for_comms(True)
    model._k3_pmesh = pmesh
    return model


@torch.no_grad()
def init_weights(model: nn.Module) -> None:
    """The model's own initialisation (K3ForCausalLM.reset_parameters), run on the local shards (DTensor ops)."""
    model.reset_parameters()


def materialize(model: nn.Module, device, seed: Optional[int] = None, init: bool = True) -> nn.Module:
    """Allocate every rank's shards on `device` (`to_empty`) and initialise them (`init=False`: leave them for a
    checkpoint load). No rank allocates a full parameter. On CPU the random init of a shard depends on the mesh
    (torch's DTensor RNG is offset-based on CUDA only); load a checkpoint for mesh-independent weights."""
    model.to_empty(device=device)
    refresh_ep_flags(model)
    if init:
        if seed is not None:
            torch.manual_seed(seed)
        init_weights(model)
    return model


# ---------------------------------------------------------------------------------------------- full tensors

def _ep_slice(p, full: torch.Tensor) -> torch.Tensor:
    ep_rank, ep_size, E = getattr(p, EP_PARAM_FLAG)
    n = E // ep_size
    return full[ep_rank * n:(ep_rank + 1) * n]


def _write_local(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` (the whole logical tensor of p, or of its EP slice; may live on CPU or be
    memory-mapped) into p's local shard: the slice is taken first, so only the local rows are read and moved."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(full.shape, p.device_mesh, p.placements)
        idx = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        loc = p.to_local()
        loc.copy_((full[idx] if len(idx) else full).to(device=loc.device, dtype=loc.dtype))
    else:
        p.copy_(full.to(device=p.device, dtype=p.dtype))


@torch.no_grad()
def load_full_state_dict(model: nn.Module, sd: dict, strict: bool = True) -> None:
    """Load an unsharded state dict (a single-process model's, or a released checkpoint memory-mapped on every
    rank) into the sharded model: each rank reads and copies only its shards (and its EP experts)."""
    refresh_ep_flags(model)
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if strict and (missing or unexpected):
        raise K3ConfigError(f"load_full_state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, t in own.items():
        if k not in sd:
            continue
        full = sd[k]
        if tuple(full.shape) != _logical_shape(t):
            raise K3ConfigError(f"load_full_state_dict: {k} has shape {tuple(full.shape)}, the model expects "
                                f"{_logical_shape(t)}")
        if is_ep_param(t):
            full = _ep_slice(t, full)
        _write_local(t, full)


def _logical_shape(t) -> tuple:
    """The whole (all-rank) shape of a parameter: an EP expert slice counts all E experts."""
    if is_ep_param(t):
        _, ep_size, E = getattr(t, EP_PARAM_FLAG)
        return (E,) + tuple(t.shape[1:])
    return tuple(t.shape)


def gather_full(t: torch.Tensor, ep_param=None) -> torch.Tensor:
    """The whole logical tensor on every rank: DTensor -> full_tensor(); EP expert tensors (flagged params or
    their grads, pass the param as `ep_param`) are further all-gathered over their ep group."""
    from torch.distributed.tensor import DTensor
    full = t.full_tensor() if isinstance(t, DTensor) else t
    ref = ep_param if ep_param is not None else t
    if is_ep_param(ref):
        group = _ep_group_of(ref)
        parts = [torch.empty_like(full) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, full.contiguous(), group=group)
        full = torch.cat(parts)
    return full


def _ep_group_of(p):
    return p._k3_ep_group


def full_state_dict(model: nn.Module, grads: bool = False) -> dict:
    """name -> full tensor (parameters, or their gradients with `grads=True`; None where no grad), on every rank.
    For tests and small models only (it materialises everything)."""
    refresh_ep_flags(model)
    out = {}
    for n, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        out[n] = None if t is None else gather_full(t, ep_param=p).clone()
    if not grads:
        for n, b in model.named_buffers():
            out[n] = b.detach().clone()
    return out


# ---------------------------------------------------------------------------------------------- loss / norm

def global_token_count(num_tokens, pmesh: ParallelMesh) -> torch.Tensor:
    """Sum of target tokens over all data ranks (one all-reduce over `dp_cp`)."""
    n = num_tokens if torch.is_tensor(num_tokens) else torch.tensor(num_tokens)
    n = n.detach().to(torch.int64).clone().reshape(())
    dist.all_reduce(n, group=pmesh.data_group())
    return n


def global_mean_loss(out, pmesh: ParallelMesh, global_count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's share of the mean loss over every target token of the global batch:
    out.loss * out.num_tokens / global count (summed over ranks = the global mean; FSDP sums gradients)."""
    n = out.num_tokens if torch.is_tensor(out.num_tokens) else torch.tensor(out.num_tokens)
    if global_count is None:
        global_count = global_token_count(n, pmesh)
    return out.loss * (n.to(out.loss.device, torch.float32) / global_count.to(out.loss.device).clamp_min(1))


def _replication(p) -> int:
    """How many ranks hold each element of p (its Replicate mesh dims; a plain tensor: every rank)."""
    from torch.distributed.tensor import DTensor, Replicate
    if not isinstance(p, DTensor):
        return dist.get_world_size()
    r = 1
    for i, pl in enumerate(p.placements):
        if isinstance(pl, Replicate):
            r *= p.device_mesh.size(i)
    return r


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    group=None) -> torch.Tensor:
    """Clip by the global 2-norm of all gradients, whatever mesh each lives on (FSDP shards, EP experts, HSDP
    replicas): sum over the local shards of each grad's squares divided by its replication count, one all-reduce
    over `group` (default: the world), sqrt. Returns the total norm (fp32, 0-dim). Non-finite norms are returned
    and nothing is scaled (the caller skips the step)."""
    from torch.distributed.tensor import DTensor
    if norm_type != 2.0:
        raise K3ConfigError(f"clip_grad_norm_: only the 2-norm is supported, got {norm_type}")
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    dev = local[0].device if local else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=dev)
    for g, lg in zip(grads, local):
        if lg.numel():
            sq += lg.double().pow(2).sum() / _replication(g)
    dist.all_reduce(sq, group=group)
    total = sq.sqrt().float()
    if max_norm and max_norm > 0 and torch.isfinite(total):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if float(coef) < 1.0:
            torch._foreach_mul_(local, coef.to(dev))
    return total
