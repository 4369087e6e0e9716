r"""Post-training end to end: pre-train -> SFT on the generated calculator set -> GRPO RL on `calculator`.

    python benchmarks/posttrain_cpu.py --micro --threads 1 --out /tmp/posttrain --plot benchmarks/posttrain_cpu.png
    python benchmarks/posttrain_cpu.py --preset tiny --out /tmp/posttrain              # the `tiny` preset (slower)
    python benchmarks/posttrain_cpu.py --device cuda --preset small --throughput --out /tmp/pt_gpu
                                                     # rollout / training tokens per second on one GPU (no eval)

The same as the CLI pipeline
    k3 train --steps N --stages 256:1 --out RUN/pt
    k3 sft   --ckpt RUN/pt --tasks calculator --out RUN/sft
    k3 rl    --ckpt RUN/sft --env calculator --env-option terms=2 --env-option digits=1 --env-option given_call=true \
             --steps 60 --prompts-per-step 8 --lr 3e-5 --param-lr '^model\.norm\.=0.1' --warmup-steps 3 \
             --skip-uniform-groups --max-turns 3 --eval-prompts 256 --eval-samples 4 --out RUN/rl
driven through the library (so --micro can override the model shape, which `k3 train` has no flag for).

The task is the calculator at the easy end of its curriculum (`--calc-terms 2 --calc-digits 1`: "What is 7 * 8?").
By default the prompt already holds the correct call and its result (`--calc-given-call`, the first curriculum
level: the policy only answers); `--no-calc-given-call` is the full task (the policy writes the call). The expert
conversations of both are the same tokens, so one SFT run serves both (`--skip-done` reuses it).
RL (AdamW over every parameter, linear warmup then constant LR, groups without a reward spread skipped) is measured
on `--eval-prompts` held-out prompts, the same prompts before and after: the greedy reward and (`--eval-samples K`)
the sampled reward (K samples per prompt at --temperature, the same sampler seeds before and after), the quantity
GRPO optimises; the paired differences and their standard errors (`eval_delta`, `eval_sampled_delta`, `..._stderr`,
`..._z`) say whether RL moved them.

The default recipe (measured 2026-12-02 on the micro model, SFT reused from --out with --skip-done):

    python benchmarks/posttrain_cpu.py --micro --threads 1 --skip-done --out RUN --plot benchmarks/posttrain_cpu.png

= 60 RL steps x 8 prompts x 8 samples, AdamW on the whole model at --rl-lr 3e-5, the final RMSNorm (64 weights,
the output's scale) at --rl-norm-lr 0.1 (k3 rl --param-lr '^model\.norm\.=0.1'), warm-up 3 steps. Held-out
(256 prompts): sampled reward 0.410 -> 0.745 (paired +0.335 +- 0.019, z 17.3), greedy 0.734 -> 0.766 (+0.031 +-
0.011, z 2.9); RL stage 468 s with its four evals (1 thread, 2 shared cores, load 2-4.6).

Why two learning rates: one LR for everything fails on this SFT'd micro model. The SFT policy's answer token is
spread (entropy ~2 nats, teacher-forced probability of the correct answer 0.40 at T=1, greedy reward 0.73), and
the reward-improving move that survives the gradient noise of 8 prompts per step is sharpening it, which needs the
final norm to move by ~0.1 per step; the body tolerates only tiny steps (a step of norm <= ~0.03 along the GRPO
gradient raises the held-out expected reward, 0.3 lowers it by 0.24). Measured at 20 steps (sampled, paired):
AdamW on everything at 1e-5 +0.003 +- 0.004, 3e-5 -0.006 +- 0.006, 1e-4..1e-3 flat or collapsing; successes only
(--neg-adv-scale 0) at 3e-4 +0.005 +- 0.008, at 1e-3 -0.034 +- 0.011; SGD (step norm <= 0.05) +0.01..0.025 in
teacher-forced p(correct); Muon (the pre-training optimizer, 1e-3) -0.02. The control, only the final norm trained
(`--train-params '^model\.norm\.'`, same 60 steps, 257 s): sampled 0.410 -> 0.731 (+0.321 +- 0.019), greedy
0.734 -> 0.766 (the same): nearly all of the gain is the final norm's; the body at 3e-5 adds +0.014 sampled (within
noise) and costs the full backward. After ~35 steps many groups are uniform (all right or all wrong): the policy is
nearly greedy and GRPO's signal fades, so the reward settles near the greedy one.

Prints a JSON summary (greedy reward on held-out prompts before / after RL with standard errors, the per-step
sampled reward curve, rollout and training tokens per second, wall times, the 1-minute load average) and writes it
to RUN/summary.json; `--plot PATH` also writes the reward curve (sampled reward per step, greedy eval +- 2 s.e.).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import sys
import time


MICRO = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=4,
             num_experts_per_token=2, moe_intermediate_size=64, routed_expert_hidden_size=64, intermediate_size=192,
             attn_res_block_size=2, kda_gate_low_rank=16,
             linear_attn_config=dict(num_heads=2, head_dim=32, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                     full_attn_layers=[4], kda_layers=[1, 2, 3]))


# --throughput: an untrained policy earns reward 0 everywhere, so uniform groups are kept (trained on) to time training
# (no SFT stage: RL starts from the pre-trained checkpoint; the pre-training checkpoints are removed, only final/ is
# kept, so `small` fits the disk: fp32 RL state of 1.45B parameters is ~23 GB)
THROUGHPUT = dict(pt_steps=3, sft_steps=0, rl_steps=3, eval_prompts=0, prompts_per_step=8, group_size=8,
                  keep_uniform_groups=True, calc_given_call=False)


def plot_curve(summary: dict, path: str) -> None:
    """Sampled train reward per RL step (mean +- s.e. over the step's rollouts) and the greedy eval before /
    after (+- 2 s.e.)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rl = summary["rl"]
    ys = rl["reward_curve"]
    se = rl.get("reward_stderr_curve") or [0.0] * len(ys)
    xs = list(range(1, len(ys) + 1))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(xs, ys, "o-", ms=3, label="sampled reward (train rollouts, T=%g)" % summary["temperature"])
    ax.fill_between(xs, [y - e for y, e in zip(ys, se)], [y + e for y, e in zip(ys, se)], alpha=0.2)
    w = 5
    if len(ys) >= 2 * w:
        ma = [sum(ys[i - w + 1:i + 1]) / w for i in range(w - 1, len(ys))]
        ax.plot(xs[w - 1:], ma, "-", color="tab:blue", lw=2.5, alpha=0.6, label=f"its {w}-step moving mean")
    if rl.get("eval_reward_start") is not None and rl.get("eval_reward_end") is not None:
        ax.errorbar([0, len(ys)], [rl["eval_reward_start"], rl["eval_reward_end"]],
                    yerr=[2 * (rl.get("eval_stderr_start") or 0), 2 * (rl.get("eval_stderr_end") or 0)],
                    fmt="s", color="k", capsize=4,
                    label=f"greedy eval, {rl['eval_prompts']} held-out prompts (+-2 s.e.)")
    if rl.get("eval_sampled_start") is not None and rl.get("eval_sampled_end") is not None:
        ax.errorbar([0, len(ys)], [rl["eval_sampled_start"], rl["eval_sampled_end"]],
                    yerr=[2 * (rl.get("eval_sampled_stderr_start") or 0), 2 * (rl.get("eval_sampled_stderr_end") or 0)],
                    fmt="D", color="tab:red", capsize=4,
                    label=f"sampled eval, {rl['eval_samples']} x {rl['eval_prompts']} held-out (+-2 s.e.)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward (exact match)")
    ax.set_ylim(0, 1)
    argv = summary.get("argv") or []
    tp = argv[argv.index("--train-params") + 1] if "--train-params" in argv[:-1] else None
    rec = summary.get("rl_recipe") or {}
    how = (f"training only {tp}" if tp else "whole model" + (
        f", AdamW lr {rec.get('lr'):g}" if rec.get("lr") else "")) + "".join(
        f", {rx} lr {v:g}" for rx, v in (rec.get("param_lrs") or {}).items())
    ax.set_title(f"calculator: SFT -> GRPO, {summary['model']} on {summary['device']}\n{how}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/posttrain_cpu")
    p.add_argument("--preset", default="tiny", help="model preset (tiny, small, ...) [tiny]")
    p.add_argument("--micro", action="store_true", help="a 4-layer d=64 model (the tiny preset, shrunk)")
    p.add_argument("--device", default="cpu", help="cpu | cuda [cpu]")
    p.add_argument("--throughput", action="store_true",
                   help="only measure tokens/s: " + ", ".join(
                       (f"--no-{k.replace('_', '-')}" if v is False else f"--{k.replace('_', '-')}")
                       + ("" if isinstance(v, bool) else f" {v}") for k, v in THROUGHPUT.items()))
    p.add_argument("--pt-steps", type=int, default=40)
    p.add_argument("--sft-steps", type=int, default=220, help="0: no SFT stage (RL from the pre-trained model)")
    p.add_argument("--sft-per-task", type=int, default=800)
    p.add_argument("--sft-lr", type=float, default=6e-3)
    p.add_argument("--rl-steps", type=int, default=60, help="0: stop after SFT [60]")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--rl-lr", type=float, default=3e-5,
                   help="RL AdamW learning rate of every parameter but the final norm's (constant after warm-up)")
    p.add_argument("--rl-norm-lr", type=float, default=0.1,
                   help="RL AdamW learning rate of the final RMSNorm (model.norm.*, the output's scale); 0: --rl-lr")
    p.add_argument("--rl-warmup", type=int, default=3, help="RL linear LR warmup steps")
    p.add_argument("--train-params", default=None, metavar="REGEX",
                   help="RL: train only the parameters whose name matches (e.g. '^model\\.norm\\.'), freeze the rest")
    p.add_argument("--rl-param-lr", action="append", default=None, metavar="REGEX=LR",
                   help="RL: parameters whose name matches REGEX get LR instead of --rl-lr (repeatable)")
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--neg-adv-scale", type=float, default=1.0, help="RL: scale of negative advantages")
    p.add_argument("--keep-uniform-groups", action="store_true",
                   help="also train on groups whose rewards are all equal (advantage 0: compute, no gradient)")
    p.add_argument("--epochs", type=int, default=1, help="RL optimizer steps per batch")
    p.add_argument("--temperature", type=float, default=1.0, help="RL sampling temperature")
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--eval-samples", type=int, default=4,
                   help="also the sampled reward on the eval prompts: this many samples per prompt at --temperature "
                        "(the same sampler seeds before and after: a paired difference); 0 = greedy only")
    p.add_argument("--max-new-tokens", type=int, default=64, help="RL: tokens per assistant turn")
    p.add_argument("--calc-terms", type=int, default=2, help="calculator env: operands per expression (2..N)")
    p.add_argument("--calc-digits", type=int, default=1, help="calculator env: digits per operand")
    p.add_argument("--calc-given-call", action=argparse.BooleanOptionalAction, default=True,
                   help="calculator env, first curriculum level: the prompt holds the correct call and its result, "
                        "the policy only answers (the SFT conversations are the same tokens); --no-calc-given-call: "
                        "the full task (the policy writes the call)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--plot", default=None, help="also write the reward curve PNG here")
    p.add_argument("--skip-done", action="store_true", help="reuse finished stages found in --out")
    a = p.parse_args(argv)
    if a.throughput:
        given = {x.split("=")[0] for x in (argv if argv is not None else sys.argv[1:])}
        for k, v in THROUGHPUT.items():
            if not {f"--{k.replace('_', '-')}", f"--no-{k.replace('_', '-')}"} & given:
                setattr(a, k, v)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("k3.checkpoint").setLevel(logging.WARNING)
    import torch
    from k3.rl.trainer import RLConfig, RLRunner
    from k3.train.config import TrainConfig
    from k3.train.trainer import Trainer
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    out = a.out
    os.makedirs(out, exist_ok=True)
    model_name = "micro (d=64, 4 layers)" if a.micro else a.preset
    res = {"model": model_name, "device": a.device, "threads": a.threads, "temperature": a.temperature,
           "env_options": {"terms": a.calc_terms, "digits": a.calc_digits, "given_call": a.calc_given_call},
           "load_avg_start": os.getloadavg()[0], "argv": sys.argv[1:] if argv is None else list(argv)}
    if a.device.startswith("cuda"):
        res["gpu"] = torch.cuda.get_device_name()
    env_options = {"terms": a.calc_terms, "digits": a.calc_digits}
    if a.calc_given_call:
        env_options["given_call"] = True
    common = dict(progress=False, tensorboard=False, samples=False, threads=a.threads, overwrite=True,
                  eval_every=0, val_tokens=2048, device=a.device, compile="none")

    def done(stage, steps):
        d = os.path.join(out, stage)
        if not (a.skip_done and os.path.isdir(os.path.join(d, "final"))):
            return False
        with open(os.path.join(d, "train_config.json")) as f:
            return json.load(f)["steps"] >= steps

    t0 = time.time()
    pt = os.path.join(out, "pt")
    if not done("pt", a.pt_steps):
        cfg = TrainConfig(preset=a.preset, out_dir=pt, steps=a.pt_steps, stages=[(256, 1.0)], tokens_per_step=2048,
                          model_overrides=dict(MICRO) if a.micro else {}, **common)
        s = Trainer(cfg).train()
        res["pretrain"] = {k: s.get(k) for k in ("val_loss_before", "val_loss_after", "tokens_per_s", "step")}
        if a.throughput:
            shutil.rmtree(os.path.join(pt, "checkpoints"), ignore_errors=True)
    res["pretrain_s"] = time.time() - t0

    t0 = time.time()
    sft = os.path.join(out, "sft") if a.sft_steps > 0 else pt      # --sft-steps 0: RL from the pre-trained model
    if a.sft_steps > 0 and not done("sft", a.sft_steps):
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
        s = Trainer(cfg, data=calculator_sft).train()
        res["sft"] = {k: s.get(k) for k in ("val_loss_before", "val_loss_after", "tokens_per_s", "step")}
    res["sft_s"] = time.time() - t0
    if a.rl_steps <= 0:   # pre-training + SFT only: a shared start for RL variants (their --out holds links to it)
        return write_summary(out, res)

    t0 = time.time()
    rl_dir = os.path.join(out, "rl")
    param_lrs = {}
    for item in a.rl_param_lr or []:                         # the first matching regex wins: these first
        rx, _, v = item.rpartition("=")
        param_lrs[rx] = float(v)
    if a.rl_norm_lr > 0 and (a.train_params is None or re.search(a.train_params, "model.norm.weight")):
        param_lrs.setdefault(r"^model\.norm\.", a.rl_norm_lr)
    param_lrs = param_lrs or None
    rc = RLConfig(ckpt=os.path.join(sft, "final"), env="calculator", env_options=env_options, out_dir=rl_dir,
                  steps=a.rl_steps, group_size=a.group_size, prompts_per_step=a.prompts_per_step, lr=a.rl_lr,
                  warmup_steps=a.rl_warmup, train_params=a.train_params, param_lrs=param_lrs,
                  neg_adv_scale=a.neg_adv_scale, kl_coef=a.kl_coef, epochs=a.epochs,
                  temperature=a.temperature, max_turns=3,
                  max_new_tokens_per_turn=a.max_new_tokens, max_tokens=1024, eval_prompts=a.eval_prompts,
                  eval_samples=a.eval_samples,
                  skip_uniform_groups=not a.keep_uniform_groups, device=a.device, threads=a.threads,
                  overwrite=True)
    res["rl_recipe"] = {"lr": a.rl_lr, "param_lrs": param_lrs, "warmup": a.rl_warmup, "steps": a.rl_steps,
                        "prompts_per_step": a.prompts_per_step, "group_size": a.group_size,
                        "train_params": a.train_params}
    s = RLRunner(rc).run()
    res["rl_s"] = time.time() - t0
    res["rl"] = {k: s.get(k) for k in ("eval_reward_start", "eval_reward_end", "eval_stderr_start",
                                       "eval_stderr_end", "eval_delta", "eval_delta_stderr", "eval_prompts",
                                       "eval_samples", "eval_sampled_start", "eval_sampled_end",
                                       "eval_sampled_stderr_start", "eval_sampled_stderr_end",
                                       "eval_sampled_delta", "eval_sampled_delta_stderr",
                                       "reward_curve", "rollout_tokens_per_s", "train_tokens_per_s", "status")}
    with open(os.path.join(rl_dir, "metrics.jsonl")) as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    res["rl"]["reward_stderr_curve"] = [(r["reward_std"] or 0.0) / math.sqrt(max(r["trajectories"], 1))
                                        for r in rows]
    res["rl"]["rollout_s"] = sum(r["rollout_s"] for r in rows)
    res["rl"]["train_s"] = sum(r["train_s"] for r in rows)
    res["rl"]["generated_tokens"] = sum(r["generated_tokens"] for r in rows)
    res["rl"]["trained_tokens"] = sum(r.get("packed_tokens") or 0 for r in rows)
    if a.device.startswith("cuda"):
        res["max_memory_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
    for k in ("eval_delta", "eval_sampled_delta"):
        if res["rl"].get(k + "_stderr"):
            res["rl"][k + "_z"] = res["rl"][k] / res["rl"][k + "_stderr"]
    res["load_avg_end"] = os.getloadavg()[0]
    if a.plot:
        try:
            plot_curve(res, a.plot)
        except ImportError:
            logging.warning("matplotlib is not installed: no plot")
        else:
            shutil.copyfile(a.plot, os.path.join(out, "curve.png")) if os.path.abspath(a.plot) != os.path.abspath(
                os.path.join(out, "curve.png")) else None
    return write_summary(out, res)


def write_summary(out: str, res: dict) -> int:
    """RUN/summary.json and the same JSON on stdout; the exit code."""
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
