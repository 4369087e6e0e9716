import json
import os

import pytest
import torch

from k3.config import K3Config, PRESETS
from k3.errors import K3ConfigError

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "k3", "config.json")
RELEASED = os.path.join(os.path.dirname(__file__), "..", "k3", "presets", "kimi-k3.json")


def test_presets_exist():
    assert {"tiny", "small", "kimi-k3"} <= set(PRESETS)


def test_released_config_round_trip(tmp_path):
    raw = json.load(open(RELEASED))
    cfg = K3Config.from_dict(raw)
    assert cfg.to_dict() == raw  # container + text_config + vision_config, nothing lost
    p = tmp_path / "config.json"
    cfg.save_json(str(p))
    assert json.load(open(p)) == raw
    bare = cfg.to_dict(text_only=True)
    assert bare == raw["text_config"]
    assert K3Config.from_dict(bare).to_dict() == bare


@pytest.mark.skipif(not os.path.exists(SHARED), reason="shared/ not beside the checkout")
def test_preset_is_the_shared_release():
    assert json.load(open(SHARED)) == json.load(open(RELEASED))


def test_released_layer_map():
    cfg = K3Config.from_preset("kimi-k3")
    t = cfg.layer_types
    assert t.count("kda") == 69 and t.count("mla") == 24
    assert [i for i, x in enumerate(t) if x == "mla"] == list(range(3, 92, 4)) + [92]
    assert t[0] == "kda" and not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, 93))


def test_tiny_has_every_feature():
    cfg = K3Config.from_preset("tiny")
    t = cfg.layer_types
    assert "kda" in t and "mla" in t and t[-1] == "mla"
    assert cfg.num_hidden_layers // cfg.attn_res_block_size >= 2
    assert cfg.num_shared_experts > 0 and cfg.first_k_dense_replace == 1 and cfg.hidden_act == "situ"
    assert cfg.routed_expert_hidden_size < cfg.hidden_size


@pytest.mark.parametrize("override,key", [
    (dict(num_experts_per_token=17, num_experts=16), "num_experts_per_token"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_expert_group=3), "num_expert_group"),
    (dict(mla_use_nope=False), "mla_use_nope"),
    ({"linear_attn_config.use_full_rank_gate": False}, "linear_attn_config.use_full_rank_gate"),
    (dict(topk_method="greedy"), "topk_method"),
    (dict(num_expert_group=4, topk_group=2, use_grouped_topk=False), "use_grouped_topk"),
    (dict(num_expert_group=8, topk_group=1), "topk_group"),   # 1 kept group of 2 experts < top-4
    ({"linear_attn_config.gate_lower_bound": -10.5}, "gate_lower_bound"),
    ({"linear_attn_config.gate_lower_bound": 0.0}, "gate_lower_bound"),
    ({"linear_attn_config.gate_lower_bound": "-5"}, "gate_lower_bound"),
    (dict(attn_res_mode="full"), "attn_res_mode"),
    ({"linear_attn_config.head_dim": 0}, "head_dim"),
    ({"linear_attn_config.kda_layers": [1, 2, 3, 4, 5, 6, 7]}, "kda_layers"),
    ({"linear_attn_config.full_attn_layers": [4, 9]}, "full_attn_layers"),
])
def test_invalid_configs_name_the_key(override, key):
    with pytest.raises(K3ConfigError, match=key):
        K3Config.from_preset("tiny", **override)


def test_unknown_preset_and_bad_file(tmp_path):
    with pytest.raises(K3ConfigError, match="unknown preset"):
        K3Config.from_preset("nope")
    p = tmp_path / "c.json"
    p.write_text("{not json")
    with pytest.raises(K3ConfigError, match="not valid JSON"):
        K3Config.from_json(str(p))


def test_replace_accepts_a_linear_attn_config_object():
    import dataclasses
    base = K3Config.from_preset("small")
    la = dataclasses.replace(base.linear_attn_config, full_attn_layers=[4], kda_layers=[1, 2, 3, 5])
    cfg = base.replace(num_hidden_layers=5, linear_attn_config=la)
    assert cfg.layer_types == ["kda", "kda", "kda", "mla", "kda"]
    assert cfg.linear_attn_config.head_dim == base.linear_attn_config.head_dim


def test_expert_groups_reach_the_router():
    """num_expert_group / topk_group are used (grouped top-k, k3.ops.router.select_experts), not only validated."""
    from k3.model import K3ForCausalLM
    cfg = K3Config.from_preset("tiny", num_expert_group=4, topk_group=2, num_hidden_layers=2,
                               **{"linear_attn_config.full_attn_layers": [2], "linear_attn_config.kda_layers": [1]})
    m = K3ForCausalLM(cfg)
    gate = m.model.layers[1].block_sparse_moe.gate
    assert (gate.num_expert_group, gate.topk_group) == (4, 2)
    torch.manual_seed(0)
    idx, w, scores = gate(torch.randn(64, cfg.hidden_size))
    groups = (idx // (cfg.num_experts // 4))
    assert all(len(set(r.tolist())) <= 2 for r in groups)        # every token's experts lie in <= 2 groups


def test_attnres_and_kda_norm_eps_follow_the_spec_not_rms_norm_eps():
    """Spec §3.3 / §3.4: the AttnRes mix and the KDA output norm use eps 1e-5 whatever rms_norm_eps says."""
    from k3.model import K3ForCausalLM
    cfg = K3Config.from_preset("tiny", rms_norm_eps=1e-3, num_hidden_layers=2,
                               **{"linear_attn_config.full_attn_layers": [2], "linear_attn_config.kda_layers": [1]})
    m = K3ForCausalLM(cfg)
    assert m.model.layers[0].input_layernorm.eps == 1e-3
    assert all(layer.res_eps == 1e-5 for layer in m.model.layers)
    assert m.model.layers[0].self_attn.norm_eps == 1e-5
    # every mix of a forward (layers and the output mix) runs with 1e-5
    import k3.model as km
    seen = []

    def spy(sources, w, eps=1e-5, backend=None):
        seen.append(eps)
        return orig(sources, w, eps, backend)
    orig = km.attnres_mix
    km.attnres_mix = spy
    try:
        with torch.no_grad():
            m(torch.randint(0, cfg.vocab_size, (1, 5)))
    finally:
        km.attnres_mix = orig
    assert seen and set(seen) == {1e-5}
