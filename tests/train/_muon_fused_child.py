"""Run under TRITON_INTERPRET=1 by test_optim.py: MuonAdamW(fused=True) against the foreach path on a micro K3
model (per-head, stacked experts, gate_up halves, tall and wide plain matrices), fp32 weights and bf16 weights
with fp32 masters, three steps with the same gradients. Prints one JSON object."""
import copy
import json

import torch

from k3.ops.triton_interp import emulate_gpu, fix_interpreter_bf16_dot
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.train.optim import build_optimizer

fix_interpreter_bf16_dot()
emulate_gpu(True)   # fp32 -> bf16 stores round to nearest even, as on the GPU (the interpreter truncates)
torch.manual_seed(0)
cfg = K3Config.from_preset(
    "tiny", hidden_size=64, num_hidden_layers=4, vocab_size=256, bos_token_id=250, eos_token_id=251,
    pad_token_id=255, intermediate_size=96, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=4,
    num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=24, routed_expert_hidden_size=32,
    kda_gate_low_rank=16, attn_res_block_size=2,
    **{"linear_attn_config.num_heads": 2, "linear_attn_config.head_dim": 16,
       "linear_attn_config.full_attn_layers": [4], "linear_attn_config.kda_layers": [1, 2, 3]})
base = K3ForCausalLM(cfg)
out = {}
for name, dt, masters in (("fp32", torch.float32, False), ("bf16_masters", torch.bfloat16, True)):
    models = [copy.deepcopy(base).to(dt) for _ in range(2)]
    opts = [build_optimizer(m, lr=0.02, weight_decay=0.1, master_weights=masters, fused=f)
            for m, f in zip(models, (False, True))]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        grads = {n: torch.randn(p.shape, generator=g).to(dt) for n, p in models[0].named_parameters()}
        for m, o in zip(models, opts):
            for n, p in m.named_parameters():
                p.grad = grads[n].clone()
            o.step()
    worst, worst_master, n_muon = 0.0, 0.0, 0
    n_masters = 0
    for (n, pa), (_, pb) in zip(models[0].named_parameters(), models[1].named_parameters()):
        a, b = pa.detach(), pb.detach()
        d = (a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-30)
        worst = max(worst, float(d))
        if masters and "master" in opts[0].state.get(pa, {}):
            n_masters += 1
            ma, mb = opts[0].state[pa]["master"], opts[1].state[pb]["master"]
            worst_master = max(worst_master, float((ma.double() - mb.double()).norm() / ma.double().norm()))
    n_muon = sum(len(gr["params"]) for gr in opts[1].param_groups if gr["use_muon"])
    ortho = sorted({gr["ortho"] for gr in opts[1].param_groups if gr["use_muon"]})
    out[name] = dict(worst=worst, worst_master=worst_master, n_muon=n_muon, orthos=ortho, n_masters=n_masters)
print(json.dumps(out))
