"""The gate lower bounds the chunked KDA paths accept (issue #34 item 2): [-10, 0) or None, per k3.ops.kda.

Just inside the limit (lb = -10, gate saturated so g = -10 in every channel) the torch chunk path and the Triton
kernels (interpreter, a small case in a subprocess) match the fp64 token-by-token reference; just outside it
chunk_kda and the model config refuse the bound, naming the limit. The fla dispatch's routing is checked without
fla (it needs CUDA): fla's safe_gate range [-5, 0), steeper bounds handed to the triton backend.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from k3.config import K3Config
from k3.errors import K3ConfigError
from k3.ops.kda import LOWER_BOUND_LIMITS, MIN_LOWER_BOUND, chunk_kda, lower_bound_problem, recurrent_kda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_TRITON = importlib.util.find_spec("triton") is not None
F64 = torch.float64
LN_FP32_MIN_NORMAL = 87.33  # ln(2^-126): below it exp() is subnormal (flushed to 0 on GPUs)


def _inputs(T=80, H=2, K=16, V=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=F64)
    q, k, v = r(1, T, H, K), r(1, T, H, K), r(1, T, H, V)
    beta = torch.rand(1, T, H, generator=g, dtype=F64)
    A_log, dt_bias = torch.rand(H, generator=g, dtype=F64) * 0.5, r(H * K) * 0.5
    return [x.to(dtype) for x in (q, k, v, beta, A_log, dt_bias)] + [r]


def test_limit_follows_from_the_triton_tiles():
    """The Triton tiles factor decays through reference row REF of a 16-row tile: single factors exp(8 |lb|)."""
    from k3.ops.kda.triton import MIN_LOG_DECAY
    from k3.ops.kda.triton.bwd_config import REF as BWD_REF, TS
    assert MIN_LOWER_BOUND == LOWER_BOUND_LIMITS["triton"] == MIN_LOG_DECAY == -10.0
    reach = max(BWD_REF, TS - 1 - BWD_REF)
    assert reach == 8 and reach * abs(MIN_LOWER_BOUND) <= 80 < LN_FP32_MIN_NORMAL
    assert LOWER_BOUND_LIMITS["fla"] == -5.0 and LOWER_BOUND_LIMITS["torch"] == float("-inf")
    if HAVE_TRITON:
        from k3.ops.kda.triton import fwd
        assert max(fwd.REF, 16 - 1 - fwd.REF) == reach


@pytest.mark.parametrize("lb", [-10.0, -6.0, -3.0, -1e-3])
def test_bounds_inside_are_accepted(lb):
    assert lower_bound_problem(lb) is None
    cfg = K3Config.from_preset("tiny", **{"linear_attn_config.gate_lower_bound": lb})
    assert cfg.lac.gate_lower_bound == lb
    assert K3Config.from_dict(cfg.to_dict()).lac.gate_lower_bound == lb


@pytest.mark.parametrize("lb", [-10.001, -11.0, -1e9, float("-inf"), float("nan"), 0.0, 0.5])
def test_bounds_outside_are_refused_naming_the_limit(lb):
    with pytest.raises(K3ConfigError, match=r"linear_attn_config\.gate_lower_bound") as e:
        K3Config.from_preset("tiny", **{"linear_attn_config.gate_lower_bound": lb})
    assert "-10.0" in str(e.value)
    q, k, v, beta, A_log, dt_bias, _ = _inputs(T=8)
    with pytest.raises(ValueError, match="lower_bound"):
        chunk_kda(q, k, v, torch.zeros_like(q), beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                  lower_bound=lb, backend="torch")
    if lb < MIN_LOWER_BOUND:
        assert "safe limit -10.0" in lower_bound_problem(lb) and "Triton" in lower_bound_problem(lb)


def test_null_bound_is_the_softplus_gate_in_config():
    cfg = K3Config.from_preset("tiny", **{"linear_attn_config.gate_lower_bound": None})
    assert cfg.lac.gate_lower_bound is None
    d = cfg.to_dict()
    assert d["linear_attn_config"]["gate_lower_bound"] is None
    assert K3Config.from_dict(d).lac.gate_lower_bound is None


@pytest.mark.parametrize("saturated", [True, False])
def test_torch_chunk_at_the_limit_matches_fp64_reference(saturated):
    """fp32 chunk path at lb = -10 (every decay exp(-10) when the gate saturates: the steepest tiles) vs the fp64
    token loop; T = 80 crosses a 64-chunk boundary with a partial chunk."""
    q, k, v, beta, A_log, dt_bias, r = _inputs()
    f = torch.full_like(q, 60.0) if saturated else r(*q.shape).float() * 3
    h0 = r(1, 2, 16, 16).float()
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=MIN_LOWER_BOUND,
              output_final_state=True)
    o, S = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, backend="torch", **kw)
    o_ref, S_ref = recurrent_kda(*(x.double() for x in (q, k, v, f, beta)), A_log=A_log.double(),
                                 dt_bias=dt_bias.double(), initial_state=h0.double(), **kw)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S.double(), S_ref, rtol=1e-4, atol=1e-5)


def test_softplus_gate_chunk_matches_reference():
    q, k, v, beta, A_log, dt_bias, r = _inputs(T=70, dtype=F64)
    f = r(*q.shape) * 2
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=None)
    o = chunk_kda(q, k, v, f, beta, backend="torch", **kw)[0]
    g = -A_log.exp()[:, None] * torch.nn.functional.softplus(f + dt_bias.view(2, 16))
    ref = recurrent_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)


def test_fla_routing_by_bound(monkeypatch):
    from k3.ops.kda import fla_backend as fb
    assert fb.FLA_SAFE_MIN_LOWER_BOUND == LOWER_BOUND_LIMITS["fla"]
    assert fb.safe_gate_for(True, -5.0) is True and fb.safe_gate_for(True, -1e-3) is True
    assert fb.safe_gate_for(True, -5.001) is None and fb.safe_gate_for(True, -10.0) is None
    assert fb.safe_gate_for(True, None) is False and fb.safe_gate_for(False, -7.0) is False
    # bounds steeper than fla's safe range go to the triton backend when it can run, else torch
    from k3.ops.kda import triton as ktriton
    q, k, v, beta, A_log, dt_bias, _ = _inputs(T=20)
    args = (q, k, v, torch.zeros_like(q), beta)
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-7.0)
    called = []
    monkeypatch.setattr(ktriton, "available", lambda: True)
    monkeypatch.setattr(ktriton, "chunk_kda_triton", lambda *a, **k: called.append(k["lower_bound"]) or "triton")
    assert fb._fallback("test-bound", *args, to_triton=True, **kw) == "triton" and called == [-7.0]
    monkeypatch.setattr(ktriton, "available", lambda: False)
    o, _ = fb._fallback("test-bound-2", *args, to_triton=True, **kw)
    torch.testing.assert_close(o, chunk_kda(*args, backend="torch", **kw)[0])


_CHILD = r"""
import json, torch
from k3.ops.kda import chunk_kda, recurrent_kda
from k3.ops.kda.triton import chunk as tchunk
gen = torch.Generator().manual_seed(0)
def r(*s): return torch.randn(*s, generator=gen, dtype=torch.float64)
T, H, K = 40, 1, 16
q, k, v = r(1, T, H, K), r(1, T, H, K), r(1, T, H, K)
beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
A_log, dtb, h0 = torch.rand(H, generator=gen, dtype=torch.float64), r(H * K) * 0.5, r(1, H, K, K)
out = {}
for name, f in (("saturated", torch.full_like(q, 60.0)), ("random", r(1, T, H, K) * 3)):
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-10.0, output_final_state=True)
    ins = [x.float().requires_grad_() for x in (q, k, v, f, beta)]
    o, S = chunk_kda(*ins, A_log=A_log.float(), dt_bias=dtb.float(), initial_state=h0.float(), backend="triton", **kw)
    (o * torch.cos(torch.arange(o.numel()).view_as(o).float())).sum().backward()
    refs = [x.clone().requires_grad_() for x in (q, k, v, f, beta)]
    o_r, S_r = recurrent_kda(*refs, A_log=A_log, dt_bias=dtb, initial_state=h0, **kw)
    (o_r * torch.cos(torch.arange(o_r.numel()).view_as(o_r).double())).sum().backward()
    rr = lambda a, b: float((a.double() - b).norm() / b.norm().clamp_min(1e-30))
    out[name] = dict(o=rr(o, o_r), S=rr(S, S_r), dq=rr(ins[0].grad, refs[0].grad), dv=rr(ins[2].grad, refs[2].grad),
                     df=rr(ins[3].grad, refs[3].grad), finite=bool(torch.isfinite(o).all()))
out["fallbacks"] = sorted(tchunk._FALLBACK_LOGGED)
print("RESULT", json.dumps(out))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_triton_kernels_at_the_limit_match_fp64_reference():
    """Triton forward (16-token chunks) and backward (64-token chunks, 16-row tiles) at lb = -10 in the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-3000:]
    res = json.loads(line[-1][7:])
    assert res["fallbacks"] == []  # the kernels ran (no fallback to torch)
    for name in ("saturated", "random"):
        r = res[name]
        assert r["finite"], name
        assert r["o"] < 2e-5 and r["S"] < 2e-5, (name, r)
        assert r["dq"] < 1e-4 and r["dv"] < 1e-4 and r["df"] < 1e-3, (name, r)
