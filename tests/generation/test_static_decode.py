"""StaticDecoder (k3.generation.static): the fused, shape-static decode step equals the normal cached decode."""
import pytest
import torch

from k3.errors import RequestError
from k3.generation import K3Cache, StaticDecoder, generate, stream_generate
from k3.generation.cache import KDALayerCache
from k3.generation.static import self_check

from conftest import build, micro_config


def _prefilled(model, prompts, max_length=64):
    cache = K3Cache.for_model(model, len(prompts), max_length=max_length)
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            model(torch.tensor([p]), cache=cache.rows(i))
            cache.rows(i).advance(len(p))
    return cache


def _compare(model, prompts, steps, seed=0):
    """Greedy-decode `steps` tokens with both paths from the same prompts; max logit diff and the two caches."""
    ref_c, st_c = _prefilled(model, prompts), _prefilled(model, prompts)
    dec = StaticDecoder(model, st_c, len(prompts))
    torch.manual_seed(seed)
    tok = torch.randint(0, model.config.vocab_size, (len(prompts), 1))
    err = 0.0
    for _ in range(steps):
        with torch.inference_mode():
            ref = model(tok, cache=ref_c).logits[:, -1]
        ref_c.advance(1)
        out = dec.step(tok)
        assert out.shape == ref.shape
        err = max(err, float((out - ref).abs().max()))
        tok = ref.argmax(-1, keepdim=True)
    return err, ref_c, st_c


def _prompts(n_rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (7, 3, 12, 1)[:n_rows]]


@pytest.mark.parametrize("all_mla", [False, True])
def test_static_equals_cached_fp64_ragged(all_mla):
    model = build(micro_config(all_mla=all_mla))
    err, a, b = _compare(model, _prompts(3), 30)
    assert err < 1e-10
    assert a.lengths == b.lengths
    for la, lb in zip(a.layers, b.layers):
        if isinstance(la, KDALayerCache):
            assert (la.state - lb.state).abs().max() < 1e-10
            assert (la.conv - lb.conv).abs().max() < 1e-10
        else:
            assert la.lengths == lb.lengths and la.lengths_t.tolist() == lb.lengths_t.tolist()
            for r, n in enumerate(la.lengths):
                assert (la.buf[r, :n] - lb.buf[r, :n]).abs().max() < 1e-10


def test_static_equals_cached_fp32_many_steps(model32):
    err, _, _ = _compare(model32, _prompts(4), 48)
    assert err <= 1e-5


def test_static_moe_dense_path_fp64():
    """N x top_k > experts: every expert runs on every token (the other MoE branch)."""
    model = build(micro_config(num_experts=4, num_experts_per_token=2))
    err, _, _ = _compare(model, _prompts(3), 12)
    assert err < 1e-10


def test_static_then_normal_decode_continues(model64):
    """The cache stays valid for the normal forward after static steps (same layout and lengths)."""
    prompts = _prompts(2)
    ref_c, mix_c = _prefilled(model64, prompts), _prefilled(model64, prompts)
    dec = StaticDecoder(model64, mix_c, 2)
    tok = torch.tensor([[3], [4]])
    with torch.inference_mode():
        for t in range(10):
            ref = model64(tok, cache=ref_c).logits[:, -1]
            ref_c.advance(1)
            if t < 5:
                out = dec.step(tok)
            else:
                out = model64(tok, cache=mix_c).logits[:, -1]
                mix_c.advance(1)
            assert (out - ref).abs().max() < 1e-10
            tok = ref.argmax(-1, keepdim=True)


def test_static_window_and_reallocation_checks(model64):
    cache = _prefilled(model64, [[1, 2, 3]], max_length=0)
    dec = StaticDecoder(model64, cache, 1, max_length=5)
    tok = torch.tensor([[7]])
    dec.step(tok)
    dec.step(tok)
    with pytest.raises(RuntimeError, match="full"):
        dec.step(tok)
    cache2 = _prefilled(model64, [[1, 2, 3]], max_length=0)
    dec2 = StaticDecoder(model64, cache2, 1)
    cache2.reserve(cache2._mla[0].capacity + 1)
    with pytest.raises(RuntimeError, match="reallocated"):
        dec2.step(tok)
    with pytest.raises(ValueError):
        StaticDecoder(model64, cache2, 2)


@pytest.mark.parametrize("sampling", [{}, dict(do_sample=True, seed=3, top_k=20, top_p=0.9, temperature=0.8,
                                               repetition_penalty=1.2)])
def test_generate_static_matches_default(model32, sampling):
    ids = [[1, 2, 3, 4, 5], [9, 8], [7, 7, 7]]
    a = generate(model32, ids, 16, return_dict=True, **sampling)
    b = generate(model32, ids, 16, return_dict=True, static=True, **sampling)
    assert a.new_tokens == b.new_tokens and a.finish_reasons == b.finish_reasons
    s = list(stream_generate(model32, [ids[0]], 8, static=True, **sampling))
    assert s == list(stream_generate(model32, [ids[0]], 8, static=False, **sampling))


def test_generate_static_options_errors(model32):
    with pytest.raises(RequestError):
        generate(model32, [[1, 2]], 2, cuda_graph=True)          # CPU model
    with pytest.raises(RequestError):
        generate(model32, [[1, 2]], 2, use_cache=False, static=True)


def test_self_check_cpu(model32):
    assert self_check(model32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_capture_matches_cached(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(micro_config(), torch.float32).to("cuda", dtype)
    prompts = _prompts(3)

    def prefilled():
        c = K3Cache.for_model(model, 3, max_length=64)
        with torch.inference_mode():
            for i, p in enumerate(prompts):
                model(torch.tensor([p], device="cuda"), cache=c.rows(i))
                c.rows(i).advance(len(p))
        return c

    ref_c, st_c = prefilled(), prefilled()
    dec = StaticDecoder(model, st_c, 3, cuda_graph=True)
    tok = torch.tensor([[3], [4], [5]], device="cuda")
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for t in range(12):
        with torch.inference_mode():
            ref = model(tok, cache=ref_c).logits[:, -1].float()
        ref_c.advance(1)
        out = dec.step(tok)
        assert float((out - ref).abs().max()) <= tol * max(1.0, float(ref.abs().max())), t
        tok = ref.argmax(-1, keepdim=True)
    assert dec.graph is not None                      # captured at step 2, replayed since
    assert self_check(model)
    ids = [[1, 2, 3], [4, 5]]
    a = generate(model, ids, 8, static=False, return_dict=True)
    b = generate(model, ids, 8, cuda_graph=True, return_dict=True)
    if dtype == torch.float32:
        assert a.new_tokens == b.new_tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_records_routing():
    """RL's record_routing on the CUDA-graph step: the captured step writes its picks into static buffers on every
    replay; the same routing as the module-level decode's router hooks (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(micro_config(), torch.float32).to("cuda")
    ids = [[1, 2, 3, 9], [4, 5], [7, 8, 6]]
    a = generate(model, ids, 10, static=False, record_routing=True, stop_token_ids=[])
    b = generate(model, ids, 10, cuda_graph=True, record_routing=True, stop_token_ids=[])
    assert a.new_tokens == b.new_tokens and a.routing is not None and b.routing is not None
    for ra, rb in zip(a.routing, b.routing):
        assert list(ra) == list(rb)
        for name in ra:
            assert (rb[name][:-1] >= 0).all() and torch.equal(ra[name], rb[name]), name


@pytest.mark.slow
def test_static_compiled_equals_cached(model32):
    """compile=True (torch.compile of the step) decodes the same tokens with the same logits (fp32 rounding)."""
    prompts = _prompts(3)
    ref_c, st_c = _prefilled(model32, prompts), _prefilled(model32, prompts)
    dec = StaticDecoder(model32, st_c, 3, compile=True)
    tok = torch.tensor([[5], [6], [7]])
    for _ in range(6):
        with torch.inference_mode():
            ref = model32(tok, cache=ref_c).logits[:, -1]
        ref_c.advance(1)
        out = dec.step(tok)
        assert float((out - ref).abs().max()) <= 1e-4
        tok = ref.argmax(-1, keepdim=True)
    assert ref_c.lengths == st_c.lengths


def test_static_compiled_writes_cache_in_place(model32):
    """Under compile=True the new latent row goes into the cache buffer in place: the generated code allocates no
    copy of the MLA window (an index_put_ into the window *view* was functionalized into one copy per MLA layer and
    step: 1.2 GB per layer at 1M tokens on the H200, benchmarks/RESULTS.md, fifth session)."""
    from torch._inductor.utils import run_and_get_code
    prompts = _prompts(3)
    st_c = _prefilled(model32, prompts)                       # capacity 64 tokens per row
    W = 41                                                    # window < capacity: the buffer is sliced
    dec = StaticDecoder(model32, st_c, 3, max_length=W, compile=True)
    tok = torch.tensor([[5], [6], [7]])
    _, code = run_and_get_code(dec.step, tok)
    src = "\n".join(code)
    assert "index_put" in src or "scatter" in src or "store" in src  # the step was compiled and captured
    assert f"empty_strided_cpu((3, {W}, " not in src, [ln for ln in src.splitlines() if f"(3, {W}, " in ln][:3]
