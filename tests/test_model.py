"""Whole-model properties: causality, packed = separate, AttnRes wiring, chunked loss, gradients everywhere."""
import pytest
import torch

import k3.model as M
from k3.config import K3Config
from k3.info import count_params
from k3.model import K3ForCausalLM


def micro(**kw):
    base = dict(vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2,
                q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                num_experts=8, num_experts_per_token=2, moe_intermediate_size=16, routed_expert_hidden_size=32,
                intermediate_size=96, attn_res_block_size=2, kda_gate_low_rank=8, bos_token_id=256,
                eos_token_id=258, pad_token_id=511)
    base.update(kw)
    L = base["num_hidden_layers"]
    full = [i for i in range(1, L + 1) if i % 4 == 0 or i == L]
    base["linear_attn_config"] = dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                      full_attn_layers=full, kda_layers=[i for i in range(1, L + 1) if i not in full])
    return K3Config.from_preset("tiny", **base)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForCausalLM(micro()).double()
    with torch.no_grad():  # non-zero pseudo-queries so the mixes are not uniform
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
    return m.eval()


def test_causality(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (2, 40))
    base = model(ids).logits
    ids2 = ids.clone()
    ids2[:, 25] = (ids2[:, 25] + 1) % 512
    out = model(ids2).logits
    assert torch.allclose(out[:, :25], base[:, :25], atol=1e-10)
    assert not torch.allclose(out[:, 25:], base[:, 25:])


def test_packed_equals_separate(model):
    torch.manual_seed(2)
    lens = [7, 1, 30, 12]
    docs = [torch.randint(0, 512, (1, n)) for n in lens]
    packed = torch.cat(docs, 1)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    out = model(packed, cu_seqlens=cu).logits
    for d, a in zip(docs, cu[:-1]):
        sep = model(d).logits
        assert torch.allclose(out[:, int(a):int(a) + d.shape[1]], sep, atol=1e-9)


def test_attnres_source_counts(monkeypatch):
    cfg = micro(num_hidden_layers=7, attn_res_block_size=3)
    m = K3ForCausalLM(cfg)
    counts = []
    real = M.attnres_mix
    monkeypatch.setattr(M, "attnres_mix", lambda src, w, eps: counts.append(len(src)) or real(src, w, eps))
    m(torch.randint(0, 512, (1, 5)))
    bs = 3
    expect = []
    for l in range(7):
        if l > 0:
            expect.append(-(-l // bs) + 1)  # attention read: ceil(l/bs) + 1
        expect.append(l // bs + 2)          # FFN read: floor(l/bs) + 2
    expect.append((7 - 1) // bs + 2)         # final read: completed blocks + partial
    assert counts == expect


def test_loss_chunked_equals_one_shot_and_ignores(model):
    torch.manual_seed(3)
    ids = torch.randint(0, 512, (2, 33))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[0, :5] = -100
    model.loss_chunk_size = 0
    a = model(ids, labels=labels).loss
    model.loss_chunk_size = 7
    b = model(ids, labels=labels).loss
    model.loss_chunk_size = 4096
    logits = model(ids).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), labels.reshape(-1), ignore_index=-100)
    assert torch.allclose(a, ref) and torch.allclose(b, ref)


def test_compiled_loss_equals_eager():
    """The training loss with its gradient formed in the forward pass (k3/ops/loss.py, the default) and the
    checkpointed chunks (`fused_ce = False`), eager and compiled (compile_loss, what compile_model does): same loss
    and gradients, in chunks with a short tail and ignored targets, in training mode."""
    from k3.compile import compile_loss
    torch.manual_seed(5)
    m = K3ForCausalLM(micro()).float().train()
    h = torch.randn(2, 21, 64, requires_grad=True)
    y = torch.randint(0, 512, (2, 21))
    y[0, :4] = -100
    m.loss_chunk_size = 16

    def run(fused):
        m.fused_ce = fused
        loss, n = m.loss(h, y)
        return loss, n, torch.autograd.grad(loss, (h, m.lm_head.weight))
    ref, n_ref, g_ref = run(False)
    runs = {"fused eager": run(True)}
    compile_loss(m)
    assert m.ce_chunk is not M.ce_chunk_sum and m.ce_grad is not M.ce_chunk_grad
    runs["fused compiled"], runs["checkpointed compiled"] = run(True), run(False)
    for name, (got, n, g) in runs.items():
        # the count stays a 0-dim tensor (the model never reads it on the host: no sync in a CUDA step)
        assert isinstance(n, torch.Tensor) and n.dim() == 0 and int(n) == int(n_ref) == 38, name
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=name)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_every_parameter_gets_gradient():
    torch.manual_seed(4)
    cfg = micro(num_experts=4, num_experts_per_token=2)
    m = K3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.1)
    m.loss_chunk_size = 16
    ids = torch.randint(0, 512, (2, 48))
    m(ids, labels=ids.roll(-1, 1)).loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    # layer 0's attention read has a single source (the embedding), so its AttnRes weights are unused (spec §3.2)
    assert missing == ["model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"]
    assert m.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.grad is None  # a buffer, not trained


def test_gradient_checkpointing_same_grads():
    torch.manual_seed(5)
    m = K3ForCausalLM(micro()).double()
    ids = torch.randint(0, 512, (1, 20))
    m(ids, labels=ids).loss.backward()
    g1 = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    m.train()
    m.set_gradient_checkpointing(True)
    m(ids, labels=ids).loss.backward()
    for n, p in m.named_parameters():
        if n in g1:
            assert torch.allclose(p.grad, g1[n], atol=1e-10), n


def test_bad_inputs(model):
    with pytest.raises(ValueError, match="out of range"):
        model(torch.tensor([[1, 600]]))
    with pytest.raises(ValueError, match="batch size 1"):
        model(torch.zeros(2, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        model(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        model(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 2, 4]))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        model(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="at least 2 boundaries"):
        model(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([4]))
    with pytest.raises(ValueError, match="labels shape"):
        model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 3, dtype=torch.long))


def test_info_released_numbers():
    info = count_params(K3Config.from_preset("kimi-k3"))
    assert info["total_params"] == 2_779_484_478_208
    assert info["active_params"] == 104_189_614_848
    c = info["components"]
    assert c["kda_attention"]["total"] == 69 * 443_740_416
    assert c["mla_attention"]["total"] == 24 * 232_196_096
    assert c["routed_experts"]["total"] == 92 * 896 * 33_030_144
    assert info["active_params_with_embedding"] == 104_189_614_848 + 1_174_405_120


def test_info_tiny_matches_real_model():
    cfg = K3Config.from_preset("tiny")
    info = count_params(cfg)
    m = K3ForCausalLM(cfg)
    real = sum(p.numel() for p in m.parameters()) + sum(b.numel() for b in m.buffers())
    pad = sum(max(0, cfg.a_log_storage_size - cfg.linear_attn_config.num_heads) for t in cfg.layer_types if t == "kda")
    assert info["total_params"] == real + pad
    assert 10e6 <= info["total_params"] <= 40e6


def test_pinned_routing_replays_picks_and_keeps_gradients():
    from k3.nn.moe import pinned_routing
    torch.manual_seed(1)
    m = K3ForCausalLM(micro()).float()
    ids = torch.randint(0, 512, (2, 24))
    rec = pinned_routing(m)
    with rec:
        ref = m(ids).logits
    assert len(rec.picks) == sum(1 for layer in m.model.layers if hasattr(layer, "block_sparse_moe"))
    # inside the replay the routers hand on the recorded picks (an observer hook registered after the replay's)
    seen = {}

    def observe(n):
        def hook(mod, inp, out):
            seen[n] = out[0]
        return hook
    with rec.replay(m), torch.autocast("cpu", dtype=torch.bfloat16):
        hooks = [mod.register_forward_hook(observe(n)) for n, mod in m.named_modules()
                 if type(mod).__name__ == "K3Router"]
        out = m(ids).logits
    for h in hooks:
        h.remove()
    assert seen.keys() == rec.picks.keys()
    for n, idx in seen.items():
        assert torch.equal(idx, rec.picks[n][0])
    out.float().sum().backward()
    assert m.model.layers[1].block_sparse_moe.gate.weight.grad.abs().sum() > 0  # weights still from scores
    # replay of the fp32 run on itself is exact
    with rec.replay(m), torch.no_grad():
        again = m(ids).logits
    torch.testing.assert_close(again, ref.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="recorded picks"):
        with rec.replay(m):
            m(ids[:, :10])
    fresh = pinned_routing(m)
    with pytest.raises(ValueError, match="no recorded picks"):
        with fresh.replay(m):
            pass


def test_fp32_parts_stay_fp32_under_autocast():
    """Router scores and the AttnRes mix are fp32 by the spec: bf16 autocast must not lower their matmuls."""
    from k3.ops.attnres import attnres_mix, attnres_mix_reference
    from k3.ops.moe import route
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 128, generator=g), torch.randn(16, 128, generator=g)
    ref = route(x, w, None, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = route(x, w, None, 4)
    assert got[2].dtype == torch.float32
    torch.testing.assert_close(got[2], ref[2], rtol=1e-6, atol=1e-6)
    srcs = [torch.randn(32, 64, generator=g) for _ in range(4)]
    q = torch.randn(64, generator=g)
    mix_ref = attnres_mix_reference(srcs, q)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mix, mix2 = attnres_mix(srcs, q), attnres_mix_reference(srcs, q)
    torch.testing.assert_close(mix, mix_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mix2, mix_ref, rtol=1e-6, atol=1e-6)
