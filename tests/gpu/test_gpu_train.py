"""The trainer on CUDA (skipped without it): `--param-dtype bf16` (bf16 weights, fp32 masters in the optimizer)
against the default fp32-weight autocast run on the same data, a few steps of a micro model, no compile."""
import json
import math
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MICRO = dict(hidden_size=64, num_hidden_layers=4, vocab_size=1024, bos_token_id=768, eos_token_id=770,
             pad_token_id=1023, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
             routed_expert_hidden_size=32, kda_gate_low_rank=16, attn_res_block_size=2,
             **{"linear_attn_config.num_heads": 2, "linear_attn_config.head_dim": 16,
                "linear_attn_config.full_attn_layers": [4], "linear_attn_config.kda_layers": [1, 2, 3]})


def test_bf16_params_train_like_fp32_on_cuda(tmp_path):
    from k3.train.data import load_corpus
    from k3.train.trainer import Trainer, TrainConfig
    train, val = load_corpus()
    p = tmp_path / "docs.jsonl"
    with open(p, "w") as f:
        for i, t in enumerate(train[:60] + val[:6]):
            f.write(json.dumps({"name": f"d{i}", "text": t[:3000]}) + "\n")
    losses = {}
    for dt in ("fp32", "bf16"):
        out = tmp_path / dt
        cfg = TrainConfig(out_dir=str(out), preset="tiny", model_overrides=dict(MICRO), steps=8, tokens_per_step=512,
                          stages=[(128, 1.0)], data=[str(p)], cache_dir=str(tmp_path / "cache"), lr=1e-2,
                          val_tokens=512, recall_examples=4, recall_pairs=4, progress=False, tensorboard=False,
                          samples=False, plot=False, seed=0, device="cuda", eval_every=0, compile="none",
                          param_dtype=dt)
        t = Trainer(cfg)
        t.train()
        with open(os.path.join(out, "metrics.jsonl")) as fh:
            losses[dt] = [r["loss"] for r in map(json.loads, fh) if r["type"] == "train"]
        if dt == "bf16":
            assert t.model.model.embed_tokens.weight.dtype == torch.bfloat16
            st = [s for s in t.optimizer.state.values() if "master" in s]
            assert st and all(s["master"].dtype == torch.float32 and s["master"].is_cuda for s in st)
    print(f"[gpu-train] losses fp32 {losses['fp32']}\n[gpu-train] losses bf16 {losses['bf16']}", flush=True)
    assert all(math.isfinite(x) for v in losses.values() for x in v)
    assert losses["bf16"][-1] < losses["bf16"][0]
    # same data and init: the two recipes stay close over a few steps (bf16 activations vs autocast)
    assert abs(losses["bf16"][-1] - losses["fp32"][-1]) < 0.05 * losses["fp32"][-1], losses
