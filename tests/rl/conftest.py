import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.tokenizer import build_toy_tokenizer


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny ops: one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def toy_tok(tmp_path_factory):
    return build_toy_tokenizer(str(tmp_path_factory.mktemp("rl_toytok")))


def tiny_model(vocab_size, eos, pad, bos, seed=0, dtype=torch.float32):
    base = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=8, num_experts=4, num_experts_per_token=2, moe_intermediate_size=16,
                routed_expert_hidden_size=16, intermediate_size=48, attn_res_block_size=2, kda_gate_low_rank=8,
                bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    base["linear_attn_config"] = dict(num_heads=2, head_dim=8, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                      full_attn_layers=[4], kda_layers=[1, 2, 3])
    cfg = K3Config.from_preset("tiny", **base)
    torch.manual_seed(seed)
    return K3ForCausalLM(cfg).to(dtype).eval()


@pytest.fixture(scope="session")
def toy_model(toy_tok):
    return tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id)


@pytest.fixture(scope="session")
def make_tiny_model():
    """The factory tiny_model(vocab_size, eos, pad, bos, seed=0, dtype=torch.float32)."""
    return tiny_model
