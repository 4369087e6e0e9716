import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM


def micro_config(layers=6, all_mla=False, **kw):
    base = dict(vocab_size=512, hidden_size=64, num_hidden_layers=layers, num_attention_heads=2,
                num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=8, num_experts=8, num_experts_per_token=2, moe_intermediate_size=16,
                routed_expert_hidden_size=32, intermediate_size=96, attn_res_block_size=2, kda_gate_low_rank=8,
                bos_token_id=256, eos_token_id=258, pad_token_id=511)
    base.update(kw)
    L = base["num_hidden_layers"]
    full = list(range(1, L + 1)) if all_mla else [i for i in range(1, L + 1) if i % 3 == 0]
    base["linear_attn_config"] = dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                      full_attn_layers=full, kda_layers=[i for i in range(1, L + 1) if i not in full])
    return K3Config.from_preset("tiny", **base)


def build(cfg, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    m = K3ForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # non-trivial mixes and attention scores
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
            elif "kv_b_proj" in n or "q_b_proj" in n:
                p.normal_(0, 0.3)
    return m.eval()


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These tests run many tiny ops: one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def model64():
    return build(micro_config())


@pytest.fixture(scope="session")
def model32():
    return build(micro_config(), torch.float32)
