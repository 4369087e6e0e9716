"""KDA Triton backend vs the token-loop reference, on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported, and pytest imports every test module into one process,
so the checks run in one subprocess (this file run as a script, with TRITON_INTERPRET=1) that prints a JSON
table of relative RMSEs; the tests below read that table. Skips cleanly when triton is not installed.
The forward (k3.ops.kda.triton.fwd) runs every forward case through chunk_kda as a user would; the options of its
prep (fwd.PREP_DEFAULT) and walk (fwd.STATE_CFG_DEFAULT), set through `triton_config`, run subsets. The interpreter
computes dots exactly in fp32 and truncates fp32 -> bf16; `emulate_gpu` makes it round like the GPU (tf32 dot
operands truncated to 10 mantissa bits, tf32x3 as three such products, fp32 -> bf16 to nearest even), used for the
D=128 accuracy checks.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

if __name__ == "__main__":  # the TRITON_INTERPRET=1 child: tests/ (helpers.py) on the path, as pytest has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import interpreted_results, max_rel_err, rel_err  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# fp32 inputs: forward output / final state (<= 4.3e-7 measured) and gradients against fp64 (<= 4.9e-6)
TOL_OUT, TOL_GRAD = 1e-5, 5e-5
# the prep's `qk="bf16"` option at fp32 inputs: bf16 Aqk / Akk operands, so bf16-level error (6.5e-3 measured)
TOL_QK_BF16 = 1e-2
# bf16 inputs vs the fp32 loop on the same (rounded) inputs: o is rounded to bf16 (1.6e-3 alone) and the WY
# intermediates and the state operand of the dots are bf16, as in fla; ~1e-2 at these small K, V (3.3e-3 at
# D=128 on the H200).
TOL_BF16 = 2.5e-2
# prep options beyond the default (fwd.PREP_DEFAULT), run on a subset of the forward cases
PREP_CASES = {
    "c2_w4_ieee_chunkfast": dict(c=2, num_warps=4, maxnreg=None, inv="ieee", head_fast=False),
    "c4_loop2_prefetch": dict(c=4, loop=2, prefetch=True),
    "c2_loop4_blkn_qk3": dict(c=2, loop=4, inv="blkn", qk="tf32x3"),
    "qk_bf16": dict(qk="bf16"),
    "kb16": dict(kb=16, num_warps=1),                  # K = 32: two K blocks; V = 16: one value block
    "kb16_c2_loop2": dict(kb=16, c=2, loop=2, head_fast=False),
}
PREP_FWD_CASES = ("precomputed_g", "varlen", "gate_at_bound_lb-10", "bf16")
# walk options (fwd.STATE_CFG_DEFAULT, kda_chunk_fwd(state_cfg=...)) on a subset: T = 100 not a multiple of 16 with
# an initial state, varlen (lengths 0, 1, 5, 17, ...) with initial states, bf16 varlen, K = V = 16 without an
# initial state
STATE_CASES = {
    "bv16_s2": dict(bv=16, num_stages=2),
    "w8": dict(num_warps=8),
    # time pieces (the pipelined forward): 16 tokens (every chunk its own piece; sequences of 0 and 1 tokens walk
    # empty pieces), 48 (T = 100: pieces of 48, 48, 4), 64
    "pipe16": dict(pipe=16),
    "pipe48": dict(pipe=48),
    "pipe64": dict(pipe=64),
}
# the pipelined forward against the unpiped one: the same kernels on the same chunks, so equal to rounding
PIPE_RUNS = {"pipe32": 32, "pipe16": 16, "pipe128": 128}
STATE_FWD_CASES = ("gate_l2_h0", "precomputed_g", "varlen", "bf16")
# D=128 bf16 inputs with GPU rounding emulated: o and state vs the fp32 loop. "hard": nearly collinear keys and weak
# decay (|n| ~ 1): a tf32 inverse by repeated squaring gives o off by 0.27-0.41 there (tried), the block inverse
# matches the ieee squaring
TOL_D128 = {"random": 5e-3, "hard": 1e-2}  # ieee inverse: 3.1e-3 / 7e-3 to 8e-3 (bf16 W, U and state)
D128_CASES = ("random", "hard")
D128_RUNS = {"default": {}, "ieee": dict(inv="ieee"), "blkn": dict(inv="blkn"), "kb32": dict(kb=32, num_warps=1)}
# The default suite runs these options only, every one above under `pytest -m slow` (a second child with the full
# tables): the prep's other inverse with 3-pass products, a loop over two chunks (c2_loop4_blkn_qk3) and its K blocks
# with the chunk-wise head (kb16_c2_loop2); the walk's smaller value blocks (bv16_s2) and time pieces that do not
# divide the sequences (pipe48); at D=128 the default and the other block inverse.
DEFAULT_OPTIONS = {"prep": ("c2_loop4_blkn_qk3", "kb16_c2_loop2"), "state": ("bv16_s2", "pipe48"),
                   "d128": ("default", "blkn")}
OPTIONS_ENV = "K3_TEST_LAUNCH_OPTIONS"  # which options the child runs: "default" (DEFAULT_OPTIONS) or "all"


def _chosen(table: str, options: dict) -> dict:
    """The entries of one option table the child runs ($K3_TEST_LAUNCH_OPTIONS: "default" or "all")."""
    which = os.environ.get(OPTIONS_ENV, "default")
    if which not in ("default", "all"):
        raise ValueError(f"{OPTIONS_ENV}={which!r}: expected 'default' or 'all'")
    return {k: v for k, v in options.items() if which == "all" or k in DEFAULT_OPTIONS[table]}


_rr = rel_err  # relative RMSE of a against reference b (tests/helpers.py)


from k3.ops.triton_interp import emulate_gpu, fix_interpreter_bf16_dot, run_interpreted  # noqa: E402,F401


def _checks() -> dict:
    import torch
    import torch.nn.functional as F
    from k3.ops.kda import chunk_kda, recurrent_kda
    from k3.ops.kda.triton import available, fused_recurrent_kda_triton, triton_config
    from k3.ops.kda.triton import fwd as ops, tables

    assert available(), "triton backend should be available under TRITON_INTERPRET=1"
    fix_interpreter_bf16_dot()
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

    # Forward cases: (name, args, kwargs, tolerance). Inputs drawn once.
    cases = []
    # fused gate + L2 norm + initial state; T = 100 = 64 + 36 = 6*16 + 4 (partial chunk for both chunk sizes)
    q, k, v, f, beta = inputs(2, 100, H, K, V)
    cases.append(("gate_l2_h0", (q, k, v, f, beta), dict(initial_state=r(2, H, K, V), **gk), TOL_OUT))
    # precomputed log-decay, no L2 norm (unit keys), explicit scale, no initial state, K=V=16
    q, k, v, g, beta = inputs(1, 50, 1, 16, 16, unit_k=True, gate=False)
    cases.append(("precomputed_g", (q, k, v, g, beta), dict(scale=0.3), TOL_OUT))
    # varlen with an initial state per sequence: lengths 5, 64 (one full 64-chunk), 1, 0, 280 (5 chunks of 64,
    # 18 of 16), 17
    cu = torch.tensor([0, 5, 69, 70, 70, 350, 367])
    q, k, v, f, beta = inputs(1, 367, H, K, V)
    cases.append(("varlen", (q, k, v, f, beta), dict(initial_state=r(6, H, K, V), cu_seqlens=cu, **gk), TOL_OUT))
    # gates at the bound: raw gate saturated (g = lower_bound to fp32 precision) for lower_bound -5 and -10 (the
    # steepest the kernels accept: in-tile exponents up to 8 * 10 = 80), precomputed g == -5, and precomputed g
    # switching between 0 and -10 (steepest and flattest in one tile)
    q, k, v, f, beta = inputs(1, 80, H, K, V)
    cases.append(("gate_at_bound", (q, k, v, torch.full_like(f, 60.0), beta), dict(**gk), TOL_OUT))
    cases.append(("gate_at_bound_lb-10", (q, k, v, torch.full_like(f, 60.0), beta),
                  dict(initial_state=r(1, H, K, V), lower_bound=-10.0, **gk), TOL_OUT))
    q, k, v, g, beta = inputs(1, 70, 1, 32, 32, unit_k=True, gate=False)
    cases.append(("g_eq_-5", (q, k, v, torch.full_like(g, -5.0), beta), dict(), TOL_OUT))
    g_mix = torch.where(torch.rand(g.shape, generator=gen) < 0.5, -10.0, 0.0)
    cases.append(("g_mixed_0_-10", (q, k, v, g_mix, beta), dict(initial_state=r(1, 1, 32, 32)), TOL_OUT))
    # bf16 inputs (reference: fp32 loop on the rounded inputs), varlen with a length-1 document, gate + L2 + h0
    cu_b = torch.tensor([0, 1, 71, 100])
    xs = [x.bfloat16() for x in inputs(1, 100, H, K, V)]
    cases.append(("bf16", tuple(xs), dict(initial_state=r(3, H, K, V), cu_seqlens=cu_b, **gk), TOL_BF16))
    res["tol"] = {name: tol for name, _, _, tol in cases}

    refs = [recurrent_kda(*[x.float() for x in args], output_final_state=True, **kw) for _, args, kw, _ in cases]
    causal_in = inputs(1, 80, H, K, V)
    t0 = 20
    for (name, args, kw, _), (o1, s1) in zip(cases, refs):
        o2, s2 = chunk_kda(*args, output_final_state=True, backend="triton", **kw)
        res[f"fwd.{name}.o"] = _rr(o2, o1)
        res[f"fwd.{name}.S"] = _rr(s2, s1)
        res[f"fwd.{name}.dtype_ok"] = float(o2.dtype == args[2].dtype and s2.dtype == torch.float32)
    # causality: outputs at t <= t0 never depend on gates (or anything else) after t0
    q, k, v, f, beta = causal_in
    o_a, _ = chunk_kda(q, k, v, f, beta, backend="triton", **gk)
    f2 = f.clone()
    f2[:, t0 + 1:] = r(*f2[:, t0 + 1:].shape) * 10
    v2 = v.clone()
    v2[:, t0 + 1:] += 1.0
    o_b, _ = chunk_kda(q, k, v2, f2, beta, backend="triton", **gk)
    res["fwd.causal.max_abs_diff_before"] = max_rel_err(o_b[:, :t0 + 1], o_a[:, :t0 + 1])
    res["fwd.causal.changed_after"] = float((o_a[:, t0 + 1:] - o_b[:, t0 + 1:]).abs().max())

    def option_sweep(label, field, option_sets, fwd_cases):
        """chunk_kda (public path) under triton_config(**{field: options}) per option set."""
        for oname, opts in option_sets.items():
            with triton_config(**{field: opts}):
                for (name, args, kw, _), (o1, s1) in zip(cases, refs):
                    if name in fwd_cases:
                        o2, s2 = chunk_kda(*args, output_final_state=True, backend="triton", **kw)
                        res[f"{label}[{oname}].{name}.o"] = _rr(o2, o1)
                        res[f"{label}[{oname}].{name}.S"] = _rr(s2, s1)

    option_sweep("prep", "prep_cfg", _chosen("prep", PREP_CASES), PREP_FWD_CASES)
    option_sweep("state", "state_cfg", _chosen("state", STATE_CASES), STATE_FWD_CASES)
    # pipelined vs unpiped, varlen with initial states (and without a final state: the last piece's walk then stores
    # nothing)
    _, args, kw, _ = next(c for c in cases if c[0] == "varlen")
    for run, piece in PIPE_RUNS.items():
        o0, s0 = ops.kda_chunk_fwd(*args, K ** -0.5, output_final_state=True, state_cfg=dict(pipe=0), **kw)
        o1, s1 = ops.kda_chunk_fwd(*args, K ** -0.5, output_final_state=True, state_cfg=dict(pipe=piece), **kw)
        o2, _ = ops.kda_chunk_fwd(*args, K ** -0.5, state_cfg=dict(pipe=piece), **kw)
        res[f"pipe.{run}.o"], res[f"pipe.{run}.S"] = _rr(o1, o0), _rr(s1, s0)
        res[f"pipe.{run}.o_no_final"] = _rr(o2, o0)
        res[f"pipe.{run}.used"] = float(ops.pipe_tokens(ops.state_config(dict(pipe=piece)), 280, 12) == piece)
    # longest documents walked first (lengths 5, 64, 1, 0, 280, 17 -> order 280, 64, 17, 5, 1, 0; the default at
    # varlen), unpiped and pipelined, against grid order (lpt=False): same result, final states per sequence
    o0, s0 = ops.kda_chunk_fwd(*args, K ** -0.5, output_final_state=True,
                               state_cfg=dict(pipe=0, lpt=False), **kw)
    o1, s1 = ops.kda_chunk_fwd(*args, K ** -0.5, output_final_state=True,
                               state_cfg=dict(pipe=32, lpt=True), **kw)
    o2, s2 = ops.kda_chunk_fwd(*args, K ** -0.5, output_final_state=True, state_cfg=dict(pipe=0),
                               **kw)
    res["pipe.lpt.o"], res["pipe.lpt.S"] = max(_rr(o1, o0), _rr(o2, o0)), max(_rr(s1, s0), _rr(s2, s0))
    res["lpt.order"] = tables._walk_order(tables._cu_cpu(1, 0, kw["cu_seqlens"]), "cpu").tolist()
    # equal-length rows (no cu_seqlens): the prep finds each piece's chunks without tables (T = 100: the last
    # piece's chunk is partial)
    _, args_f, kw_f, _ = next(c for c in cases if c[0] == "gate_l2_h0")
    o0, s0 = ops.kda_chunk_fwd(*args_f, K ** -0.5, output_final_state=True, state_cfg=dict(pipe=0),
                               **kw_f)
    o1, s1 = ops.kda_chunk_fwd(*args_f, K ** -0.5, output_final_state=True,
                               state_cfg=dict(pipe=32), **kw_f)
    res["pipe.fixed.o"], res["pipe.fixed.S"] = _rr(o1, o0), _rr(s1, s0)
    res["state_bad_cfg_raises"] = 0.0
    for bad in (dict(ch=3), dict(prefetch=True), dict(kernel="v3"), dict(bv=24), dict(foo=1), dict(pipe=24),
                dict(pipe=-16), dict(lpt=1)):
        try:
            ops.state_config(bad)
        except ValueError:
            res["state_bad_cfg_raises"] += 1.0
    res["prep_bad_cfg_raises"] = 0.0
    try:
        ops.prep_config(dict(c=3))
    except ValueError:
        res["prep_bad_cfg_raises"] = 1.0
    # D=128, bf16 inputs, tensor-core rounding emulated: prep options vs the fp32 loop
    Hd, Dd = 2, 128
    cu_d = torch.tensor([0, 37, 100])
    al_d, dt_d = torch.rand(Hd, generator=gen), r(Hd * Dd) * 0.1
    gk_d = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=al_d, dt_bias=dt_d)
    h0_d = r(2, Hd, Dd, Dd) * 0.1
    d128 = {}
    q, k, v, f, beta = inputs(1, 100, Hd, Dd, Dd)
    d128["random"] = (q, k, v, f, beta)
    k_hard = F.normalize(r(1, 1, Hd, Dd) + 0.03 * r(1, 100, Hd, Dd), dim=-1)  # nearly collinear keys
    f_hard = -6.0 + 0.1 * r(1, 100, Hd, Dd)                                   # log-decay ~ -0.01 per token
    d128["hard"] = (q, k_hard, v, f_hard, 0.5 + 0.5 * torch.rand(1, 100, Hd, generator=gen))
    emulate_gpu(True)
    for case in D128_CASES:
        xs = tuple(x.bfloat16() for x in d128[case])
        kw = dict(initial_state=h0_d, cu_seqlens=cu_d, **gk_d)
        o1, s1 = recurrent_kda(*[x.float() for x in xs], output_final_state=True, **kw)
        for run, pc in _chosen("d128", D128_RUNS).items():
            with triton_config(prep_cfg=pc):
                o2, s2 = chunk_kda(*xs, output_final_state=True, backend="triton", **kw)
            res[f"d128.{run}.{case}.o"] = _rr(o2, o1)
            res[f"d128.{run}.{case}.S"] = _rr(s2, s1)
    emulate_gpu(False)
    # decode: one token per sequence through chunk_kda (dispatches to the recurrent kernel), varlen decode,
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
    # gradients (the backend's forward and backward) vs the fp64 reference
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
    return res


@pytest.fixture(scope="module")
def results():
    """The child's table with DEFAULT_OPTIONS."""
    return interpreted_results(__file__, timeout=300, env_set={OPTIONS_ENV: "default"})


@pytest.fixture(scope="module")
def results_all_options():
    """The child's table with every option (the slow tests' cases)."""
    return interpreted_results(__file__, timeout=600, env_set={OPTIONS_ENV: "all"})


def _options(table: str, options) -> list:
    """An option table's entries as test parameters: those outside DEFAULT_OPTIONS marked slow."""
    return [o if o in DEFAULT_OPTIONS[table] else pytest.param(o, marks=pytest.mark.slow) for o in options]


def _table(request, table: str, option):
    """The child's table that holds `option`: the default one, or (a slow case) the full one."""
    return request.getfixturevalue("results" if option in DEFAULT_OPTIONS[table] else "results_all_options")


def _assert_o_and_state(results, key, tol):
    """Output and final-state relative errors of one checked run both within tol."""
    assert results[key + ".o"] <= tol, (key, results[key + ".o"], results[key + ".S"])
    assert results[key + ".S"] <= tol, (key, results[key + ".o"], results[key + ".S"])


FWD_CASES = ["gate_l2_h0", "precomputed_g", "varlen", "gate_at_bound", "gate_at_bound_lb-10", "g_eq_-5",
             "g_mixed_0_-10", "bf16"]


@pytest.mark.parametrize("name", FWD_CASES)
def test_forward_and_state(results, name):
    tol = results["tol"][name]
    key = f"fwd.{name}"
    _assert_o_and_state(results, key, tol)
    assert results[key + ".dtype_ok"] == 1.0


@pytest.mark.parametrize("option", _options("prep", PREP_CASES))
@pytest.mark.parametrize("name", PREP_FWD_CASES)
def test_prep_options(request, option, name):
    results = _table(request, "prep", option)
    tol = results["tol"][name]
    key = f"prep[{option}].{name}"
    if option == "qk_bf16" and tol < TOL_BF16:  # bf16 Aqk/Akk operands: bf16-level error even for fp32 inputs
        tol = TOL_QK_BF16
    _assert_o_and_state(results, key, tol)


@pytest.mark.parametrize("option", _options("state", STATE_CASES))
@pytest.mark.parametrize("name", STATE_FWD_CASES)
def test_state_options(request, option, name):
    results = _table(request, "state", option)
    tol = results["tol"][name]
    key = f"state[{option}].{name}"
    _assert_o_and_state(results, key, tol)


def test_state_config_validated(results):
    assert results["state_bad_cfg_raises"] == 8.0


@pytest.mark.parametrize("variant", list(PIPE_RUNS))
def test_pipelined_forward_equals_unpiped(results, variant):
    assert results[f"pipe.{variant}.used"] == 1.0
    for key in ("o", "S", "o_no_final"):
        assert results[f"pipe.{variant}.{key}"] <= 1e-6, (variant, key, results[f"pipe.{variant}.{key}"])


def test_pipelined_forward_fixed_rows_equals_unpiped(results):
    assert results["pipe.fixed.o"] <= 1e-6 and results["pipe.fixed.S"] <= 1e-6, results["pipe.fixed.o"]


def test_pipelined_longest_first_equals_unpiped(results):
    assert results["lpt.order"] == [4, 1, 5, 0, 2, 3], results["lpt.order"]
    assert results["pipe.lpt.o"] <= 1e-6 and results["pipe.lpt.S"] <= 1e-6, (results["pipe.lpt.o"],
                                                                            results["pipe.lpt.S"])


def test_prep_config_validated(results):
    assert results["prep_bad_cfg_raises"] == 1.0


@pytest.mark.parametrize("run", _options("d128", D128_RUNS))
@pytest.mark.parametrize("case", D128_CASES)
def test_d128_bf16_gpu_rounding(request, run, case):
    results = _table(request, "d128", run)
    key = f"d128.{run}.{case}"
    assert results[key + ".o"] <= TOL_D128[case], (key, results[key + ".o"], results[key + ".S"])
    assert results[key + ".S"] <= TOL_D128[case], (key, results[key + ".o"], results[key + ".S"])


def test_forward_causal(results):
    # rounding only (a tile's reference row may lie after t)
    assert results["fwd.causal.max_abs_diff_before"] <= 1e-6
    assert results["fwd.causal.changed_after"] > 1e-3


@pytest.mark.parametrize("name", ["decode_B3", "decode_varlen", "decode_inplace"])
def test_decode_and_state(results, name):
    assert results[name + ".o"] <= TOL_OUT, results
    assert results[name + ".S"] <= TOL_OUT, results


def test_decode_updates_state_in_place(results):
    assert results["decode_inplace.same_tensor"] == 0.0


@pytest.mark.parametrize("name", ["dq", "dk", "dv", "dh0", "dg", "dbeta", "dA_log", "ddt_bias"])
def test_gradients(results, name):
    assert results["grad." + name] <= TOL_GRAD, results


def test_registered_without_importing_triton():
    from k3.ops.kda import kda_backends
    assert "triton" in kda_backends()


if __name__ == "__main__":
    print(json.dumps(_checks()))


def test_state_cfg_from_the_environment(monkeypatch):
    """$K3_KDA_STATE_CFG sets state_cfg keys for every call (a call's own state_cfg wins); bad values are refused by
    name; lpt takes None / True / False."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from k3.ops.kda.triton import fwd as ops
    monkeypatch.setenv("K3_KDA_STATE_CFG", '{"bv": 64, "lpt": false}')
    cfg = ops.state_config()
    assert cfg["bv"] == 64 and cfg["lpt"] is False and cfg["pipe"] is None
    assert ops.state_config(dict(bv=32))["bv"] == 32 and ops.state_config(dict(bv=32))["lpt"] is False
    for raw, msg in (("{bv: 64}", "not JSON"), ("[64]", "JSON object"), ('{"bvv": 64}', "unknown keys"),
                     ('{"lpt": 1}', "lpt")):
        monkeypatch.setenv("K3_KDA_STATE_CFG", raw)
        with pytest.raises(ValueError, match=msg):
            ops.state_config()
    monkeypatch.delenv("K3_KDA_STATE_CFG")
    assert ops.state_config()["lpt"] is None


def test_pipe_auto_rule():
    """pipe=None: pipelined in PIPE_AUTO-token pieces only above PIPE_AUTO tokens, up to PIPE_MAX_PROGS (sequence,
    head) pairs; an explicit piece length wins."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from k3.ops.kda.triton import fwd as ops
    auto, n = ops.state_config({}), ops.PIPE_AUTO
    assert ops.pipe_tokens(auto, n + 1, 96) == n
    assert ops.pipe_tokens(auto, n, 96) == 0                       # one piece: nothing to overlap
    assert ops.pipe_tokens(auto, 4 * n, ops.PIPE_MAX_PROGS + 1) == 0
    assert ops.pipe_tokens(auto, 4 * n, 192) == n and ops.pipe_tokens(auto, 4 * n, 1152) == 0
    assert ops.pipe_tokens(ops.state_config(dict(pipe=0)), 4 * n, 96) == 0
    assert ops.pipe_tokens(ops.state_config(dict(pipe=512)), 1000, 5000) == 512


def test_fixed_length_tables_built_once_per_shape():
    """Without cu_seqlens the device chunk tables are built once per (B, T, chunk, device) and reused (no host
    work or host-to-device copy per call); they equal a fresh build; varlen tables are built per call."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    import torch
    from k3.ops.kda.triton import tables as ops
    ops._FIXED_TABLES.clear()
    a = ops._seq_tables(3, 100, None, "cpu", 16)
    b = ops._seq_tables(3, 100, None, "cpu", 16)
    assert all(x is y for x, y in zip(a[:4], b[:4])) and a[4:] == b[4:] == (3, 21)
    cu = torch.tensor([0, 100, 200, 300])
    fresh = ops._seq_tables(1, 300, cu, "cpu", 16)  # the same boundaries as varlen: built, not cached
    assert all(torch.equal(x, y) for x, y in zip(a[:4], fresh[:4])) and fresh[4:] == a[4:]
    assert ops._seq_tables(1, 300, cu, "cpu", 16)[1] is not fresh[1]
    c = ops._seq_tables(3, 100, None, "cpu", 64)  # another chunk length: its own entry
    assert c[5] == 6 and len(ops._FIXED_TABLES) == 2
    for t in range(ops._FIXED_TABLES_MAX + 5):  # bounded: the oldest shapes go
        ops._seq_tables(1, 16 * (t + 1), None, "cpu", 16)
    assert len(ops._FIXED_TABLES) == ops._FIXED_TABLES_MAX
