"""linear_cross_entropy_sum (k3/ops/loss.py): the gradient formed in the forward pass against autograd through
F.cross_entropy on fresh random inputs, fp64 and fp32, chunk edge cases, ignored targets, scaling, bf16."""
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from k3.ops.loss import ce_chunk_grad, linear_cross_entropy_sum


def _case(N=50, d=24, V=97, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, d, generator=g) * 2).to(dtype)
    w = (torch.randn(V, d, generator=g) * 0.3).to(dtype)
    y = torch.randint(0, V, (N,), generator=g)
    y[3] = y[17] = -100
    y[40:50] = -100          # a whole chunk of ignored targets at chunk 10
    return h, w, y


def _reference(h, w, y):
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    loss = F.cross_entropy(hr @ wr.t(), y, ignore_index=-100, reduction="sum")
    return loss, torch.autograd.grad(loss, (hr, wr))


@pytest.mark.parametrize("chunk", [0, 1, 7, 10, 16, 50, 64])
def test_matches_autograd_fp64(chunk):
    h, w, y = _case()
    ref, (dh_ref, dw_ref) = _reference(h, w, y)
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy_sum(hs, ws, y, chunk)
    dh, dw = torch.autograd.grad(loss, (hs, ws))
    assert_close(loss, ref, rel=1e-12)
    assert_close(dh, dh_ref, rel=1e-12)
    assert_close(dw, dw_ref, rel=1e-12)
    assert float(dh[40:50].abs().max()) == 0.0 and float(dh[3].abs().max()) == 0.0   # ignored rows: no gradient


def test_fp32_scaled_backward_and_all_ignored():
    h, w, y = _case(seed=1, dtype=torch.float32)
    ref, (dh_ref, dw_ref) = _reference(h, w, y)
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    (linear_cross_entropy_sum(hs, ws, y, 16) * 0.25).backward()   # e.g. 1 / n and gradient accumulation weights
    assert_close(hs.grad, 0.25 * dh_ref, rel=1e-5)
    assert_close(ws.grad, 0.25 * dw_ref, rel=1e-5)
    hs2 = h.clone().requires_grad_()
    none = linear_cross_entropy_sum(hs2, w, torch.full_like(y, -100), 16)
    assert float(none) == 0.0 and float(torch.autograd.grad(none, hs2)[0].abs().max()) == 0.0


def test_bf16_within_rounding_and_grad_dtypes():
    h, w, y = _case(N=64, d=32, V=128, seed=2, dtype=torch.float32)
    ref, (dh_ref, dw_ref) = _reference(h, w, y)
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    loss = linear_cross_entropy_sum(hb, wb, y, 16)
    dh, dw = torch.autograd.grad(loss, (hb, wb))
    assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    assert_close(loss, ref, rel=1e-2)
    assert_close(dh, dh_ref, rel=2e-2)
    assert_close(dw, dw_ref, rel=2e-2)


def test_chunk_grad_is_the_softmax_minus_onehot():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 13, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 13, (9,), generator=g)
    y[2] = -100
    loss, gr = ce_chunk_grad(x, y)
    ref = F.cross_entropy(x, y, ignore_index=-100, reduction="sum")
    assert_close(loss, ref, rel=1e-14)
    assert_close(gr, torch.autograd.grad(ref, x)[0], rel=1e-14)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="linear_cross_entropy_sum"):
        linear_cross_entropy_sum(torch.randn(4, 8), torch.randn(5, 7), torch.zeros(4, dtype=torch.long), 2)


def test_frozen_head_or_frozen_inputs():
    """Only the gradients that are asked for are formed (a frozen lm_head, or fixed hidden states)."""
    h, w, y = _case(seed=4)
    _, (dh_ref, dw_ref) = _reference(h, w, y)
    hs = h.clone().requires_grad_()
    (dh,) = torch.autograd.grad(linear_cross_entropy_sum(hs, w, y, 8), (hs,))
    ws = w.clone().requires_grad_()
    (dw,) = torch.autograd.grad(linear_cross_entropy_sum(h, ws, y, 8), (ws,))
    assert_close(dh, dh_ref, rel=1e-12)
    assert_close(dw, dw_ref, rel=1e-12)


def test_bf16_gradient_scale_is_not_rounded():
    """Backward scales the stored bf16 dh by the incoming gradient (1 / n, accumulation weights) in fp32: a scale
    rounded to bf16 first (1/3 -> 0.33398) would bias every gradient by 0.2%."""
    h, w, y = _case(N=64, d=32, V=128, seed=5, dtype=torch.float32)
    hb = h.bfloat16().requires_grad_()
    (g1,) = torch.autograd.grad(linear_cross_entropy_sum(hb, w.bfloat16(), y, 16), (hb,))
    (g3,) = torch.autograd.grad(linear_cross_entropy_sum(hb, w.bfloat16(), y, 16) / 3, (hb,))
    ratio = float((g3.double() * g1.double()).sum() / (g1.double() ** 2).sum())
    assert abs(ratio * 3 - 1) < 5e-4, ratio
