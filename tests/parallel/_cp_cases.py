"""Functions the context-parallel tests run on every rank (through launcher.run_dist): each rank builds the
single-process reference on the whole sequence itself (fp32, tiny shapes) and returns both."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import batch, micro_config, reference_model  # noqa: E402


def _gather_rows(x_1L, cp, T):
    """[1, L, ...] slices of every cp rank -> [1, T, ...] (no autograd)."""
    parts = [torch.empty_like(x_1L) for _ in range(cp.size)]
    dist.all_gather(parts, x_1L.contiguous(), group=cp.group)
    return torch.cat(parts, 1)[:, :T]


def _sum_grads(module, group=None):
    out = {}
    for n, p in module.named_parameters():
        if p.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g, group=group)
            out[n] = g
    return out


def _diff(a: dict, b: dict) -> dict:
    """name -> max abs difference (keys of both); missing keys are reported as inf."""
    out = {}
    for k in set(a) | set(b):
        if k not in a or k not in b:
            out[k] = float("inf")
        else:
            out[k] = float((a[k] - b[k]).abs().max()) if a[k].numel() else 0.0
    return out


def layer_case(kind: str, T: int, cu: list, cp, seed: int = 0):
    """One KDA or MLA layer (micro config) on a packed sequence under the ContextParallel `cp` vs the same layer
    in one process on the whole sequence (computed on cp rank 0 only, which returns the max abs differences of
    outputs, input gradients and parameter gradients, and the reference scales; other ranks return None)."""
    from k3.nn.kda import KDAAttention
    from k3.nn.mla import MLAAttention
    from k3.parallel.context import apply_context_parallel
    cfg = micro_config()
    torch.manual_seed(seed)
    ref = KDAAttention(cfg, 1) if kind == "kda" else MLAAttention(cfg, 3)
    if kind == "kda":
        ref.reset_gate_parameters()
    for p in ref.parameters():          # non-trivial norms / gates
        if p.dim() == 1:
            p.data.add_(0.1 * torch.randn_like(p))
    mod = type(ref)(cfg, ref.layer_idx)
    mod.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, T, cfg.hidden_size, generator=g)
    R = torch.randn(1, T, cfg.hidden_size, generator=g)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    apply_context_parallel(mod, cp)
    b = cp.shard(torch.zeros(1, T, dtype=torch.long), None, cu_t)
    sl = b.slice
    s, e = sl.start, sl.start + sl.slice_len
    xp = torch.cat([x, x.new_zeros(1, sl.total_len - T, x.shape[-1])], 1)
    Rp = torch.cat([R, R.new_zeros(1, sl.total_len - T, R.shape[-1])], 1)
    xl = xp[:, s:e].clone().requires_grad_(True)
    y = mod(xl, cu_seqlens=b.cu_seqlens)
    (y * Rp[:, s:e]).sum().backward()
    y_all = _gather_rows(y.detach(), cp, T)
    gx = _gather_rows(xl.grad, cp, T)
    grads = _sum_grads(mod, cp.group)
    if cp.rank != 0:
        return None
    xr = x.clone().requires_grad_(True)
    y_ref = ref(xr, cu_seqlens=cu_t)
    (y_ref * R).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return {"case": f"{kind} T={T} cu={cu} cp={cp.size}", "out": float((y_all - y_ref.detach()).abs().max()),
            "gx": float((gx - xr.grad).abs().max()), "grads": _diff(grads, ref_grads),
            "scale": float(y_ref.abs().max()), "gscale": max(float(v.abs().max()) for v in ref_grads.values()),
            "cont": sl.cont}


def model_case(cp: int, seqs: list, ep: int = 1, ac: bool = False, seed: int = 0, sub: bool = False,
               fsdp: bool = False):
    """The whole micro model under dp_shard = world / cp x cp (x ep, folded into the dp x cp ranks): dp rank d
    runs packed sequence seqs[d] = (T, cu_seqlens), cut into cp slices. The loss over the global token count and
    every gradient (experts gathered over ep) = one process on all the sequences (rank 0 only returns them).
    `sub`: CP alone over the first cp ranks of the world (a process subgroup; the other ranks only join its
    creation), one sequence, no mesh. `fsdp`: EP, CP and FSDP2 applied by parallelize_model on the real mesh."""
    if sub:
        return _model_case_sub(cp, seqs, seed)
    from k3.parallel import ParallelDims, build_mesh
    from k3.parallel.context import ContextParallel, apply_context_parallel
    from k3.parallel.expert import apply_expert_parallel, is_ep_param
    from k3.parallel.parallelize import gather_full, global_mean_loss, refresh_ep_flags
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = micro_config()
    dims = ParallelDims(dp_shard=-1, cp=cp, ep=ep, world_size=world, num_experts=cfg.num_experts)
    assert dims.dp_shard == len(seqs)
    data = []
    for i, (T, cu) in enumerate(seqs):
        ids, labels = batch(seed + 11 + i, 1, T, cfg.vocab_size)
        data.append((ids, labels, torch.tensor(cu, dtype=torch.int32)))
    model = reference_model(cfg, seed)
    pm = build_mesh(dims, "cpu")
    if fsdp:
        from k3.parallel.parallelize import parallelize_model
        parallelize_model(model, pm, activation_checkpointing=ac)
        cpar = model._k3_cp
    else:
        cpar = ContextParallel.from_mesh(pm)
        apply_context_parallel(model, cpar)
        if ep > 1:
            apply_expert_parallel(model, pm.ep)
        if ac:
            model.set_gradient_checkpointing(True)
    assert pm.dp_index() == rank // cp and pm.cp_rank() == cpar.rank == rank % cp   # cp ranks are consecutive
    ids, labels, cu_t = data[pm.dp_index()]
    b = cpar.shard(ids, labels, cu_t, pad_id=cfg.pad_token_id)
    out = model(b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens)
    loss = global_mean_loss(out, pm)
    loss.backward()
    lsum = loss.detach().clone()
    dist.all_reduce(lsum)
    h = cpar.gather(out.hidden_states.detach())
    refresh_ep_flags(model)
    grads = {}
    if fsdp:
        from k3.parallel.parallelize import full_state_dict
        grads = {k: v for k, v in full_state_dict(model, grads=True).items() if v is not None}
    for name, p in ([] if fsdp else model.named_parameters()):
        if p.grad is None:
            continue
        gr = p.grad.clone()
        if is_ep_param(p):
            dist.all_reduce(gr, group=pm.expert_fsdp.get_group())
            gr = gather_full(gr, ep_param=p)
        else:
            dist.all_reduce(gr)
        grads[name] = gr
    if rank != 0:
        return None
    ref = reference_model(cfg, seed)
    tot, n = 0.0, 0
    for i, (ids, labels, cu_t) in enumerate(data):
        o = ref(ids, labels=labels, cu_seqlens=cu_t)
        if i == 0:
            h_ref = o.hidden_states.detach()
        tot = tot + o.loss * o.num_tokens
        n += int(o.num_tokens)
    (tot / n).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return {"case": f"model cp={cp} dp={dims.dp_shard} ep={ep} ac={ac} fsdp={fsdp} seqs={seqs}", "loss": float(lsum),
            "ref_loss": float(tot / n), "h": float((h - h_ref).abs().max()), "grads": _diff(grads, ref_grads),
            "gscale": max(float(v.abs().max()) for v in ref_grads.values()), "cont": b.slice.cont}


def _model_case_sub(cp: int, seqs: list, seed: int):
    from k3.parallel.context import ContextParallel, apply_context_parallel
    ranks = list(range(cp))
    group = dist.new_group(ranks)
    if dist.get_rank() not in ranks:
        return None
    cfg = micro_config()
    (T, cu), = seqs
    ids, labels = batch(seed + 11, 1, T, cfg.vocab_size)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    model = reference_model(cfg, seed)
    cpar = ContextParallel(group)
    apply_context_parallel(model, cpar)
    b = cpar.shard(ids, labels, cu_t, pad_id=cfg.pad_token_id)
    out = model(b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens)
    n = out.num_tokens.clone()
    dist.all_reduce(n, group=group)
    loss = out.loss * out.num_tokens / n
    loss.backward()
    lsum = loss.detach().clone()
    dist.all_reduce(lsum, group=group)
    h = cpar.gather(out.hidden_states.detach())
    grads = _sum_grads(model, group)
    if cpar.rank != 0:
        return None
    ref = reference_model(cfg, seed)
    o = ref(ids, labels=labels, cu_seqlens=cu_t)
    o.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return {"case": f"model cp={cp} (subgroup) seqs={seqs}", "loss": float(lsum), "ref_loss": float(o.loss),
            "h": float((h - o.hidden_states).abs().max()), "grads": _diff(grads, ref_grads),
            "gscale": max(float(v.abs().max()) for v in ref_grads.values()), "cont": b.slice.cont}


def _cp_groups(cp: int):
    """(ContextParallel over consecutive groups of cp ranks, this rank's dp index). cp not dividing the world:
    one subgroup of the first cp ranks (the others get (None, 1))."""
    from k3.parallel import ParallelDims, build_mesh
    from k3.parallel.context import ContextParallel
    world = dist.get_world_size()
    if world % cp:
        group = dist.new_group(list(range(cp)))
        return (ContextParallel(group), 0) if dist.get_rank() < cp else (None, 1)
    pm = build_mesh(ParallelDims(cp=cp, world_size=dist.get_world_size()), "cpu")
    return ContextParallel.from_mesh(pm), dist.get_rank() // cp


def suite(layers: dict, models: list, balance: bool = False):
    """Everything in one launch (process start-up dominates on a loaded CPU). `layers`: cp -> [per dp group: list
    of layer_case kwargs]: the dp groups of one cp degree run different cases at the same time. `models`: list of
    model_case kwargs. Returns {"layers": [results of this rank], "models": [...]} (None where not rank 0)."""
    out = {"layers": [], "models": []}
    for cp, per_group in layers.items():
        cpar, d = _cp_groups(cp)
        for kw in (per_group[d] if cpar is not None and d < len(per_group) else []):
            out["layers"].append(layer_case(cp=cpar, **kw))
    for kw in models:
        out["models"].append(model_case(**kw))
    if balance:
        out["balance"] = balance_case()
    return out


def balance_case(names=("qb", "sign"), seqs=((24, [0, 5, 17, 24]), (16, [0, 16])), cp: int = 2,
                 distributed: bool = True, seed: int = 0):
    """Each balancer's router biases after one step whose batch is the packed sequences `seqs`: under
    dp = len(seqs) x cp (every rank a slice; k3.balance reduces over the default group = all dp x cp ranks), or
    with distributed=False one process running the sequences whole (run it where no process group exists).
    Lengths divisible by cp (padding tokens would also be routed)."""
    from k3.balance import make_balancer
    cfg = micro_config()
    out = {}
    data = []
    for i, (T, cu) in enumerate(seqs):
        ids, _ = batch(seed + 21 + i, 1, T, cfg.vocab_size)
        data.append((ids, torch.tensor(cu, dtype=torch.int32)))
    for name in names:
        model = reference_model(cfg, seed)
        if distributed:
            from k3.parallel import ParallelDims, build_mesh
            from k3.parallel.context import ContextParallel, apply_context_parallel
            pm = build_mesh(ParallelDims(dp_shard=-1, cp=cp, world_size=dist.get_world_size()), "cpu")
            cpar = ContextParallel.from_mesh(pm)
            apply_context_parallel(model, cpar)
        bal = make_balancer(name).attach(model)
        with torch.no_grad():
            if distributed:
                ids, cu_t = data[pm.dp_index()]
                b = cpar.shard(ids, None, cu_t)
                model(b.input_ids, cu_seqlens=b.cu_seqlens)
            else:
                for ids, cu_t in data:
                    model(ids, cu_seqlens=cu_t)
        bal.step()
        out[name] = {r.name: r.bias.detach().clone() for r in bal.routers}
    return out


def _mla_layers(model):
    from k3.nn.mla import MLAAttention
    return [m for m in model.modules() if isinstance(m, MLAAttention)]


def extreme_pad_id(model, real_ml: list) -> tuple:
    """(token id, margin): the token whose q.k with itself, alone in a document (what a padding document of one
    token computes in every MLA layer), exceeds the one-process max logit `real_ml` ([H] per MLA layer) by the
    most, over every head of every MLA layer. One forward of the vocabulary as single-token documents."""
    mlas = _mla_layers(model)
    seen = {}
    hooks = [m.register_forward_hook(lambda m, a, kw, out, i=i: seen.__setitem__(i, a[0].detach()), with_kwargs=True)
             for i, m in enumerate(mlas)]
    V = model.config.vocab_size
    try:
        with torch.no_grad():
            model(torch.arange(V).unsqueeze(0), cu_seqlens=torch.arange(V + 1, dtype=torch.int32))
    finally:
        for h in hooks:
            h.remove()
    best = None
    with torch.no_grad():
        for i, m in enumerate(mlas):
            x = seen[i]
            q = m.project_q(x)
            k, _ = m.expand_kv(*m.project_latent(x))
            self_logit = (q.float() * k.float()).sum(-1)[0] * m.softmax_scale         # [V, H]
            margin = (self_logit - real_ml[i].float().max()).amax(-1)                   # over heads: [V]
            j = int(margin.argmax())
            if best is None or float(margin[j]) > best[1]:
                best = (j, float(margin[j]))
    return best


def max_logit_case(T: int = 37, cu: tuple = (0, 9, 30, 37), seed: int = 0):
    """The whole micro model, training forward with max-logit tracking, under context parallelism over the
    world (T not divisible by it: the tail is padded with a pad token chosen so that its own q.k is extreme) vs
    one process on the unpadded sequence: every MLA layer's per-head max logit (max-reduced over the cp ranks,
    as QK-clip and the trainer reduce it) and the heads sharded_qk_clip clips at a tau between the real max and
    the pad token's own logit."""
    from k3.parallel.context import ContextParallel, apply_context_parallel
    from k3.parallel.qk_clip import sharded_qk_clip
    from k3.train.optim import qk_clip
    cfg = micro_config()
    ids, labels = batch(seed + 31, 1, T, cfg.vocab_size)
    cu_t = torch.tensor(list(cu), dtype=torch.int32)
    ref = reference_model(cfg, seed)
    for m in _mla_layers(ref):
        m.track_max_logit = True
    ref.train()
    with torch.no_grad():
        ref(ids, labels=labels, cu_seqlens=cu_t)
    ref_ml = [m.last_max_logit.clone() for m in _mla_layers(ref)]
    pad_id, margin = extreme_pad_id(ref, ref_ml)
    for m, S in zip(_mla_layers(ref), ref_ml):     # the scan's forward overwrote them
        m.last_max_logit = S.clone()
    model = reference_model(cfg, seed)
    for m in _mla_layers(model):
        m.track_max_logit = True
    model.train()
    cpar = ContextParallel()
    apply_context_parallel(model, cpar)
    b = cpar.shard(ids, labels, cu_t, pad_id=pad_id)
    with torch.no_grad():
        model(b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens)
    local = [m.last_max_logit.clone() for m in _mla_layers(model)]
    cp_ml = []
    for S in local:
        S = S.clone()
        dist.all_reduce(S, op=dist.ReduceOp.MAX)
        cp_ml.append(S)
    tau = float(torch.cat([S.reshape(-1) for S in ref_ml]).max()) + margin / 2   # below the pad's own logit
    n_cp = sharded_qk_clip(model, tau=tau)
    n_ref = qk_clip(ref, tau=tau, sync=False)
    return {"case": f"max logit cp={cpar.size} T={T} cu={list(cu)} pad={sl_pad(b.slice)} pad_id={pad_id}",
            "ref": ref_ml, "cp": cp_ml, "local": local, "margin": margin, "pad_id": pad_id,
            "n_cp": n_cp, "n_ref": n_ref, "tau": tau, "pad_rows": sl_pad(b.slice)}


def sl_pad(sl) -> int:
    return sl.total_len - sl.orig_len
