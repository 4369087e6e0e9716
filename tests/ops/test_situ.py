"""SiTU-GLU as one autograd node (saves only g, u) and its Triton kernels (run on CPU by the interpreter)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from helpers import assert_close, row
from k3.ops.activations import situ_glu, situ_glu_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _force_node(monkeypatch):
    monkeypatch.setenv("K3_SITU_NODE", "1")  # on CPU the plain formula is the default (faster there)


def test_situ_node_matches_autograd_formula_fp64():
    torch.manual_seed(1)
    g = (torch.randn(37, 24, dtype=torch.float64) * 6).requires_grad_()
    u = (torch.randn(37, 24, dtype=torch.float64) * 40).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 4.0, 25.0), (g, u), rtol=1e-7)
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
        assert_close(a, b, rel=4e-3, what=name)


_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_situ_triton_child.py")
# case id (rows x channels . dtype): bound of the relative errors of o, dg and du against the torch formulas
SITU_CASES = {"tiny.torch.float32": 1e-6, "5x48.torch.float32": 1e-6, "33x512.torch.float32": 1e-6, "3x1536.torch.bfloat16": 1e-2}


@pytest.fixture(scope="module")
def situ_rows():
    """The child's table per K3_SITU_TANH setting (None: as inherited), each run once for the tests below."""
    from k3.ops.triton_interp import run_interpreted
    cache = {}

    def get(tanh):
        if tanh not in cache:
            cache[tanh] = run_interpreted(_SCRIPT, timeout=300, env_set={"K3_SITU_TANH": tanh} if tanh else None)
        return cache[tanh]
    return get


# K3_SITU_TANH=approx (hardware tanh, inline PTX) applies to 16-bit CUDA tensors only: under the interpreter the
# kernels keep the exact path, with the same bounds
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize("tanh", [None, "approx"], ids=["tanh-inherited", "tanh-approx"])
@pytest.mark.parametrize("name", SITU_CASES)
def test_situ_triton_kernels_interpreted(situ_rows, tanh, name):
    errs = row(situ_rows(tanh), name)
    assert max(errs) < SITU_CASES[name], f"{name}: relative errors of o, dg, du {errs} (bound {SITU_CASES[name]:g})"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_situ_tanh_unknown_value_refused_at_import():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, K3_SITU_TANH="fast")
    bad = subprocess.run([sys.executable, "-c", "import k3.ops.activations_triton"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "K3ConfigError: K3_SITU_TANH must be one of auto, approx, exact, got 'fast'" in bad.stderr
