"""The router's fp32-precision logits from bf16 activations as three bf16 GEMM terms (k3/ops/router.py) against
fp64, on fresh random inputs; the bf16 GEMMs run as fp32 emulation on CPU (the H200 run is tests/gpu)."""
import pytest
import torch

from helpers import assert_close, rel_err
from k3.ops import dispatch
from k3.ops.moe import route
from k3.ops.router import router_logits, split3


def _inputs(N=384, d=256, E=64, seed=0, wdtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, d, generator=g) * 3).bfloat16()
    w = (torch.randn(E, d, generator=g) * 0.02 * torch.logspace(-3, 2, d)).to(wdtype)   # 5 decades of scale
    return x, w


def test_split3_reconstructs_fp32():
    a = torch.randn(4096) * torch.logspace(-20, 20, 4096)
    a1, a2, a3 = split3(a)
    assert a1.dtype == a2.dtype == a3.dtype == torch.bfloat16
    err = (a1.double() + a2.double() + a3.double() - a.double()).abs()
    assert bool((err <= a.double().abs() * 2.0 ** -24).all()), float((err / a.double().abs()).max())
    assert float((a1.double() - a.double()).abs().max()) > 0   # one bf16 term alone would not do


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_split_logits_and_grads_match_fp64(wdtype):
    for seed in range(3):
        x, w = _inputs(seed=seed, wdtype=wdtype)
        dl = torch.randn(x.shape[0], w.shape[0], dtype=torch.float64)
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        ref = xr @ wr.t()
        dx_ref, dw_ref = torch.autograd.grad(ref, (xr, wr), dl)
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        got = router_logits(xs, ws, backend="split_bf16")
        dx, dw = torch.autograd.grad(got, (xs, ws), dl.float())
        assert got.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == wdtype
        assert_close(got, ref, rel=1e-6)
        bf16_gemm = (x.float() @ w.bfloat16().float().t()).bfloat16()
        assert rel_err(bf16_gemm, ref) > 1e-4   # a plain bf16 GEMM would fail the bound above
        # dW in fp32 precision (stored in the weight's dtype); dx no worse than one rounding of the exact one to bf16
        assert_close(dw, dw_ref, rel=1e-6 if wdtype == torch.float32 else 4e-3)
        assert_close(dx, dx_ref, rel=1.1 * rel_err(dx_ref.bfloat16(), dx_ref))


def test_route_scores_and_dispatch(monkeypatch):
    x, w = _inputs(N=512, seed=5)
    bias = torch.randn(w.shape[0]) * 0.01
    assert dispatch.resolve("router", None, "cpu") == "fp32"    # CPU default: the reference product
    assert dispatch.resolve("router", None, "cuda") == "split_bf16"
    i_ref, w_ref, s_ref = route(x, w, bias, 8)
    import k3.ops.router as R
    calls = []
    monkeypatch.setattr(R._SplitLogits, "apply", lambda *a, _f=R._SplitLogits.apply: calls.append(1) or _f(*a))
    monkeypatch.setenv("K3_BACKEND", "router:split_bf16")   # forced: any number of rows (512 here)
    i_s, w_s, s_s = route(x, w, bias, 8)
    assert calls
    assert_close(s_s, s_ref, rel=1e-6)
    assert_close(w_s, w_ref, rel=1e-6)
    assert float((i_s == i_ref).float().mean()) > 0.99
    with pytest.raises(ValueError, match="unknown backend"):
        dispatch.resolve("router", "bf16", "cpu")


def test_split_logits_compiles_and_opcheck():
    x, w = _inputs(N=64, d=128, E=16, seed=7)
    torch.library.opcheck(torch.ops.k3.router_logits.default, (x, w))
    torch.library.opcheck(torch.ops.k3.router_logits_bwd.default, (x, w, torch.randn(64, 16)))
    # the custom ops are opaque to Inductor: the compiled call is the eager one, bit for bit
    f = torch.compile(lambda a, b: router_logits(a, b, backend="split_bf16"), fullgraph=True)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn(64, 16)
    gc = torch.autograd.grad(f(xs, ws), (xs, ws), dy)
    ge = torch.autograd.grad(router_logits(xe, we, backend="split_bf16"), (xe, we), dy)
    assert all(torch.equal(a, b) for a, b in zip(gc, ge))


def test_split_only_from_min_rows_when_automatic(monkeypatch):
    """Automatic choice (the CUDA default, simulated): the split from SPLIT_MIN_ROWS rows (training, prefill), the
    fp32 GEMM below (decode steps); a named backend applies at any size; fp32 / fp16 activations never split."""
    import k3.ops.router as R
    monkeypatch.delenv("K3_BACKEND", raising=False)
    monkeypatch.setattr(R.dispatch, "resolve", lambda op, backend, dev: backend or "split_bf16")
    w = torch.randn(8, 16)
    big, small = torch.zeros(R.SPLIT_MIN_ROWS, 16).bfloat16(), torch.zeros(4, 16).bfloat16()
    assert R.use_split(big, w) and not R.use_split(small, w)
    assert R.use_split(small, w, backend="split_bf16") and not R.use_split(big, w, backend="fp32")
    assert not R.use_split(big.float(), w) and not R.use_split(big.half(), w)


def test_route_uses_select_experts_with_groups():
    """route = sigmoid scores + k3.ops.router.select_experts (grouped top-k included)."""
    from k3.ops.router import select_experts
    x, w = _inputs(N=64, d=32, E=16)
    x = x.float()
    bias = torch.randn(16) * 0.05
    for G, kg in ((1, 1), (4, 2)):
        idx, wk, scores = route(x, w, bias, 4, True, 1.5, G, kg)
        idx2, wk2 = select_experts(scores, bias, 4, True, 1.5, G, kg)
        assert torch.equal(idx, idx2) and torch.equal(wk, wk2)
        if G > 1:
            assert all(len(set((r // 4).tolist())) <= kg for r in idx)
