"""Loading released-format checkpoints of several non-default shapes from their own files alone (issue #29 item 1).

The checkpoints are written by tests/checkpoint/released_fixture.py (released names and shapes, no k3 writer)."""
import pytest
import torch

from k3.checkpoint import from_pretrained, load_config, load_state_dict
from k3.config import K3Config

from .released_fixture import (mxfp4_reference_decode, quantization_config, released_tensors,
                                               text_config, write_released)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = {
    # head dim 32 (the old separate default 128 made this fail), container config, dense experts
    "hd32": dict(),
    # head dim 16, 5 KDA heads, 3 MLA heads, no q LoRA, no output gate / shared experts / latent norm,
    # grouped top-k, dense layers 0-1 + MoE every 2nd layer, MLA first and last, AttnRes blocks of 3,
    # tied embeddings, rms eps 1e-6, `torch_dtype` spelling, bare text config
    "hd16": dict(lac_head_dim=16, lac_num_heads=5, num_attention_heads=3, q_lora_rank=0, kv_lora_rank=8,
                 mla_use_output_gate=False, num_shared_experts=0, latent_moe_use_norm=False, num_experts=8,
                 num_expert_group=2, topk_group=1, num_experts_per_token=2, first_k_dense_replace=2,
                 moe_layer_freq=2, attn_res_block_size=3, num_hidden_layers=7, full_attn_layers=[1, 7],
                 tie_word_embeddings=True, rms_norm_eps=1e-6, _torch_dtype=True, _container=False),
    # head dim 64, 2 KDA heads with A_log padded to 8, MXFP4 experts (latent 64, expert width 32), lora 40/24
    "hd64_mxfp4": dict(lac_head_dim=64, lac_num_heads=2, q_lora_rank=40, kv_lora_rank=24,
                       routed_expert_hidden_size=64, moe_intermediate_size=32, num_experts=4,
                       num_experts_per_token=3, lac_short_conv_kernel_size=3, _mxfp4=True, _a_log=8),
}


def _make(tmp_path, name):
    kw = dict(CASES[name])
    mx, alog = kw.pop("_mxfp4", False), kw.pop("_a_log", None)
    tdt, container = kw.pop("_torch_dtype", False), kw.pop("_container", True)
    c = text_config(**kw)
    if mx:
        c["quantization_config"] = quantization_config()
    t = released_tensors(c, mxfp4=mx, a_log_size=alog)
    if tdt:
        c["torch_dtype"] = c.pop("dtype")
    return c, t, write_released(str(tmp_path / name), c, t, container=container)


@pytest.mark.parametrize("name", list(CASES))
def test_released_style_checkpoint_loads_and_runs(tmp_path, name):
    c, t, path = _make(tmp_path, name)
    cfg = load_config(path)
    lac = c["linear_attn_config"]
    # every model field comes from the file
    assert cfg.kda_gate_low_rank == lac["head_dim"]
    assert cfg.lac.num_heads == lac["num_heads"] and cfg.num_attention_heads == c["num_attention_heads"]
    assert cfg.dtype == "float32" and cfg.tie_word_embeddings == c["tie_word_embeddings"]
    assert [i for i, x in enumerate(cfg.layer_types) if x == "mla"] == [i - 1 for i in lac["full_attn_layers"]]
    model = from_pretrained(path)  # strict: every tensor used, every parameter filled
    blocks = model.model.layers
    for i, layer in enumerate(blocks):
        moe = c["num_experts"] > 0 and i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0
        assert hasattr(layer, "block_sparse_moe") == moe, i
        assert layer.input_layernorm.eps == c["rms_norm_eps"]
        if moe:
            g = layer.block_sparse_moe.gate
            assert (g.num_expert_group, g.topk_group, g.top_k) == (c["num_expert_group"], c["topk_group"],
                                                                 c["num_experts_per_token"])
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == c["tie_word_embeddings"]
    # tensors land where the released names say
    sd = model.state_dict()
    for k, v in t.items():
        mk = k[len("language_model."):]
        if ".experts." in mk:
            continue
        if mk.endswith("A_log"):
            v = v[:lac["num_heads"]]
        assert torch.equal(sd[mk], v.to(sd[mk].dtype)), k
    M = c["moe_intermediate_size"]
    i = next(i for i in range(c["num_hidden_layers"]) if hasattr(blocks[i], "block_sparse_moe"))
    pre = f"language_model.model.layers.{i}.block_sparse_moe.experts."
    ex = blocks[i].block_sparse_moe.experts
    for e in range(c["num_experts"]):
        def W(n):
            if c.get("quantization_config"):
                return mxfp4_reference_decode(t[pre + f"{e}.{n}.weight_packed"], t[pre + f"{e}.{n}.weight_scale"])
            return t[pre + f"{e}.{n}.weight"]
        assert torch.equal(ex.gate_up_proj[e, :, :M], W("w1").t())
        assert torch.equal(ex.gate_up_proj[e, :, M:], W("w3").t())
        assert torch.equal(ex.down_proj[e], W("w2").t())
    ids = torch.randint(0, c["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 9, c["vocab_size"]) and torch.isfinite(logits).all()


def test_release_rule_for_decay_rank_round_trips():
    c = text_config(lac_head_dim=16)
    cfg = K3Config.from_dict(c)
    assert cfg.kda_gate_low_rank == 16 and "kda_gate_low_rank" not in cfg.to_dict()
    assert cfg.release_compatible_problems == []
    # changing head_dim moves the derived rank with it; an explicit other rank is kept and reported
    assert cfg.replace(**{"linear_attn_config.head_dim": 8}).kda_gate_low_rank == 8
    odd = cfg.replace(kda_gate_low_rank=4)
    assert odd.to_dict()["kda_gate_low_rank"] == 4 and "kda_gate_low_rank" in odd.release_compatible_problems[0]
    assert K3Config.from_preset("kimi-k3").kda_gate_low_rank == 128


def test_subset_load_of_a_sharded_released_checkpoint(tmp_path):
    c, t, path = _make(tmp_path, "hd32")
    want = lambda k: ".layers.1." in k or k.endswith("embed_tokens.weight")  # noqa: E731
    sd = load_state_dict(path, keys=want)
    assert set(sd) == {k[len("language_model."):] for k in t if want(k[len("language_model."):])
                       and ".experts." not in k} | {f"model.layers.1.block_sparse_moe.experts.{n}"
                                                    for n in ("gate_up_proj", "down_proj")}
    assert torch.equal(sd["model.embed_tokens.weight"], t["language_model.model.embed_tokens.weight"])


def test_expert_slice_load_for_an_expert_parallel_rank(tmp_path):
    c, t, path = _make(tmp_path, "hd64_mxfp4")
    full = load_state_dict(path, strict=True)
    k = "model.layers.1.block_sparse_moe.experts.gate_up_proj"
    part = load_state_dict(path, keys=lambda n: ".layers.1.block_sparse_moe." in n, experts=(1, 3), strict=True)
    assert part[k].shape[0] == 2 and torch.equal(part[k], full[k][1:3])
    assert torch.equal(part[k.replace("gate_up", "down")], full[k.replace("gate_up", "down")][1:3])
    assert "model.layers.1.block_sparse_moe.gate.weight" in part and "model.embed_tokens.weight" not in part
    with pytest.raises(Exception, match="experts="):
        load_state_dict(path, experts=(3, 9))


def test_absent_keys_follow_the_files_other_keys():
    c = text_config(num_attention_heads=3, lac_head_dim=8)
    del c["num_key_value_heads"]
    cfg = K3Config.from_dict(c)
    assert cfg.num_key_value_heads == 3 and cfg.kda_gate_low_rank == 8
