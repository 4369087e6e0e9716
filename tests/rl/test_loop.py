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


def test_grpo_update_spends_one_forward_per_epoch(toy_tok, make_tiny_model):
    """The old log-probs are the first epoch's own (detached): one model forward per epoch, and the same parameters
    as the textbook step (old log-probs from a separate no-grad forward, then per epoch the clipped loss, backward,
    SGD), for 1 and 2 epochs (the second epoch is off-policy: its ratios differ from 1)."""
    import copy
    from k3.rl.grpo import grpo_loss
    model = make_tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id, seed=7)
    eng = RolloutEngine(model, toy_tok, "calculator", RolloutConfig(group_size=2, max_new_tokens_per_turn=6,
                                                                    max_turns=1, seed=4))
    cfg = GRPOConfig(group_size=2, tis_cap=2.0)
    trajs, _ = flatten_groups(eng.collect([23]), cfg)
    adv = [1.0, -1.0]
    for epochs in (1, 2):
        a, b = copy.deepcopy(model).train(), copy.deepcopy(model).train()
        calls = []
        h = a.model.embed_tokens.register_forward_pre_hook(lambda *_: calls.append(1))
        grpo_update(a, torch.optim.SGD(a.parameters(), lr=0.2), trajs, adv, cfg, epochs=epochs, max_grad_norm=None)
        h.remove()
        assert len(calls) == epochs
        pk = pack_trajectories(trajs, adv)
        ids, cu, mask = pk["input_ids"], pk["cu_seqlens"], pk["mask"]
        with torch.no_grad(), replay_routing(b, pk["routing"]):
            old = token_logprobs(b, ids, mask, cu)
        opt = torch.optim.SGD(b.parameters(), lr=0.2)
        for _ in range(epochs):
            opt.zero_grad(set_to_none=True)
            with replay_routing(b, pk["routing"]):
                lp, ent = token_logprobs(b, ids, mask, cu, return_entropy=True)
            loss, _ = grpo_loss(lp, old, pk["advantages"], mask, cfg, sampler_logp=pk.get("sampler_logp"),
                                entropy=ent)
            loss.backward()
            opt.step()
        moved = 0.0
        for (n, pa), pb, p0 in zip(a.named_parameters(), b.parameters(), model.parameters()):
            assert torch.allclose(pa, pb, rtol=0, atol=1e-6), n
            moved = max(moved, float((pa - p0).detach().abs().max()))
        assert moved > 1e-4                                               # the step did something
