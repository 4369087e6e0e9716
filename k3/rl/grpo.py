"""GRPO-family policy loss: group-normalised advantages, token-level clipped ratio loss, optional k3 KL to a
reference policy and truncated importance sampling (TIS) for the sampler/trainer mismatch.

Token tensors share one shape (packed [T], or [B, T]): `logp` (current policy, with grad), `old_logp` (the policy
that the ratio is taken against: the trainer's recomputation of the rollout policy, no grad), `mask` (True on
model-generated tokens that get a gradient; tool outputs, prompts and padding are False) and `advantages` (the
trajectory's advantage on each of its tokens, see `tokens_from_trajectories`).

    ratio_t  = exp(logp_t - old_logp_t)
    pg_t     = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    w_t      = min(exp(old_logp_t - sampler_logp_t), tis_cap)           (detached; 1 without sampler_logp)
    kl_t     = exp(ref_t - logp_t) - (ref_t - logp_t) - 1               (the "k3" estimator, >= 0)
    loss     = sum_t mask_t * (w_t * pg_t + kl_coef * kl_t) / sum_t mask_t  (token-level mean over the batch)

On the first update of a batch logp == old_logp bit for bit (same model, same inputs), so the ratio is exactly 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from k3.errors import K3ConfigError

__all__ = ["GRPOConfig", "group_advantages", "grpo_loss", "tokens_from_trajectories"]


@dataclass
class GRPOConfig:
    group_size: int = 8
    eps_low: float = 0.2           # ratio clip below: 1 - eps_low
    eps_high: float = 0.28         # ratio clip above: 1 + eps_high ("clip-higher")
    normalize_std: bool = True     # (r - mean) / (std + eps); False: r - mean only
    adv_eps: float = 1e-6
    kl_coef: float = 0.0           # 0: no reference model
    tis_cap: Optional[float] = 2.0  # None: no truncated importance sampling
    neg_adv_scale: float = 1.0     # negative advantages are multiplied by this (0: learn from successes only)

    def validate(self) -> None:
        if self.group_size < 1:
            raise K3ConfigError(f"grpo.group_size must be >= 1, got {self.group_size}")
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise K3ConfigError(f"grpo.eps_low must be in [0, 1) and eps_high >= 0, got {self.eps_low}, "
                                f"{self.eps_high}")
        if not 0 <= self.neg_adv_scale <= 1:
            raise K3ConfigError(f"grpo.neg_adv_scale must be in [0, 1], got {self.neg_adv_scale}")
        if self.kl_coef < 0:
            raise K3ConfigError(f"grpo.kl_coef must be >= 0, got {self.kl_coef}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise K3ConfigError(f"grpo.tis_cap must be > 0 (or None), got {self.tis_cap}")


def group_advantages(rewards, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages [N] of rewards [N] laid out as consecutive groups of `group_size` samples of one prompt:
    (r - group mean) / (group std + eps), std the population std (unbiased=False; a group of equal rewards gives
    0); with normalize_std=False just r - group mean."""
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if group_size < 1 or r.numel() % group_size:
        raise K3ConfigError(f"group_advantages: {r.numel()} rewards do not split into groups of {group_size}")
    g = r.view(-1, group_size)
    a = g - g.mean(1, keepdim=True)
    if normalize_std:
        a = a / (g.std(1, unbiased=False, keepdim=True) + eps)
    return a.reshape(-1).float()


def tokens_from_trajectories(values: Sequence[float], lengths: Sequence[int], device=None) -> torch.Tensor:
    """A per-trajectory value repeated over each trajectory's tokens, concatenated (the packed layout)."""
    if len(values) != len(lengths):
        raise K3ConfigError(f"{len(values)} values for {len(lengths)} trajectories")
    v = torch.as_tensor(list(values), dtype=torch.float32, device=device)
    return torch.repeat_interleave(v, torch.as_tensor(list(lengths), device=device))


def _check(name, t, ref):
    if t is not None and tuple(t.shape) != tuple(ref.shape):
        raise K3ConfigError(f"grpo_loss: {name} has shape {tuple(t.shape)}, logp has {tuple(ref.shape)}")


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              cfg: Optional[GRPOConfig] = None, ref_logp: Optional[torch.Tensor] = None,
              sampler_logp: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None
              ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """(scalar loss, metrics) -- see the module docstring. metrics: loss, pg_loss, clip_frac (tokens whose
    clipped branch is active), clip_low_frac / clip_high_frac, ratio_mean/min/max, kl (mean k3 estimate; 0 without
    a reference), entropy (mean of `entropy`, only when given), tis_weight_mean, tis_capped_frac, tokens."""
    cfg = cfg or GRPOConfig()
    for name, t in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask), ("ref_logp", ref_logp),
                    ("sampler_logp", sampler_logp), ("entropy", entropy)):
        _check(name, t, logp)
    m = mask.to(torch.bool)
    mf = m.to(torch.float32)
    n = mf.sum().clamp_min(1.0)
    lp = logp.float()
    old = old_logp.detach().float()
    adv = advantages.detach().float()
    ratio = torch.exp(torch.where(m, lp - old, torch.zeros_like(lp)))
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(lo, hi)
    pg = torch.maximum(pg1, pg2)
    w = None
    if sampler_logp is not None and cfg.tis_cap is not None:
        w = torch.exp(torch.where(m, old - sampler_logp.detach().float(), torch.zeros_like(old)))
        w = w.clamp(max=cfg.tis_cap)
        per_tok = w * pg
    else:
        per_tok = pg
    kl = None
    if ref_logp is not None:
        d = torch.where(m, ref_logp.detach().float() - lp, torch.zeros_like(lp))
        kl = torch.exp(d) - d - 1.0
        if cfg.kl_coef:
            per_tok = per_tok + cfg.kl_coef * kl
    loss = (per_tok * mf).sum() / n
    with torch.no_grad():
        rd = ratio.detach()
        clipped = (pg2.detach() > pg1.detach()) & m
        low = clipped & (rd < lo)
        high = clipped & (rd > hi)
        rm = rd[m] if m.any() else rd.new_ones(1)
        metrics = {
            "loss": float(loss.detach()), "pg_loss": float((pg.detach() * mf).sum() / n),
            "clip_frac": float(clipped.float().sum() / n), "clip_low_frac": float(low.float().sum() / n),
            "clip_high_frac": float(high.float().sum() / n),
            "ratio_mean": float(rm.mean()), "ratio_min": float(rm.min()), "ratio_max": float(rm.max()),
            "kl": float((kl.detach() * mf).sum() / n) if kl is not None else 0.0,
            "tis_weight_mean": float((w * mf).sum() / n) if w is not None else 1.0,
            "tis_capped_frac": float(((w >= cfg.tis_cap) & m).float().sum() / n) if w is not None else 0.0,
            "tokens": int(mf.sum()),
        }
        if entropy is not None:
            metrics["entropy"] = float((entropy.detach().float() * mf).sum() / n)
    return loss, metrics
