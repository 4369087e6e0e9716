"""The ablation switches of the model (issue #34): each changes the model as intended, the defaults change nothing.

- `linear_attn_config.gate_lower_bound: null`: the unbounded Kimi-Linear gate g = -exp(A_log) softplus(f + dt_bias);
- `attn_res_mode: "none"`: a standard pre-norm residual stream, no AttnRes parameters;
- `mla_use_output_gate: false`: MLA without the sigmoid output gate (no g_proj);
- `hidden_act: "swiglu"` / `"silu"`: SwiGLU instead of SiTU-GLU.
"""
import pytest
import torch
import torch.nn.functional as F

from k3.config import K3Config
from k3.errors import K3ConfigError
from k3.model import K3ForCausalLM
from k3.nn.kda import KDAAttention
from k3.ops.kda import recurrent_kda

F64 = torch.float64


def micro(L=2, **kw):
    base = dict(vocab_size=256, hidden_size=32, num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=2,
                q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, routed_expert_hidden_size=16,
                intermediate_size=48, attn_res_block_size=1, kda_gate_low_rank=8, bos_token_id=1,
                eos_token_id=2, pad_token_id=255)
    lac = dict(num_heads=2, head_dim=8, short_conv_kernel_size=4, gate_lower_bound=-5.0,
               full_attn_layers=[L], kda_layers=list(range(1, L)))
    lac.update(kw.pop("lac", {}))
    base["linear_attn_config"] = lac
    base.update(kw)
    return K3Config.from_preset("tiny", **base)


def build(cfg, seed=0):
    torch.manual_seed(seed)
    return K3ForCausalLM(cfg).double().eval()


# ------------------------------------------------------------------ residual mode

def test_no_attnres_has_no_attnres_params_and_is_a_prenorm_residual():
    m = build(micro(attn_res_mode="none"))
    names = [n for n, _ in m.named_parameters()]
    assert not [n for n in names if "_res_" in n]
    ref_names = [n for n, _ in build(micro()).named_parameters()]
    assert sorted(set(ref_names) - set(names)) == sorted(n for n in ref_names if "_res_" in n)
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        h = m.model.embed_tokens(ids)
        for layer in m.model.layers:   # written out: h += attn(norm(h)); h += ffn(norm(h))
            h = h + layer.self_attn(layer.input_layernorm(h))
            h = h + layer.ffn(layer.post_attention_layernorm(h))
        want = m.lm_head(m.model.norm(h))
        got = m(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw", [dict(attn_res_mode="none"), dict(lac=dict(gate_lower_bound=None)),
                                dict(mla_use_output_gate=False)], ids=["no_attnres", "softplus", "no_mla_gate"])
def test_switched_models_train_and_decode_like_their_forward(kw):
    """Gradients reach every parameter; the cached decode (prefill + steps) equals the full forward and the static
    (shape-static, fused) decode step reproduces the cached decode."""
    from k3.generation.cache import K3Cache
    from k3.generation.static import self_check
    lac = dict(full_attn_layers=[3], kda_layers=[1, 2], **kw.pop("lac", {}))
    m = build(micro(L=3, lac=lac, **kw))
    ids = torch.randint(0, 256, (1, 12))
    m.train()
    m(ids, labels=ids).loss.backward()
    # (layer 0's attention input is the embedding alone in block mode: its mix parameters are unused by design)
    assert [n for n, p in m.named_parameters() if p.grad is None
            and not n.startswith("model.layers.0.self_attention_res_")] == []
    m.eval()
    with torch.no_grad():
        full = m(ids).logits
        cache = K3Cache.for_model(m, 1, max_length=16)
        pre = m(ids[:, :9], cache=cache).logits
        cache.advance(9)
        steps = []
        for t in range(9, 12):
            steps.append(m(ids[:, t:t + 1], cache=cache).logits)
            cache.advance(1)
    torch.testing.assert_close(torch.cat([pre] + steps, 1), full, rtol=1e-9, atol=1e-9)
    assert self_check(m)


def test_attn_res_mode_refused_for_release_and_validated():
    assert micro(attn_res_mode="none").release_compatible_problems
    assert not micro().release_compatible_problems
    assert "attn_res_mode" not in micro().to_dict()          # the default is not written (k3-only key)
    d = micro(attn_res_mode="none").to_dict()
    assert d["attn_res_mode"] == "none" and K3Config.from_dict(d).attn_res_mode == "none"
    with pytest.raises(K3ConfigError, match="attn_res_mode"):
        micro(attn_res_mode="full")


# ------------------------------------------------------------------ KDA gate

def test_softplus_gate_layer_matches_reference_formula():
    cfg = micro(lac=dict(gate_lower_bound=None))
    torch.manual_seed(0)
    layer = KDAAttention(cfg).double()
    layer.reset_gate_parameters()
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
        layer.A_log.normal_(0, 0.5)
    # init: decays exp(g) at f = 0 span [0.5, 0.999] with A_log = 0
    fresh = KDAAttention(cfg).double()
    fresh.reset_gate_parameters()
    decay0 = torch.exp(-F.softplus(fresh.dt_bias))
    assert float(decay0.min()) >= 0.5 - 1e-9 and float(decay0.max()) <= 0.999 + 1e-9
    x = torch.randn(2, 20, 32, dtype=F64)
    B, T, H, K = 2, 20, 2, 8
    with torch.no_grad():
        got = layer(x)
        act = F.silu
        conv = lambda proj, w: act(F.conv1d(F.pad(proj(x).transpose(1, 2), (3, 0)), w, groups=w.shape[0])
                                   ).transpose(1, 2).reshape(B, T, H, K)
        q, k, v = conv(layer.q_proj, layer.q_conv1d.weight), conv(layer.k_proj, layer.k_conv1d.weight), \
            conv(layer.v_proj, layer.v_conv1d.weight)
        f = layer.f_b_proj(layer.f_a_proj(x)).view(B, T, H, K)
        g = -layer.A_log.exp()[:, None] * F.softplus(f + layer.dt_bias.view(H, K))   # the Kimi-Linear gate
        beta = torch.sigmoid(layer.b_proj(x))
        o = recurrent_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.o_norm.weight
        want = layer.o_proj((o * torch.sigmoid(layer.g_proj(x)).view(B, T, H, K)).reshape(B, T, H * K))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_softplus_gate_model_differs_from_bounded_and_runs():
    ids = torch.randint(0, 256, (1, 20))
    a = build(micro())
    b = build(micro(lac=dict(gate_lower_bound=None)))
    assert b.model.layers[0].self_attn.lower_bound is None
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert torch.isfinite(lb).all() and not torch.allclose(la, lb)


@pytest.mark.parametrize("lb", [-10.0, -6.0, -3.0])
def test_guide_range_bounds_build_and_run(lb):
    m = build(micro(lac=dict(gate_lower_bound=lb)))
    with torch.no_grad():
        assert torch.isfinite(m(torch.randint(0, 256, (1, 70))).logits).all()


# ------------------------------------------------------------------ MLA output gate and SwiGLU

def test_mla_output_gate_off_has_no_g_proj():
    on, off = build(micro()), build(micro(mla_use_output_gate=False))
    assert on.model.layers[1].self_attn.g_proj is not None and off.model.layers[1].self_attn.g_proj is None
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert torch.isfinite(off(ids).logits).all()


def test_swiglu_is_accepted_and_other_acts_name_the_choices():
    for act in ("swiglu", "silu", "situ"):
        assert micro(hidden_act=act).hidden_act == act
    with pytest.raises(K3ConfigError, match="'swiglu'"):
        micro(hidden_act="gelu")


# ------------------------------------------------------------------ defaults unchanged

def test_default_block_mode_keeps_every_attnres_param():
    m = build(micro())
    names = {n for n, _ in m.named_parameters()}
    for i in range(2):
        for n in ("self_attention_res_norm.weight", "self_attention_res_proj.weight", "mlp_res_norm.weight",
                  "mlp_res_proj.weight"):
            assert f"model.layers.{i}.{n}" in names
    assert {"model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight"} <= names
    assert micro().attn_res_mode == "block" and micro().lac.gate_lower_bound == -5.0
