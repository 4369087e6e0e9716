"""QK-clip's max logit under context parallelism ignores the padding (cp not dividing the sequence): each MLA
layer's per-head max logit, reduced over the cp ranks, equals one process's on the unpadded sequence, even with
a pad token whose own q.k is larger than every real logit (so a leak would show and clip heads)."""
import pytest
import torch

from launcher import run_dist


@pytest.fixture(scope="module")
def cp2_max_logit():
    return run_dist("tests/parallel/_cp_cases.py:max_logit_case", 2, {"T": 37, "cu": (0, 9, 30, 37)})


def test_cp_max_logit_excludes_padding(cp2_max_logit):
    r = cp2_max_logit[0]
    assert r["pad_rows"] == 1
    assert r["margin"] > 1e-3, r            # the pad token's own logit beats every real one: a leak would show
    assert len(r["ref"]) == len(r["cp"]) >= 1
    for S_ref, S_cp in zip(r["ref"], r["cp"]):
        torch.testing.assert_close(S_cp, S_ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{r['case']}: {m}")
    assert r["n_ref"] == 0 and r["n_cp"] == 0, r       # tau above every real logit: nothing to clip
    for other in cp2_max_logit[1:]:
        for a, b in zip(other["cp"], r["cp"]):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def _mla_under_cp(T, cu, size, rank, seed=0):
    """An MLA layer (micro config) with the CP forward and rank `rank`'s slice set by hand (no processes: these
    slices need no collective), plus its one-process twin."""
    from launcher import _load
    from k3.nn.mla import MLAAttention
    from k3.parallel.context import ContextParallel, apply_context_parallel, plan_slices
    cfg = _load("tests/parallel/cases.py:micro_config")()
    torch.manual_seed(seed)
    ref = MLAAttention(cfg, 3)
    mod = MLAAttention(cfg, 3)
    mod.load_state_dict(ref.state_dict())
    for m in (ref, mod):
        m.track_max_logit = True
        m.train()
    cp = ContextParallel()
    apply_context_parallel(mod, cp)
    cp.current = plan_slices(T, cu, size, rank)
    return cfg, ref, mod, cp.current


def test_pad_rows_with_huge_logits_stay_out_of_the_max_logit():
    """cp = 2, T = 5, documents [0, 3) [3, 5): rank 1 holds [3, 5) + one pad row. The pad row is picked so its
    own q.k beats every real logit (the unmasked max would differ); the max logit equals the one-process one of
    the rank's real rows, and the output the plain attention over the slice."""
    from k3.ops.attention import causal_attention
    cfg, ref, mod, sl = _mla_under_cp(5, [0, 3, 5], 2, 1)
    assert sl.local_cu[1] == [0, 2, 3] and not sl.cont[1]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, cfg.hidden_size, generator=g)
    ref(x, cu_seqlens=torch.tensor([0, 2], dtype=torch.int32))
    S_ref = ref.last_max_logit.clone()

    def self_logit(row):
        q = mod.project_q(row)
        k, _ = mod.expand_kv(*mod.project_latent(row))
        return ((q * k).sum(-1) * mod.softmax_scale)[0, 0]          # [H]

    with torch.no_grad():
        cands = [s * torch.randn(1, 1, cfg.hidden_size, generator=g) for s in (10.0, 30.0, 100.0) for _ in range(8)]
        pad = max(cands, key=lambda r: float((self_logit(r) - S_ref).max()))
        assert float((self_logit(pad) - S_ref).max()) > 1e-2
    xs = torch.cat([x, pad], 1)
    cu = torch.tensor(sl.local_cu[1], dtype=torch.int32)
    with torch.no_grad():
        y = mod(xs, cu_seqlens=cu)
        q = mod.project_q(xs)
        k, v = mod.expand_kv(*mod.project_latent(xs))
        o_all, S_all = causal_attention(q, k, v, mod.softmax_scale, cu_seqlens=cu.long(), return_max_logit=True)
        y_plain = mod.output(o_all, xs)
    assert float((S_all - S_ref).max()) > 1e-2                  # a max over every query would see the pad
    torch.testing.assert_close(mod.last_max_logit, S_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y, y_plain, atol=0, rtol=0)      # the output is the same attention call


def test_rank_of_padding_only_reports_minus_inf():
    """cp = 3, T = 4: rank 2's slice [4, 6) is all padding: it has no real logit (-inf, neutral for the max over
    ranks); its output is still computed (shape, finite)."""
    cfg, _, mod, sl = _mla_under_cp(4, None, 3, 2)
    assert sl.slice_len == 2 and sl.orig_len - sl.start <= 0 and not sl.cont[2]
    x = torch.randn(1, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    y = mod(x, cu_seqlens=torch.tensor(sl.local_cu[2], dtype=torch.int32))
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert mod.last_max_logit.shape == (cfg.num_attention_heads,)
    assert torch.isneginf(mod.last_max_logit).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("T, cu, off", [(300, [0, 7, 140, 300], 0), (9, None, 0), (6, None, 5)])
def test_attention_max_logit_is_causal_attentions(dtype, T, cu, off):
    """attention_max_logit = the max logit causal_attention returns, bit for bit (same tiles and ops)."""
    from k3.ops.attention import attention_max_logit, causal_attention
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, T, 3, 8, generator=g).to(dtype)
    k = torch.randn(1, T + off, 3, 8, generator=g).to(dtype)
    v = torch.randn(1, T + off, 3, 4, generator=g).to(dtype)
    cu_t = None if cu is None else torch.tensor(cu)
    _, ml = causal_attention(q, k, v, 0.35, cu_seqlens=cu_t, return_max_logit=True, q_offset=off)
    ml2 = attention_max_logit(q, k, 0.35, cu_seqlens=cu_t, q_offset=off)
    assert ml2.dtype == ml.dtype and torch.equal(ml2, ml)
    assert torch.isneginf(attention_max_logit(q[:, :0], k, 0.35)).all()
