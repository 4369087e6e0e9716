"""KDA ops: chunked path vs the token-by-token reference (values, states, gradients), gate, varlen, dispatch."""

import pytest
import torch
import torch.nn.functional as F

from helpers import max_rel_err
from k3.ops import dispatch
from k3.ops.kda import chunk_kda, kda_gate, recurrent_kda, register_kda_backend
from k3.ops.kda import _IMPLS
from k3.ops.kda.chunk import tile_size

F64 = torch.float64


def make(B=1, T=70, H=2, K=16, V=8, dtype=F64, g_lo=-5.0, g_hi=0.0, seed=0, unit_k=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    if unit_k:
        k = F.normalize(k, dim=-1)
    g = g_lo + (g_hi - g_lo) * torch.rand(B, T, H, K, generator=gen, dtype=F64)
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def both(*args, **kw):
    o1, s1 = recurrent_kda(*args, output_final_state=True, **kw)
    o2, s2 = chunk_kda(*args, output_final_state=True, **kw)
    return o1, s1, o2, s2


@pytest.mark.parametrize("T", [1, 15, 63, 64, 65, 130])
def test_chunk_matches_recurrent_fp64(T):
    q, k, v, g, beta = make(B=2, T=T, seed=T)
    h0 = torch.randn(2, 2, 16, 8, dtype=F64)
    o1, s1, o2, s2 = both(q, k, v, g, beta, initial_state=h0)
    assert o2.dtype == F64 and s2.dtype == F64 and o2.shape == (2, T, 2, 8) and s2.shape == (2, 2, 16, 8)
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s1, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunk_sizes(chunk_size):
    q, k, v, g, beta = make(T=130, seed=chunk_size)
    o1, s1 = recurrent_kda(q, k, v, g, beta, output_final_state=True)
    o2, s2 = chunk_kda(q, k, v, g, beta, output_final_state=True, chunk_size=chunk_size)
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s1, rtol=1e-10, atol=1e-10)


def test_chunk_matches_recurrent_fp32_inkernel():
    q, k, v, f, beta = make(B=2, T=200, H=3, K=32, V=32, dtype=torch.float32, g_lo=-3, g_hi=3, unit_k=False)
    A_log, dt_bias = torch.rand(3) * 2, torch.randn(3 * 32) * 0.5
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    o1, s1, o2, s2 = both(q, k, v, f, beta, **kw)
    assert o2.dtype == torch.float32 and s2.dtype == torch.float32
    assert max_rel_err(o2, o1) < 1e-4 and max_rel_err(s2, s1) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("mode", ["at_bound", "near_zero", "bound_then_zero", "steep"])
def test_extreme_gates(dtype, mode):
    q, k, v, g, beta = make(T=150, dtype=dtype, seed=3)
    if mode == "at_bound":
        g = torch.full_like(g, -5.0)
    elif mode == "near_zero":
        g = -1e-6 * torch.rand_like(g)
        g[:, ::7] = 0.0
    elif mode == "bound_then_zero":
        g = torch.where(torch.arange(150)[None, :, None, None] % 40 < 20, torch.full_like(g, -5.0),
                        torch.zeros_like(g))
    else:  # steeper than the K3 bound (unbounded gate): the tile must shrink
        g = -100.0 * torch.rand_like(g)
        assert tile_size(g, 64, dtype) < 16
    h0 = torch.randn(1, 2, 16, 8, dtype=dtype)
    o1, s1, o2, s2 = both(q, k, v, g, beta, initial_state=h0)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    tol = 1e-10 if dtype == F64 else 1e-5
    assert max_rel_err(o2, o1) < tol and max_rel_err(s2, s1) < tol


def test_tile_size_bound():
    g = torch.full((1, 64, 1, 4), -5.0)
    assert tile_size(g, 64, torch.float32) == 16 and tile_size(g * 3, 64, torch.float32) < 16
    assert tile_size(g * 10, 64, F64) == 16


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_varlen_equals_separate(fn):
    lens = [1, 64, 0, 5, 90, 17]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T, N = sum(lens), len(lens)
    q, k, v, g, beta = make(T=T, seed=11)
    h0 = torch.randn(N, 2, 16, 8, dtype=F64)
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n in range(N):
        a, b = int(cu[n]), int(cu[n + 1])
        on, sn = recurrent_kda(*(x[:, a:b] for x in (q, k, v, g, beta)), initial_state=h0[n:n + 1],
                               output_final_state=True)
        torch.testing.assert_close(o[:, a:b], on, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s[n:n + 1], sn, rtol=1e-10, atol=1e-10)
    assert torch.equal(s[2], h0[2])  # empty sequence keeps its state


@pytest.mark.parametrize("with_h0", [True, False])
def test_varlen_mixed_lengths_grads_equal_separate(with_h0):
    """Packed docs of very different lengths (empty, 1 token, exact/partial chunks, unsorted) through the
    length-sorted chunk loop: outputs, final states and all gradients equal per-sequence calls."""
    lens = [1, 200, 0, 64, 65, 3, 130, 0, 1]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T, N = sum(lens), len(lens)
    xs = [x.requires_grad_() for x in make(T=T, seed=5)]
    h0 = torch.randn(N, 2, 16, 8, dtype=F64, requires_grad=True) if with_h0 else None
    gen = torch.Generator().manual_seed(6)
    wo, ws = torch.randn(1, T, 2, 8, generator=gen, dtype=F64), torch.randn(N, 2, 16, 8, generator=gen, dtype=F64)
    o, s = chunk_kda(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    grads = torch.autograd.grad((o * wo).sum() + (s * ws).sum(), xs + ([h0] if with_h0 else []))
    xs2 = [x.detach().clone().requires_grad_() for x in xs]
    h02 = h0.detach().clone().requires_grad_() if with_h0 else None
    loss = 0.0
    for n in range(N):
        a, b = int(cu[n]), int(cu[n + 1])
        on, sn = chunk_kda(*(x[:, a:b] for x in xs2), initial_state=h02[n:n + 1] if with_h0 else None,
                           output_final_state=True)
        torch.testing.assert_close(o[:, a:b], on, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s[n:n + 1], sn, rtol=1e-10, atol=1e-10)
        loss = loss + (on * wo[:, a:b]).sum() + (sn * ws[n:n + 1]).sum()
    grads2 = torch.autograd.grad(loss, xs2 + ([h02] if with_h0 else []))
    for g1, g2 in zip(grads, grads2):
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-10)
    if not with_h0:
        assert not s[2].any() and not s[7].any()  # empty sequences end in the zero state


def test_state_chaining_and_decode():
    q, k, v, g, beta = make(B=2, T=100, seed=5)
    h0 = torch.randn(2, 2, 16, 8, dtype=F64)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    cut = 70
    oa, sa = chunk_kda(*(x[:, :cut] for x in (q, k, v, g, beta)), initial_state=h0, output_final_state=True)
    ob, sb = chunk_kda(*(x[:, cut:cut + 20] for x in (q, k, v, g, beta)), initial_state=sa, output_final_state=True)
    outs = [oa, ob]
    for t in range(cut + 20, 100):  # decode: T=1 reference steps carry the state
        ot, sb = recurrent_kda(*(x[:, t:t + 1] for x in (q, k, v, g, beta)), initial_state=sb,
                               output_final_state=True)
        outs.append(ot)
    torch.testing.assert_close(torch.cat(outs, 1), o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sb, s, rtol=1e-10, atol=1e-10)


def test_decode_step_matches_spec_closed_form():
    q, k, v, g, beta = make(B=1, T=1, H=1, K=4, V=3, seed=2)
    S0 = torch.randn(1, 1, 4, 3, dtype=F64)
    o, S = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    kk, bb = k[0, 0, 0], beta[0, 0, 0]
    S_ref = (torch.eye(4, dtype=F64) - bb * torch.outer(kk, kk)) @ torch.diag(g[0, 0, 0].exp()) @ S0[0, 0] \
        + bb * torch.outer(kk, v[0, 0, 0])
    torch.testing.assert_close(S[0, 0], S_ref)
    torch.testing.assert_close(o[0, 0, 0], S_ref.T @ (q[0, 0, 0] * 0.5))


def test_inkernel_l2norm_and_gate_equal_outside():
    q, k, v, f, beta = make(T=80, seed=7, unit_k=False, g_lo=-4, g_hi=4)
    A_log, dt_bias = torch.rand(2, dtype=F64), torch.randn(32, dtype=F64)
    for lb in (-5.0, None):
        inside = chunk_kda(q, k, v, f, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           A_log=A_log, dt_bias=dt_bias, lower_bound=lb)[0]
        nq = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        nk = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        outside = recurrent_kda(nq, nk, v, kda_gate(f, A_log, dt_bias, lb), beta)[0]
        torch.testing.assert_close(inside, outside, rtol=1e-10, atol=1e-10)


def test_kda_gate():
    f = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    A_log, dt_bias = torch.randn(2), torch.randn(8)
    g = kda_gate(f, A_log, dt_bias)
    assert g.dtype == torch.float32 and bool(((g > -5) & (g < 0)).all())
    x = f.float() + dt_bias.view(2, 4)
    torch.testing.assert_close(g, -5 * torch.sigmoid(A_log.exp()[:, None] * x))
    torch.testing.assert_close(kda_gate(f, A_log, dt_bias, None), -A_log.exp()[:, None] * F.softplus(x))
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f, torch.zeros(128), dt_bias)


def _grad_case(gate_in_kernel):
    q, k, v, g, beta = make(B=2, T=40, seed=9, unit_k=not gate_in_kernel, g_lo=-3 if gate_in_kernel else -5,
                            g_hi=3 if gate_in_kernel else 0)
    h0 = torch.randn(2, 2, 16, 8, dtype=F64)
    leaves = [q, k, v, g, beta, h0]
    kw = {}
    if gate_in_kernel:
        A_log, dt_bias = torch.rand(2, dtype=F64), torch.randn(32, dtype=F64)
        leaves += [A_log, dt_bias]
        kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    for x in leaves:
        x.requires_grad_(True)
    wo, ws = torch.randn(2, 40, 2, 8, dtype=F64), torch.randn(2, 2, 16, 8, dtype=F64)
    grads = []
    for fn, extra in ((recurrent_kda, {}), (chunk_kda, dict(chunk_size=16))):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw, **extra)
        grads.append(torch.autograd.grad((o * wo).sum() + (s * ws).sum(), leaves))
    return grads


@pytest.mark.parametrize("gate_in_kernel", [False, True])
def test_gradients_match_reference(gate_in_kernel):
    ref, got = _grad_case(gate_in_kernel)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_gradcheck_tiny():
    q, k, v, f, beta = make(B=1, T=5, H=1, K=4, V=3, seed=4, unit_k=False, g_lo=-2, g_hi=2)
    h0, A_log, dt_bias = torch.randn(1, 1, 4, 3, dtype=F64), torch.rand(1, dtype=F64), torch.randn(4, dtype=F64)
    leaves = [x.requires_grad_(True) for x in (q, k, v, f, beta, h0, A_log, dt_bias)]

    def fn(q, k, v, f, beta, h0, A_log, dt_bias):
        return chunk_kda(q, k, v, f, beta, initial_state=h0, output_final_state=True, chunk_size=16,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    assert torch.autograd.gradcheck(fn, leaves)


def test_causality():
    q, k, v, g, beta = make(T=100, seed=12)
    o = chunk_kda(q, k, v, g, beta)[0]
    t0 = 37
    pert = [x.clone() for x in (q, k, v, g, beta)]
    for x in pert:
        x[:, t0:] = torch.randn_like(x[:, t0:])
    pert[3][:, t0:] = -5 * torch.rand_like(pert[3][:, t0:])
    pert[4][:, t0:] = torch.rand_like(pert[4][:, t0:])
    o2 = chunk_kda(*pert)[0]
    torch.testing.assert_close(o2[:, :t0], o[:, :t0], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(o2[:, t0:], o[:, t0:])


def test_bf16_close_to_fp32_reference():
    q, k, v, f, beta = make(B=1, T=130, H=2, K=32, V=32, dtype=torch.bfloat16, seed=13, unit_k=False,
                            g_lo=-3, g_hi=3)
    A_log, dt_bias = torch.rand(2), torch.randn(64)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              output_final_state=True)
    o, s = chunk_kda(q, k, v, f, beta, **kw)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_ref, s_ref = recurrent_kda(*(x.float() for x in (q, k, v, f, beta)), **kw)
    assert max_rel_err(o, o_ref) < 1e-2 and max_rel_err(s, s_ref) < 1e-4
    o_rec, s_rec = recurrent_kda(q, k, v, f, beta, **kw)
    assert o_rec.dtype == torch.bfloat16 and s_rec.dtype == torch.float32


def _bad_cases():
    q, k, v, g, beta = make(B=2, T=8, seed=1)
    h0 = torch.zeros(2, 2, 16, 8, dtype=F64)
    yield "k", dict(k=k[..., :8])
    yield "v", dict(v=v[:, :4])
    yield "g", dict(g=g[..., 0])
    yield "beta", dict(beta=beta[..., None])
    yield "q", dict(q=q[0], k=k[0], v=v[0], g=g[0], beta=beta[0])
    yield "cu_seqlens", dict(cu_seqlens=torch.tensor([0, 8]))  # B=2
    yield "cu_seqlens", dict(q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=beta[:1], cu_seqlens=torch.tensor([0, 3, 7]))
    yield "cu_seqlens", dict(q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=beta[:1], cu_seqlens=torch.tensor([0., 8.]))
    yield "initial_state", dict(initial_state=h0[:1])
    yield "initial_state", dict(q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=beta[:1], initial_state=h0,
                                cu_seqlens=torch.tensor([0, 2, 5, 8]))
    yield "A_log", dict(use_gate_in_kernel=True, dt_bias=torch.zeros(32))
    yield "dt_bias", dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(16))
    yield "beta", dict(beta=beta.long())
    yield "chunk_size", dict(chunk_size=24)


@pytest.mark.parametrize("arg,kw", list(_bad_cases()))
def test_bad_inputs_raise(arg, kw):
    q, k, v, g, beta = make(B=2, T=8, seed=1)
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    args.update(kw)
    with pytest.raises(ValueError, match=arg):
        chunk_kda(**args)
    if arg != "chunk_size":
        args.pop("chunk_size", None)
        with pytest.raises(ValueError, match=arg):
            recurrent_kda(**args)


def test_backend_dispatch(monkeypatch):
    monkeypatch.delenv("K3_BACKEND", raising=False)
    q, k, v, g, beta = make(T=8)
    with pytest.raises(ValueError, match="unknown backend"):
        chunk_kda(q, k, v, g, beta, backend="nope")
    calls = []

    def fake(*a, **kw):
        calls.append(kw["chunk_size"])
        return "fake", None
    register_kda_backend("fake_test", fake, lambda: True, priority=0)
    try:
        assert chunk_kda(q, k, v, g, beta, backend="fake_test") == ("fake", None)
        monkeypatch.setenv("K3_BACKEND", "kda:fake_test")
        assert chunk_kda(q, k, v, g, beta)[0] == "fake"
        assert calls == [64, 64]
        monkeypatch.delenv("K3_BACKEND")
        assert chunk_kda(q, k, v, g, beta, backend="torch")[0].shape == (1, 8, 2, 8)
    finally:
        _IMPLS.pop("fake_test", None)
        dispatch._REGISTRY["kda"].pop("fake_test", None)
    assert "torch" in dispatch.backends("kda")


def test_forward_only_calls_prefer_triton_rule(monkeypatch):
    """The CUDA rule of chunk_kda: no-grad calls with enough tokens per sequence go to "triton" (measured faster
    forward), calls with gradients or decode-sized ones keep the resolved backend."""
    import k3.ops.kda as kda_mod
    from k3.ops import dispatch
    monkeypatch.setattr(dispatch, "is_available", lambda op, name: True)
    n = kda_mod.FORWARD_ONLY_TRITON_MIN_TOKENS
    mk = lambda B, T, req=False: [torch.randn(B, T, 2, 16, requires_grad=req) for _ in range(4)] + [torch.rand(B, T, 2)]
    choose = lambda xs, cu=None: kda_mod._forward_only_choice(*xs, None, None, None, cu)
    assert choose(mk(2, n)) == "triton"
    assert choose(mk(2, n, req=True)) is None                     # training: gradients needed
    with torch.no_grad():
        assert choose(mk(2, n, req=True)) == "triton"             # same tensors under no_grad
    assert choose(mk(4, 1)) is None                               # decode-sized
    cu = torch.tensor([0, 5, 10, 2 * n])                          # 3 sequences, 2n tokens: below n per sequence
    assert choose(mk(1, 2 * n), cu) is None
    assert choose(mk(1, 3 * n), torch.tensor([0, n, 2 * n, 3 * n])) == "triton"
    monkeypatch.setattr(dispatch, "is_available", lambda op, name: False)
    assert choose(mk(2, n)) is None                               # triton missing: keep fla
