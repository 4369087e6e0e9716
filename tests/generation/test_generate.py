"""generate / stream_generate: cache vs no cache, ragged batches, stops, sampling, cancellation."""
import threading

import pytest
import torch

import k3
from k3.generation import (GenerationEvent, SamplingParams, apply_repetition_penalty, generate, process_logits,
                           select_next, stream_generate, top_k_mask, top_p_mask)

NOSTOP = dict(stop_token_ids=[])


def test_greedy_same_with_and_without_cache(model32):
    torch.manual_seed(10)
    ids = torch.randint(0, 512, (1, 9))
    a = generate(model32, ids, 12, use_cache=True, **NOSTOP)
    b = generate(model32, ids, 12, use_cache=False, **NOSTOP)
    assert a.shape == (1, 21) and torch.equal(a, b) and torch.equal(a[:, :9], ids)
    assert k3.generate is generate


def test_ragged_batch_equals_one_at_a_time(model64):
    torch.manual_seed(11)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (4, 13, 8)]
    out = generate(model64, prompts, 7, return_dict=True, prefill_chunk_size=5, **NOSTOP)
    for i, p in enumerate(prompts):
        single = generate(model64, [p], 7, **NOSTOP)[0].tolist()
        assert out.new_tokens[i] == single[len(p):]
        assert out.sequences[i, :len(single)].tolist() == single
    # padded tensor + lengths is the same request
    pad = torch.full((3, 13), 511)
    for i, p in enumerate(prompts):
        pad[i, :len(p)] = torch.tensor(p)
    out2 = generate(model64, pad, 7, lengths=[4, 13, 8], return_dict=True, **NOSTOP)
    assert out2.new_tokens == out.new_tokens


def test_chunked_prefill_same_tokens(model64):
    torch.manual_seed(12)
    ids = torch.randint(0, 512, (2, 23))
    a = generate(model64, ids, 5, prefill_chunk_size=None, **NOSTOP)
    b = generate(model64, ids, 5, prefill_chunk_size=4, **NOSTOP)
    assert torch.equal(a, b)


def test_stop_token_and_max_new_tokens(model32):
    torch.manual_seed(13)
    ids = torch.randint(0, 512, (1, 6))
    free = generate(model32, ids, 10, return_dict=True, **NOSTOP)
    assert free.finish_reasons == ["length"] and len(free.new_tokens[0]) == 10
    stop = free.new_tokens[0][3]
    first = free.new_tokens[0].index(stop)
    out = generate(model32, ids, 10, stop_token_ids=[stop], return_dict=True)
    assert out.finish_reasons == ["stop_token"] and out.new_tokens[0] == free.new_tokens[0][:first + 1]
    assert generate(model32, ids, 0).shape == (1, 6)


def test_stop_string_with_tokenizer(model32):
    class CharTok:  # one character per id (a..z cycling), no specials
        vocab_size = 512
        stop_ids = []

        def decode(self, ids, skip_special=False):
            return "".join(chr(97 + i % 26) for i in ids)

    tok = CharTok()
    torch.manual_seed(14)
    ids = torch.randint(0, 512, (1, 6))
    free = generate(model32, ids, 10, tokenizer=tok, return_dict=True)
    text = free.texts[0]
    target = text[4:6]
    out = generate(model32, ids, 10, tokenizer=tok, stop_strings=[target], return_dict=True)
    assert out.finish_reasons == ["stop_string"]
    cut = text.find(target)
    assert out.texts[0] == text[:cut] and len(out.new_tokens[0]) == cut + len(target)
    chunks = list(stream_generate(model32, ids, 10, tokenizer=tok, stop_strings=[target], output="text"))
    assert "".join(chunks) == text[:cut]


def test_seed_determinism_and_sampling(model32):
    torch.manual_seed(15)
    ids = torch.randint(0, 512, (2, 5))
    kw = dict(do_sample=True, temperature=1.5, top_k=50, top_p=0.95, repetition_penalty=1.2, **NOSTOP)
    a = generate(model32, ids, 8, seed=123, **kw)
    b = generate(model32, ids, 8, seed=123, **kw)
    c = generate(model32, ids, 8, seed=124, **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_stream_ids_and_events(model32):
    torch.manual_seed(16)
    ids = torch.randint(0, 512, (1, 5))
    toks = list(stream_generate(model32, ids, 6, **NOSTOP))
    assert all(isinstance(t, int) for t in toks)
    assert toks == generate(model32, ids, 6, **NOSTOP)[0, 5:].tolist()
    evs = list(stream_generate(model32, [[1, 2], [3, 4, 5]], 3, output="events", **NOSTOP))
    assert all(isinstance(e, GenerationEvent) and len(e.tokens) == 2 for e in evs) and len(evs) == 3


def test_cancellation(model32):
    ev = threading.Event()
    got = []
    for t in stream_generate(model32, [[1, 2, 3]], 50, cancel=ev, **NOSTOP):
        got.append(t)
        if len(got) == 2:
            ev.set()
    assert len(got) == 2
    calls = []
    out = generate(model32, [[1, 2, 3]], 50, cancel=lambda: len(calls.append(0) or calls) > 4, return_dict=True,
                   **NOSTOP)
    assert out.finish_reasons == ["cancelled"] and len(out.new_tokens[0]) < 50


def test_bad_requests(model32):
    from k3.errors import RequestError
    with pytest.raises(RequestError):
        generate(model32, [[]], 3)
    with pytest.raises(RequestError):
        generate(model32, [[1, 10_000]], 3)
    with pytest.raises(RequestError):
        generate(model32, [[1]], 3, do_sample=True, top_p=0.0)


# ------------------------------------------------------------------ masks on hand-made logits
def test_top_k_mask():
    x = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    m = top_k_mask(x, 2)
    assert torch.isinf(m).tolist() == [[True, False, True, False, True]]
    assert torch.equal(top_k_mask(x, 0), x) and torch.equal(top_k_mask(x, 9), x)


def test_top_p_mask():
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    x = p.log()
    keep = lambda q: (~torch.isinf(top_p_mask(x, q))).tolist()[0]
    assert keep(0.5) == [True, False, False, False, False]
    assert keep(0.6) == [True, True, False, False, False]
    assert keep(0.7) == [True, True, False, False, False]      # 0.5+0.2 reaches 0.7 (float: allow one more)
    assert keep(0.71) == [True, True, True, False, False]
    assert keep(0.01) == [True, False, False, False, False]    # never empty
    # unsorted input: mask follows the tokens
    perm = torch.tensor([3, 0, 4, 1, 2])
    assert (~torch.isinf(top_p_mask(x[:, perm], 0.6))).tolist()[0] == [False, True, False, True, False]


def test_repetition_penalty_and_temperature():
    x = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    assert apply_repetition_penalty(x, seen, 2.0).tolist() == [[1.0, -4.0, 1.0]]
    y = process_logits(x, SamplingParams(do_sample=True, temperature=0.5))
    assert torch.allclose(y, x * 2)
    assert select_next(x, SamplingParams()).tolist() == [0]
    g = torch.Generator().manual_seed(0)
    draws = {select_next(torch.tensor([[0.0, 0.0, -1e9]]), SamplingParams(do_sample=True), generator=g).item()
             for _ in range(50)}
    assert draws == {0, 1}


# ------------------------------------------------------------------ numerical safety of sampling (issue 28.1)
DEGENERATE = [dict(do_sample=True, temperature=1e-300), dict(do_sample=True, temperature=0.7, top_p=1e-300),
              dict(do_sample=True, temperature=0.7, repetition_penalty=1e-300),
              dict(do_sample=True, temperature=0.7, repetition_penalty=1e300),
              dict(do_sample=False, repetition_penalty=1e-300), dict(do_sample=True, temperature=1e300)]


@pytest.mark.parametrize("kw", DEGENERATE)
def test_degenerate_sampling_never_raises(kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50) * 30
    seen = torch.rand(3, 50) < 0.5
    t = select_next(x, SamplingParams(**kw), seen, g)
    assert t.shape == (3,) and bool(((t >= 0) & (t < 50)).all())
    assert not torch.isnan(process_logits(x, SamplingParams(**kw), seen)).any()


def test_tiny_temperature_is_greedy_and_nonfinite_logits_are_handled():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 40)
    assert torch.equal(select_next(x, SamplingParams(do_sample=True, temperature=1e-300), generator=g), x.argmax(-1))
    y = x.clone()
    y[0] = float("nan")                        # a whole row of NaN: no raise, some token
    y[1, 7] = float("nan")                     # a NaN entry is never chosen
    y[1, 3] = float("inf")                     # +inf wins
    y[2, :] = float("-inf")
    for p in (SamplingParams(), SamplingParams(do_sample=True, temperature=0.9, top_p=0.5, top_k=5)):
        t = select_next(y, p, generator=g).tolist()
        assert t[1] == 3 and all(0 <= v < 40 for v in t)
    z = x.clone()
    z[3] = float("nan")
    z[3, 11] = 5.0
    assert select_next(z, SamplingParams(do_sample=True), generator=g).tolist()[3] == 11


def test_sampling_params_validate_non_finite():
    from k3.errors import RequestError
    for kw in (dict(temperature=float("nan"), do_sample=True), dict(top_p=float("nan")),
               dict(repetition_penalty=float("inf")), dict(top_k=1.5)):
        with pytest.raises(RequestError):
            SamplingParams(**kw).validate()


def test_generate_with_degenerate_sampling(model32):
    torch.manual_seed(21)
    ids = torch.randint(0, 512, (2, 5))
    greedy = generate(model32, ids, 6, **NOSTOP)
    assert torch.equal(generate(model32, ids, 6, do_sample=True, temperature=1e-300, seed=0, **NOSTOP), greedy)
    for kw in DEGENERATE:
        out = generate(model32, ids, 4, seed=1, **{**kw, **NOSTOP})
        assert out.shape == (2, 9)


# ------------------------------------------------------------------ incremental text (issue 28.3)
@pytest.fixture(scope="module")
def toy_tok(tmp_path_factory):
    from k3.tokenizer import build_toy_tokenizer
    return build_toy_tokenizer(str(tmp_path_factory.mktemp("toytok")), num_merges=100)


def test_text_stream_equals_full_decode_and_cuts_stops(toy_tok):
    from k3.generation.generate import _decode, TextStream
    tok = toy_tok
    text = "héllo wörld — 日本語 text 🙂 more words, numbers 123 and ünïcödé; the end. " * 3
    ids = tok.encode(text)
    rng = torch.Generator().manual_seed(0)
    for trial in range(30):
        seq = list(ids)
        if trial % 3 == 1:          # random ordinary ids (cut multi-byte characters included) and specials
            seq = torch.randint(0, tok.vocab_size, (60,), generator=rng).tolist()
        full = _decode(tok, seq)
        stops = [] if trial % 2 == 0 else [full[j:j + n] for j, n in ((len(full) // 2, 3), (len(full) // 3, 2))
                                            if full[j:j + n]]
        ts = TextStream(tok, stops)
        parts = []
        for t in seq:
            parts.append(ts.push(t))
            if ts.stopped:
                break
        parts.append(ts.finish())
        got = "".join(parts)
        if not stops:
            assert got == full and ts.cut == -1
        else:
            cut = min(h for h in (full.find(s) for s in stops) if h >= 0)
            assert ts.stopped and ts.cut == cut and got == full[:cut]
            # every piece sent before the stop is a prefix of the final text (nothing is taken back)
            assert full.startswith("".join(parts[:-1]))


def test_text_stream_work_per_token_is_bounded(toy_tok):
    """No re-decoding of the whole output: every decode call sees at most a few ids, however long the text."""
    from k3.generation.generate import MAX_PENDING_IDS, TextStream
    tok = toy_tok
    sizes = []
    real = tok.decode

    class Spy:
        vocab_size = tok.vocab_size
        is_special = staticmethod(tok.is_special)

        def decode(self, ids, skip_special=False):
            sizes.append(len(ids))
            return real(ids, skip_special=skip_special)

    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 200)
    ts = TextStream(Spy(), ["zzzz", "lazy cat", "qq", "fox jumps under"])
    out = "".join(ts.push(t) for t in ids) + ts.finish()
    assert out == real(ids) and not ts.stopped
    assert max(sizes) <= MAX_PENDING_IDS + 1 and len(sizes) <= 2 * len(ids) + 2
