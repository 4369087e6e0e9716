"""Parameter accounting on the meta device (no memory): total and active-per-token parameters by component.

Counts follow the checkpoint as stored (architecture.md §8): the router correction bias is included, and `A_log` counts with
its stored padding (`a_log_storage_size`). "Active" excludes the input embedding table (the report's convention);
`active_params_with_embedding` includes it.
"""
from __future__ import annotations

import re
from collections import OrderedDict

import torch

from k3.config import K3Config

COMPONENTS = ["embed_tokens", "lm_head", "final_norm_attnres", "layer_norms_attnres", "kda_attention",
              "mla_attention", "dense_ffn", "routers", "latent_proj_norm", "shared_experts", "routed_experts"]


def _component(name: str, layer_types) -> str:
    if name.startswith("model.embed_tokens"):
        return "embed_tokens"
    if name.startswith("lm_head"):
        return "lm_head"
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if not m:
        return "final_norm_attnres"
    i, rest = int(m.group(1)), m.group(2)
    if rest.startswith("self_attn."):
        return "kda_attention" if layer_types[i] == "kda" else "mla_attention"
    if rest.startswith("mlp."):
        return "dense_ffn"
    if rest.startswith("block_sparse_moe.gate"):
        return "routers"
    if rest.startswith("block_sparse_moe.routed_expert_"):
        return "latent_proj_norm"
    if rest.startswith("block_sparse_moe.shared_experts"):
        return "shared_experts"
    if rest.startswith("block_sparse_moe.experts"):
        return "routed_experts"
    return "layer_norms_attnres"


def count_params(cfg: K3Config) -> dict:
    from k3.model import K3ForCausalLM
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, init=False)
    total = OrderedDict((c, 0) for c in COMPONENTS)
    active = OrderedDict((c, 0) for c in COMPONENTS)
    types = cfg.layer_types
    seen = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen:  # tied weights
            continue
        seen.add(id(t))
        n = t.numel()
        if name.endswith("self_attn.A_log"):
            n = max(n, cfg.a_log_storage_size)
        c = _component(name, types)
        total[c] += n
        if c == "routed_experts":
            active[c] += n * cfg.num_experts_per_token // cfg.num_experts
        elif c != "embed_tokens":
            active[c] += n
    tot, act = sum(total.values()), sum(active.values())
    return {
        "total_params": tot,
        "active_params": act,
        "active_params_with_embedding": act + total["embed_tokens"],
        "components": {c: {"total": total[c], "active": active[c]} for c in COMPONENTS},
        "layers": {"num_hidden_layers": cfg.num_hidden_layers, "kda": types.count("kda"), "mla": types.count("mla"),
                   "moe": sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))},
    }


def train_flops_per_token(cfg: K3Config, T: int) -> dict:
    """Training FLOPs per token (forward + backward) at sequence length T, the benchmarks' MFU convention: 6 x active
    parameters (count_params: matmul weights incl. lm_head, routed experts at top_k / E, embedding excluded) plus the
    attention terms that grow with T: causal MLA softmax attention 3 * 2 * H * (Dqk + Dv) * (T + 1) / 2 per MLA layer,
    and KDA's chunked form (chunk C = 64, independent of T) 3 * H * (2 * C * (K + V) + 6 * K * V) per KDA layer."""
    act = count_params(cfg)["active_params"]
    n_mla, n_kda = cfg.layer_types.count("mla"), cfg.layer_types.count("kda")
    H = cfg.num_attention_heads
    mla = 3 * 2 * H * (cfg.qk_head_dim + cfg.v_head_dim) * (T + 1) / 2 * n_mla
    lac, C = cfg.linear_attn_config, 64
    kda = 3 * lac.num_heads * (2 * C * (2 * lac.head_dim) + 6 * lac.head_dim ** 2) * n_kda
    return dict(active_params=act, dense=6 * act, mla_attn=mla, kda=kda, total=6 * act + mla + kda)


def format_info(info: dict, name: str = "") -> str:
    lines = [f"K3 model {name}".rstrip(),
             f"layers: {info['layers']['num_hidden_layers']} ({info['layers']['kda']} KDA + {info['layers']['mla']} MLA,"
             f" {info['layers']['moe']} MoE)",
             f"{'component':<22}{'total':>20}{'active/token':>20}"]
    for c, v in info["components"].items():
        if v["total"]:
            lines.append(f"{c:<22}{v['total']:>20,}{v['active']:>20,}")
    lines.append(f"{'TOTAL':<22}{info['total_params']:>20,}{info['active_params']:>20,}")
    lines.append(f"active incl. input embedding: {info['active_params_with_embedding']:,}")
    return "\n".join(lines)
