"""Chunked token log-probs == a plain full-logits log_softmax gather; on-policy ratio exactly 1; routing replay."""
import pytest
import torch

from k3.rl.grpo import grpo_loss
from k3.rl.logprobs import token_logprobs
from k3.rl.routing import replay_routing, routers



@pytest.fixture(scope="module")
def model(make_tiny_model):
    return make_tiny_model(96, 90, 95, 88, seed=1, dtype=torch.float64)


def _reference(model, ids, cu=None, temperature=1.0):
    logits = model(ids, cu_seqlens=cu).logits.double() / temperature
    lp = torch.log_softmax(logits, -1)
    ent = -(lp.exp() * lp).sum(-1)
    out = torch.zeros(ids.shape, dtype=torch.float64)
    eo = torch.zeros(ids.shape, dtype=torch.float64)
    out[:, 1:] = lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    eo[:, 1:] = ent[:, :-1]
    return out, eo


@pytest.mark.parametrize("chunk", [1, 5, 0])
def test_matches_full_gather(model, chunk):
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 13))
    lp, ent = token_logprobs(model, ids, chunk=chunk, return_entropy=True, temperature=0.7)
    ref, rent = _reference(model, ids, temperature=0.7)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp.double(), ref, atol=1e-5) and torch.all(lp[:, 0] == 0)
    assert torch.allclose(ent.double(), rent, atol=1e-5)


def test_packed_and_masked(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (1, 20))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    mask = torch.rand(1, 20) > 0.3
    lp = token_logprobs(model, ids, mask, cu_seqlens=cu, chunk=4)
    ref, _ = _reference(model, ids, cu)
    ref[0, 7] = 0.0                 # first token of the second segment has no prediction
    ref[~mask] = 0.0
    assert torch.allclose(lp.double(), ref, atol=1e-5)
    # same values as the two segments run separately
    a = token_logprobs(model, ids[:, :7], chunk=4)
    assert torch.allclose(lp[0, :7][mask[0, :7]], a[0][mask[0, :7]], atol=1e-6)


def test_gradient_matches_and_ratio_exactly_one(model):
    torch.manual_seed(2)
    ids = torch.randint(0, 96, (1, 11))
    mask = torch.ones(1, 11, dtype=torch.bool)
    with torch.no_grad():
        old = token_logprobs(model, ids, mask, chunk=3)
    model.zero_grad()
    lp = token_logprobs(model, ids, mask, chunk=3)
    assert torch.equal(lp.detach(), old)
    loss, m = grpo_loss(lp, old, torch.ones_like(lp), mask)
    assert m["ratio_min"] == 1.0 == m["ratio_max"]
    loss.backward()
    g = model.lm_head.weight.grad.clone()
    model.zero_grad()
    ref, _ = _reference(model, ids)
    (-(ref[:, 1:].sum()) / 11).backward()   # loss = -mean(A * ratio) with A = 1 over 11 tokens (t=0 contributes 0)
    assert torch.allclose(g, model.lm_head.weight.grad, atol=1e-8)
    model.zero_grad()


def test_replay_routing_identity_and_override(model):
    torch.manual_seed(3)
    ids = torch.randint(0, 96, (1, 9))
    picks = {}

    def rec(name):
        def hook(mod, inp, out):
            picks[name] = out[0].detach().clone()
        return hook
    hs = [m.register_forward_hook(rec(n)) for n, m in routers(model)]
    with torch.no_grad():
        base = token_logprobs(model, ids)
    for h in hs:
        h.remove()
    with torch.no_grad(), replay_routing(model, picks):
        same = token_logprobs(model, ids)
    assert torch.equal(base, same)
    # all -1: live routing, same result; flipped picks: different result
    live = {k: torch.full_like(v, -1) for k, v in picks.items()}
    with torch.no_grad(), replay_routing(model, live):
        assert torch.equal(token_logprobs(model, ids), base)
    E = model.config.num_experts
    other = {k: (v + 1) % E for k, v in picks.items()}
    with torch.no_grad(), replay_routing(model, other):
        assert not torch.allclose(token_logprobs(model, ids), base)
    # router still gets gradients under replay
    with replay_routing(model, other):
        token_logprobs(model, ids).sum().backward()
    name, r = routers(model)[0]
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    model.zero_grad()
    from k3.rl.routing import RoutingReplayError
    with pytest.raises(RoutingReplayError, match="picks"):
        with torch.no_grad(), replay_routing(model, picks):
            token_logprobs(model, ids[:, :5])
