"""One GRPO update over finished rollout groups, and the `metrics.jsonl` row of an RL step.

    groups = engine.collect(seeds)                              # k3.rl.rollout
    apply_filter([t for g in groups for t in g], flt)           # k3.rl.safety (filtered -> reward 0)
    trajs, adv = flatten_groups(groups, grpo_cfg)               # group-normalised advantages
    m = grpo_update(model, optimizer, trajs, adv, grpo_cfg, ref_model=ref)
    row = metrics_row(step, trajs, m, rollout_s, train_s)

`grpo_update` packs the trajectories into one `cu_seqlens` row and runs `epochs` optimizer steps of `grpo_loss`;
the old (trainer) log-probs are the first epoch's own, detached (that step is exactly on-policy: ratio 1, and no
separate no-grad forward is spent on them). With
`replay=True` and recorded routing, every forward replays the rollout's expert choices (k3/rl/routing.py).
"""
from __future__ import annotations

import contextlib
import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from k3.rl.grpo import GRPOConfig, group_advantages, grpo_loss
from k3.rl.logprobs import token_logprobs
from k3.rl.rollout import Trajectory, pack_trajectories
from k3.rl.routing import replay_routing

__all__ = ["flatten_groups", "grpo_update", "metrics_row"]


def flatten_groups(groups: Sequence[Sequence[Trajectory]], cfg: GRPOConfig) -> Tuple[List[Trajectory], List[float]]:
    """(trajectories in group order, their advantages) -- each group must hold cfg.group_size samples."""
    trajs = [t for g in groups for t in g]
    if any(len(g) != cfg.group_size for g in groups):
        from k3.errors import K3ConfigError
        raise K3ConfigError(f"every group needs grpo.group_size={cfg.group_size} samples, got "
                            f"{[len(g) for g in groups]}")
    adv = group_advantages([t.reward for t in trajs], cfg.group_size, cfg.normalize_std, cfg.adv_eps)
    if cfg.neg_adv_scale != 1.0:
        adv = torch.where(adv < 0, adv * cfg.neg_adv_scale, adv)
    return trajs, adv.tolist()


def grpo_update(model, optimizer, trajs: Sequence[Trajectory], advantages: Sequence[float],
                cfg: Optional[GRPOConfig] = None, *, ref_model=None, replay: bool = True, epochs: int = 1,
                chunk: int = 1024, temperature: float = 1.0, max_grad_norm: Optional[float] = 1.0,
                autocast_dtype: Optional[torch.dtype] = None) -> Dict[str, Any]:
    """Optimizer steps on the GRPO loss of `trajs` (module doc). Returns the metrics of the first epoch plus
    `grad_norm` and `tokens` (the packed length). autocast_dtype (e.g. torch.bfloat16): every training-side
    forward (old, reference and new log-probs) runs under torch.autocast on the model's device; weights,
    gradients, the optimizer and the log-probs stay fp32."""
    cfg = cfg or GRPOConfig()
    cfg.validate()
    dev = model.device
    b = pack_trajectories(trajs, advantages, device=dev)
    ids, cu, mask = b["input_ids"], b["cu_seqlens"], b["mask"]
    picks = b["routing"] if replay else {}

    def ctx(m):
        stack = contextlib.ExitStack()
        if autocast_dtype is not None:
            stack.enter_context(torch.autocast(dev.type, dtype=autocast_dtype))
        if picks:
            stack.enter_context(replay_routing(m, picks))
        return stack

    old = None     # the policy before the update: the first epoch's own log-probs (detached), no extra forward
    ref = None
    if ref_model is not None and cfg.kl_coef > 0:
        with torch.no_grad(), ctx(ref_model):
            ref = token_logprobs(ref_model, ids, mask, cu, chunk=chunk, temperature=temperature)
    sampler = b.get("sampler_logp")
    first: Dict[str, Any] = {}
    for e in range(int(epochs)):
        optimizer.zero_grad(set_to_none=True)
        with ctx(model):
            lp, ent = token_logprobs(model, ids, mask, cu, chunk=chunk, return_entropy=True, temperature=temperature)
        if old is None:
            old = lp.detach()
        loss, m = grpo_loss(lp, old, b["advantages"], mask, cfg, ref_logp=ref, sampler_logp=sampler, entropy=ent)
        loss.backward()
        gn = None
        if max_grad_norm:
            gn = float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                      max_grad_norm))
        optimizer.step()
        if e == 0:
            first = dict(m, grad_norm=gn, packed_tokens=int(ids.shape[1]))
    return first


def metrics_row(step: int, trajs: Sequence[Trajectory], update: Dict[str, Any], rollout_s: float,
                train_s: float) -> Dict[str, Any]:
    """A `RUN/metrics.jsonl` row: step, reward_mean/std, kl, entropy, clip_frac, rollout / train tokens per
    second, filtered count, finish reasons, mean trajectory length."""
    r = [t.reward for t in trajs]
    gen = sum(t.num_generated for t in trajs)
    reasons: Dict[str, int] = {}
    for t in trajs:
        reasons[t.finish_reason or "running"] = reasons.get(t.finish_reason or "running", 0) + 1
    row = {"step": int(step), "reward_mean": statistics.fmean(r) if r else 0.0,
           "reward_std": statistics.pstdev(r) if len(r) > 1 else 0.0,
           "kl": update.get("kl", 0.0), "entropy": update.get("entropy", 0.0),
           "clip_frac": update.get("clip_frac", 0.0), "loss": update.get("loss", 0.0),
           "rollout_tokens_per_s": gen / rollout_s if rollout_s > 0 else 0.0,
           "train_tokens_per_s": update.get("packed_tokens", 0) / train_s if train_s > 0 else 0.0,
           "trajectories": len(trajs), "generated_tokens": gen,
           "mean_length": statistics.fmean([len(t.token_ids) for t in trajs]) if trajs else 0.0,
           "filtered": sum(bool(t.filtered) for t in trajs), "finish": reasons}
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
