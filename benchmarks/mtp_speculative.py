"""MTP self-speculative decoding: acceptance rate and speed against plain greedy decoding (JSON).

Trains a model with MTP blocks (`num_nextn_predict_layers`, loss = main + lambda * mean MTP) on the built-in corpus
with the k3 trainer (or loads a checkpoint with --ckpt), then decodes --prompts validation-text prompts greedily
twice: `k3.generate(...)` and `k3.generate(..., speculative="mtp")`. Reports per method tokens/s (best of --repeats,
alternating), the MTP acceptance rate (accepted drafts / drafted), tokens per verify round, and whether every
output is identical (exact_match; speculative decoding must equal greedy decoding).

CPU (~6 min on 2 loaded cores with the 1.45M-parameter `micro` model, 100 steps x 2048 tokens; ~14 min with
`--preset tiny`, the RESULTS row):
    python benchmarks/mtp_speculative.py --threads 1 --json mtp_cpu.json
    python benchmarks/mtp_speculative.py --preset tiny --threads 1 --json mtp_tiny_cpu.json
H200 (the `small` preset, ~150 s: gpu_run.sh stage `mtp`; fp32 decoding for the exact-match check, bf16 argmax
near-ties can differ between a 2-token verify and a 1-token step, so exact_match may be False in bf16; our KDA kernels
because fla's first backward at this shape autotunes for minutes on a fresh machine):
    K3_BACKEND=kda:triton,attnres:torch python benchmarks/mtp_speculative.py --device cuda --preset small \\
        --steps 40 --batch-tokens 8192 --seq-len 1024 --lr 3e-3 --new-tokens 64 --prompts 4 --repeats 1 \\
        --compile none --dtype float32 --plain-static off --json mtp_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

import k3

# a ~1M-parameter variant of `tiny` (4 layers, d=128, 8 experts) that learns something in a few CPU minutes
MICRO = dict(hidden_size=128, num_hidden_layers=4, vocab_size=2048, bos_token_id=1792, eos_token_id=1794,
             pad_token_id=2047, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
             q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=64,
             routed_expert_hidden_size=64, kda_gate_low_rank=16, attn_res_block_size=2,
             **{"linear_attn_config.num_heads": 4, "linear_attn_config.head_dim": 16,
                "linear_attn_config.full_attn_layers": [4], "linear_attn_config.kda_layers": [1, 2, 3]})


def train(args, out_dir: str):
    from k3.train.trainer import TrainConfig, Trainer
    overrides = dict(MICRO) if args.preset == "micro" else {}
    overrides.update(num_nextn_predict_layers=args.mtp, mtp_loss_weight=args.mtp_weight)
    cfg = TrainConfig(out_dir=out_dir, preset="tiny" if args.preset == "micro" else args.preset,
                      model_overrides=overrides, steps=args.steps, tokens_per_step=args.batch_tokens,
                      stages=[(args.seq_len, 1.0)], lr=args.lr, progress=False, tensorboard=False, samples=False,
                      plot=False, seed=0, device=args.device, eval_every=0, recall_examples=0,
                      compile=args.compile)
    t0 = time.time()
    summary = Trainer(cfg).train()
    return os.path.join(out_dir, "final"), {"train_seconds": time.time() - t0, "steps": args.steps,
                                            "val_loss": summary.get("val_loss_after"),
                                            "status": summary.get("status")}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="micro", help="micro (built in here), tiny, small, ... [micro]")
    p.add_argument("--ckpt", default=None, help="a trained checkpoint with MTP blocks (skips training)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="decoding dtype (float32 / bfloat16)")
    p.add_argument("--mtp", type=int, default=1, help="num_nextn_predict_layers [1]")
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--compile", default="auto", choices=["auto", "none", "modules", "layers", "model"],
                   help="training: k3 train's --compile [auto: modules on CUDA]")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--plain-static", choices=["auto", "off"], default="auto",
                   help="plain greedy baseline: generate's default decode (auto: the static / CUDA-graph step on "
                        "CUDA) or the module forward (off, the path speculative decoding uses)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    res: dict = {"config": vars(args), "host": platform.node(), "torch": torch.__version__}
    tmp = None
    if args.ckpt is None:
        tmp = tempfile.mkdtemp(prefix="k3-mtp-bench-")
        ckpt, res["train"] = train(args, tmp)
    else:
        ckpt = args.ckpt
    from k3.checkpoint import from_pretrained
    model = from_pretrained(ckpt, device=device, dtype=args.dtype).eval()
    if model.mtp is None:
        raise SystemExit(f"{ckpt}: the model has no MTP blocks (num_nextn_predict_layers = 0)")
    from k3.train.data import HFTokenizer, load_corpus
    tok = HFTokenizer.from_pretrained(ckpt)
    _, val = load_corpus()
    prompts = []
    for doc in val:
        ids = tok.encode(doc)
        if len(ids) >= args.prompt_tokens:
            prompts.append(ids[:args.prompt_tokens])
        if len(prompts) == args.prompts:
            break
    plain_t = [float("inf")] * len(prompts)
    spec_t = [float("inf")] * len(prompts)
    exact, stats = True, []
    for r in range(args.repeats):
        for i, pr in enumerate(prompts):
            ids = torch.tensor([pr], device=device)
            sync(device)
            t0 = time.perf_counter()
            ref = k3.generate(model, ids, args.new_tokens, stop_token_ids=[],
                              static=None if args.plain_static == "auto" else False)
            sync(device)
            plain_t[i] = min(plain_t[i], time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = k3.generate(model, ids, args.new_tokens, stop_token_ids=[], speculative="mtp", return_dict=True)
            sync(device)
            spec_t[i] = min(spec_t[i], time.perf_counter() - t0)
            exact = exact and torch.equal(out.sequences, ref)
            if r == 0:
                stats.append(out.speculative)
                if i == 0:   # what the model writes (a weak model's greedy text repeats: easy to draft)
                    res["sample_text"] = tok.decode(out.new_tokens[0])
    n_new = args.new_tokens * len(prompts)
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    rounds = sum(s["rounds"] for s in stats)
    res.update({
        "model_parameters": model.num_parameters(), "num_nextn_predict_layers": len(model.mtp),
        "prompts": len(prompts), "new_tokens_per_prompt": args.new_tokens,
        "exact_match": bool(exact),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_verify_round": (n_new - len(prompts)) / rounds if rounds else 0.0,
        "rollback_rate": sum(s["rollbacks"] for s in stats) / rounds if rounds else 0.0,
        "plain_tokens_per_s": n_new / sum(plain_t), "speculative_tokens_per_s": n_new / sum(spec_t),
    })
    res["speedup"] = res["speculative_tokens_per_s"] / res["plain_tokens_per_s"]
    text = json.dumps(res, indent=2, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
