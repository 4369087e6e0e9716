"""One GRPO update on real rollouts of a random tiny model: ratio 1 on-policy, direction of the update, metrics."""
import json

import torch

from k3.rl.grpo import GRPOConfig
from k3.rl.logprobs import token_logprobs
from k3.rl.loop import flatten_groups, grpo_update, metrics_row
from k3.rl.rollout import RolloutConfig, RolloutEngine, pack_trajectories
from k3.rl.routing import replay_routing


def test_grpo_update_on_rollouts(toy_tok, make_tiny_model):
    model = make_tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id, seed=5)
    eng = RolloutEngine(model, toy_tok, "calculator",
                        RolloutConfig(group_size=2, max_new_tokens_per_turn=5, max_turns=1, seed=2,
                                      recompute_logprobs=True))
    groups = eng.collect([21])
    cfg = GRPOConfig(group_size=2, tis_cap=2.0)
    trajs, adv = flatten_groups(groups, cfg)
    assert adv == [0.0, 0.0]                   # random model: both rewards 0
    adv = [1.0, -1.0]                          # force a direction
    b = pack_trajectories(trajs, adv)

    def gen_logp():
        with torch.no_grad(), replay_routing(model, b["routing"]):
            lp = token_logprobs(model, b["input_ids"], b["mask"], b["cu_seqlens"])
        s = b["starts"][1]
        return float(lp[0, :s].sum()), float(lp[0, s:].sum())

    before = gen_logp()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    m = grpo_update(model, opt, trajs, adv, cfg)
    model.eval()
    assert m["ratio_min"] == 1.0 == m["ratio_max"] and m["clip_frac"] == 0.0
    assert m["tis_weight_mean"] == 1.0          # trainer and (recomputed, replayed) sampler agree exactly
    assert m["tokens"] == sum(t.num_generated for t in trajs) and m["entropy"] > 0
    after = gen_logp()
    assert after[0] > before[0] and after[1] < before[1]
    row = metrics_row(1, trajs, m, rollout_s=0.5, train_s=0.25)
    line = json.dumps(row, allow_nan=False)
    assert {"step", "reward_mean", "reward_std", "kl", "entropy", "clip_frac", "rollout_tokens_per_s",
            "train_tokens_per_s"} <= set(json.loads(line))


def test_grpo_update_under_bf16_autocast(toy_tok, make_tiny_model):
    """RLConfig.train_dtype bf16 (the CUDA default; torch.autocast on CPU here): the old and new log-probs share the
    autocast, so the first ratio is still exactly 1; weights and gradients stay fp32, and the gradient is the fp32
    update's up to bf16 rounding (cosine > 0.99); the sampler's fp32 log-probs now differ (TIS weights != 1)."""
    import copy
    model = make_tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id, seed=6)
    eng = RolloutEngine(model, toy_tok, "calculator", RolloutConfig(group_size=2, max_new_tokens_per_turn=6,
                                                                    max_turns=1, seed=3))
    trajs, _ = flatten_groups(eng.collect([22]), GRPOConfig(group_size=2))
    adv = [1.0, -1.0]
    grads, ms = {}, {}
    for name, dt in (("fp32", None), ("bf16", torch.bfloat16)):
        m = copy.deepcopy(model).train()
        ms[name] = grpo_update(m, torch.optim.SGD(m.parameters(), lr=0.0), trajs, adv,
                               GRPOConfig(group_size=2, tis_cap=2.0), autocast_dtype=dt)
        assert all(p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
                   for p in m.parameters())
        grads[name] = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    for m in ms.values():
        assert m["ratio_min"] == 1.0 == m["ratio_max"]
    assert ms["fp32"]["tis_weight_mean"] == 1.0 != ms["bf16"]["tis_weight_mean"]
    g32, g16 = grads["fp32"], grads["bf16"]
    assert g32.shape == g16.shape and float(g32.norm()) > 0
    cos = float(torch.nn.functional.cosine_similarity(g32, g16, dim=0))
    assert 0.99 < cos < 1.0, cos
