"""k3.generate(return_logprobs=True, record_routing=True): same tokens as the default path, log-probs of the
distribution actually sampled (temperature, penalty, top-k/top-p truncation), routing per row."""
import math

import pytest
import torch

from k3.errors import RequestError
from k3.generation import generate
from k3.generation.sampling import SamplingParams, process_logits


@pytest.mark.parametrize("kw", [dict(), dict(do_sample=True, temperature=0.8),
                                dict(do_sample=True, temperature=1.3, top_k=5, top_p=0.9, repetition_penalty=1.2)])
def test_same_tokens_and_logprobs_of_the_sampled_distribution(toy_tok, toy_model, kw):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]                      # ragged
    ref = generate(toy_model, prompts, 6, seed=3, return_dict=True, stop_token_ids=[], **kw)
    out = generate(toy_model, prompts, 6, seed=3, return_logprobs=True, stop_token_ids=[], **kw)
    assert out.new_tokens == ref.new_tokens                   # the extra output changes no draw
    params = SamplingParams(**{k: v for k, v in kw.items()})
    for i, p in enumerate(prompts):
        assert len(out.logprobs[i]) == len(out.new_tokens[i])
        seq = list(p)
        for s, tok in enumerate(out.new_tokens[i]):
            with torch.no_grad():
                logits = toy_model(torch.tensor([seq]), logits_to_keep=1).logits[:, -1].float()
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[0, torch.tensor(seq)] = True
            x = process_logits(logits, params, seen)
            want = float(torch.log_softmax(x, -1)[0, tok])
            assert math.isfinite(want) and abs(out.logprobs[i][s] - want) < 1e-4, (i, s)
            seq.append(tok)


def test_truncation_is_part_of_the_sampled_distribution(toy_tok, toy_model):
    """top_k=1 keeps one token: it is drawn with probability 1, so its sampler log-prob is exactly 0."""
    b = generate(toy_model, [[5, 6, 7]], 4, seed=1, do_sample=True, top_k=1, return_logprobs=True,
                 stop_token_ids=[])
    g = generate(toy_model, [[5, 6, 7]], 4, return_logprobs=True, stop_token_ids=[])
    assert b.new_tokens == g.new_tokens and b.logprobs[0] == [0.0] * 4
    assert all(x < 0 for x in g.logprobs[0])      # greedy: the argmax under the untruncated logits


def test_record_routing(toy_tok, toy_model):
    out = generate(toy_model, [[5, 6, 7, 8], [9, 10, 11, 12]], 3, seed=0, record_routing=True,
                   stop_token_ids=[], prefill_chunk_size=2)
    k = toy_model.config.num_experts_per_token
    assert out.routing is not None and len(out.routing) == 2
    for r in out.routing:
        assert r and all(v.shape == (4 + 3, k) for v in r.values())
        assert all((v[:-1] >= 0).all() and (v[-1] == -1).all() for v in r.values())
    with pytest.raises(RequestError, match="record_routing"):
        generate(toy_model, [[5, 6]], 2, record_routing=True, use_cache=False)


@pytest.mark.parametrize("rows", [2, 3])   # the static step's gathered (rows x k <= experts) and dense expert paths
def test_record_routing_through_the_static_step(toy_tok, make_tiny_model, monkeypatch, rows):
    """The static (CUDA-graph on CUDA) decode step writes its picks into static buffers: the same routing, per row
    and position, as the module-level decode's router hooks (fp64: no near-ties), and the same tokens."""
    from k3.generation.static import StaticDecoder
    m = make_tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id, seed=1,
                        dtype=torch.float64)
    prompts = [[5, 6, 7, 8, 9], [9, 10, 11], [13, 14, 15, 16]][:rows]       # ragged
    kw = dict(seed=2, do_sample=True, record_routing=True, stop_token_ids=[], prefill_chunk_size=2)
    ref = generate(m, prompts, 6, static=False, **kw)
    steps = []
    step = StaticDecoder.step
    monkeypatch.setattr(StaticDecoder, "step", lambda self, ids: steps.append(1) or step(self, ids))
    out = generate(m, prompts, 6, static=True, cuda_graph=False, **kw)
    assert len(steps) == 5 and out.new_tokens == ref.new_tokens
    assert out.routing is not None and ref.routing is not None
    for i, (a, b) in enumerate(zip(ref.routing, out.routing)):
        assert list(a) == list(b) and len(a) == 3                         # the 3 MoE layers of the toy model
        for name in a:
            assert (b[name][:-1] >= 0).all(), (i, name)
            assert torch.equal(a[name], b[name]), (i, name)
