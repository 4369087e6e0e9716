"""Muon/AdamW optimizer, parameter routing and QK-clip (k3.train.optim), on fake modules named per CONTRACTS.md."""
import copy
import importlib.util
import math
import os

import pytest
import torch
import torch.nn as nn

from helpers import row
from k3.errors import K3ConfigError
from k3.train.optim import build_optimizer, classify_parameters, newton_schulz, qk_clip



pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: threads only add sync overhead


torch.manual_seed(0)
D, H, K = 32, 4, 8          # hidden, heads, KDA head dim
NOPE, ROPE, VD, QL, KVL = 6, 4, 5, 16, 12   # MLA dims
E, LAT, M = 3, 16, 10       # experts, latent, expert FFN


def lin(i, o):
    return nn.Linear(i, o, bias=False)


class KDA(nn.Module):
    def __init__(self):
        super().__init__()
        P = H * K
        self.q_proj, self.k_proj, self.v_proj, self.g_proj = lin(D, P), lin(D, P), lin(D, P), lin(D, P)
        self.o_proj, self.f_a_proj, self.f_b_proj, self.b_proj = lin(P, D), lin(D, 4), lin(4, P), lin(D, H)
        self.q_conv1d = nn.Conv1d(P, P, 4, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, 4, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, 4, groups=P, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K))


class MLA(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = H, NOPE, ROPE, VD
        self.q_a_proj = lin(D, QL)
        self.q_a_layernorm = nn.RMSNorm(QL)
        self.q_b_proj = lin(QL, H * (NOPE + ROPE))
        self.kv_a_proj_with_mqa = lin(D, KVL + ROPE)
        self.kv_a_layernorm = nn.RMSNorm(KVL)
        self.kv_b_proj = lin(KVL, H * (NOPE + VD))
        self.g_proj, self.o_proj = lin(D, H * VD), lin(H * VD, D)
        self.track_max_logit, self.last_max_logit = False, None


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, LAT, 2 * M) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, M, LAT) * 0.1)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = lin(D, E)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.routed_expert_down_proj, self.routed_expert_up_proj = lin(D, LAT), lin(LAT, D)
        self.routed_expert_norm = nn.RMSNorm(LAT)
        self.shared_experts = nn.Module()
        self.shared_experts.gate_proj, self.shared_experts.up_proj = lin(D, 8), lin(D, 8)
        self.shared_experts.down_proj = lin(8, D)
        self.experts = Experts()


class Layer(nn.Module):
    def __init__(self, attn, ffn):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.self_attention_res_norm, self.mlp_res_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.self_attention_res_proj, self.mlp_res_proj = lin(D, 1), lin(D, 1)
        self.self_attn = attn
        if isinstance(ffn, MoE):
            self.block_sparse_moe = ffn
        else:
            self.mlp = ffn


class Dense(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = lin(D, 24), lin(D, 24), lin(24, D)


class FakeK3(nn.Module):
    def __init__(self, V=50):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, D)
        self.model.layers = nn.ModuleList([Layer(KDA(), Dense()), Layer(MLA(), MoE())])
        self.model.norm, self.model.output_attn_res_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.model.output_attn_res_proj = lin(D, 1)
        self.lm_head = lin(D, V)


def ns_ref(G):
    """Plain fp64 quintic Newton–Schulz of one matrix."""
    X = G.double()
    tr = X.shape[0] > X.shape[1]
    if tr:
        X = X.T
    X = X / (torch.linalg.matrix_norm(X) + 1e-7)
    for _ in range(5):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X.T if tr else X


def muon_dir_ref(G, block_rows=None):
    """0.2*sqrt(max(r, c)) * NS(block) for every block of `block_rows` rows (None: whole matrix)."""
    if block_rows is None:
        return 0.2 * math.sqrt(max(G.shape)) * ns_ref(G)
    out = [muon_dir_ref(G[i:i + block_rows]) for i in range(0, G.shape[0], block_rows)]
    return torch.cat(out, 0)


def test_routing():
    model = FakeK3()
    r = {x.name: x for x in classify_parameters(model)}
    L0, L1 = "model.layers.0.", "model.layers.1."
    assert set(r) == {n for n, _ in model.named_parameters()}
    adamw = {n for n, x in r.items() if not x.use_muon}
    expect_adamw = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                    "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight"}
    for L in (L0, L1):
        expect_adamw |= {L + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                         "self_attention_res_norm.weight", "mlp_res_norm.weight",
                                         "self_attention_res_proj.weight", "mlp_res_proj.weight")}
    expect_adamw |= {L0 + "self_attn." + s for s in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
                                                     "A_log", "dt_bias", "o_norm.weight")}
    expect_adamw |= {L1 + "self_attn.q_a_layernorm.weight", L1 + "self_attn.kv_a_layernorm.weight",
                     L1 + "block_sparse_moe.routed_expert_norm.weight"}
    assert adamw == expect_adamw
    ortho = {n: x.ortho for n, x in r.items() if x.use_muon}
    for p in "qkv":
        assert ortho[L0 + f"self_attn.{p}_proj.weight"] == f"rows:{K}"
    assert ortho[L1 + "self_attn.q_b_proj.weight"] == f"rows:{NOPE + ROPE}"
    assert ortho[L1 + "self_attn.kv_b_proj.weight"] == f"rows:{NOPE + VD}"
    assert ortho[L1 + "block_sparse_moe.experts.gate_up_proj"] == "gate_up"
    assert ortho[L1 + "block_sparse_moe.experts.down_proj"] == "experts"
    for n in (L0 + "self_attn.g_proj.weight", L0 + "self_attn.f_b_proj.weight", L0 + "self_attn.b_proj.weight",
              L1 + "self_attn.q_a_proj.weight", L1 + "self_attn.kv_a_proj_with_mqa.weight",
              L1 + "self_attn.o_proj.weight", L1 + "block_sparse_moe.gate.weight", L0 + "mlp.down_proj.weight",
              L1 + "block_sparse_moe.shared_experts.up_proj.weight"):
        assert ortho[n] == "plain"
    decay = {n for n, x in r.items() if x.weight_decay}
    assert "model.embed_tokens.weight" in decay and "lm_head.weight" in decay
    assert not decay & {n for n in r if n.endswith(("norm.weight", "A_log", "dt_bias", "res_proj.weight"))}
    assert all(x.weight_decay for x in r.values() if x.use_muon)

    opt = build_optimizer(model, lr=0.01)
    names = [g["group_name"] for g in opt.param_groups]
    assert len(names) == len(set(names))
    seen = [n for g in opt.param_groups for n in g["param_names"]]
    assert sorted(seen) == sorted(r)
    for g in opt.param_groups:
        assert (g["weight_decay"] == 0.1) == (g["group_name"] in ("adamw",) or g["use_muon"])


def test_newton_schulz_matches_fp64_and_orthogonalises():
    G = torch.randn(3, 12, 20)
    X = newton_schulz(G)
    for i in range(3):
        torch.testing.assert_close(X[i].double(), ns_ref(G[i]), atol=2e-5, rtol=1e-4)
    sv = torch.linalg.svdvals(X[0])
    assert sv.min() > 0.5 and sv.max() < 1.3  # quintic NS: singular values in ~[0.7, 1.2]


def test_muon_update_matches_reference_per_head():
    torch.manual_seed(1)
    model = FakeK3()
    lr, wd, mu = 0.02, 0.1, 0.95
    opt = build_optimizer(model, lr=lr, weight_decay=wd, momentum=mu)
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    grads1 = {n: torch.randn_like(p) for n, p in params.items()}
    grads2 = {n: torch.randn_like(p) for n, p in params.items()}
    L0, L1 = "model.layers.0.self_attn.", "model.layers.1."
    cases = {L0 + "q_proj.weight": K, L0 + "v_proj.weight": K, L1 + "self_attn.q_b_proj.weight": NOPE + ROPE,
             L1 + "self_attn.kv_b_proj.weight": NOPE + VD, L1 + "self_attn.o_proj.weight": None,
             L0 + "f_b_proj.weight": None}

    def ref_dir(name, u):
        if name.endswith("gate_up_proj"):  # gate / up halves are separate matrices, per expert
            return torch.stack([torch.cat([muon_dir_ref(u[e][:, :M]), muon_dir_ref(u[e][:, M:])], -1)
                                for e in range(E)])
        if name.endswith("experts.down_proj"):
            return torch.stack([muon_dir_ref(u[e]) for e in range(E)])
        return muon_dir_ref(u, cases[name])

    # step 1 (Nesterov: u = g + mu*g), step 2 (buf = mu*g1 + g2; u = g2 + mu*buf)
    expected = {n: before[n].double() for n in list(cases) + [L1 + "block_sparse_moe.experts.gate_up_proj",
                                                                L1 + "block_sparse_moe.experts.down_proj"]}
    bufs = {n: torch.zeros_like(before[n], dtype=torch.float64) for n in expected}
    for grads in (grads1, grads2):
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
        for n in expected:
            g = grads[n].double()
            bufs[n] = mu * bufs[n] + g
            u = g + mu * bufs[n]
            d = ref_dir(n, u)
            expected[n] = expected[n] * (1 - lr * wd) - lr * d
    for n, want in expected.items():
        torch.testing.assert_close(params[n].detach().double(), want, atol=2e-6, rtol=1e-5, msg=n)
    # per-head differs from whole-matrix orthogonalisation (so the test above is meaningful)
    n = L1 + "self_attn.kv_b_proj.weight"
    assert not torch.allclose(muon_dir_ref(grads1[n]), muon_dir_ref(grads1[n], NOPE + VD), atol=1e-3)
    # update RMS is 0.2 per block: check with one fresh step, no decay
    m2 = FakeK3()
    o2 = build_optimizer(m2, lr=1.0, weight_decay=0.0)
    w = m2.model.layers[0].self_attn.q_proj.weight
    w0 = w.detach().clone()
    w.grad = torch.randn_like(w)
    o2.step()
    rms = (w.detach() - w0).pow(2).mean().sqrt()
    assert 0.15 < rms < 0.25


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(2)
    model = FakeK3()
    opt = build_optimizer(model, lr=0.01, adamw_lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    emb = model.model.embed_tokens.weight
    norm = model.model.norm.weight
    ref_emb, ref_norm = nn.Parameter(emb.detach().clone()), nn.Parameter(norm.detach().clone())
    ref = torch.optim.AdamW([{"params": [ref_emb], "weight_decay": 0.1}, {"params": [ref_norm], "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        g1, g2 = torch.randn_like(emb), torch.randn_like(norm)
        emb.grad, norm.grad, ref_emb.grad, ref_norm.grad = g1, g2, g1.clone(), g2.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(emb.detach(), ref_emb.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(norm.detach(), ref_norm.detach(), atol=1e-6, rtol=1e-5)


def test_state_dict_roundtrip_and_lambdalr():
    from k3.train.schedule import cosine_with_warmup
    torch.manual_seed(3)
    m1 = FakeK3()
    m2 = FakeK3()
    m2.load_state_dict(m1.state_dict())
    o1 = build_optimizer(m1, lr=0.02, adamw_lr=0.004)
    s1 = torch.optim.lr_scheduler.LambdaLR(o1, cosine_with_warmup(2, 10))
    grads = [{n: torch.randn_like(p) for n, p in m1.named_parameters()} for _ in range(3)]

    def step(m, o, s, g):
        for n, p in m.named_parameters():
            p.grad = g[n].clone()
        o.step()
        s.step()

    step(m1, o1, s1, grads[0])
    m2.load_state_dict(m1.state_dict())
    o2 = build_optimizer(m2, lr=0.02, adamw_lr=0.004)
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, cosine_with_warmup(2, 10))
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))  # as if saved to disk
    s2.load_state_dict(copy.deepcopy(s1.state_dict()))
    for g in grads[1:]:
        step(m1, o1, s1, g)
        step(m2, o2, s2, g)
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), n
    lrs = {g["group_name"]: g["lr"] for g in o1.param_groups}
    f = cosine_with_warmup(2, 10)(3)
    assert lrs["adamw"] == pytest.approx(0.004 * f) and lrs["muon:plain"] == pytest.approx(0.02 * f)


# ----------------------------------------------------------------------------------------------- QK-clip

def mla_max_logits(mla, cq, ckv, k_pe):
    """Per-head max of (q_h . k_h) * (nope+rope)^-1/2 over causal pairs; q/k built from the projections."""
    T = cq.shape[0]
    q = mla.q_b_proj(cq).view(T, H, NOPE + ROPE)
    kv = mla.kv_b_proj(ckv).view(T, H, NOPE + VD)
    k = torch.cat([kv[..., :NOPE], k_pe[:, None, :].expand(T, H, ROPE)], dim=-1)
    logits = torch.einsum("thd,shd->hts", q.double(), k.double()) * (NOPE + ROPE) ** -0.5
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return logits.masked_fill(~mask, float("-inf")).amax(dim=(1, 2))


@torch.no_grad()
def test_qk_clip_rescales_only_heads_over_threshold():
    torch.manual_seed(4)
    model = FakeK3()
    mla = model.model.layers[1].self_attn
    # make heads 1 and 3 "hot"
    wq = mla.q_b_proj.weight.view(H, NOPE + ROPE, QL)
    wq[1] *= 6.0
    wq[3] *= 9.0
    T = 12
    cq, ckv, k_pe = torch.randn(T, QL) * 3, torch.randn(T, KVL) * 3, torch.randn(T, ROPE) * 3
    S = mla_max_logits(mla, cq, ckv, k_pe)
    tau = float(S.sort().values[1]) + 1e-3  # two heads over, two under
    assert (S > tau).sum() == 2 and (S > 0).all()
    q0, kv0 = mla.q_b_proj.weight.clone(), mla.kv_b_proj.weight.clone()
    other = {n: p.clone() for n, p in model.named_parameters() if "q_b_proj" not in n and "kv_b_proj" not in n}
    mla.last_max_logit = S.float()
    assert qk_clip(model, tau=tau) == 2
    S2 = mla_max_logits(mla, cq, ckv, k_pe)
    over = S > tau
    torch.testing.assert_close(S2[over], torch.full_like(S2[over], tau), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S2[~over], S[~over], rtol=1e-6, atol=1e-6)
    # exact factors, per row block
    gamma = (tau / S).clamp(max=1.0).float()
    wq, wq0 = mla.q_b_proj.weight.view(H, -1, QL), q0.view(H, -1, QL)
    wkv, wkv0 = mla.kv_b_proj.weight.view(H, -1, KVL), kv0.view(H, -1, KVL)
    for h in range(H):
        torch.testing.assert_close(wq[h, :NOPE], wq0[h, :NOPE] * gamma[h].sqrt())
        torch.testing.assert_close(wq[h, NOPE:], wq0[h, NOPE:] * gamma[h])
        torch.testing.assert_close(wkv[h, :NOPE], wkv0[h, :NOPE] * gamma[h].sqrt())
        assert torch.equal(wkv[h, NOPE:], wkv0[h, NOPE:])  # v rows untouched
        if not over[h]:
            assert torch.equal(wq[h], wq0[h]) and torch.equal(wkv[h, :NOPE], wkv0[h, :NOPE])
    for n, p in model.named_parameters():  # k_pe (kv_a_proj_with_mqa) and everything else untouched
        if n in other:
            assert torch.equal(p, other[n]), n
    # idempotent: the recorded max is now the post-clip value
    assert qk_clip(model, tau=tau) == 0
    mla.last_max_logit = None
    assert qk_clip(model, tau=tau) == 0


def test_master_weights_keep_updates_below_bf16_resolution():
    """bf16 parameters with fp32 masters follow the fp32-parameter run exactly (same gradients); without masters
    updates smaller than bf16's resolution are lost."""
    from k3.train.optim import MuonAdamW
    torch.manual_seed(0)
    w0 = torch.ones(8, 16) + torch.randn(8, 16) * 0.01
    grads = [torch.randn(8, 16).bfloat16().float() for _ in range(40)]  # representable in both dtypes
    runs = {}
    for name, dt, master in (("fp32", torch.float32, False), ("bf16_master", torch.bfloat16, True),
                             ("bf16_plain", torch.bfloat16, False)):
        for use_muon in (False, True):
            p = nn.Parameter(w0.bfloat16().to(dt))
            opt = MuonAdamW([{"params": [p], "use_muon": use_muon, "lr": 1e-4, "weight_decay": 0.1}],
                            master_weights=master)
            for g in grads:
                p.grad = g.to(dt)
                opt.step()
            runs[name, use_muon] = (p.detach().clone(), opt.master(p).detach().clone(), opt)
    for use_muon in (False, True):
        ref = runs["fp32", use_muon][0]
        p, m, _ = runs["bf16_master", use_muon]
        assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
        torch.testing.assert_close(m, ref, rtol=0, atol=2e-6)            # the master is the fp32 trajectory
        assert torch.equal(p, m.bfloat16())                               # the weight is its rounding
        plain = runs["bf16_plain", use_muon][0]
        assert (plain.float() - ref).abs().mean() > 100 * (m - ref).abs().mean().clamp_min(1e-7)  # lost updates


def test_master_weights_state_dict_keeps_fp32():
    """Masters and moments of bf16 parameters stay fp32 through state_dict / load_state_dict (torch's default would
    cast them to bf16), and a resumed optimizer continues bitwise."""
    from k3.train.optim import MuonAdamW
    torch.manual_seed(1)
    mk = lambda: nn.Parameter(torch.randn(4, 8).bfloat16())
    p = mk()
    opt = MuonAdamW([{"params": [p], "use_muon": False, "lr": 1e-3}], master_weights=True)
    gs = [torch.randn(4, 8).bfloat16() for _ in range(4)]
    for g in gs[:2]:
        p.grad = g
        opt.step()
    sd = copy.deepcopy(opt.state_dict())  # as a checkpoint round trip (state_dict() shares tensors)
    q = nn.Parameter(p.detach().clone())
    opt2 = MuonAdamW([{"params": [q], "use_muon": False, "lr": 1e-3}], master_weights=True)
    opt2.load_state_dict(sd)
    st = opt2.state[q]
    assert st["master"].dtype == st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
    for g in gs[2:]:
        p.grad, q.grad = g, g.clone()
        opt.step()
        opt2.step()
    assert torch.equal(p, q) and torch.equal(opt.master(p), opt2.master(q))


@torch.no_grad()
def test_qk_clip_scales_the_master_weights():
    """With master weights, QK-clip scales the fp32 masters and sets the bf16 weights to their rounding (scaling
    only the bf16 weight would be undone by the next step's copy from the master)."""
    from k3.train.optim import MuonAdamW
    torch.manual_seed(5)
    model = FakeK3().to(torch.bfloat16)
    mla = model.model.layers[1].self_attn
    opt = MuonAdamW([{"params": list(model.parameters()), "use_muon": False, "lr": 1e-3}], master_weights=True)
    m_q0 = opt.master(mla.q_b_proj.weight).clone()
    S = torch.full((H,), 10.0)
    S[2] = 400.0
    mla.last_max_logit = S
    assert qk_clip(model, tau=100.0, optimizer=opt) == 1
    mq = opt.master(mla.q_b_proj.weight)
    g = torch.tensor(100.0 / 400.0)
    torch.testing.assert_close(mq.view(H, -1, QL)[2, :NOPE], m_q0.view(H, -1, QL)[2, :NOPE] * g.sqrt())
    torch.testing.assert_close(mq.view(H, -1, QL)[2, NOPE:], m_q0.view(H, -1, QL)[2, NOPE:] * g)
    assert torch.equal(mq.view(H, -1, QL)[0], m_q0.view(H, -1, QL)[0])
    assert torch.equal(mla.q_b_proj.weight, mq.bfloat16())


def test_orthogonalize_many_batches_blocks_of_one_shape(monkeypatch):
    """The optimizer's batched Newton-Schulz (blocks of one shape from many tensors stacked, in chunks) gives each
    tensor the fp64 per-block direction, whatever the chunking."""
    from k3.train import optim
    torch.manual_seed(4)
    us = [torch.randn(24, 10), torch.randn(3, 10, 12), torch.randn(2, 10, 24), torch.randn(10, 12),
          torch.randn(16, 10)]
    orthos = ["rows:8", "experts", "gate_up", "plain", "rows:8"]

    def ref(u, o):
        if o.startswith("rows:"):
            return muon_dir_ref(u, int(o[5:]))
        if o == "plain":
            return muon_dir_ref(u)
        if o == "experts":
            return torch.stack([muon_dir_ref(x) for x in u])
        m = u.shape[-1] // 2
        return torch.stack([torch.cat([muon_dir_ref(x[:, :m]), muon_dir_ref(x[:, m:])], -1) for x in u])

    for cap in (1 << 28, 300):   # one stack per shape; then a tensor per chunk (8x10x10 blocks need >300)
        monkeypatch.setattr(optim, "NS_BATCH_ELEMS", cap)
        outs = optim.orthogonalize_many(us, orthos)
        for u, o, out in zip(us, orthos, outs):
            assert out.shape == u.shape and out.dtype == torch.float32
            torch.testing.assert_close(out.double(), ref(u, o), atol=2e-5, rtol=1e-4, msg=o)


@pytest.fixture(scope="module")
def fused_muon_rows():
    """MuonAdamW(fused=True) (Triton momentum and apply kernels, under the interpreter) against the foreach path,
    three steps: one child process computes every case's row once."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    from k3.ops.triton_interp import run_interpreted
    return run_interpreted(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_muon_fused_child.py"),
                           timeout=600)


# case: bounds of the fused weights' (and fp32 masters') worst relative difference from the foreach path
FUSED_MUON_CASES = {
    "fp32": dict(worst=2e-6),
    "bf16_masters": dict(worst=1e-3, worst_master=2e-6),   # bf16 weights: the masters' rounding, a few last-bit flips
}


@pytest.mark.parametrize("name", FUSED_MUON_CASES)
def test_fused_muon_matches_foreach_path(fused_muon_rows, name):
    """Every block mode (experts, gate_up halves, per-head rows, plain), fp32 weights and bf16 weights with fp32
    masters."""
    r = row(fused_muon_rows, name)
    assert {"experts", "gate_up", "plain"} <= set(r["orthos"]) and any(o.startswith("rows:") for o in r["orthos"]), r
    for key, bound in FUSED_MUON_CASES[name].items():
        assert r[key] < bound, f"{name}: {key} {r[key]:.3g} >= {bound:g} ({r})"
    if "worst_master" in FUSED_MUON_CASES[name]:
        assert r["n_masters"] > 0, r


def test_fused_muon_child_has_every_case(fused_muon_rows):
    assert set(fused_muon_rows) == set(FUSED_MUON_CASES)


def test_fused_muon_needs_triton_somewhere_to_run(monkeypatch):
    import k3.ops.dispatch as d
    monkeypatch.setattr(d, "triton_runs", lambda: False)
    with pytest.raises(K3ConfigError, match="K3_MUON_FUSED"):
        build_optimizer(FakeK3(), lr=0.01, fused=True)


def test_fused_muon_default_follows_device_and_env(monkeypatch):
    """Auto: fused only for CUDA parameters (CPU here: the foreach path); K3_MUON_FUSED=0/1 overrides; other values
    are refused by name."""
    monkeypatch.delenv("K3_MUON_FUSED", raising=False)
    assert build_optimizer(FakeK3(), lr=0.01).fused is False
    monkeypatch.setenv("K3_MUON_FUSED", "0")
    assert build_optimizer(FakeK3(), lr=0.01).fused is False
    monkeypatch.setenv("K3_MUON_FUSED", "yes")
    with pytest.raises(K3ConfigError, match="K3_MUON_FUSED must be 0 or 1"):
        build_optimizer(FakeK3(), lr=0.01)
