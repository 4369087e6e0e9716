"""An independent writer of released-format K3 checkpoints for tests (docs/architecture.md §4, architecture.md §4.2).

Nothing here uses k3's own writer or name mapping: names and shapes come from the released tensor table, so a
loader bug and a writer bug cannot cancel out. MXFP4 experts are written as random codes + scales (any byte is a
valid E2M1 pair; scales near 2**-3), and `mxfp4_reference_decode` decodes them by the spec's formula.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def text_config(**kw) -> dict:
    """A small released-style `text_config` dict (released key names only); `kw` overrides keys; nested
    `linear_attn_config` keys with `lac_` prefix."""
    L = kw.pop("num_hidden_layers", 6)
    full = kw.pop("full_attn_layers", [3, 6])
    lac = {"num_heads": 3, "head_dim": 32, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
           "gate_lower_bound": -5.0, "full_attn_layers": full,
           "kda_layers": [i for i in range(1, L + 1) if i not in full]}
    for k in list(kw):
        if k.startswith("lac_"):
            lac[k[4:]] = kw.pop(k)
    c = {"activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
         "architectures": ["KimiLinearForCausalLM"], "attn_res_block_size": 2, "bos_token_id": 1,
         "dtype": "float32", "eos_token_id": 2, "first_k_dense_replace": 1, "hidden_act": "situ",
         "hidden_size": 48, "initializer_range": 0.02, "intermediate_size": 80, "kv_lora_rank": 16,
         "latent_moe_use_norm": True, "linear_attn_config": lac, "max_position_embeddings": 4096,
         "mla_use_nope": True, "mla_use_output_gate": True, "model_type": "kimi_linear",
         "moe_intermediate_size": 64, "moe_layer_freq": 1, "moe_renormalize": True,
         "moe_router_activation_func": "sigmoid", "num_attention_heads": 2, "num_expert_group": 1,
         "num_experts": 6, "num_experts_per_token": 2, "num_hidden_layers": L, "num_key_value_heads": 2,
         "num_nextn_predict_layers": 0, "num_shared_experts": 1, "pad_token_id": 127, "q_lora_rank": 24,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "rms_norm_eps": 1e-5, "routed_expert_hidden_size": 32,
         "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
         "use_cache": True, "use_grouped_topk": True, "v_head_dim": 16, "vocab_size": 128}
    c.update(kw)
    if c["num_key_value_heads"] != c["num_attention_heads"]:
        c["num_key_value_heads"] = c["num_attention_heads"]
    return c


def is_moe(c: dict, i: int) -> bool:
    return c["num_experts"] > 0 and i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0


def released_tensors(c: dict, mxfp4: bool = False, a_log_size=None, seed: int = 0) -> dict:
    """{released name: tensor} for text config `c` (names/shapes per the released table)."""
    g = torch.Generator().manual_seed(seed)
    fdt = getattr(torch, c.get("dtype") or c.get("torch_dtype", "float32"))

    def w(*shape, std=0.05, dtype=None):
        return (torch.randn(*shape, generator=g) * std).to(dtype or fdt)

    def ones(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(fdt)

    d, V = c["hidden_size"], c["vocab_size"]
    lac = c["linear_attn_config"]
    H, K, ck = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    P = H * K
    out = {}
    pre = "language_model."
    out[pre + "model.embed_tokens.weight"] = w(V, d, std=0.5)
    if not c["tie_word_embeddings"]:
        out[pre + "lm_head.weight"] = w(V, d)
    out[pre + "model.norm.weight"] = ones(d)
    out[pre + "model.output_attn_res_norm.weight"] = ones(d)
    out[pre + "model.output_attn_res_proj.weight"] = w(1, d)
    full = set(lac["full_attn_layers"])
    nh = c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    vd = c["v_head_dim"]
    for i in range(c["num_hidden_layers"]):
        p = f"{pre}model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            out[p + n + ".weight"] = ones(d)
        out[p + "self_attention_res_proj.weight"] = w(1, d)
        out[p + "mlp_res_proj.weight"] = w(1, d)
        a = p + "self_attn."
        if (i + 1) not in full:   # KDA
            for n in "qkvg":
                out[a + f"{n}_proj.weight"] = w(P, d)
            out[a + "o_proj.weight"] = w(d, P)
            out[a + "f_a_proj.weight"] = w(K, d)      # the decay rank = head_dim (released rule)
            out[a + "f_b_proj.weight"] = w(P, K)
            out[a + "b_proj.weight"] = w(H, d)
            for n in "qkv":
                out[a + f"{n}_conv1d.weight"] = w(P, 1, ck, std=0.3, dtype=torch.float32)
            S = a_log_size or H
            alog = torch.zeros(S)
            alog[:H] = torch.randn(H, generator=g) * 0.3
            out[a + "A_log"] = alog
            out[a + "dt_bias"] = w(P, std=0.5, dtype=torch.float32)
            out[a + "o_norm.weight"] = (1 + 0.1 * torch.randn(K, generator=g))
        else:                     # MLA
            if c["q_lora_rank"]:
                out[a + "q_a_proj.weight"] = w(c["q_lora_rank"], d)
                out[a + "q_a_layernorm.weight"] = ones(c["q_lora_rank"])
                out[a + "q_b_proj.weight"] = w(nh * qk, c["q_lora_rank"])
            else:
                out[a + "q_proj.weight"] = w(nh * qk, d)
            out[a + "kv_a_proj_with_mqa.weight"] = w(c["kv_lora_rank"] + c["qk_rope_head_dim"], d)
            out[a + "kv_a_layernorm.weight"] = ones(c["kv_lora_rank"])
            out[a + "kv_b_proj.weight"] = w(nh * (c["qk_nope_head_dim"] + vd), c["kv_lora_rank"])
            if c["mla_use_output_gate"]:
                out[a + "g_proj.weight"] = w(nh * vd, d)
            out[a + "o_proj.weight"] = w(d, nh * vd)
        if is_moe(c, i):
            m = p + "block_sparse_moe."
            E, l, M = c["num_experts"], c["routed_expert_hidden_size"], c["moe_intermediate_size"]
            out[m + "gate.weight"] = w(E, d, std=0.3)
            out[m + "gate.e_score_correction_bias"] = w(E, std=0.01, dtype=torch.float32)
            out[m + "routed_expert_down_proj.weight"] = w(l, d)
            if c["latent_moe_use_norm"]:
                out[m + "routed_expert_norm.weight"] = ones(l)
            out[m + "routed_expert_up_proj.weight"] = w(d, l)
            if c["num_shared_experts"]:
                S = c["num_shared_experts"] * M
                out[m + "shared_experts.gate_proj.weight"] = w(S, d)
                out[m + "shared_experts.up_proj.weight"] = w(S, d)
                out[m + "shared_experts.down_proj.weight"] = w(d, S)
            for e in range(E):
                for nm, (o, ii) in (("w1", (M, l)), ("w3", (M, l)), ("w2", (l, M))):
                    b = f"{m}experts.{e}.{nm}."
                    if mxfp4:
                        out[b + "weight_packed"] = torch.randint(0, 256, (o, ii // 2), generator=g, dtype=torch.uint8)
                        out[b + "weight_scale"] = torch.randint(121, 125, (o, ii // 32), generator=g,
                                                                dtype=torch.uint8)
                    else:
                        out[b + "weight"] = w(o, ii)
        else:
            I = c["intermediate_size"]
            out[p + "mlp.gate_proj.weight"] = w(I, d)
            out[p + "mlp.up_proj.weight"] = w(I, d)
            out[p + "mlp.down_proj.weight"] = w(d, I)
    return out


def mxfp4_reference_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The spec formula, element by element in vector form: W[r, 32j+k] = value(code) * 2**(scale[r,j]-127)."""
    o, half = packed.shape
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], -1).reshape(o, 2 * half).long()
    vals = torch.tensor(E2M1, dtype=torch.float64)[codes]
    mult = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=1)
    return (vals * mult).float()


def quantization_config() -> dict:
    return {"config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                          "weights": {"dynamic": False, "group_size": 32, "num_bits": 4,
                                                      "observer": "minmax", "scale_dtype": "torch.uint8",
                                                      "strategy": "group", "symmetric": True, "type": "float"}}},
            "format": "mxfp4-pack-quantized",
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def write_released(directory: str, c: dict, tensors: dict, container: bool = True, shards: int = 3) -> str:
    """config.json (container with text_config, or the bare text config) + `shards` safetensors + index."""
    os.makedirs(directory, exist_ok=True)
    cfg = c
    if container:
        cfg = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
               "bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"],
               "pad_token_id": c["pad_token_id"], "tie_word_embeddings": c["tie_word_embeddings"],
               "text_config": c}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    keys = list(tensors)
    # experts out of id order within a shard, as in the release
    keys = keys[::2] + keys[1::2]
    per = -(-len(keys) // shards)
    wm = {}
    for s in range(shards):
        part = keys[s * per:(s + 1) * per]
        name = f"model-{s + 1:05d}-of-{shards:06d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, os.path.join(directory, name))
        wm.update({k: name for k in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                   "weight_map": wm}, f)
    return directory
