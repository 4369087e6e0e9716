"""Short conv, SiTU-GLU, AttnRes mixing, MLA attention and MoE routing/experts against their references."""
import pytest
import torch

from helpers import max_rel_err
from k3.ops.activations import situ_glu
from k3.ops.attention import attention_reference, causal_attention
from k3.ops.attnres import attnres_mix, attnres_mix_reference
from k3.ops.conv import causal_conv1d, causal_conv1d_reference
from k3.ops.moe import experts_forward, experts_forward_reference, route


def test_situ_bounds_and_limit():
    g = torch.randn(1000) * 50
    u = torch.randn(1000) * 500
    out = situ_glu(g, u)
    assert out.abs().max() <= 100.0  # saturates at beta1*beta2 in fp32
    g, u = torch.randn(100, dtype=torch.float64), torch.randn(100, dtype=torch.float64)
    swiglu = torch.nn.functional.silu(g) * u
    assert torch.allclose(situ_glu(g, u, 1e6, 1e6), swiglu, atol=1e-6)
    out_bf = situ_glu(g.bfloat16(), u.bfloat16())
    assert out_bf.dtype == torch.bfloat16


@pytest.mark.parametrize("T", [1, 3, 17])
def test_conv_matches_reference_with_state(T):
    torch.manual_seed(T)
    x, w, s0 = torch.randn(2, T, 8), torch.randn(8, 1, 4), torch.randn(2, 8, 3)
    y, s = causal_conv1d(x, w, s0, output_final_state=True)
    yr, sr = causal_conv1d_reference(x, w, s0)
    assert torch.allclose(y.double(), yr, atol=2e-6)  # fp32: |diff| <= 8e-7
    assert torch.allclose(s.double(), sr, atol=1e-6)


def test_conv_state_continuation_and_varlen():
    torch.manual_seed(0)
    x, w = torch.randn(1, 30, 6), torch.randn(6, 1, 4)
    y, s = causal_conv1d(x, w, output_final_state=True)
    y1, s1 = causal_conv1d(x[:, :11], w, output_final_state=True)
    y2, s2 = causal_conv1d(x[:, 11:], w, s1, output_final_state=True)
    assert torch.allclose(torch.cat([y1, y2], 1), y, atol=1e-6) and torch.allclose(s2, s)
    cu = torch.tensor([0, 1, 2, 12, 30])
    s0 = torch.randn(4, 6, 3)
    yv, sv = causal_conv1d(x, w, s0, cu_seqlens=cu, output_final_state=True)
    for n in range(4):
        a, b = int(cu[n]), int(cu[n + 1])
        yr, sr = causal_conv1d(x[:, a:b], w, s0[n:n + 1], output_final_state=True)
        assert torch.allclose(yv[:, a:b], yr, atol=1e-6)
        assert torch.allclose(sv[n:n + 1], sr, atol=1e-6)


def test_attnres_fast_matches_definition():
    torch.manual_seed(0)
    for S in (1, 2, 5, 9):
        src = [torch.randn(3, 7, 32) * (i + 1) for i in range(S)]
        w = torch.randn(32)
        assert torch.allclose(attnres_mix(src, w), attnres_mix_reference(src, w), atol=1e-5)
    # definition written by hand for one token
    v = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0]])]
    w = torch.tensor([0.5, -0.25])
    k = [x / torch.sqrt((x ** 2).mean() + 1e-5) for x in v]
    a = torch.softmax(torch.stack([(ki * w).sum() for ki in k]), 0)
    assert torch.allclose(attnres_mix(v, w), a[0] * v[0] + a[1] * v[1], atol=1e-6)
    # gradients flow to every source and to w
    src = [torch.randn(4, 16, requires_grad=True) for _ in range(3)]
    w = torch.randn(16, requires_grad=True)
    attnres_mix(src, w).square().sum().backward()
    assert all(s.grad is not None and s.grad.abs().sum() > 0 for s in src) and w.grad.abs().sum() > 0


def test_attnres_bf16_is_fp32_math():
    torch.manual_seed(1)
    src = [torch.randn(64, 128).bfloat16() for _ in range(4)]
    w = torch.randn(128)
    out = attnres_mix(src, w)
    ref = attnres_mix_reference([s.double() for s in src], w.double())
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 0.05


@pytest.mark.parametrize("cu", [None, [0, 5, 6, 20]])
def test_attention_matches_reference(cu):
    torch.manual_seed(0)
    B = 1 if cu else 2
    q, k = torch.randn(B, 20, 3, 12), torch.randn(B, 20, 3, 12)
    v = torch.randn(B, 20, 3, 8)
    cu_t = torch.tensor(cu) if cu else None
    o, ml = causal_attention(q, k, v, 0.3, cu_seqlens=cu_t, return_max_logit=True)
    assert torch.allclose(o.double(), attention_reference(q, k, v, 0.3, cu_t).double(), atol=1e-5)
    s = torch.einsum("bthd,bshd->bhts", q, k) * 0.3
    mask = torch.ones(20, 20).tril().bool()
    if cu:
        doc = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 1, 14]))
        mask &= doc[:, None] == doc[None]
    assert torch.allclose(ml, s.masked_fill(~mask, -1e9).amax((0, 2, 3)), atol=1e-5)


def test_attention_query_tiles_and_offset(monkeypatch):
    import k3.ops.attention as A
    monkeypatch.setattr(A, "_Q_TILE", 4)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 13, 2, 8), torch.randn(1, 13, 2, 8), torch.randn(1, 13, 2, 8)
    o, _ = causal_attention(q, k, v, 0.35)
    assert torch.allclose(o, attention_reference(q, k, v, 0.35), atol=1e-5)
    o2, _ = causal_attention(q[:, 9:], k, v, 0.35, q_offset=9)  # last 4 queries against the full cache
    assert torch.allclose(o2, o[:, 9:], atol=1e-5)


def test_router_bias_changes_selection_not_weights():
    torch.manual_seed(0)
    x, W = torch.randn(50, 16), torch.randn(8, 16)
    idx0, w0, s0 = route(x, W, torch.zeros(8), 2)
    bias = torch.zeros(8)
    bias[3] = 10.0
    idx1, w1, s1 = route(x, W, bias, 2)
    assert (idx1 == 3).any(1).all()  # the bias forces expert 3 into every selection
    assert torch.equal(s0, s1)
    # weights are the *scores* of the selected experts, renormalised: bias never enters
    expect = s1.gather(1, idx1) / s1.gather(1, idx1).sum(1, keepdim=True)
    assert torch.allclose(w1, expect)
    assert s0.dtype == torch.float32 and torch.allclose(w0.sum(1), torch.ones(50))


@pytest.mark.parametrize("backend", ["grouped_mm", "padded_bmm"])
@pytest.mark.parametrize("dims", [(16, 8), (6, 5)])
def test_experts_match_per_token_loop(backend, dims):
    torch.manual_seed(0)
    l, M = dims
    E, N, k = 6, 40, 3
    x = torch.randn(N, l, dtype=torch.float64 if backend == "padded_bmm" else torch.float32)
    gu, dn = torch.randn(E, l, 2 * M, dtype=x.dtype), torch.randn(E, M, l, dtype=x.dtype)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    w = torch.rand(N, k)
    glu = lambda g, u: situ_glu(g, u)
    out = experts_forward(x, idx, w, gu, dn, glu, backend=backend)
    ref = experts_forward_reference(x, idx, w, gu, dn, glu)
    assert max_rel_err(out, ref) < 1e-6  # fp32 / fp64: <= 1.5e-7 of the largest element


def test_experts_grad_and_empty_expert():
    torch.manual_seed(0)
    E, N, k, l, M = 8, 12, 2, 16, 8
    x = torch.randn(N, l, requires_grad=True)
    gu = torch.randn(E, l, 2 * M, requires_grad=True)
    dn = torch.randn(E, M, l, requires_grad=True)
    idx = torch.randint(0, 4, (N, 1))
    idx = torch.cat([idx, idx + 4], 1)  # experts 0..7 used; make 3 and 7 empty
    idx[idx == 3] = 2
    idx[idx == 7] = 6
    w = torch.rand(N, k)
    glu = lambda g, u: situ_glu(g, u)
    out = experts_forward(x, idx, w, gu, dn, glu, backend="grouped_mm")
    g = torch.randn_like(out)
    gx, ggu, gdn = torch.autograd.grad(out, (x, gu, dn), g)
    ref = experts_forward_reference(x, idx, w, gu, dn, glu)
    rx, rgu, rdn = torch.autograd.grad(ref, (x, gu, dn), g)
    for a, b in ((gx, rx), (ggu, rgu), (gdn, rdn)):
        assert max_rel_err(a, b) < 1e-6  # fp32: <= 1.5e-7 of the largest element
    assert ggu[3].abs().sum() == 0 and ggu[7].abs().sum() == 0


@pytest.mark.parametrize("backend", ["padded_bmm", "grouped_mm"])
def test_experts_dispatch_backward_gradcheck(backend):
    """The permute / unpermute gathers' own backward (gathers by the inverse permutation, k rows per token summed)
    against finite differences in fp64, every input's gradient; k = 3 with repeated tokens per expert. fp64 takes
    the padded-bmm path (grouped_mm has no fp64 kernel), so the gradcheck runs the shared dispatch code on it, and
    the grouped_mm case compares fp32 gradients with the reference loop."""
    torch.manual_seed(3)
    E, N, k, l, M = 5, 7, 3, 8, 4
    dt = torch.float64 if backend == "padded_bmm" else torch.float32
    x = torch.randn(N, l, dtype=dt, requires_grad=True)
    gu = torch.randn(E, l, 2 * M, dtype=dt, requires_grad=True)
    dn = torch.randn(E, M, l, dtype=dt, requires_grad=True)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    w = torch.rand(N, k, dtype=dt, requires_grad=True)
    glu = lambda g, u: torch.nn.functional.silu(g) * u
    if dt == torch.float64:
        assert torch.autograd.gradcheck(lambda *ins: experts_forward(*ins, glu, backend=backend), (x, idx, w, gu, dn))
    else:
        out = experts_forward(x, idx, w, gu, dn, glu, backend=backend)
        ref = experts_forward_reference(x, idx, w, gu, dn, glu)
        g = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, (x, w, gu, dn), g), torch.autograd.grad(ref, (x, w, gu, dn), g)):
            assert max_rel_err(a, b) < 1e-6  # fp32: <= 1.3e-7 of the largest element


def test_experts_dispatch_backward_sums_in_fp32():
    """bf16 activations: each token's k gradient rows are summed in fp32 and rounded once (index_select's own
    backward would accumulate in bf16)."""
    from k3.ops.moe import _DispatchRows
    torch.manual_seed(0)
    N, k, l = 4, 8, 16
    order = torch.randperm(N * k)
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(N * k))
    x = torch.randn(N, l, dtype=torch.bfloat16, requires_grad=True)
    g = (torch.randn(N * k, l) * torch.logspace(0, 3, N * k)[:, None]).bfloat16()
    x_A = _DispatchRows.apply(x, order // k, inv, k)
    assert torch.equal(x_A, x.detach()[order // k])
    x_A.backward(g)
    want = torch.zeros(N, l, dtype=torch.float64).index_add_(0, order // k, g.double()).bfloat16()
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("tile", [1, 3, 4, 7, 128])
def test_attention_document_tiles(monkeypatch, tile):
    """Packed documents are attended in query tiles that start at their first query's document: same result as
    the dense reference for any tile size, empty documents included; max-logit too."""
    import k3.ops.attention as A
    monkeypatch.setattr(A, "_DOC_TILE", tile)
    torch.manual_seed(tile)
    cu = torch.tensor([0, 5, 5, 6, 19, 30])
    q, k = torch.randn(1, 30, 2, 8, dtype=torch.float64), torch.randn(1, 30, 2, 8, dtype=torch.float64)
    v = torch.randn(1, 30, 2, 6, dtype=torch.float64)
    o, ml = causal_attention(q, k, v, 0.4, cu_seqlens=cu, return_max_logit=True)
    assert torch.allclose(o, attention_reference(q, k, v, 0.4, cu), atol=1e-12)
    s = torch.einsum("bthd,bshd->bhts", q, k) * 0.4
    doc = torch.repeat_interleave(torch.arange(5), cu[1:] - cu[:-1])
    mask = torch.ones(30, 30).tril().bool() & (doc[:, None] == doc[None])
    assert torch.allclose(ml, s.masked_fill(~mask, -1e9).amax((0, 2, 3)), atol=1e-12)


@pytest.mark.slow
def test_moe_layer_compiles_on_cpu_fp32():
    """torch.compile of a LatentMoE in fp32 on CPU: grouped_mm's fake-tensor rule takes bf16 only, so the compiled
    call goes through padded_bmm; same result as eager."""
    from k3.config import K3Config
    from k3.nn.moe import LatentMoE, init_moe_
    torch.manual_seed(0)
    layer = LatentMoE(K3Config.from_preset("tiny"))
    init_moe_(layer, 0.02)
    x = torch.randn(64, layer.routed_expert_down_proj.in_features)
    ref = layer(x)
    torch._dynamo.reset()
    out = torch.compile(layer)(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
