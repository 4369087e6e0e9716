"""The routing decision (k3.ops.router.select_experts) and the expert-parallel seam of k3.ops.moe
(dispatch_tokens -> compute_experts -> combine_tokens), each against an obvious per-token loop in fp64."""
import pytest
import torch

from k3.ops.activations import situ_glu
from k3.ops.moe import combine_tokens, compute_experts, dispatch_tokens, experts_forward
from k3.ops.router import expert_weights, select_experts, selection_scores


def _glu(g, u):
    return situ_glu(g, u, 4.0, 25.0)


def _scores(N, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.sigmoid(torch.randn(N, E, generator=g, dtype=torch.float64) * 2)
    b = torch.randn(E, generator=g, dtype=torch.float64) * 0.3
    return s, b


def _select_loop(s, b, k, G, kg, renorm, scaling):
    """Written out from DeepSeek-V3's noaux_tc: group score = sum of the two largest biased scores of the group;
    keep the best kg groups; top-k of the biased scores over the kept experts; weights from the unbiased scores."""
    N, E = s.shape
    m = E // G
    idx_all, w_all = [], []
    for n in range(N):
        biased = [float(s[n, e] + b[e]) for e in range(E)]
        gscore = [sum(sorted(biased[g * m:(g + 1) * m], reverse=True)[:2]) for g in range(G)]
        kept = sorted(range(G), key=lambda g: -gscore[g])[:kg]
        cand = [e for e in range(E) if e // m in kept]
        pick = sorted(cand, key=lambda e: -biased[e])[:k]
        w = [float(s[n, e]) for e in pick]
        if renorm:
            tot = sum(w)
            w = [x / (tot + 1e-20) for x in w]
        idx_all.append(pick)
        w_all.append([x * scaling for x in w])
    return torch.tensor(idx_all), torch.tensor(w_all, dtype=torch.float64)


@pytest.mark.parametrize("G,kg", [(1, 1), (4, 2), (8, 3), (16, 16)])
@pytest.mark.parametrize("renorm,scaling", [(True, 1.0), (False, 2.5)])
def test_select_experts_matches_written_out_noaux_tc(G, kg, renorm, scaling):
    s, b = _scores(40, 32, seed=G + kg)
    idx, w = select_experts(s, b, 6, renorm, scaling, G, kg)
    idx_ref, w_ref = _select_loop(s, b, 6, G, kg, renorm, scaling)
    assert torch.equal(idx, idx_ref)
    assert torch.allclose(w, w_ref, rtol=1e-12, atol=0)


def test_grouped_selection_stays_in_kept_groups_and_bias_not_in_weights():
    s, b = _scores(64, 32, seed=3)
    idx, w = select_experts(s, b, 4, True, 1.0, num_expert_group=8, topk_group=2)
    assert all(len(set((r // 4).tolist())) <= 2 for r in idx)
    assert torch.allclose(w, expert_weights(s, idx, True, 1.0))
    sel = selection_scores(s, b, 8, 2)
    assert bool((sel == float("-inf")).sum(1).eq(32 - 8).all())      # 6 of 8 groups masked per token
    # one group kept = top-k inside the group with the best top-2 sum
    idx1, _ = select_experts(s, b, 2, True, 1.0, num_expert_group=8, topk_group=1)
    assert bool(((idx1 // 4)[:, 0] == (idx1 // 4)[:, 1]).all())


def test_select_experts_gradient_reaches_scores_only_through_weights():
    s, b = _scores(8, 16)
    s = s.clone().requires_grad_()
    idx, w = select_experts(s, b, 3)
    w.sum().backward()
    assert s.grad is not None and bool((s.grad != 0).sum(1).le(3).all())


# ------------------------------------------------------------------------------------------ dispatch/compute/combine
def _moe_inputs(N=13, l=8, M=6, E=5, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, l, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g, dtype=torch.float64)
    gu = torch.randn(E, l, 2 * M, generator=g, dtype=torch.float64) * 0.3
    dn = torch.randn(E, M, l, generator=g, dtype=torch.float64) * 0.3
    return x, idx, w, gu, dn


def test_dispatch_groups_rows_by_expert():
    x, idx, w, gu, dn = _moe_inputs()
    N, k = idx.shape
    E = gu.shape[0]
    x_A, plan = dispatch_tokens(x, idx, E)
    # the loop: for each expert in order, the rows of the tokens that selected it, in token order
    rows, counts = [], []
    for e in range(E):
        toks = [n for n in range(N) for j in range(k) if int(idx[n, j]) == e]
        rows += [x[n] for n in toks]
        counts.append(len(toks))
    assert torch.equal(x_A, torch.stack(rows))
    assert plan.counts.tolist() == counts
    assert plan.offsets.tolist() == torch.tensor(counts).cumsum(0).tolist()
    assert (plan.num_tokens, plan.top_k) == (N, k)
    for n in range(N):          # slot (n, j) of the token-major layout sits at row inv[n*k + j]
        for j in range(k):
            a = int(plan.inv[n * k + j])
            assert torch.equal(x_A[a], x[n]) and int(plan.tok_of_row[a]) == n


@pytest.mark.parametrize("backend,dtype", [("padded_bmm", torch.float64), ("grouped_mm", torch.float32)])
def test_compute_experts_matches_per_row_loop(backend, dtype):
    """fp64 through the padded batched GEMM; torch._grouped_mm takes fp32 at most (CPU), checked against the fp64
    loop at fp32 accuracy (16-byte aligned widths so it runs)."""
    x, idx, w, gu, dn = _moe_inputs(l=8, M=8, seed=1)
    E = gu.shape[0]
    x, gu, dn = x.to(dtype), gu.to(dtype), dn.to(dtype)
    x_A, plan = dispatch_tokens(x, idx, E)
    y_A = compute_experts(x_A, plan.counts, plan.offsets, gu, dn, _glu, backend=backend)
    expert_of_row = torch.repeat_interleave(torch.arange(E), plan.counts)
    ref = []
    for a in range(x_A.shape[0]):
        e = int(expert_of_row[a])
        g, u = (x_A[a] @ gu[e]).chunk(2, -1)
        ref.append(_glu(g.double(), u.double()) @ dn[e].double())
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert torch.allclose(y_A.double(), torch.stack(ref), rtol=tol, atol=tol)


def test_compute_experts_with_an_empty_expert():
    x, _, w, gu, dn = _moe_inputs(E=6, seed=2)
    g = torch.Generator().manual_seed(5)
    others = torch.tensor([0, 1, 2, 4, 5])                                 # expert 3 gets no rows
    idx = torch.stack([others[torch.randperm(5, generator=g)[:2]] for _ in range(x.shape[0])])
    x_A, plan = dispatch_tokens(x, idx, 6)
    assert int(plan.counts[3]) == 0
    y_A = compute_experts(x_A, plan.counts, plan.offsets, gu, dn, _glu)
    assert y_A.shape == x_A.shape and bool(torch.isfinite(y_A).all())
    out = combine_tokens(y_A, plan, w)
    assert torch.allclose(out, experts_forward(x, idx, w, gu, dn, _glu, backend="loop"), rtol=1e-12, atol=1e-13)


def test_combine_matches_per_token_loop():
    x, idx, w, gu, dn = _moe_inputs(seed=3)
    N, k = idx.shape
    x_A, plan = dispatch_tokens(x, idx, gu.shape[0])
    y_A = torch.randn(x_A.shape, dtype=torch.float64)
    out = combine_tokens(y_A, plan, w)
    ref = torch.stack([sum(w[n, j] * y_A[int(plan.inv[n * k + j])] for j in range(k)) for n in range(N)])
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-14)


def test_composition_is_experts_forward_with_gradients():
    x, idx, w, gu, dn = _moe_inputs(seed=4)
    E = gu.shape[0]
    args = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    ref = experts_forward(args[0], idx, args[1], args[2], args[3], _glu, backend="loop")
    ref_g = torch.autograd.grad(ref.sum(), args)
    args2 = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    x_A, plan = dispatch_tokens(args2[0], idx, E)
    out = combine_tokens(compute_experts(x_A, plan.counts, plan.offsets, args2[2], args2[3], _glu), plan, args2[1])
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-13)
    for a, b in zip(torch.autograd.grad(out.sum(), args2), ref_g):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    assert torch.equal(out, experts_forward(x, idx, w, gu, dn, _glu))
