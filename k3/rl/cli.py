"""`k3 rl`: GRPO-family RL of a checkpoint on a built-in (or registered) environment. See k3/rl/trainer.py."""
from __future__ import annotations

import argparse
import json
import logging

from k3.flags import finite_float, int_at_least
from k3.rl.trainer import RLConfig

# flag dest -> RLConfig field (flags default to None so --resume can tell which were given)
_FIELDS = {
    "ckpt": "ckpt", "env": "env", "out": "out_dir", "steps": "steps", "group_size": "group_size",
    "prompts_per_step": "prompts_per_step", "lr": "lr", "warmup_steps": "warmup_steps",
    "weight_decay": "weight_decay", "train_params": "train_params", "eval_samples": "eval_samples",
    "grad_clip": "max_grad_norm",
    "epochs": "epochs", "kl_coef": "kl_coef", "neg_adv_scale": "neg_adv_scale", "clip_low": "clip_low",
    "clip_high": "clip_high", "tis_cap": "tis_cap", "train_dtype": "train_dtype",
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_turns": "max_turns",
    "max_tokens": "max_tokens", "max_new_tokens": "max_new_tokens_per_turn", "iteration_budget": "iteration_budget",
    "thinking": "thinking", "no_replay": "replay", "no_std_norm": "normalize_std", "seed": "seed",
    "skip_uniform_groups": "skip_uniform_groups",
    "seed_offset": "seed_offset", "filter_rules": "filter_rules", "review_every": "review_every",
    "review_timeout": "review_timeout", "eval_prompts": "eval_prompts", "save_every": "save_every", "keep": "keep",
    "device": "device", "threads": "threads", "no_plot": "plot", "overwrite": "overwrite", "stop_at": "stop_at",
}
_NEGATED = {"no_replay", "no_std_norm", "no_plot"}


def _env_option(text: str):
    key, sep, val = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(val)
    except ValueError:
        return key, val


def _param_lr(text: str):
    rx, sep, val = text.rpartition("=")
    if not sep or not rx:
        raise argparse.ArgumentTypeError(f"expected REGEX=LR, got {text!r}")
    try:
        lr = finite_float(0, lo_open=True)(val)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return rx, lr


def add_parser(subparsers) -> argparse.ArgumentParser:
    d = RLConfig()
    s = subparsers.add_parser(
        "rl", help="GRPO RL with tools on a built-in environment (calculator, kv-lookup, multi-tool)",
        description="Reinforcement learning of a trained checkpoint (usually after k3 sft): groups of sampled, "
                    "multi-turn tool-use rollouts through k3.generate, group-normalised advantages, clipped "
                    "token-level policy loss, truncated importance sampling, optional KL to the start model, "
                    "routing replay; output filter, reward audit log and human-review gate.",
        epilog="Outputs in --out: metrics.jsonl (step, reward_mean, reward_std, kl, entropy, clip_frac, "
               "rollout/train tokens per second, ...), audit.jsonl, eval.jsonl, rewards.png, checkpoints/step-N/, "
               "final/, review/ (with --review-every). Ctrl-C saves a checkpoint; continue with --resume.")
    a = s.add_argument
    a("--ckpt", default=None, help="the policy: a checkpoint dir, a run's final/, or a run dir (required)")
    a("--env", default=None, help=f"environment name [{d.env}]")
    a("--env-option", dest="env_options", action="append", type=_env_option, default=None, metavar="KEY=VALUE",
      help="environment constructor option (JSON value), repeatable")
    a("--out", default=None, help=f"run directory [{d.out_dir}]")
    a("--steps", type=int_at_least(1), default=None, help=f"RL steps [{d.steps}]")
    a("--group-size", type=int_at_least(1), default=None, help=f"samples per prompt (G) [{d.group_size}]")
    a("--prompts-per-step", type=int_at_least(1), default=None, help=f"prompts per step [{d.prompts_per_step}]")
    a("--lr", type=finite_float(0, lo_open=True), default=None, help=f"AdamW learning rate [{d.lr}]")
    a("--warmup-steps", type=int_at_least(0), default=None, help=f"linear LR warmup, RL steps [{d.warmup_steps}]")
    a("--weight-decay", type=finite_float(0), default=None, help=f"[{d.weight_decay}]")
    a("--train-params", default=None, metavar="REGEX",
      help="train only the parameters whose name matches REGEX (re.search), freeze the rest [all]")
    a("--param-lr", dest="param_lrs", action="append", type=_param_lr, default=None, metavar="REGEX=LR",
      help="parameters whose name matches REGEX (re.search; the first --param-lr that matches) get this LR "
           "instead of --lr, e.g. '^model\\.norm\\.=0.1'; repeatable")
    a("--grad-clip", type=finite_float(0), default=None, help=f"gradient-norm clip, 0 = off [{d.max_grad_norm}]")
    a("--epochs", type=int_at_least(1), default=None, help=f"optimizer steps per batch [{d.epochs}]")
    a("--train-dtype", choices=["auto", "fp32", "bf16"], default=None,
      help="training forwards under bf16 autocast (fp32 weights, optimizer and log-probs) or fp32; auto: bf16 on "
           f"CUDA, fp32 elsewhere [{d.train_dtype}]")
    a("--kl-coef", type=finite_float(0), default=None, help=f"KL to the --ckpt model, 0 = off [{d.kl_coef}]")
    a("--neg-adv-scale", type=finite_float(0, 1), default=None,
      help=f"multiply negative advantages by this; 0 learns from successes only [{d.neg_adv_scale}]")
    a("--clip-low", type=finite_float(0, 1), default=None, help=f"ratio clip below 1 - eps [{d.clip_low}]")
    a("--clip-high", type=finite_float(0), default=None, help=f"ratio clip above 1 + eps [{d.clip_high}]")
    a("--tis-cap", type=finite_float(0), default=None,
      help=f"truncated importance sampling cap, 0 = off [{d.tis_cap}]")
    a("--no-std-norm", action="store_true", default=None, help="advantages r - mean (no division by the std)")
    a("--skip-uniform-groups", action="store_true", default=None,
      help="train only on groups whose rewards differ (equal rewards: advantage 0, no policy gradient) [off]")
    a("--temperature", type=finite_float(0, lo_open=True), default=None, help=f"sampling temperature [{d.temperature}]")
    a("--top-p", type=finite_float(0, 1, lo_open=True), default=None, help=f"[{d.top_p}]")
    a("--top-k", type=int_at_least(0), default=None, help=f"0 = off [{d.top_k}]")
    a("--max-turns", type=int_at_least(1), default=None, help=f"assistant turns per trajectory [{d.max_turns}]")
    a("--max-tokens", type=int_at_least(1), default=None, help=f"token budget per trajectory [{d.max_tokens}]")
    a("--max-new-tokens", type=int_at_least(1), default=None,
      help=f"tokens per assistant turn [{d.max_new_tokens_per_turn}]")
    a("--iteration-budget", type=int_at_least(1), default=None,
      help="generated tokens per trajectory per step: longer ones pause and resume next step [off]")
    a("--thinking", action="store_true", default=None, help="thinking-mode chat template")
    a("--no-replay", action="store_true", default=None, help="route live in the training forward (no replay)")
    a("--seed", type=int, default=None, help=f"[{d.seed}]")
    a("--seed-offset", type=int_at_least(0), default=None, help=f"first prompt seed [{d.seed_offset}]")
    a("--filter-rules", default=None, help="output-filter rules (JSON file, see k3.rl.safety)")
    a("--review-every", type=int_at_least(0), default=None,
      help="every N steps write RUN/review/step-N.jsonl and wait for step-N.approved / .rejected [off]")
    a("--review-timeout", type=finite_float(0), default=None, help=f"seconds to wait for a review [{d.review_timeout}]")
    a("--eval-prompts", type=int_at_least(0), default=None,
      help="greedy reward on this many held-out prompts at the start and the end [0 = off]")
    a("--eval-samples", type=int_at_least(0), default=None,
      help="with --eval-prompts: also the sampled reward, N samples per prompt at --temperature [0 = off]")
    a("--save-every", type=int_at_least(0), default=None, help="checkpoint every N steps; 0 = at the end [0]")
    a("--keep", type=int_at_least(1), default=None, help=f"checkpoints to keep [{d.keep}]")
    a("--stop-at", type=int_at_least(1), default=None, help="stop (with a checkpoint) after this step")
    a("--device", default=None, help="auto | cpu | cuda[:N] [auto]")
    a("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    a("--no-plot", action="store_true", default=None, help="no rewards.png")
    a("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    a("--overwrite", action="store_true", default=None, help="replace a run in --out")
    a("--json", action="store_true", help="print the summary as JSON")
    s.set_defaults(fn=run)
    return s


def build_rl_config(args) -> RLConfig:
    from k3.errors import K3ConfigError
    from k3.rl.trainer import resume_rl_config
    ov = {}
    for dest, fld in _FIELDS.items():
        v = getattr(args, dest, None)
        if v is None:
            continue
        ov[fld] = (not v) if dest in _NEGATED else v
    if getattr(args, "env_options", None):
        ov["env_options"] = dict(args.env_options)
    if getattr(args, "param_lrs", None):
        ov["param_lrs"] = dict(args.param_lrs)
    if args.resume and ov.get("overwrite"):
        raise K3ConfigError("--resume and --overwrite exclude each other (continue the run, or replace it)")
    out_dir = ov.pop("out_dir", RLConfig().out_dir)
    if args.resume:
        cfg = resume_rl_config(out_dir, ov)
    else:
        cfg = RLConfig(out_dir=out_dir, **ov)
    cfg.validate()
    return cfg


def run(args) -> int:
    from k3.rl.trainer import RLRunner
    from k3.train.report import finite_or_none
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("k3.checkpoint").setLevel(logging.WARNING)
    cfg = build_rl_config(args)
    print(f"k3 rl: {cfg.ckpt} on {cfg.env}, {cfg.steps} steps x {cfg.prompts_per_step} prompts x "
          f"{cfg.group_size} samples, out {cfg.out_dir}" + (" (resume)" if cfg.resume else ""), flush=True)
    summary = RLRunner(cfg).run()
    if args.json:
        print(json.dumps(finite_or_none(summary), indent=2, default=str, allow_nan=False))
    else:
        for k in ("status", "step", "reward_first", "reward_last", "eval_reward_start", "eval_reward_end",
                  "eval_sampled_start", "eval_sampled_end", "rollout_tokens_per_s", "train_tokens_per_s",
                  "checkpoint", "final", "plot"):
            v = summary.get(k)
            print(f"{k:22s} {v:.4g}" if isinstance(v, float) else f"{k:22s} {v}")
    return 130 if summary["status"] == "interrupted" else 0
