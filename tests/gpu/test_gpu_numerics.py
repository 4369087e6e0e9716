"""GPU paths vs the fp32 CPU reference, within bf16 tolerances (outputs and gradients). Skipped without CUDA.

Errors are relative Frobenius norms ||gpu - ref|| / ||ref||; bf16 operands land around 1e-3..1e-2. Each test
prints its errors (run with -s to see them; benchmarks/RESULTS.md quotes them).
"""
import functools

import pytest
import torch

from helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
BF = torch.bfloat16


rel = functools.partial(rel_err, finite=True)   # rel(gpu, reference); a non-finite GPU result fails by itself


def report(name, **errs):
    print(f"[gpu-numerics] {name}: " + ", ".join(f"{k}={v:.2e}" for k, v in errs.items()), flush=True)


def leaf(x, dev, dtype=None):
    return x.detach().to(dev, dtype or x.dtype).requires_grad_()


# ---------------------------------------------------------------------------------------------------- KDA
def kda_inputs(B, T, H, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    f = r(B, T, H, K)
    beta = torch.rand(B, T, H, generator=g)
    A_log = torch.rand(H, generator=g) * 1.5
    dt_bias = r(H * K) * 0.5
    return q, k, v, f, beta, A_log, dt_bias


def _kda_run(backend, dev, dtype, q, k, v, f, beta, A_log, dt_bias, h0=None, cu=None, grad=True):
    from k3.ops.kda import chunk_kda
    xs = [leaf(t, dev, dtype) for t in (q, k, v, f)] + [leaf(beta, dev, torch.float32)]
    ps = [leaf(A_log, dev, torch.float32), leaf(dt_bias, dev, torch.float32)]
    o, S = chunk_kda(*xs, scale=q.shape[-1] ** -0.5, initial_state=None if h0 is None else h0.to(dev),
                     output_final_state=True, cu_seqlens=None if cu is None else cu.to(dev),
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=ps[0], dt_bias=ps[1],
                     lower_bound=-5.0, backend=backend)
    grads = None
    if grad:
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(99)).to(dev, o.dtype)
        dS = torch.randn(S.shape, generator=torch.Generator().manual_seed(98)).to(dev, S.dtype)
        ((o.float() * do.float()).sum() + (S * dS).sum()).backward()
        grads = [t.grad for t in xs + ps]
    return o, S, grads


needs_fla = pytest.mark.skipif(
    not (torch.cuda.is_available() and __import__("k3.ops.kda.fla_backend", fromlist=["x"]).available()),
    reason="needs fla")


@needs_fla
@pytest.mark.parametrize("T", [64, 300])
def test_kda_fla_vs_cpu_reference(T):
    B, H, K, V = 2, 8, 128, 128  # H8 D128: a key of the committed fla autotune pack (H4 D128 autotuned for 100 s)
    q, k, v, f, beta, A_log, dt_bias = kda_inputs(B, T, H, K, V, seed=T)
    h0 = torch.randn(B, H, K, V) * 0.1
    o_r, S_r, g_r = _kda_run("torch", "cpu", torch.float32, q, k, v, f, beta, A_log, dt_bias, h0)
    o_g, S_g, g_g = _kda_run("fla", DEV, BF, q, k, v, f, beta, A_log, dt_bias, h0)
    assert o_g.dtype == BF and S_g.dtype == torch.float32
    errs = dict(o=rel(o_g, o_r), S=rel(S_g, S_r))
    for n, a, b in zip(["dq", "dk", "dv", "df", "dbeta", "dA_log", "ddt_bias"], g_g, g_r):
        errs[n] = rel(a, b)
    report(f"kda fla T={T}", **errs)
    assert errs["o"] < 2e-2 and errs["S"] < 2e-2
    assert all(errs[n] < 5e-2 for n in ("dq", "dk", "dv", "df", "dbeta", "dA_log", "ddt_bias")), errs


@needs_fla
def test_kda_fla_varlen_and_decode():
    H, K, V = 4, 64, 64
    lens = [37, 128, 5, 200]
    T = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    q, k, v, f, beta, A_log, dt_bias = kda_inputs(1, T, H, K, V, seed=7)
    h0 = torch.randn(len(lens), H, K, V) * 0.1
    o_r, S_r, g_r = _kda_run("torch", "cpu", torch.float32, q, k, v, f, beta, A_log, dt_bias, h0, cu)
    o_g, S_g, g_g = _kda_run("fla", DEV, BF, q, k, v, f, beta, A_log, dt_bias, h0, cu)
    errs = dict(o=rel(o_g, o_r), S=rel(S_g, S_r), dq=rel(g_g[0], g_r[0]), dv=rel(g_g[2], g_r[2]))
    report("kda fla varlen", **errs)
    assert errs["o"] < 2e-2 and errs["S"] < 2e-2 and errs["dq"] < 5e-2 and errs["dv"] < 5e-2
    # decode: one token per sequence from a carried state -> fused_recurrent_kda, no grad
    q1, k1, v1, f1, b1, _, _ = kda_inputs(3, 1, H, K, V, seed=8)
    S0 = torch.randn(3, H, K, V) * 0.3
    with torch.no_grad():
        o_r, S_r, _ = _kda_run("torch", "cpu", torch.float32, q1, k1, v1, f1, b1, A_log, dt_bias, S0, grad=False)
        o_g, S_g, _ = _kda_run("fla", DEV, BF, q1, k1, v1, f1, b1, A_log, dt_bias, S0, grad=False)
    errs = dict(o=rel(o_g, o_r), S=rel(S_g, S_r))
    report("kda fla decode", **errs)
    assert errs["o"] < 2e-2 and errs["S"] < 1e-2


def test_kda_dispatch_picks_fla_on_cuda():
    from k3.ops import dispatch
    from k3.ops.kda import fla_backend
    expected = "fla" if fla_backend.available() else "torch"
    assert dispatch.resolve("kda", None, "cuda") == expected
    assert dispatch.resolve("kda", None, "cpu") == "torch"


# ---------------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("case", ["dense", "varlen", "offset", "decode"])
def test_attention_flash_vs_reference(case):
    from k3.ops.attention import attention_reference, causal_attention
    H, Dq, Dv = 4, 96, 64
    g = torch.Generator().manual_seed(1)
    B, Tq, Tk = (2, 333, 333) if case == "dense" else (1, 500, 500) if case == "varlen" else \
        (2, 100, 300) if case == "offset" else (2, 1, 300)
    q, k, v = (torch.randn(B, Tq, H, Dq, generator=g), torch.randn(B, Tk, H, Dq, generator=g),
               torch.randn(B, Tk, H, Dv, generator=g))
    cu = torch.tensor([0, 17, 200, 201, 500], dtype=torch.int32) if case == "varlen" else None
    off = Tk - Tq
    scale = Dq ** -0.5
    qg, kg, vg = leaf(q, DEV, BF), leaf(k, DEV, BF), leaf(v, DEV, BF)
    o_g, _ = causal_attention(qg, kg, vg, scale, cu_seqlens=None if cu is None else cu.to(DEV), q_offset=off,
                              backend="flash")
    # reference: fp64 on CPU over the full context, keep the last Tq queries
    qc, kc, vc = leaf(q.double(), "cpu"), leaf(k.double(), "cpu"), leaf(v.double(), "cpu")
    if off:
        qfull = torch.cat([torch.zeros(B, off, H, Dq, dtype=torch.float64), qc], 1)
        o_r = attention_reference(qfull, kc, vc, scale)[:, off:]
    else:
        o_r = attention_reference(qc, kc, vc, scale, cu)
    do = torch.randn(o_r.shape, generator=g)
    (o_g.float() * do.to(DEV)).sum().backward()
    (o_r * do.double()).sum().backward()
    errs = dict(o=rel(o_g, o_r), dq=rel(qg.grad, qc.grad), dk=rel(kg.grad, kc.grad), dv=rel(vg.grad, vc.grad))
    report(f"attention flash {case}", **errs)
    assert all(e < 2e-2 for e in errs.values()), errs


# ---------------------------------------------------------------------------------------------------- AttnRes
@pytest.mark.parametrize("backend", ["fla", "compile"])
def test_attnres_fused_vs_reference(backend):
    from k3.ops import dispatch
    from k3.ops.attnres import attnres_mix, attnres_mix_reference
    avail = dispatch._REGISTRY["attnres"][backend][0]()
    if not avail:
        pytest.skip(f"attnres backend {backend} not available")
    g = torch.Generator().manual_seed(2)
    S, N, d = 5, 777, 512
    srcs = [torch.randn(N, d, generator=g) * (1 + i) for i in range(S)]
    w = torch.randn(d, generator=g) * 0.1
    for dtype, tol in ((torch.float32, 1e-4), (BF, 2e-2)):
        sg = [leaf(s, DEV, dtype) for s in srcs]
        wg = leaf(w, DEV, torch.float32)
        sc = [leaf(s.to(dtype).float(), "cpu") for s in srcs]
        wc = leaf(w, "cpu")
        o_g = attnres_mix(sg, wg, 1e-5, backend=backend)
        o_r = attnres_mix_reference(sc, wc, 1e-5)
        assert o_g.dtype == dtype
        do = torch.randn(N, d, generator=g)
        (o_g.float() * do.to(DEV)).sum().backward()
        (o_r * do).sum().backward()
        errs = dict(o=rel(o_g, o_r), dw=rel(wg.grad, wc.grad),
                    dsrc=max(rel(a.grad, b.grad) for a, b in zip(sg, sc)))
        report(f"attnres {backend} {dtype}", **errs)
        assert errs["o"] < tol and errs["dsrc"] < max(tol, 1e-3) * 5 and errs["dw"] < max(tol, 1e-3) * 5, errs


# ---------------------------------------------------------------------------------------------------- MoE
@pytest.mark.parametrize("combine", ["torch", "triton"])
def test_experts_grouped_mm_bf16_vs_cpu(combine):
    from k3.ops.activations import situ_glu
    from k3.ops.moe import experts_forward, route
    g = torch.Generator().manual_seed(3)
    N, E, k, l, M = 1000, 16, 4, 128, 64
    x = torch.randn(N, l, generator=g)
    rw = torch.randn(E, l, generator=g) * 0.1
    idx, w, _ = route(x, rw, None, k)
    gu = torch.randn(E, l, 2 * M, generator=g) * l ** -0.5
    dn = torch.randn(E, M, l, generator=g) * M ** -0.5
    xg, gug, dng, wg = leaf(x, DEV, BF), leaf(gu, DEV, BF), leaf(dn, DEV, BF), leaf(w, DEV)
    xc, guc, dnc, wc = leaf(x, "cpu"), leaf(gu, "cpu"), leaf(dn, "cpu"), leaf(w, "cpu")
    o_g = experts_forward(xg, idx.to(DEV), wg, gug, dng, situ_glu, backend="grouped_mm", combine_backend=combine)
    o_r = experts_forward(xc, idx, wc, guc, dnc, situ_glu, backend="grouped_mm", combine_backend="torch")
    do = torch.randn(N, l, generator=g)
    (o_g.float() * do.to(DEV)).sum().backward()
    (o_r * do).sum().backward()
    errs = dict(o=rel(o_g, o_r), dx=rel(xg.grad, xc.grad), dgu=rel(gug.grad, guc.grad), ddn=rel(dng.grad, dnc.grad),
                dw=rel(wg.grad, wc.grad))
    report(f"experts grouped_mm bf16, combine {combine}", **errs)
    assert all(e < 2e-2 for e in errs.values()), errs


# ---------------------------------------------------------------------------------------------------- model
# Routing is pinned: the CPU fp32 run records every router's top-k picks and the CUDA run replays them (weights from
# its own scores). At random init the score margins are small and a bf16 rounding flips picks; unpinned, the model
# comparison measured those flips (logits 0.21 apart on the H200 and equally on CPU bf16 autocast, 2026-11-30), not
# the kernels. Tolerances: fp32 mode checks semantics (TF32 off in torch; fla's fp32 kernels use tf32 dots);
# bf16 mode is what eight random-init layers of bf16 rounding give on CPU autocast too (logits 4.2e-2, grad median
# 7.5e-2 there), with margin.
# "bf16w": bf16 weights in the release's storage dtypes (fp32 A_log, dt_bias, short convs, o_norm, routing bias),
# as `k3 train` runs on CUDA; the weights' own rounding adds to the bf16 activations' (tolerances: a guess, x1.5).
TINY_TOL = {"fp32": dict(logits=2e-2, loss=2e-3, grad_median=4e-2),
            "bf16": dict(logits=8e-2, loss=1e-2, grad_median=1.5e-1),
            "bf16w": dict(logits=1.2e-1, loss=1.5e-2, grad_median=2.2e-1)}


@pytest.mark.parametrize("mode", ["bf16", "bf16w", "fp32"])
@pytest.mark.parametrize("packed", [False, True])
def test_tiny_model_cuda_vs_cpu(packed, mode, monkeypatch):
    import contextlib
    if mode == "fp32":
        # fla's fp32 KDA kernels are not in the committed autotune pack: their first call autotunes for minutes on
        # a fresh machine (a whole 140 s test stage went there, 2026-11-30). fp32 mode checks every other CUDA path
        # at model level; fla's KDA is checked against the fp32 reference by the op tests above (bf16).
        # The first fp32 run (2026-11-30, fourth session) did not finish inside 90 s either: AttnRes goes to the torch
        # path too (fla's fused AttnRes is checked in fp32 by its op test above).
        monkeypatch.setenv("K3_BACKEND", "kda:torch,attnres:torch")
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.nn.moe import pinned_routing
    torch.manual_seed(0)
    cfg = K3Config.from_preset("tiny")
    m_cpu = K3ForCausalLM(cfg).float()
    with torch.no_grad():  # non-zero pseudo-queries so the AttnRes mixes are not uniform
        for n, p in m_cpu.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.05)
    m_gpu = K3ForCausalLM(cfg, init=False).float().to(DEV)
    m_gpu.load_state_dict(m_cpu.state_dict())
    if mode == "bf16w":
        from k3.checkpoint import cast_to_storage_dtype
        cast_to_storage_dtype(m_gpu, BF)
    g = torch.Generator().manual_seed(4)
    B, T = (1, 384) if packed else (2, 192)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    cu = torch.tensor([0, 100, 101, 300, 384], dtype=torch.int32) if packed else None
    rec = pinned_routing(m_cpu)
    with rec:
        out_c = m_cpu(ids, labels=labels, cu_seqlens=cu, return_logits=True)
    out_c.loss.backward()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ctx = torch.autocast("cuda", dtype=BF) if mode == "bf16" else contextlib.nullcontext()
        with rec.replay(m_gpu), ctx:
            out_g = m_gpu(ids.to(DEV), labels=labels.to(DEV), cu_seqlens=None if cu is None else cu.to(DEV),
                          return_logits=True)
        out_g.loss.backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    errs = dict(logits=rel(out_g.logits.float(), out_c.logits),
                loss=abs(out_g.loss.item() - out_c.loss.item()) / abs(out_c.loss.item()))
    gc = dict(m_cpu.named_parameters())
    gerr = {}
    for n, p in m_gpu.named_parameters():
        if p.grad is not None and gc[n].grad is not None and gc[n].grad.norm() > 0:
            gerr[n] = rel(p.grad.float(), gc[n].grad)
    errs["grad_median"] = sorted(gerr.values())[len(gerr) // 2]
    errs["grad_max"] = max(gerr.values())
    worst = max(gerr, key=gerr.get)
    report(f"tiny model cuda({mode}, routing pinned) vs cpu fp32 packed={packed} (worst grad: {worst})", **errs)
    tol = TINY_TOL[mode]
    assert all(errs[k] < tol[k] for k in tol), (errs, tol)


# ---------------------------------------------------------------------------------------------------- our Triton kernels
def test_situ_triton_kernels_vs_fp32_reference(monkeypatch):
    """Both tanh paths of the SiTU kernels (exact, and the opt-in hardware tanh.approx) against the fp32 reference;
    the approx path must actually run (outputs differ from the exact path's) and stay within 1.5x its error."""
    from k3.ops import activations_triton as at
    from k3.ops.activations import situ_glu, situ_glu_reference
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(4096, 1024, generator=g) * 4
    do = torch.randn(4096, 512, generator=g)
    ref_g, ref_u = gu[:, :512].clone().requires_grad_(), gu[:, 512:].clone().requires_grad_()
    situ_glu_reference(ref_g, ref_u).backward(do)
    ref_o = situ_glu_reference(gu[:, :512], gu[:, 512:])
    errs, outs = {}, {}
    for mode in ("exact", "approx"):
        monkeypatch.setattr(at, "APPROX_TANH", mode)
        gub = gu.to(DEV, BF).requires_grad_()
        out = situ_glu(*gub.chunk(2, -1))          # strided halves, the MoE's layout
        out.backward(do.to(DEV, BF))
        outs[mode] = (out.detach(), gub.grad)
        errs[mode] = dict(o=rel(out, ref_o), dg=rel(gub.grad[:, :512], ref_g.grad), du=rel(gub.grad[:, 512:], ref_u.grad))
        report(f"situ triton {mode}", **errs[mode])
    assert all(v < 1e-2 for e in errs.values() for v in e.values()), errs
    assert not torch.equal(outs["exact"][0], outs["approx"][0]) and not torch.equal(outs["exact"][1], outs["approx"][1])
    assert all(errs["approx"][k] <= 1.5 * errs["exact"][k] + 5e-4 for k in errs["exact"]), errs


@pytest.mark.parametrize("varlen", [False, True])
def test_conv_triton_vs_fp32_reference(varlen):
    """The Triton short conv (backend "triton" of k3.ops.conv) in bf16 on the GPU against the CPU fp32 torch path:
    output and both gradients, at a KDA shape (C = 1024), with and without document resets."""
    from k3.ops.conv import causal_conv1d
    g = torch.Generator().manual_seed(5)
    B, T, C = (1, 3000, 1024) if varlen else (2, 1500, 1024)
    x = torch.randn(B, T, C, generator=g) * 2
    w = torch.randn(C, 1, 4, generator=g) * 0.5
    dy = torch.randn(B, T, C, generator=g)
    cu = torch.tensor([0, 1, 700, 701, 2200, 3000], dtype=torch.int32) if varlen else None
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr, _ = causal_conv1d(xr, wr, cu_seqlens=cu, backend="torch")
    yr.backward(dy)
    xg, wg = x.to(DEV, BF).requires_grad_(), w.to(DEV).requires_grad_()
    yg, _ = causal_conv1d(xg, wg, cu_seqlens=cu.to(DEV) if cu is not None else None, backend="triton")
    yg.backward(dy.to(DEV, BF))
    errs = dict(y=rel(yg, yr), dx=rel(xg.grad, xr.grad), dw=rel(wg.grad, wr.grad))
    report(f"conv triton bf16 varlen={varlen}", **errs)
    assert all(v < 1e-2 for v in errs.values()), errs
    # every launch option the backward's autotuner chooses among
    from k3.ops import conv_triton as ct
    st = ct.token_starts(cu.to(DEV), T) if cu is not None else None
    for cfg in ct.BWD_CONFIGS:
        dx, dw = ct.conv1d_bwd(xg.detach(), wg.detach().reshape(C, 4), dy.to(DEV, BF), st, True, config=cfg)
        e = dict(dx=rel(dx, xr.grad), dw=rel(dw, wr.grad.reshape(C, 4)))
        assert all(v < 1e-2 for v in e.values()), (cfg, e)
    print(f"[gpu-numerics] conv triton bwd: all {len(ct.BWD_CONFIGS)} launch options within 1e-2, autotuner picked "
          f"{ct._conv4_bwd_tuned.best_config}", flush=True)


def test_router_split_bf16_vs_fp64():
    """The router's logits from bf16 activations as three bf16 GEMM terms (cuBLAS mm with fp32 output; the CUDA
    default) against fp64: logits and dW at fp32-accumulation level (the seventh session's run: 1.0e-6 / 4.4e-6 at
    K = 1024 / 8192; printed next to cuBLAS's fp32 GEMM on the same inputs), far below a bf16 GEMM's ~2e-3; dx no
    worse than one bf16 rounding of the exact value (1.66e-3 both)."""
    from k3.ops import dispatch
    from k3.ops.router import router_logits
    assert dispatch.resolve("router", None, "cuda") == "split_bf16"
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(8192, 1024, generator=g) * 3).bfloat16()
    w = torch.randn(64, 1024, generator=g) * 0.02
    dl = torch.randn(8192, 64, generator=g, dtype=torch.float64)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = xr @ wr.t()
    dx_ref, dw_ref = torch.autograd.grad(ref, (xr, wr), dl)
    xg, wg = x.to(DEV).requires_grad_(), w.to(DEV).requires_grad_()
    out = router_logits(xg, wg)
    out.backward(dl.to(DEV, torch.float32))
    x32, w32, dl32 = x.to(DEV).float(), w.to(DEV), dl.to(DEV, torch.float32)
    errs = dict(logits=rel(out, ref), logits_fp32_gemm=rel(x32 @ w32.t(), ref),
                dw=rel(wg.grad, dw_ref), dw_fp32_gemm=rel(dl32.t() @ x32, dw_ref),
                dx=rel(xg.grad, dx_ref), dx_rounding=rel(dx_ref.bfloat16(), dx_ref))
    report("router split bf16", **errs)
    assert errs["logits"] < 1e-5 and errs["dw"] < 5e-5, errs
    assert errs["dx"] < 1.1 * errs["dx_rounding"], errs


def test_linear_cross_entropy_bf16_vs_fp64():
    """The training loss with its gradient formed in the forward pass (k3/ops/loss.py: bf16 GEMMs, the dW sum in
    fp32 via cuBLAS mm with fp32 output, the compiled chunk gradient) against fp64 autograd, at the lm_head shape
    of `small` (V = 32768, d = 1024) with 4 chunks and ignored targets; and against the checkpointed chunks."""
    import torch.nn.functional as F
    from k3.ops.loss import ce_chunk_grad, linear_cross_entropy_sum
    g = torch.Generator().manual_seed(13)
    N, d, V = 2048, 1024, 32768
    h = torch.randn(N, d, generator=g)
    w = torch.randn(V, d, generator=g) * 0.02
    y = torch.randint(0, V, (N,), generator=g)
    y[::7] = -100
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy(hr @ wr.t(), y, ignore_index=-100, reduction="sum")
    dh_ref, dw_ref = torch.autograd.grad(ref, (hr, wr))
    hg, wg = h.to(DEV, BF).requires_grad_(), w.to(DEV, BF).requires_grad_()
    loss = linear_cross_entropy_sum(hg, wg, y.to(DEV), 512, torch.compile(ce_chunk_grad))
    dh, dw = torch.autograd.grad(loss, (hg, wg))
    hc, wc = h.to(DEV, BF).requires_grad_(), w.to(DEV, BF).requires_grad_()
    plain = F.cross_entropy((hc @ wc.t()).float(), y.to(DEV), ignore_index=-100, reduction="sum")
    dh_p, dw_p = torch.autograd.grad(plain, (hc, wc))
    errs = dict(loss=rel(loss, ref), dh=rel(dh, dh_ref), dw=rel(dw, dw_ref),
                plain_loss=rel(plain, ref), plain_dh=rel(dh_p, dh_ref), plain_dw=rel(dw_p, dw_ref))
    report("linear CE fused bf16 (plain bf16 autograd alongside)", **errs)
    assert errs["loss"] < 2 * errs["plain_loss"] + 1e-6, errs
    assert errs["dh"] < 1.5 * errs["plain_dh"] + 1e-3 and errs["dw"] < 1.5 * errs["plain_dw"] + 1e-3, errs


@pytest.mark.parametrize("H,C,R", [(8, 256, 32), (64, 512, 64)])
def test_mla_decode_triton_vs_fp64_reference(H, C, R):
    from k3.ops import mla_decode_triton as mdt
    g = torch.Generator().manual_seed(H)
    N, W = 3, 5000
    kv = torch.randn(N, W, C + R, generator=g)
    qf = torch.randn(N, H, C + R, generator=g) * (C + R) ** -0.5
    lens = torch.tensor([0, 1234, W - 1])
    ref = []
    for n in range(N):
        L = int(lens[n]) + 1
        p = torch.softmax(qf[n].double() @ kv[n, :L].double().t(), -1)
        ref.append(p @ kv[n, :L, :C].double())
    ref = torch.stack(ref)
    out = mdt.mla_decode(qf.to(DEV), kv.to(DEV, BF), lens.to(DEV), C)
    err = rel(out, ref)
    report(f"mla decode triton H{H} C{C}", o=err)
    assert err < 1e-2


def test_kda_triton_backward_selfcheck(monkeypatch):
    from k3.ops.kda.triton.selfcheck import gpu_selfcheck
    monkeypatch.delenv("K3_KDA_TRITON_BWD", raising=False)
    res = gpu_selfcheck(T=1000, H=8, D=128, dtypes=("bf16",))  # fp32: minutes of first compile
    errs = {k: v for k, v in res.items() if ".ms." not in k}
    report("kda triton bwd", **errs)
    for k, v in errs.items():
        tight = ".fp32." in k or k.endswith("fp32")
        loose = any(n in k for n in ("dg", "df", "dbeta", "dA_log", "ddt_bias"))
        tol = 1e-3 if tight else (2e-2 if loose else 8e-3)
        assert v <= tol, (k, v)


def test_kda_triton_backward_finite_with_saturated_gates():
    """Every gradient finite at H96 D128 bf16 with gates that saturate (exp(A_log) up to 16, no dht): the regime
    where an earlier form of the backward (u' / du' kept by the sequential passes) gave non-finite states and
    gradients on the H200 while the selfcheck above passed (2026-11-30, benchmarks/kda_bwd_nan.py)."""
    from k3.ops.kda.triton import bwd as ops_bwd
    gen = torch.Generator(device=DEV).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)
    T, H, D = 2048, 96, 128
    q, k, v, f, do = (r(1, T, H, D).to(BF) for _ in range(5))
    beta = r(1, T, H).sigmoid().to(BF)
    A_log = torch.log(torch.empty(H, device=DEV).uniform_(1, 16, generator=gen))
    grads = ops_bwd.kda_chunk_bwd(q, k, v, f, beta, do, None, D ** -0.5, use_qk_l2norm_in_kernel=True,
                                  use_gate_in_kernel=True, A_log=A_log, dt_bias=r(H * D) * 0.1, lower_bound=-5.0)
    bad = {n: int((~torch.isfinite(x)).sum()) for n, x in
           zip(("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"), grads) if not torch.isfinite(x).all()}
    assert not bad, bad


def test_kda_triton_backward_collinear_keys_on_the_gpu():
    """A run of one repeated token (nearly collinear keys, long memory, beta near 1) at H8 D128 bf16 on the GPU's
    tensor cores: the backward's block-inverted T keeps every gradient near the fp32 torch path's (the former
    repeated squaring in one-pass tf32 gave ~1e4-1e6 relative error here and blew `small` training up), and the
    former inverse (INV "pow") is still far off, so the inputs reach the cancellation."""
    from k3.ops.kda.chunk import chunk_kda_torch
    from k3.ops.kda.triton import bwd as ops_bwd
    gen = torch.Generator(device=DEV).manual_seed(5)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)
    T, H, D = 1024, 8, 128
    k = (r(1, 1, H, D).expand(1, T, H, D) + 0.1 * r(1, T, H, D)).to(BF)
    q, v, do = (r(1, T, H, D).to(BF) for _ in range(3))
    f = (r(1, T, H, D) * 2 - 30).to(BF)                          # the gate far below its midpoint: g ~ 0
    beta = (0.9 + 0.1 * torch.rand(1, T, H, device=DEV, generator=gen)).to(BF)
    h0, dht = r(1, H, D, D), r(1, H, D, D)
    kw = dict(initial_state=h0, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=torch.rand(H, device=DEV, generator=gen), dt_bias=r(H * D) * 0.5, lower_bound=-5.0)
    xs = [t.float().requires_grad_() for t in (q, k, v)] + [f.float(), beta.float().requires_grad_(),
                                                           h0.clone().requires_grad_()]
    o, S = chunk_kda_torch(*xs[:5], scale=D ** -0.5, initial_state=xs[5], output_final_state=True,
                           **{n: kw[n] for n in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias",
                                                 "lower_bound")})
    ((o * do.float()).sum() + (S * dht).sum()).backward()
    ref = dict(dq=xs[0].grad, dk=xs[1].grad, dv=xs[2].grad, dbeta=xs[4].grad, dh0=xs[5].grad)
    errs = {}
    for inv in ("blk", "pow"):
        g = ops_bwd.kda_chunk_bwd(q, k, v, f, beta, do, dht, D ** -0.5, launch={"matrices": {"INV": inv}}, **kw)
        got = dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g))
        errs[inv] = {n: (rel if inv == "blk" else rel_err)(got[n].float(), ref[n]) for n in ref}  # pow: NaN counts
    report("kda triton bwd, collinear keys (block inversion)", **errs["blk"])
    report("kda triton bwd, collinear keys (repeated squaring)", **errs["pow"])
    assert max(errs["blk"].values()) <= 5e-2, errs
    assert not all(e <= 1.0 for e in errs["pow"].values()), errs       # a NaN there counts as far off


def test_kda_triton_backward_from_the_forwards_saved_states():
    """The training forward's saved chunk states and u' (the default at bf16) against the backward's own states pass
    at H96 D128 bf16, varlen with an initial state and sequences past one 8K time piece (the pipelined forward saves
    piece by piece): every gradient within the bf16 lines of each other (both are bf16 roundings of the same
    arithmetic; a wrong chunk index would put whole chunks' states out of place)."""
    from k3.ops.kda.triton import bwd as ops_bwd, fwd as fops
    gen = torch.Generator(device=DEV).manual_seed(3)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)
    H, D, cu = 96, 128, [0, 1, 9000, 9000, 20000]
    q, k, v, f, do = (r(1, cu[-1], H, D).to(BF) for _ in range(5))
    beta = r(1, cu[-1], H).sigmoid().to(BF)
    kw = dict(initial_state=r(len(cu) - 1, H, D, D) * 0.1, cu_seqlens=torch.tensor(cu, device=DEV),
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=torch.rand(H, device=DEV, generator=gen),
              dt_bias=r(H * D) * 0.5, lower_bound=-5.0)
    dht = r(len(cu) - 1, H, D, D)
    save = ops_bwd.fwd_save(D, D, BF)
    assert save is not None
    fops.kda_chunk_fwd(q, k, v, f, beta, D ** -0.5, output_final_state=True, save=save, **kw)
    assert save.filled
    got = ops_bwd.kda_chunk_bwd(q, k, v, f, beta, do, dht, D ** -0.5, saved=save, **kw)
    ref = ops_bwd.kda_chunk_bwd(q, k, v, f, beta, do, dht, D ** -0.5, **kw)
    rr = lambda a, b: float((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt())
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")
    errs = {n: rr(a, b) for n, a, b in zip(names, got, ref)}
    report("kda triton bwd from the forward's states vs its own", **errs)
    for n, e in errs.items():
        assert e <= (8e-3 if n in ("dq", "dk", "dv", "dh0") else 2e-2), (n, errs)


# ---------------------------------------------------------------------------------------------------- our KDA forward, full shapes
def _fp32_ref(q, k, v, f, beta, A_log, dt_bias, h0=None, cu=None):
    from k3.ops.kda import chunk_kda
    with torch.no_grad():
        return chunk_kda(*(t.to(DEV, torch.float32) for t in (q, k, v, f, beta)), scale=q.shape[-1] ** -0.5,
                         initial_state=None if h0 is None else h0.to(DEV), output_final_state=True,
                         cu_seqlens=None if cu is None else cu.to(DEV), use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, A_log=A_log.to(DEV), dt_bias=dt_bias.to(DEV), lower_bound=-5.0,
                         backend="torch")


def test_kda_triton_forward_full_shape():
    """Our Triton forward at K3 head shapes (H96 D128, bf16, varlen with an initial state) vs the fp32 torch chunk
    path on the GPU: fla's test tolerances (relative RMSE <= 5e-3 for outputs and final states)."""
    from k3.ops.kda import chunk_kda
    H, D = 96, 128
    q, k, v, f, beta, A_log, dt_bias = kda_inputs(1, 2000, H, D, D, seed=11)
    cu = torch.tensor([0, 1, 700, 1333, 2000])
    h0 = torch.randn(4, H, D, D, generator=torch.Generator().manual_seed(12)) * 0.1
    o_ref, S_ref = _fp32_ref(q, k, v, f, beta, A_log, dt_bias, h0, cu)
    with torch.no_grad():
        o, S = chunk_kda(*(t.to(DEV, BF) for t in (q, k, v, f)), beta.to(DEV), scale=D ** -0.5,
                         initial_state=h0.to(DEV), output_final_state=True, cu_seqlens=cu.to(DEV),
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log.to(DEV),
                         dt_bias=dt_bias.to(DEV), lower_bound=-5.0, backend="triton")
    rr = lambda a, b: float((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt())
    errs = dict(o=rr(o, o_ref), S=rr(S, S_ref))
    report("kda triton H96 D128 varlen+h0", **errs)
    assert errs["o"] <= 5e-3 and errs["S"] <= 5e-3, errs


def test_kda_triton_pipelined_forward_full_shape():
    """The pipelined forward (prep of piece p + 1 on the current stream while a high-priority stream walks piece p)
    at H96 D128 bf16, varlen with an initial state, against the unpiped forward on the same inputs (same kernels on
    the same chunks: equal to rounding) and the fp32 torch path (fla's tolerance); run twice in a row and after
    unrelated work on the current stream, so a missing stream wait would show as a difference."""
    from k3.ops.kda.triton import fwd as ops
    H, D = 96, 128
    q, k, v, f, beta, A_log, dt_bias = kda_inputs(1, 6000, H, D, D, seed=21)
    cu = torch.tensor([0, 1, 2100, 2100, 4500, 6000])
    h0 = torch.randn(5, H, D, D, generator=torch.Generator().manual_seed(22)) * 0.1
    o_ref, S_ref = _fp32_ref(q, k, v, f, beta, A_log, dt_bias, h0, cu)
    args = [t.to(DEV, BF) for t in (q, k, v, f)] + [beta.to(DEV, BF)]
    kw = dict(initial_state=h0.to(DEV), output_final_state=True, cu_seqlens=cu.to(DEV), use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, A_log=A_log.to(DEV), dt_bias=dt_bias.to(DEV), lower_bound=-5.0)
    rr = lambda a, b: float((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt())
    with torch.no_grad():
        o0, S0 = ops.kda_chunk_fwd(*args, D ** -0.5, state_cfg=dict(pipe=0), **kw)
        errs = {}
        for piece in (512, 1024, 2048):
            for rep in range(2):
                torch.cuda._sleep(1_000_000)  # keep the current stream busy: the side stream must wait for it
                o1, S1 = ops.kda_chunk_fwd(*args, D ** -0.5, state_cfg=dict(pipe=piece), **kw)
                errs[f"p{piece}_{rep}_vs_unpiped"] = max(rr(o1, o0), rr(S1, S0))
        errs.update(o_ref=rr(o1, o_ref), S_ref=rr(S1, S_ref))
        o2, S2 = ops.kda_chunk_fwd(*args, D ** -0.5, state_cfg=dict(pipe=1024, lpt=True), **kw)
        errs["lpt_p1024_vs_unpiped"] = max(rr(o2, o0), rr(S2, S0))
        # equal-length rows (no cu_seqlens; T not a multiple of the piece or the chunk): the prep's table-free path
        xs = [t[:, :4004].reshape(2, 2002, *t.shape[2:]).contiguous() for t in args]
        kw2 = dict(kw, cu_seqlens=None, initial_state=kw["initial_state"][:2])
        o0, S0 = ops.kda_chunk_fwd(*xs, D ** -0.5, state_cfg=dict(pipe=0), **kw2)
        o1, S1 = ops.kda_chunk_fwd(*xs, D ** -0.5, state_cfg=dict(pipe=512), **kw2)
        errs["rows_p512_vs_unpiped"] = max(rr(o1, o0), rr(S1, S0))
    report("kda triton pipelined H96 D128 varlen+h0", **errs)
    assert all(e <= 1e-6 for n, e in errs.items() if n.endswith("unpiped")), errs
    assert errs["o_ref"] <= 5e-3 and errs["S_ref"] <= 5e-3, errs


def test_kda_triton_forward_causal_in_gates():
    """Outputs before position t do not move when the gates (and keys, values) after t change."""
    from k3.ops.kda import chunk_kda
    H, D, T, t = 8, 128, 300, 137
    q, k, v, f, beta, A_log, dt_bias = kda_inputs(1, T, H, D, D, seed=13)
    f2, k2, v2 = f.clone(), k.clone(), v.clone()
    f2[:, t:] = torch.randn(f2[:, t:].shape) * 3
    k2[:, t:] += 1.0
    v2[:, t:] -= 1.0
    run = lambda ff, kk, vv: chunk_kda(*(x.to(DEV, BF) for x in (q, kk, vv, ff)), beta.to(DEV), scale=D ** -0.5,
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log.to(DEV),
                                       dt_bias=dt_bias.to(DEV), lower_bound=-5.0, backend="triton")[0]
    with torch.no_grad():
        a, b = run(f, k, v), run(f2, k2, v2)
    before = (a[:, :t].float() - b[:, :t].float()).abs().max().item()
    after = (a[:, t:].float() - b[:, t:].float()).abs().max().item()
    report("kda triton causality", before=before, after=after)
    assert before <= 1e-2 * a[:, :t].float().abs().max().item() and after > 1e-2, (before, after)


def test_model_prefill_forward_only_uses_triton_and_matches_fla(monkeypatch):
    """No-grad calls route to our forward (k3.ops.kda.FORWARD_ONLY_TRITON_MIN_TOKENS); same logits as fla's.
    Routing is pinned (recorded in the fla run, replayed in ours): unpinned, bf16-level KDA differences flip
    random-init router picks and the logits differed by 0.118 on the H200 (2026-11-30), as in the tiny-model test."""
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.nn.moe import pinned_routing
    from k3.ops.kda import triton as kt
    torch.manual_seed(0)
    cfg = K3Config.from_preset("tiny")
    m = K3ForCausalLM(cfg).to(DEV, BF).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 1024), device=DEV)
    calls = []
    orig = kt.chunk_kda_triton
    import k3.ops.kda as kda_mod
    monkeypatch.setitem(kda_mod._IMPLS, "triton", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    rec = pinned_routing(m)
    monkeypatch.setenv("K3_BACKEND", "kda:fla")
    with torch.no_grad(), rec:
        ref = m(ids).logits.float()
    assert not calls, "K3_BACKEND=kda:fla still called the triton backend"
    monkeypatch.delenv("K3_BACKEND")
    with torch.no_grad(), rec.replay(m):
        auto = m(ids).logits.float()
    assert calls, "no-grad prefill did not go to the triton backend"
    # both bf16 paths against the same model in fp32 (torch KDA / AttnRes paths, same routing): ours must be as close
    # as fla's (pinned, triton vs fla measured 3.2e-2 apart on the H200, 2026-11-30: eight random-init bf16 layers)
    import copy
    m32 = copy.deepcopy(m).float()
    monkeypatch.setenv("K3_BACKEND", "kda:torch,attnres:torch")
    with torch.no_grad(), rec.replay(m32):
        exact = m32(ids).logits.float()
    err_ours, err_fla = rel(auto, exact), rel(ref, exact)
    report("model prefill bf16 vs fp32", triton=err_ours, fla=err_fla, triton_vs_fla=rel(auto, ref))
    assert err_ours <= 1.5 * err_fla + 5e-3, (err_ours, err_fla)
