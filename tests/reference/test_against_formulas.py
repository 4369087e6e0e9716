"""The modules against an independent fp64 restatement of the spec (tests/reference/formulas.py).

Elsewhere in the suite fast paths are compared with k3's own reference functions, so a mistake shared by both
(swapped SiTU betas, the MLA gate after o_proj, the AttnRes logits without the RMS normalisation, ...) passes.
Here every layer of a small fp64 model (the `tiny` preset shrunk: 6 layers, AttnRes block boundaries at layers
0, 2, 4, KDA and MLA, dense + LatentMoE) is run on CPU and compared with formulas.py, which reads the parameters
by their released checkpoint names (k3.checkpoint.to_released: stacked experts split into w1/w3/w2, A_log
padded), so the checkpoint mapping is covered as well. All parameters are randomised (norm weights != 1, AttnRes pseudo-queries
!= 0, correction bias != 0, A_log != 0) so that no term vanishes at init values.

Tolerance: fp64 everywhere; the differences are summation-order effects (chunked KDA vs a token loop, grouped
expert GEMMs vs a per-expert loop), measured at <= ~1e-13 relative; the tests allow 1e-10 of the output scale.
"""
from __future__ import annotations

import ast
import os

import pytest
import torch

from k3.checkpoint import to_released
from k3.config import K3Config
from k3.model import K3ForCausalLM

from . import formulas as R

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-10  # relative to the output's max magnitude

# `tiny` shrunk: 6 layers (KDA at 0, 2, 3, 5; MLA at 1, 4), AttnRes blocks of 2 layers, layer 0 dense, MoE with
# 8 experts top-3 and 2 fused shared experts; v_head_dim != qk_nope_head_dim and latent != hidden so that a split or
# a transposition in the wrong place changes shapes or values
MICRO = dict(hidden_size=64, num_hidden_layers=6, vocab_size=512, bos_token_id=500, eos_token_id=502,
             pad_token_id=511, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_experts=8,
             num_experts_per_token=3, num_shared_experts=2, moe_intermediate_size=24, routed_expert_hidden_size=40,
             kda_gate_low_rank=16, attn_res_block_size=2,
             **{"linear_attn_config.num_heads": 2, "linear_attn_config.head_dim": 16,
                "linear_attn_config.full_attn_layers": [2, 5],
                "linear_attn_config.kda_layers": [1, 3, 4, 6]})


def micro_config(**over) -> K3Config:
    return K3Config.from_preset("tiny", **{**MICRO, **over})


@torch.no_grad()
def randomise_(model: K3ForCausalLM, seed: int = 0) -> K3ForCausalLM:
    """Every parameter and the correction biases random (fp32 values, so the fp32-kept released tensors hold them
    exactly), at scales where each term of the math matters: activations O(1), AttnRes logits O(1)."""
    gen = torch.Generator().manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=gen)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("_res_proj.weight"):
            v = 0.25 * rn(*t.shape)
        elif t.dim() == 1 and ("norm" in name):
            v = 1.0 + 0.3 * rn(*t.shape)
        elif name.endswith("A_log"):
            v = 0.5 * rn(*t.shape)
        elif name.endswith("dt_bias"):
            v = rn(*t.shape)
        elif name.endswith("conv1d.weight"):
            v = 0.6 * rn(*t.shape)
        elif name.endswith("e_score_correction_bias"):
            v = 0.05 * rn(*t.shape)
        elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            v = rn(*t.shape) / t.shape[1] ** 0.5          # [E, in, out]
        elif name.endswith("embed_tokens.weight"):
            v = rn(*t.shape)
        elif t.dim() == 2:
            v = 1.5 * rn(*t.shape) / t.shape[1] ** 0.5    # [out, in]: pre-activations ~1.5 (SiTU non-linear)
        else:
            continue
        t.copy_(v.to(t.dtype))
    return model


def build(cfg: K3Config = None, seed: int = 0):
    cfg = cfg or micro_config()
    torch.manual_seed(seed)
    model = randomise_(K3ForCausalLM(cfg), seed).double().eval()
    rel = to_released(model.state_dict(), cfg)
    params = {k[len("language_model."):]: v.to(torch.float64) for k, v in rel.items()}
    return cfg, model, params


@pytest.fixture(scope="module")
def micro():
    return build()


def rand_x(*shape, seed=1, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def assert_matches(got: torch.Tensor, want: torch.Tensor, tol: float = TOL, what: str = ""):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == torch.float64, f"{what}: module ran in {got.dtype}, not fp64"
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= tol * max(scale, 1e-30), f"{what}: max |module - formula| = {err:.3e} (scale {scale:.3e})"


# ------------------------------------------------------------------------------------------------ independence
def test_formulas_import_nothing_from_the_implementation():
    tree = ast.parse(open(os.path.join(os.path.dirname(__file__), "formulas.py")).read())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mods.add(node.module or "")
    assert not {m for m in mods if m == "k3" or m.startswith("k3.")}, mods


# ------------------------------------------------------------------------------------------------ SiTU, dense MLP
def _situ_inputs():
    # wide enough that both tanh saturations matter: |g| up to 30 (beta1 = 4), |u| up to 80 (beta2 = 25)
    g = torch.linspace(-30, 30, 241, dtype=torch.float64).view(-1, 1).expand(241, 61).contiguous()
    u = torch.linspace(-80, 80, 61, dtype=torch.float64).view(1, -1).expand(241, 61).contiguous()
    return g, u


def test_situ_glu_matches_formula_and_betas_are_distinguished():
    from k3.ops.activations import situ_glu
    g, u = _situ_inputs()
    want = R.situ_glu(g, u, 4.0, 25.0)
    assert_matches(situ_glu(g, u, 4.0, 25.0), want, what="situ_glu")
    # the inputs discriminate: swapped betas (or the betas on the wrong branch) move the output by O(1)
    assert (R.situ_glu(g, u, 25.0, 4.0) - want).abs().max() > 1.0
    # the bounds of architecture.md §2: |out| < beta1 * beta2
    assert want.abs().max() < 100.0


@pytest.mark.parametrize("node", ["0", "1"])
def test_situ_glu_gradient_matches_autograd_of_formula(node, monkeypatch):
    """K3_SITU_NODE=1: the hand-written backward (k3.ops.activations._situ_bwd_torch); 0: plain autograd."""
    from k3.ops.activations import situ_glu
    monkeypatch.setenv("K3_SITU_NODE", node)
    g, u = _situ_inputs()
    g1, u1 = g.clone().requires_grad_(), u.clone().requires_grad_()
    g2, u2 = g.clone().requires_grad_(), u.clone().requires_grad_()
    w = rand_x(*g.shape, seed=3)
    (situ_glu(g1, u1, 4.0, 25.0) * w).sum().backward()
    (R.situ_glu(g2, u2, 4.0, 25.0) * w).sum().backward()
    assert_matches(g1.grad, g2.grad, what="d/dg")
    assert_matches(u1.grad, u2.grad, what="d/du")


def test_dense_mlp(micro):
    cfg, model, p = micro
    x = rand_x(2, 9, cfg.hidden_size)
    mlp = model.model.layers[0].mlp
    want = R.glu_mlp(x, p["model.layers.0.mlp.gate_proj.weight"], p["model.layers.0.mlp.up_proj.weight"],
                     p["model.layers.0.mlp.down_proj.weight"], 4.0, 25.0)
    assert_matches(mlp(x), want, what="dense MLP")


# ------------------------------------------------------------------------------------------------ AttnRes
@pytest.mark.parametrize("n_sources", [2, 3, 5])
def test_attnres_mix(n_sources, micro):
    """k3.ops.attnres (fast streamed path and its written-out reference) against §3.3; sources of different
    scales so the un-weighted RMS normalisation of the keys matters."""
    from k3.model import _mix_weight
    from k3.ops.attnres import attnres_mix, attnres_mix_reference
    cfg, model, p = micro
    src = [rand_x(2, 7, cfg.hidden_size, seed=10 + i, scale=0.5 + i) for i in range(n_sources)]
    layer = model.model.layers[3]
    want = R.attnres_mix(src, p["model.layers.3.mlp_res_norm.weight"], p["model.layers.3.mlp_res_proj.weight"])
    w = _mix_weight(layer.mlp_res_norm, layer.mlp_res_proj)
    assert_matches(attnres_mix(src, w, 1e-5), want, what="attnres_mix")
    assert_matches(attnres_mix_reference(src, w, 1e-5), want, what="attnres_mix_reference")


# ------------------------------------------------------------------------------------------------ attention
def test_kda_layer(micro):
    """70 tokens: crosses the chunked kernel's 64-token chunk boundary; batch 2."""
    cfg, model, p = micro
    lac = cfg.linear_attn_config
    x = rand_x(2, 70, cfg.hidden_size)
    attn = model.model.layers[0].self_attn
    assert cfg.layer_types[0] == "kda"
    want = R.kda_layer(x, p, "model.layers.0.self_attn.", lac.num_heads, lac.head_dim, lac.gate_lower_bound)
    assert_matches(attn(x), want, what="KDA layer")


def test_kda_gate_is_bounded_below():
    f = torch.linspace(-50, 50, 101, dtype=torch.float64).view(1, 1, 1, -1).expand(1, 1, 2, 101)
    g = R.kda_gate(f, torch.tensor([0.0, 1.0], dtype=torch.float64), torch.zeros(202, dtype=torch.float64), -5.0)
    from k3.ops.kda import kda_gate
    assert_matches(kda_gate(f, torch.tensor([0.0, 1.0], dtype=torch.float64), torch.zeros(202, dtype=torch.float64),
                            -5.0), g, what="kda_gate")
    assert g.min() >= -5.0 and g.max() <= 0.0 and g.min() < -4.99 and g.max() > -1e-6


def test_mla_layer(micro):
    cfg, model, p = micro
    x = rand_x(2, 13, cfg.hidden_size)
    assert cfg.layer_types[1] == "mla"
    want = R.mla_layer(x, p, "model.layers.1.self_attn.", cfg.num_attention_heads, cfg.qk_nope_head_dim,
                       cfg.qk_rope_head_dim, cfg.v_head_dim)
    assert_matches(model.model.layers[1].self_attn(x), want, what="MLA layer")


# ------------------------------------------------------------------------------------------------ MoE
def test_router(micro):
    cfg, model, p = micro
    x = rand_x(40, cfg.hidden_size, seed=5)
    idx, w, scores = model.model.layers[2].block_sparse_moe.gate(x)
    I, W, S = R.router(x, p, "model.layers.2.block_sparse_moe.", cfg.num_experts_per_token)
    assert_matches(scores, S, what="router scores")
    # same selection as a set per token; weights compared per expert id
    assert torch.equal(idx.sort(-1).values, I.sort(-1).values)
    dense = lambda i, v: torch.zeros(x.shape[0], cfg.num_experts, dtype=v.dtype).scatter(1, i, v)  # noqa: E731
    assert_matches(dense(idx, w), dense(I, W), what="router weights")
    # the correction bias changes the selection here (bias for selection only), and the weights stay unbiased
    I0 = torch.topk(S, cfg.num_experts_per_token, -1).indices
    assert not torch.equal(I0.sort(-1).values, I.sort(-1).values)


def test_latent_moe(micro):
    cfg, model, p = micro
    x = rand_x(2, 11, cfg.hidden_size, seed=6)
    want = R.latent_moe(x, p, "model.layers.2.block_sparse_moe.", cfg.num_experts, cfg.num_experts_per_token,
                        cfg.activation_situ_beta, cfg.activation_situ_linear_beta, cfg.rms_norm_eps)
    assert_matches(model.model.layers[2].block_sparse_moe(x), want, what="LatentMoE")


# ------------------------------------------------------------------------------------------------ decoder
@pytest.mark.parametrize("layer", [0, 1, 2, 4])
def test_decoder_layer(layer, micro):
    """One decoder layer with a given block list (the first layer of a block, and one inside a block)."""
    cfg, model, p = micro
    B, T, d = 2, 9, cfg.hidden_size
    n_blocks = layer // cfg.attn_res_block_size + (1 if layer % cfg.attn_res_block_size else 0)
    blocks = [rand_x(B, T, d, seed=20 + i, scale=1.0 + i) for i in range(n_blocks)]
    partial = rand_x(B, T, d, seed=30, scale=2.0)
    got_p, got_b = model.model.layers[layer](partial, list(blocks))
    want_p, want_b = R.decoder_layer(partial, list(blocks), p, cfg, layer)
    assert len(got_b) == len(want_b)
    for a, b in zip(got_b, want_b):
        assert torch.equal(a, b)
    assert_matches(got_p, want_p, what=f"decoder layer {layer}")


def test_whole_decoder(micro):
    cfg, model, p = micro
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(7))
    assert_matches(model(ids).logits, R.decoder(ids, p, cfg), what="logits")


def test_whole_decoder_packed_documents(micro):
    """cu_seqlens: each document behaves as its own sequence (state and conv history reset, attention within the
    document); the formula simply runs each document alone."""
    cfg, model, p = micro
    lens = [5, 17, 1, 9]
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lens)), generator=torch.Generator().manual_seed(8))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    want = torch.cat([R.decoder(ids[:, a:b], p, cfg) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    assert_matches(model(ids, cu_seqlens=cu).logits, want, what="packed logits")


def test_fixed_eps_do_not_follow_rms_norm_eps():
    """architecture.md §3.3 / §3.4 step 7 fix the AttnRes and KDA output-norm eps at 1e-5; §2 gives rms_norm_eps to the
    RMSNorms. With rms_norm_eps = 1e-3 (a config a user may write) the two must not move."""
    cfg, model, p = build(micro_config(rms_norm_eps=1e-3))
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(9))
    assert_matches(model(ids).logits, R.decoder(ids, p, cfg), what="logits, rms_norm_eps=1e-3")


# ------------------------------------------------------------------------------------------------ QB
def _qb_scores(T, n, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, n, generator=gen) + torch.linspace(-1, 1, n)  # skewed: some experts over-loaded
    return torch.sigmoid(logits), 0.05 * torch.randn(n, generator=gen)


@pytest.mark.parametrize("T,n,k", [(64, 16, 4), (50, 12, 3), (33, 8, 2)])
def test_qb_default_against_written_out_definition(T, n, k):
    """`k3.balance.qb_bias` (default cutoff="exact") equals the definition of formulas.qb_bias_definition, and the
    new bias gives every expert exactly K = round(kT/n) margins above its threshold.

    Where the default differs from a plain quantile, and why (documented here on purpose):
    1. The margin's cut-off θ_ij is the k-th largest biased score among the experts *other than j*: α_i (the
       (k+1)-th) for a currently selected j, β_i (the k-th) for an unselected j. The literal QB rule uses α_i for
       every expert (`cutoff="alpha"`). Only the exact cut-off makes "j selected iff b_j > −m_ij" true for
       unselected experts; the literal one has the same fixed point but under-steps under-loaded experts
       (docs/LOG.md: ~3x more iterations at n=896). Checked below: the two agree on selected entries and differ
       on unselected ones by exactly β_i − α_i.
    2. The threshold is the *midpoint* of the K-th and (K+1)-th largest margins with K = round(k·T/n) clamped to
       [1, T−1], not the textbook (1 − k/n)-quantile (linear interpolation at rank (T−1)(1 − k/n), what
       torch.quantile gives). When k·T/n is an integer both lie in the same gap between the K-th and (K+1)-th
       order statistics (so both leave exactly K margins above), but the plain quantile sits at a fraction k/n of
       the gap above the (K+1)-th margin, i.e. almost on it: the midpoint is the choice furthest from both
       deciding margins (most robust to the next step's score noise). When k·T/n is not an integer the plain
       quantile's count is ⌈k·T/n⌉ or ⌊k·T/n⌋ by interpolation position, the default's is the rounded target.
    """
    from k3.balance import entry_margins, qb_bias, qb_thresholds
    s, b = _qb_scores(T, n, seed=T)
    d = R.qb_bias_definition(s, k, b)
    m = entry_margins(s, b, k)
    assert torch.allclose(m.double(), d["margins"], atol=1e-6, rtol=0)
    assert torch.allclose(qb_thresholds(m, k).double(), d["q"], atol=1e-6, rtol=0)
    new = qb_bias(s, k, b)
    assert torch.allclose(new.double(), d["bias"], atol=1e-6, rtol=0)
    # the defining property: exactly K margins of every column above q_j
    assert ((d["margins"] > d["q"]).sum(0) == d["K"]).all()
    # 1. literal cut-off: same on selected entries, larger by (beta_i - alpha_i) on unselected ones
    m_alpha = entry_margins(s, b, k, cutoff="alpha").double()
    z = (s + b).double()
    top = torch.topk(z, k + 1, dim=1).values
    alpha, beta = top[:, k], top[:, k - 1]
    sel = torch.zeros(T, n, dtype=torch.bool).scatter(1, torch.topk(z, k, dim=1).indices, True)
    assert torch.allclose(m_alpha[sel], m.double()[sel], atol=1e-6)
    diff = (m_alpha - m.double())[~sel]
    gap = (beta - alpha)[:, None].expand(T, n)[~sel]
    assert torch.allclose(diff, gap, atol=1e-6)
    # 2. plain quantile vs the midpoint
    plain = R.plain_quantile(d["margins"], 1 - k / n)
    if (k * T) % n == 0:
        desc = torch.sort(d["margins"], 0, descending=True).values
        K = d["K"]
        lo, hi = desc[K], desc[K - 1]
        assert ((plain >= lo - 1e-12) & (plain <= hi + 1e-12)).all()          # same gap
        assert torch.allclose(plain, lo + (k / n) * (hi - lo), atol=1e-12)    # at fraction k/n above the (K+1)-th
        assert torch.allclose(d["q"], 0.5 * (lo + hi), atol=1e-12)            # default: midpoint
    assert not torch.allclose(plain, d["q"])
