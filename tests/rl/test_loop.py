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
