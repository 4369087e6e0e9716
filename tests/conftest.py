"""Shared test fixtures."""
import json

import pytest
import torch

# a ~0.3M-parameter variant of the `tiny` preset for trainer tests (CPU and tests/gpu)
_MICRO_MODEL = dict(hidden_size=64, num_hidden_layers=4, vocab_size=1024, bos_token_id=768, eos_token_id=770,
                    pad_token_id=1023, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
                    routed_expert_hidden_size=32, kda_gate_low_rank=16, attn_res_block_size=2,
                    **{"linear_attn_config.num_heads": 2, "linear_attn_config.head_dim": 16,
                       "linear_attn_config.full_attn_layers": [4], "linear_attn_config.kda_layers": [1, 2, 3]})


@pytest.fixture(scope="session")
def micro_model_overrides():
    """`model_overrides` (K3Config.from_preset("tiny", **these)) of the trainer tests' micro model (a fresh copy)."""
    return dict(_MICRO_MODEL)


@pytest.fixture(scope="session")
def micro_corpus(tmp_path_factory):
    """A 60-document slice of the built-in corpus as a .jsonl file + a shared tokenizer cache:
    {"data": [path], "cache": dir}."""
    from k3.train.data import load_corpus
    d = tmp_path_factory.mktemp("corpus")
    train, val = load_corpus()
    p = d / "docs.jsonl"
    with open(p, "w") as f:
        for i, t in enumerate(train[:60] + val[:6]):
            f.write(json.dumps({"name": f"d{i}", "text": t[:3000]}) + "\n")
    return {"data": [str(p)], "cache": str(d / "cache")}


@pytest.fixture
def one_torch_thread():
    """Tests of many tiny ops: one intra-op thread is much faster (and far less noisy on a shared, loaded CPU).
    Opt in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")` or as an argument."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
