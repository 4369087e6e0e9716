"""KDA Triton backend vs the token-loop reference, on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported, and pytest imports every test module into one process,
so the checks run in one subprocess (this file run as a script, with TRITON_INTERPRET=1) that prints a JSON
table of relative RMSEs; the tests below read that table. Skips cleanly when triton is not installed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HAVE_TRITON = importlib.util.find_spec("triton") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL_OUT, TOL_DQKV, TOL_DGB = 5e-3, 8e-3, 2e-2


def _rr(a, b) -> float:
    """Relative RMSE of a against reference b."""
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def _checks() -> dict:
    import torch
    import torch.nn.functional as F
    from k3.ops.kda import chunk_kda, recurrent_kda
    from k3.ops.kda.triton import available, fused_recurrent_kda_triton

    assert available(), "triton backend should be available under TRITON_INTERPRET=1"
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)
    res = {}

    def inputs(B, T, H, K, V, unit_k=False, gate=True):
        q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
        if unit_k:
            k = F.normalize(k, dim=-1)
        f = r(B, T, H, K) * 2 if gate else -5 * torch.rand(B, T, H, K, generator=gen)
        beta = torch.rand(B, T, H, generator=gen)
        return q, k, v, f, beta

    def cmp(name, args, kw, backend_kw=None):
        o1, s1 = recurrent_kda(*args, output_final_state=True, **kw)
        o2, s2 = chunk_kda(*args, output_final_state=True, backend="triton", **kw, **(backend_kw or {}))
        res[name + ".o"] = _rr(o2, o1)
        res[name + ".S"] = _rr(s2, s1)

    H, K, V = 2, 32, 16
    A_log, dtb = torch.rand(H, generator=gen), r(H * K) * 0.5
    gk = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dtb)

    # 1. fused gate + L2 norm + initial state, T not a multiple of the 16-token chunk
    q, k, v, f, beta = inputs(2, 37, H, K, V)
    cmp("gate_l2_h0", (q, k, v, f, beta), dict(initial_state=r(2, H, K, V), **gk))
    # 2. precomputed log-decay, no L2 norm (unit keys), explicit scale, no initial state, K=V=16
    q, k, v, g, beta = inputs(1, 50, 1, 16, 16, unit_k=True, gate=False)
    cmp("precomputed_g", (q, k, v, g, beta), dict(scale=0.3))
    # 3. varlen with an initial state per sequence (lengths 5, 16, 1, 28, 0)
    cu = torch.tensor([0, 5, 21, 22, 50, 50])
    q, k, v, f, beta = inputs(1, 50, H, K, V)
    cmp("varlen", (q, k, v, f, beta), dict(initial_state=r(5, H, K, V), cu_seqlens=cu, **gk))
    # 4. gates at the bound: raw gate saturated (g = -5 to fp32 precision) and precomputed g == -5
    q, k, v, f, beta = inputs(1, 40, H, K, V)
    cmp("gate_at_bound", (q, k, v, torch.full_like(f, 60.0), beta), dict(**gk))
    q, k, v, g, beta = inputs(1, 40, 1, 32, 32, unit_k=True, gate=False)
    cmp("g_eq_-5", (q, k, v, torch.full_like(g, -5.0), beta), dict())
    cmp("g_mixed_0_-5", (q, k, v, torch.where(torch.rand(g.shape, generator=gen) < 0.5, -5.0, 0.0), beta), dict())
    # 5. decode: one token per sequence through chunk_kda (dispatches to the recurrent kernel), varlen decode,
    #    and the in-place few-token decode API
    q, k, v, f, beta = inputs(3, 1, H, K, V)
    h0 = r(3, H, K, V)
    cmp("decode_B3", (q, k, v, f, beta), dict(initial_state=h0, **gk))
    qv, kv_, vv, fv, bv = (x.reshape(1, 3, *x.shape[2:]) for x in (q, k, v, f, beta))
    cmp("decode_varlen", (qv, kv_, vv, fv, bv), dict(initial_state=h0, cu_seqlens=torch.arange(4), **gk))
    q, k, v, f, beta = inputs(2, 3, H, K, V)
    o1, s1 = recurrent_kda(q, k, v, f, beta, initial_state=h0[:2], output_final_state=True, **gk)
    st = h0[:2].clone()
    o2, s2 = fused_recurrent_kda_triton(q, k, v, f, beta, initial_state=st, inplace=True, **gk)
    res["decode_inplace.o"], res["decode_inplace.S"] = _rr(o2, o1), _rr(st, s1)
    res["decode_inplace.same_tensor"] = float(s2.data_ptr() != st.data_ptr())
    # 6. gradients (backward recomputes through the torch chunk path) vs the fp64 reference
    q, k, v, f, beta = inputs(1, 35, H, K, V)
    h0 = r(1, H, K, V)
    leaves64 = [x.detach().clone().double().requires_grad_() for x in (q, k, v, f, beta, h0, A_log, dtb)]
    leaves32 = [x.detach().clone().float().requires_grad_() for x in (q, k, v, f, beta, h0, A_log, dtb)]
    do, dS = r(1, 35, H, V), r(1, H, K, V)
    for leaves, fn in ((leaves64, lambda *a, **kw: recurrent_kda(*a, **kw)),
                       (leaves32, lambda *a, **kw: chunk_kda(*a, backend="triton", **kw))):
        qq, kk, vv, ff, bb, hh, al, db = leaves
        o, S = fn(qq, kk, vv, ff, bb, initial_state=hh, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, A_log=al, dt_bias=db)
        ((o * do.to(o.dtype)).sum() + (S * dS.to(S.dtype)).sum()).backward()
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"), leaves32, leaves64):
        res["grad." + name] = _rr(a.grad, b.grad)
    # 7. causality: outputs at t <= t0 never depend on gates (or anything else) after t0
    q, k, v, f, beta = inputs(1, 48, H, K, V)
    t0 = 20
    o_a, _ = chunk_kda(q, k, v, f, beta, backend="triton", **gk)
    f2 = f.clone()
    f2[:, t0 + 1:] = r(*f2[:, t0 + 1:].shape) * 10
    v2 = v.clone()
    v2[:, t0 + 1:] += 1.0
    o_b, _ = chunk_kda(q, k, v2, f2, beta, backend="triton", **gk)
    res["causal.max_abs_diff_before"] = float((o_a[:, :t0 + 1] - o_b[:, :t0 + 1]).abs().max() / o_a.abs().max())
    res["causal.changed_after"] = float((o_a[:, t0 + 1:] - o_b[:, t0 + 1:]).abs().max())
    return res


@pytest.fixture(scope="module")
def results():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


FWD = ["gate_l2_h0", "precomputed_g", "varlen", "gate_at_bound", "g_eq_-5", "g_mixed_0_-5", "decode_B3",
       "decode_varlen", "decode_inplace"]


@pytest.mark.parametrize("name", FWD)
def test_forward_and_state(results, name):
    assert results[name + ".o"] <= TOL_OUT, results
    assert results[name + ".S"] <= TOL_OUT, results


def test_decode_updates_state_in_place(results):
    assert results["decode_inplace.same_tensor"] == 0.0


@pytest.mark.parametrize("name,tol", [("dq", TOL_DQKV), ("dk", TOL_DQKV), ("dv", TOL_DQKV), ("dh0", TOL_DQKV),
                                      ("dg", TOL_DGB), ("dbeta", TOL_DGB), ("dA_log", TOL_DGB),
                                      ("ddt_bias", TOL_DGB)])
def test_gradients(results, name, tol):
    assert results["grad." + name] <= tol, results


def test_causal_in_gates(results):
    assert results["causal.max_abs_diff_before"] <= 1e-6  # rounding only (the tile reference row may lie after t)
    assert results["causal.changed_after"] > 1e-3


def test_registered_without_importing_triton():
    from k3.ops.kda import kda_backends
    assert "triton" in kda_backends()


if __name__ == "__main__":
    print(json.dumps(_checks()))
