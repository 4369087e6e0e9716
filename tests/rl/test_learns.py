"""The RL update actually learns: with reward 1 iff the sampled token is in a target set, a few GRPO steps on
samples drawn by `k3.generate` (sampler log-probs, recorded routing replayed in training, AdamW) raise the
probability of that set. Catches a flipped advantage sign, a loss that pushes the wrong log-probs, or masks that
leave the generated tokens without gradient."""
import pytest
import torch

from k3.generation import generate
from k3.rl.grpo import GRPOConfig
from k3.rl.logprobs import token_logprobs
from k3.rl.loop import flatten_groups, grpo_update
from k3.rl.rollout import Trajectory


def _hidden(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt]), return_logits=False).hidden_states[0, -1]


def _prob(model, prompt, token):
    with torch.no_grad():
        return float(torch.softmax(model.lm_head(_hidden(model, prompt)).float(), -1)[token])


def _plant(model, prompt, token, p):
    """Shift the head row of `token` along the prompt's last hidden state so that p(token | prompt) == p: a
    random model is near uniform over the vocabulary, and the test wants a token sampled a few times per group."""
    h = _hidden(model, prompt)
    with torch.no_grad():
        logits = model.lm_head(h).float()
        rest = torch.logsumexp(torch.cat([logits[:token], logits[token + 1:]]), 0)
        want = rest + torch.log(torch.tensor(p / (1 - p)))
        model.lm_head.weight[token] += (want - logits[token]) * h / h.dot(h)
    assert abs(_prob(model, prompt, token) - p) < 1e-3


def _groups(model, prompt, target_set, G, seed):
    out = generate(model, [prompt] * G, 1, do_sample=True, temperature=1.0, seed=seed, return_logprobs=True,
                   record_routing=True, static=False, cuda_graph=False, stop_token_ids=[])
    trajs = []
    for i in range(G):
        tok = int(out.new_tokens[i][0])
        t = Trajectory("toy", 0, 0, i, {}, list(prompt) + [tok], [False] * len(prompt) + [True], len(prompt),
                       sampler_logprobs=[0.0] * len(prompt) + [float(out.logprobs[i][0])],
                       routing={k: v[:len(prompt) + 1].clone() for k, v in out.routing[i].items()})
        t.reward = 1.0 if tok in target_set else 0.0
        t.done = True
        trajs.append(t)
    return [trajs]


def _step(model, opt, prompt, rewarded, seed, G=16, clip=None):
    cfg = GRPOConfig(group_size=G)
    model.eval()
    trajs, adv = flatten_groups(_groups(model, prompt, rewarded, G, seed=seed), cfg)
    model.train()
    m = grpo_update(model, opt, trajs, adv, cfg, max_grad_norm=clip)
    model.eval()
    assert m["tokens"] == G                       # exactly the sampled tokens are trained
    assert m["ratio_min"] == m["ratio_max"] == 1.0   # the first (only) epoch is on-policy
    # the sampler's log-probs are the trainer's (same model, same routing): TIS weight 1
    assert abs(m["tis_weight_mean"] - 1.0) < 1e-3
    return [t.token_ids[-1] for t in trajs], adv


@pytest.mark.parametrize("sign", [1, -1])
def test_one_small_step_moves_the_rewarded_token(toy_tok, make_tiny_model, sign):
    """First order: one small SGD step on reward 1 iff the planted token is sampled raises its probability;
    reward 1 iff it is *not* sampled lowers it (advantage sign, loss direction, masks)."""
    model = make_tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id, seed=3)
    prompt = toy_tok.encode("the cat sat on the")
    target = 42
    _plant(model, prompt, target, 0.2)
    rewarded = {target} if sign > 0 else set(range(model.config.vocab_size)) - {target}
    lr = 1e-5
    toks, adv = _step(model, torch.optim.SGD(model.parameters(), lr=lr), prompt, rewarded, seed=100)
    assert target in toks and any(a != 0 for a in adv)
    dp = (_prob(model, prompt, target) - 0.2) / lr
    assert sign * dp > 1.0, dp


def test_grpo_steps_raise_rewarded_token_probability(toy_tok, make_tiny_model):
    """A dozen GRPO steps (fresh samples each step) raise p(target) well above where it started."""
    model = make_tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id, seed=3)
    prompt = toy_tok.encode("the cat sat on the")
    target = 42
    _plant(model, prompt, target, 0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.03)
    ps = []
    for step in range(12):
        _step(model, opt, prompt, {target}, seed=100 + step, clip=1.0)
        ps.append(round(_prob(model, prompt, target), 3))
    assert ps[-1] > 0.25 and ps[-1] > min(ps) + 0.1, ps
