"""Run under TRITON_INTERPRET=1 by test_model_triton.py: a micro K3 model (fp32) with every opt-in Triton path of
the training step forced on (short conv, MoE combine / dispatch backward, packed SiTU node) against the same model
on its torch paths: loss and every gradient. Prints one JSON object."""
import json
import os

import torch

import k3.ops.activations as A
from k3.config import K3Config
from k3.model import K3ForCausalLM

torch.manual_seed(0)
cfg = K3Config.from_preset(
    "tiny", hidden_size=64, num_hidden_layers=4, vocab_size=256, bos_token_id=250, eos_token_id=251,
    pad_token_id=255, intermediate_size=96, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=4,
    num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=24, routed_expert_hidden_size=32,
    kda_gate_low_rank=16, attn_res_block_size=2,
    **{"linear_attn_config.num_heads": 2, "linear_attn_config.head_dim": 16,
       "linear_attn_config.full_attn_layers": [4], "linear_attn_config.kda_layers": [1, 2, 3]})
m = K3ForCausalLM(cfg).float().train()
with torch.no_grad():
    for n, p in m.named_parameters():
        if n.endswith("_res_proj.weight"):
            p.normal_(0, 0.5)
ids = torch.randint(0, 250, (1, 70))
cu = torch.tensor([0, 5, 5, 40, 70], dtype=torch.int32)   # documents of 5, 0, 35 and 30 tokens
from k3.ops import activations_triton as at, conv_triton as ct, moe_triton as mt  # noqa: E402
calls = {}
for mod, name in ((ct, "conv1d_fwd"), (ct, "conv1d_bwd"), (mt, "gather_sum"), (mt, "gather_dot"),
                  (at, "situ_fwd"), (at, "situ_bwd")):
    def spy(*a, _f=getattr(mod, name), _n=name, **kw):
        calls[_n] = calls.get(_n, 0) + 1
        return _f(*a, **kw)
    setattr(mod, name, spy)
res = {}
for mode in ("torch", "triton"):
    if mode == "triton":
        os.environ["K3_BACKEND"] = "conv:triton,moe_combine:triton"
        A._use_triton = lambda t: True      # the SiTU kernels and the packed node (CUDA-only in normal use)
    m.zero_grad(set_to_none=True)
    out = m(ids, labels=ids.roll(-1, 1), cu_seqlens=cu)
    out.loss.backward()
    res[mode] = (out.loss.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters()
                                     if p.grad is not None})
rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))  # noqa: E731
gt, gr = res["triton"][1], res["torch"][1]
print(json.dumps({"calls": calls, "loss": rel(res["triton"][0], res["torch"][0]), "n_grads": len(gt),
                  "same_params": sorted(gt) == sorted(gr),
                  "worst_grad": max(rel(gt[n], gr[n]) for n in gr if gr[n].norm() > 0)}))
