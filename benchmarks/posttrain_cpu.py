"""Post-training on CPU, end to end: pre-train -> SFT on the generated calculator set -> GRPO RL on `calculator`.

    python benchmarks/posttrain_cpu.py --out /tmp/posttrain                 # the `tiny` preset
    python benchmarks/posttrain_cpu.py --out /tmp/posttrain --micro         # a 4-layer d=64 model (loaded CPUs)

The same as the CLI pipeline
    k3 train --steps N --stages 256:1 --out RUN/pt
    k3 sft   --ckpt RUN/pt --tasks calculator --out RUN/sft
    k3 rl    --ckpt RUN/sft --env calculator --eval-prompts 32 --out RUN/rl
driven through the library (so --micro can override the model shape, which `k3 train` has no flag for).
Prints a JSON summary (greedy reward on held-out prompts before / after RL, the per-step reward curve, rollout and
training tokens per second, wall times, the 1-minute load average) and writes it to RUN/summary.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


MICRO = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=4,
             num_experts_per_token=2, moe_intermediate_size=64, routed_expert_hidden_size=64, intermediate_size=192,
             attn_res_block_size=2, kda_gate_low_rank=16,
             linear_attn_config=dict(num_heads=2, head_dim=32, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                     full_attn_layers=[4], kda_layers=[1, 2, 3]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/posttrain_cpu")
    p.add_argument("--micro", action="store_true", help="a 4-layer d=64 model instead of `tiny`")
    p.add_argument("--pt-steps", type=int, default=40)
    p.add_argument("--sft-steps", type=int, default=80)
    p.add_argument("--sft-per-task", type=int, default=400)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--rl-steps", type=int, default=15)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--rl-lr", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=0.7, help="RL sampling temperature")
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128, help="RL: tokens per assistant turn")
    p.add_argument("--calc-terms", type=int, default=2, help="calculator env: operands per expression (2..N)")
    p.add_argument("--calc-digits", type=int, default=2, help="calculator env: digits per operand")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-done", action="store_true", help="reuse finished stages found in --out")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("k3.checkpoint").setLevel(logging.WARNING)
    from k3.rl.trainer import RLConfig, RLRunner
    from k3.train.config import TrainConfig
    from k3.train.trainer import Trainer
    out = a.out
    os.makedirs(out, exist_ok=True)
    res = {"model": "micro (d=64, 4 layers)" if a.micro else "tiny", "load_avg_start": os.getloadavg()[0],
           "argv": sys.argv[1:]}
    env_options = {"terms": a.calc_terms, "digits": a.calc_digits}
    common = dict(progress=False, tensorboard=False, samples=False, threads=a.threads, overwrite=True,
                  eval_every=0, val_tokens=2048)

    t0 = time.time()
    pt = os.path.join(out, "pt")
    if not (a.skip_done and os.path.isdir(os.path.join(pt, "final"))):
        cfg = TrainConfig(preset="tiny", out_dir=pt, steps=a.pt_steps, stages=[(256, 1.0)], tokens_per_step=2048,
                          model_overrides=dict(MICRO) if a.micro else {}, **common)
        s = Trainer(cfg).train()
        res["pretrain"] = {k: s.get(k) for k in ("val_loss_before", "val_loss_after", "tokens_per_s", "step")}
    res["pretrain_s"] = time.time() - t0

    t0 = time.time()
    sft = os.path.join(out, "sft")
    sft_done = a.skip_done and os.path.isdir(os.path.join(sft, "final"))
    if sft_done:
        with open(os.path.join(sft, "train_config.json")) as f:
            done_steps = json.load(f)["steps"]
        sft_done = done_steps >= a.sft_steps
    if not sft_done:
        from k3.rl.sft_data import SFTData, SFTLoader, SFTValLoader, builtin_sft_set, encode_chat

        def calculator_sft(tok, seq_len, batch_size, seed):
            # the generated calculator set with this run's env options: Trainer's external-loader interface
            opts = {"calculator": env_options}
            train = builtin_sft_set(a.sft_per_task, ["calculator"], seed=0, env_options=opts)
            val = builtin_sft_set(32, ["calculator"], seed=1, env_options=opts)
            venc = [encode_chat(c, tok) for c in val]
            return SFTData(tok, SFTLoader(train, tok, seq_len, batch_size, seed=seed),
                           SFTValLoader(venc, seq_len, batch_size, tok.pad_id), len(train), len(val))
        cfg = TrainConfig(task="sft", init_from=os.path.join(pt, "final"), out_dir=sft, steps=a.sft_steps,
                          stages=[(640, 1.0)], tokens_per_step=2560, lr=a.sft_lr, sft_tasks=["calculator"],
                          sft_per_task=a.sft_per_task, recall_examples=0, **common)
        if a.skip_done and os.path.isdir(os.path.join(sft, "checkpoints")):
            # a shorter SFT run is there: continue it to --sft-steps (exact resume, the LR schedule re-timed)
            from k3.train.config import resume_config
            cfg = resume_config(sft, {"steps": a.sft_steps, "threads": a.threads})
        s = Trainer(cfg, data=calculator_sft).train()
        res["sft"] = {k: s.get(k) for k in ("val_loss_before", "val_loss_after", "tokens_per_s", "step")}
    res["sft_s"] = time.time() - t0

    t0 = time.time()
    rc = RLConfig(ckpt=os.path.join(sft, "final"), env="calculator", env_options=env_options,
                  out_dir=os.path.join(out, "rl"),
                  steps=a.rl_steps, group_size=a.group_size, prompts_per_step=a.prompts_per_step, lr=a.rl_lr,
                  temperature=a.temperature,
                  max_turns=3, max_new_tokens_per_turn=a.max_new_tokens, max_tokens=1024, eval_prompts=a.eval_prompts,
                  threads=a.threads, overwrite=True)
    s = RLRunner(rc).run()
    res["rl_s"] = time.time() - t0
    res["rl"] = {k: s.get(k) for k in ("eval_reward_start", "eval_reward_end", "reward_curve",
                                       "rollout_tokens_per_s", "train_tokens_per_s", "status")}
    res["load_avg_end"] = os.getloadavg()[0]
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
