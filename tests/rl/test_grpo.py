"""GRPO advantages and clipped loss vs hand-computed values."""
import math

import pytest
import torch

from k3.errors import K3ConfigError
from k3.rl.grpo import GRPOConfig, group_advantages, grpo_loss, tokens_from_trajectories


def test_group_advantages_hand_values():
    a = group_advantages([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], group_size=4, eps=0.0)
    # group 1: mean .5, population std .5 -> +-1; group 2: all equal -> 0 (0/(0+eps) with eps > 0)
    assert a[:4].tolist() == [1.0, -1.0, -1.0, 1.0]
    a = group_advantages([1.0, 1.0, 1.0, 1.0], group_size=4)
    assert a.tolist() == [0.0] * 4
    a = group_advantages([3.0, 1.0], group_size=2, normalize_std=False)
    assert a.tolist() == [1.0, -1.0]
    a = group_advantages([0.0, 0.0, 3.0], group_size=3, eps=1e-6)
    std = math.sqrt(2.0)
    assert a.tolist() == pytest.approx([-1 / (std + 1e-6), -1 / (std + 1e-6), 2 / (std + 1e-6)])
    with pytest.raises(K3ConfigError, match="groups of 4"):
        group_advantages([1.0, 2.0, 3.0], 4)


def test_clipped_loss_hand_values():
    cfg = GRPOConfig(eps_low=0.2, eps_high=0.3, tis_cap=None)
    old = torch.zeros(5)
    ratios = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1])
    logp = ratios.log().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    mask = torch.tensor([True, True, True, True, False])
    loss, m = grpo_loss(logp, old, adv, mask, cfg)
    # token 0: A>0, r=1.5 > 1.3 -> clipped: -1.3 ; token 1: A<0, r=1.5 -> max(1.5, 1.3) = 1.5 (unclipped)
    # token 2: A>0, r=.5 -> max(-.5, -.8) = -.5 (unclipped); token 3: A<0, r=.5 < .8 -> max(.5, .8) = .8 (clipped)
    expect = (-1.3 + 1.5 - 0.5 + 0.8) / 4
    assert float(loss.detach()) == pytest.approx(expect)
    assert m["clip_frac"] == pytest.approx(0.5) and m["clip_high_frac"] == pytest.approx(0.25)
    assert m["clip_low_frac"] == pytest.approx(0.25) and m["tokens"] == 4
    assert m["ratio_max"] == pytest.approx(1.5) and m["ratio_min"] == pytest.approx(0.5)
    loss.backward()
    # gradients only through the unclipped, unmasked tokens: d/dlogp of -A r = -A r / 4
    g = logp.grad
    assert g.tolist() == pytest.approx([0.0, 1.5 / 4, -0.5 / 4, 0.0, 0.0])


def test_kl_and_tis_hand_values():
    cfg = GRPOConfig(kl_coef=0.5, tis_cap=2.0)
    logp = torch.tensor([-1.0, -2.0])
    old = logp.clone()
    ref = torch.tensor([-1.5, -1.0])
    sampler = torch.tensor([-2.0, -1.5])          # w = min(e^{1}, 2) = 2, e^{-0.5}
    adv = torch.tensor([1.0, 1.0])
    mask = torch.ones(2, dtype=torch.bool)
    loss, m = grpo_loss(logp, old, adv, mask, cfg, ref_logp=ref, sampler_logp=sampler)
    d = torch.tensor([-0.5, 1.0])
    kl = torch.exp(d) - d - 1
    w = torch.tensor([2.0, math.exp(-0.5)])
    expect = ((w * -1.0 + 0.5 * kl).sum() / 2).item()
    assert float(loss) == pytest.approx(expect, rel=1e-6)
    assert m["kl"] == pytest.approx(float(kl.mean()), rel=1e-6)
    assert m["tis_capped_frac"] == pytest.approx(0.5)
    assert m["tis_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-6)


def test_on_policy_ratio_exactly_one():
    torch.manual_seed(0)
    logits = torch.randn(6, 11, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, 3]
    loss, m = grpo_loss(logp, logp.detach(), torch.randn(6), torch.ones(6, dtype=torch.bool))
    assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["clip_frac"] == 0.0


def test_shapes_checked_and_token_expansion():
    with pytest.raises(K3ConfigError, match="advantages has shape"):
        grpo_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2), torch.ones(3, dtype=torch.bool))
    assert tokens_from_trajectories([1.0, -2.0], [2, 3]).tolist() == [1.0, 1.0, -2.0, -2.0, -2.0]
    with pytest.raises(K3ConfigError):
        GRPOConfig(eps_low=1.5).validate()


def test_neg_adv_scale():
    """neg_adv_scale scales only the negative advantages (0: learn from the successes only)."""
    from k3.rl.loop import flatten_groups
    from k3.rl.rollout import Trajectory

    def traj(r):
        t = Trajectory("x", 0, 0, 0, {}, [1, 2], [False, True], 1)
        t.reward = r
        return t
    groups = [[traj(1.0), traj(0.0), traj(0.0), traj(0.0)]]
    _, full = flatten_groups(groups, GRPOConfig(group_size=4))
    _, half = flatten_groups(groups, GRPOConfig(group_size=4, neg_adv_scale=0.5))
    _, pos = flatten_groups(groups, GRPOConfig(group_size=4, neg_adv_scale=0.0))
    assert full[0] > 0 and all(a < 0 for a in full[1:])
    assert half == pytest.approx([full[0]] + [a / 2 for a in full[1:]]) and pos == pytest.approx([full[0], 0, 0, 0])
    with pytest.raises(K3ConfigError, match="neg_adv_scale"):
        GRPOConfig(neg_adv_scale=2.0).validate()
