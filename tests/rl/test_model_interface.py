"""K3ForCausalLM.token_logprobs and forward(routing=...): the interfaces other RL engines use."""
import torch

from k3.generation import generate
from k3.rl.logprobs import token_logprobs
from k3.rl.routing import routers


def test_model_token_logprobs_delegates(toy_tok, toy_model):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    mask = torch.tensor([[False, False, True, True, False, True]])
    a = toy_model.token_logprobs(ids, mask, chunk=2)
    b = token_logprobs(toy_model, ids, mask)
    assert torch.equal(a, b) and a.dtype == torch.float32 and (a[mask] < 0).all() and (a[~mask] == 0).all()


def test_forward_with_replayed_routing(toy_tok, toy_model):
    prompt = [5, 6, 7, 8, 9]
    out = generate(toy_model, [prompt], 4, seed=0, record_routing=True, stop_token_ids=[])
    ids = torch.tensor([prompt + out.new_tokens[0]])
    picks = out.routing[0]
    live = toy_model(ids).logits
    replay = toy_model(ids, routing=picks).logits
    torch.testing.assert_close(replay, live, atol=1e-5, rtol=1e-5)   # the sampler's own choices
    # other choices change the output; the router still gets a gradient through the replayed weights
    k = toy_model.config.num_experts_per_token
    E = toy_model.config.num_experts
    other = {n: (torch.arange(k).expand(v.shape[0], k) + 1) % E for n, v in picks.items()}
    m = toy_model.train()
    try:
        o = m(ids, labels=ids.roll(-1, 1), routing=other)
        assert not torch.allclose(m(ids, routing=other).logits, live)
        o.loss.backward()
        name, r = routers(m)[0]
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in r.parameters())
    finally:
        m.zero_grad(set_to_none=True)
        m.eval()
    lp = toy_model.token_logprobs(ids, routing=picks)
    torch.testing.assert_close(lp, toy_model.token_logprobs(ids), atol=1e-5, rtol=1e-5)
