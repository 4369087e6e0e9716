"""SiTU-GLU as one autograd node (saves only g, u) and its Triton kernels (run on CPU by the interpreter)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import assert_close
from k3.ops.activations import situ_glu, situ_glu_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _force_node(monkeypatch):
    monkeypatch.setenv("K3_SITU_NODE", "1")  # on CPU the plain formula is the default (faster there)


def test_situ_node_matches_autograd_formula_fp64():
    torch.manual_seed(1)
    g = (torch.randn(37, 24, dtype=torch.float64) * 6).requires_grad_()
    u = (torch.randn(37, 24, dtype=torch.float64) * 40).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 4.0, 25.0), (g, u))
    do = torch.randn(37, 24, dtype=torch.float64)
    ref = torch.autograd.grad(situ_glu_reference(g, u), (g, u), do)
    got = torch.autograd.grad(situ_glu(g, u), (g, u), do)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_situ_node_saves_only_its_inputs():
    g = torch.randn(64, 512, dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(64, 512, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        situ_glu(g, u)
    assert len(saved) == 2 and all(t.dtype == torch.bfloat16 for t in saved)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        situ_glu_reference(g, u)
    assert len(saved) > 2  # the plain formula keeps fp32 intermediates (what the node avoids)


def test_situ_bf16_grads_close_to_fp32():
    torch.manual_seed(2)
    g, u = torch.randn(128, 96) * 3, torch.randn(128, 96) * 30
    do = torch.randn(128, 96)
    gb, ub = g.bfloat16().requires_grad_(), u.bfloat16().requires_grad_()
    g32, u32 = gb.detach().float().requires_grad_(), ub.detach().float().requires_grad_()
    situ_glu(gb, ub).backward(do.bfloat16())
    situ_glu_reference(g32, u32).backward(do)
    for name, a, b in (("dg", gb.grad, g32.grad), ("du", ub.grad, u32.grad)):
        assert_close(a, b, rel=1e-2, what=name)


_CHILD = r"""
import json, torch
from k3.ops import activations_triton as at
from k3.ops.activations import _situ_fwd_torch, _situ_bwd_torch
torch.manual_seed(0)
res = {}
for R, C, dt in ((5, 48, torch.float32), (33, 512, torch.float32), (3, 1536, torch.bfloat16)):
    gu = torch.randn(R, 2 * C) * 8
    gu = gu.to(dt)
    g, u = gu[:, :C], gu[:, C:]          # strided halves of a fused projection
    do = torch.randn(R, C).to(dt)
    o = at.situ_fwd(g, u, 4.0, 25.0)
    o_ref = _situ_fwd_torch(g, u, 4.0, 25.0)
    dg, du = at.situ_bwd(g, u, do, 4.0, 25.0)
    dg_ref, du_ref = _situ_bwd_torch(g, u, do, 4.0, 25.0)
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
    res[f"{R}x{C}.{dt}"] = [rel(o, o_ref), rel(dg, dg_ref), rel(du, du_ref)]
    # the custom ops torch.compile sees: same results, and schema / fake tensors / compile checked by opcheck
    assert torch.equal(torch.ops.k3.situ_fwd(g, u, 4.0, 25.0), o)
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.k3.situ_bwd(g, u, do, 4.0, 25.0), (dg, du)))
    # the packed backward (MoE gate/up): one [R, 2C] gradient with dg and du in its halves, equal to the pair
    dh = torch.ops.k3.situ_bwd_packed(gu, do, 4.0, 25.0)
    assert dh.shape == gu.shape and torch.equal(dh[:, :C], dg) and torch.equal(dh[:, C:], du)
    if R == 5:
        torch.library.opcheck(torch.ops.k3.situ_fwd.default, (g, u, 4.0, 25.0))
        torch.library.opcheck(torch.ops.k3.situ_bwd.default, (g, u, do, 4.0, 25.0))
        torch.library.opcheck(torch.ops.k3.situ_bwd_packed.default, (gu, do, 4.0, 25.0))
print(json.dumps(res))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_situ_triton_kernels_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for name, errs in res.items():
        tol = 1e-6 if "float32" in name else 1e-2
        assert max(errs) < tol, (name, errs)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_situ_tanh_option_named_and_exact_off_gpu():
    """K3_SITU_TANH=approx (hardware tanh, inline PTX) applies to 16-bit CUDA tensors only: under the interpreter
    the kernels keep the exact path (same tolerances as above); an unknown value is refused by name at import."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, K3_SITU_TANH="approx")
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for name, errs in json.loads(out.stdout.strip().splitlines()[-1]).items():
        assert max(errs) < (1e-6 if "float32" in name else 1e-2), (name, errs)
    env["K3_SITU_TANH"] = "fast"
    bad = subprocess.run([sys.executable, "-c", "import k3.ops.activations_triton"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "K3ConfigError: K3_SITU_TANH must be approx or exact, got 'fast'" in bad.stderr
