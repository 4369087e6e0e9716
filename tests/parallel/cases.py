"""Functions the distributed tests run on every rank (through launcher.run_dist). Each builds the single-process
reference itself (the tiny models are cheap), so a rank returns both the distributed and the reference numbers."""
from __future__ import annotations

import torch
import torch.distributed as dist

MICRO = dict(hidden_size=64, num_hidden_layers=3, vocab_size=512, bos_token_id=256, eos_token_id=258,
             pad_token_id=511, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
             routed_expert_hidden_size=32, kda_gate_low_rank=16, attn_res_block_size=2,
             **{"linear_attn_config.num_heads": 2, "linear_attn_config.head_dim": 16,
                "linear_attn_config.full_attn_layers": [3], "linear_attn_config.kda_layers": [1, 2]})


def micro_config(**kw):
    from k3.config import K3Config
    return K3Config.from_preset("tiny", **{**MICRO, **kw})


def batch(seed: int, rows: int, T: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, T), generator=g)
    labels = torch.randint(0, vocab, (rows, T), generator=g)
    labels[torch.rand(rows, T, generator=g) < 0.25] = -100     # uneven target counts per row
    return ids, labels


def reference_model(cfg, seed=0):
    from k3.model import K3ForCausalLM
    torch.manual_seed(seed)
    return K3ForCausalLM(cfg)


def sharded_model(cfg, sd, ep=1, dp_replicate=1, **pkw):
    from k3.parallel import ParallelDims, build_mesh
    from k3.parallel.parallelize import build_meta_model, load_full_state_dict, materialize, parallelize_model
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=-1, ep=ep, world_size=dist.get_world_size(),
                        num_experts=cfg.num_experts)
    pm = build_mesh(dims, "cpu")
    model = build_meta_model(cfg)
    parallelize_model(model, pm, **pkw)
    materialize(model, "cpu", init=False)
    load_full_state_dict(model, sd)
    return model, pm


def local_bytes(model, opt=None) -> dict:
    """This rank's bytes of parameter shards, gradient shards and optimizer state (measured)."""
    from torch.distributed.tensor import DTensor

    def nb(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()
    out = {"param": sum(nb(p) for p in model.parameters()),
           "grad": 0, "optim": 0}
    if opt is not None:
        out["optim"] = sum(nb(v) for st in opt.state.values() for v in st.values()
                           if torch.is_tensor(v) and v.ndim > 0)
    return out


def _nbytes(t) -> int:
    from torch.distributed.tensor import DTensor
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def rows_of_rank(x, rank, world):
    n = x.shape[0] // world
    return x[rank * n:(rank + 1) * n]


def train_steps(ep=1, dp_replicate=1, rows=4, T=12, steps=1, opt=None, clip=0.0, lr=0.02, start=0, save=None,
                save_after=None, load=None, ac=False):
    """Steps start..steps-1 (opt None: forward/backward only), distributed and (unless resuming from `load`) in
    one process. `save`/`save_after`: DCP checkpoint into `save` after that step; `load`: resume from that
    checkpoint first. Returns on rank 0: losses, grads (last backward), params after the steps (full tensors),
    grad norms, the checkpoint's extra dict."""
    from k3.parallel.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from k3.parallel.parallelize import clip_grad_norm_, full_state_dict, global_mean_loss
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = micro_config()
    ref = reference_model(cfg) if load is None else None
    sd = {k: v.clone() for k, v in (ref or reference_model(cfg, seed=1)).state_dict().items()}
    model, pm = sharded_model(cfg, sd, ep=ep, dp_replicate=dp_replicate, activation_checkpointing=ac)
    out = {"ref_loss": [], "loss": [], "ref_norm": [], "norm": []}
    grad_bytes = 0
    if opt:
        from k3.parallel.muon import build_sharded_optimizer
        from k3.train.optim import build_optimizer
        # AdamW's eps well above the fp32 noise of tiny gradients (at 1e-8, m/sqrt(v) of a ~1e-9 gradient turns
        # reduction-order noise into O(lr) differences; that is Adam's conditioning, not the sharding)
        ref_opt = build_optimizer(ref, lr=lr, fused=False, eps=1e-4) if ref is not None else None
        d_opt = build_sharded_optimizer(model, lr=lr, eps=1e-4)
    if load is not None:
        out["extra"] = load_checkpoint(latest_checkpoint(load), model, d_opt if opt else None)
    for s in range(start, steps):
        ids, labels = batch(100 + s, rows, T, cfg.vocab_size)
        if ref is not None:
            o = ref(ids, labels=labels)
            o.loss.backward()
            out["ref_loss"].append(float(o.loss))
        o2 = model(rows_of_rank(ids, rank, world), labels=rows_of_rank(labels, rank, world))
        loss = global_mean_loss(o2, pm)
        loss.backward()
        lsum = loss.detach().clone()
        dist.all_reduce(lsum)
        out["loss"].append(float(lsum))
        if clip:
            if ref is not None:
                out["ref_norm"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
            out["norm"].append(float(clip_grad_norm_(model.parameters(), clip)))
        if s == steps - 1:
            grad_bytes = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
            if ref is not None:
                out["ref_grads"] = {k: p.grad.clone() for k, p in ref.named_parameters() if p.grad is not None}
            out["grads"] = full_state_dict(model, grads=True)
        if opt:
            if ref_opt is not None:
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
            d_opt.step()
            d_opt.zero_grad(set_to_none=True)
        if save is not None and s == save_after:
            save_checkpoint(save, s + 1, model, d_opt if opt else None,
                            extra={"step": s + 1, "data": {"epoch": 0, "offset": (s + 1) * rows}})
    out["bytes"] = local_bytes(model, d_opt if opt else None)
    out["bytes"]["grad"] = grad_bytes
    if ref is not None:
        out["ref_params"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    out["params"] = full_state_dict(model)
    return out if rank == 0 else {"ok": True}


def balancer_bias(names=("qb", "qb_hist", "sign"), ep=2, rows=4, T=12, micro=2, distributed=True):
    """Each balancer's router biases after one step (gradient accumulation over `micro` micro-batches): on the
    sharded model (FSDP, EP), or with distributed=False one process on the concatenated batch (run that where no
    process group exists: k3.balance reduces over the default group whenever one is initialised)."""
    from k3.balance import make_balancer
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    cfg = micro_config()
    out = {}
    for name in names:
        ref = reference_model(cfg)
        if distributed:
            model, _ = sharded_model(cfg, {k: v.clone() for k, v in ref.state_dict().items()}, ep=ep)
        else:
            model = ref
        bal = make_balancer(name).attach(model)
        for m in range(micro):
            ids, _ = batch(7 + m, rows, T, cfg.vocab_size)
            with torch.no_grad():
                model(rows_of_rank(ids, rank, world))
        bal.step()
        out[name] = {r.name: r.bias.detach().clone() for r in bal.routers}
    return out


def qk_clip_case(rows=4, T=12):
    """One training forward with max-logit tracking, then QK-clip: sharded (per-rank maxima reduced) vs
    k3.train.optim.qk_clip on one process."""
    from k3.parallel.parallelize import full_state_dict
    from k3.parallel.qk_clip import sharded_qk_clip
    from k3.train.optim import qk_clip
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = micro_config()
    ref = reference_model(cfg)
    model, _ = sharded_model(cfg, {k: v.clone() for k, v in ref.state_dict().items()})
    for m in list(ref.modules()) + list(model.modules()):
        if hasattr(m, "track_max_logit"):
            m.track_max_logit = True
    ids, _ = batch(3, rows, T, cfg.vocab_size)
    with torch.no_grad():
        ref(ids)
        model(rows_of_rank(ids, rank, world))
    S = torch.cat([m.last_max_logit.reshape(-1) for m in ref.modules() if getattr(m, "last_max_logit", None)
                   is not None])
    tau = float(S.max() + S.min()) / 2   # clips some heads, not all (random init logits are tiny)
    n_ref = qk_clip(ref, tau=tau, sync=False)
    n = sharded_qk_clip(model, tau=tau)
    return {"n_ref": n_ref, "n": n, "ref": {k: v.clone() for k, v in ref.state_dict().items()},
            "dist": full_state_dict(model)}


def momenta(model, opt) -> dict:
    """name -> full Muon momentum buffer (EP experts gathered over their ep group)."""
    from k3.parallel.parallelize import gather_full, refresh_ep_flags
    refresh_ep_flags(model)
    return {n: gather_full(opt.state[p]["momentum_buffer"], ep_param=p).clone()
            for n, p in model.named_parameters() if "momentum_buffer" in opt.state.get(p, {})}


def async_save_case(ckpt_dir: str):
    """Async DCP save (EP=2 model + sharded optimizer after one step), the weights changed while it is in flight,
    then wait() and a load into a fresh model/optimizer: the loaded state is the one at save time."""
    from k3.parallel.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from k3.parallel.muon import build_sharded_optimizer
    from k3.parallel.parallelize import full_state_dict, global_mean_loss
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = micro_config()
    sd = reference_model(cfg).state_dict()
    model, pm = sharded_model(cfg, sd, ep=2)
    opt = build_sharded_optimizer(model, lr=0.02)
    ids, labels = batch(5, 4, 12, cfg.vocab_size)
    global_mean_loss(model(rows_of_rank(ids, rank, world), labels=rows_of_rank(labels, rank, world)),
                     pm).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    at_save = full_state_dict(model)
    mom = momenta(model, opt)
    pending = save_checkpoint(ckpt_dir, 1, model, opt, extra={"step": 1}, async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)                           # training goes on while the save is in flight
    was_tmp = latest_checkpoint(ckpt_dir) is None
    path = pending.wait()
    model2, _ = sharded_model(cfg, {k: v * 0 for k, v in sd.items()}, ep=2)
    opt2 = build_sharded_optimizer(model2, lr=0.02)
    extra = load_checkpoint(path, model2, opt2)
    mom2 = momenta(model2, opt2)
    return {"was_tmp": was_tmp, "extra": extra, "saved": at_save, "loaded": full_state_dict(model2),
            "mom": mom, "mom2": mom2}


def two_rank_suite(ckpt_dir: str = None):
    """Everything the 2-rank tests check, in one launch (process start-up dominates on a loaded CPU):
    FSDP2 (2 steps of sharded Muon + AdamW, clipping norm), EP=2 (2 steps, activation checkpointing), HSDP
    (dp_replicate=2: replicas all-reduce, Muon on Replicate x Shard(0) DTensors), the balancers, QK-clip."""
    return {"fsdp": train_steps(ep=1, steps=2, opt="muon", clip=1e9),
            "ep2": train_steps(ep=2, steps=2, opt="muon", clip=1e9, ac=True),
            "hsdp": train_steps(dp_replicate=2, steps=2, opt="muon", clip=1e9),
            "balance": balancer_bias(),
            "qk_clip": qk_clip_case(),
            "async_save": async_save_case(ckpt_dir) if ckpt_dir else None}
