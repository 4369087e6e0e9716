"""`k3 train`: train a preset (default `tiny`) on the built-in corpus or your files. See k3/train/trainer.py."""
from __future__ import annotations

import argparse
import logging

from k3.flags import finite_float, int_at_least
from k3.train.config import (DEFAULT_STAGES, DEFAULT_STEPS, DEFAULT_TOKENS_PER_STEP, SPIKE_MIN_HISTORY,
                             SPIKE_WINDOW, TrainConfig, format_stages, parse_stages)

# flag dest -> TrainConfig field (all flags default to None so --resume can tell which ones were given)
_FIELDS = {
    "preset": "preset", "config": "config", "steps": "steps", "save_every": "save_every", "out": "out_dir",
    "data": "data", "tokenizer": "tokenizer", "balancer": "balancer", "lr": "lr", "batch_tokens": "tokens_per_step",
    "grad_accum": "grad_accum", "seed": "seed", "device": "device", "activation_checkpointing":
    "activation_checkpointing", "stages": "stages", "keep": "keep", "eval_every": "eval_every",
    "warmup": "warmup_steps", "weight_decay": "weight_decay", "grad_clip": "grad_clip", "stop_at": "stop_at",
    "max_bad_steps": "max_bad_steps", "skip_grad_spikes": "skip_grad_spikes", "val_tokens": "val_tokens",
    "split_sections": "split_sections",
    "threads": "threads", "compile": "compile", "param_dtype": "param_dtype", "no_progress": "progress",
    "no_tensorboard": "tensorboard", "no_samples": "samples", "overwrite": "overwrite", "init": "init_from",
}
_NEGATED = {"no_progress", "no_tensorboard", "no_samples"}
# `k3 sft`: its own flags -> TrainConfig fields (the shared ones as above; --data is the chats.jsonl)
_SFT_FIELDS = dict({k: v for k, v in _FIELDS.items() if k not in ("preset", "config", "data", "split_sections",
                                                                   "stages")},
                   ckpt="init_from", data="sft_data", per_task="sft_per_task", tasks="sft_tasks")
# rows of 2,048 tokens: every built-in task's conversation fits whole (kv-lookup's are ~1,150 tokens), so no answer
# is cut off (a cut conversation is warned about, k3.rl.sft_data.warn_truncation)
SFT_DEFAULTS = dict(task="sft", steps=100, lr=2e-3, tokens_per_step=4096, stages=[(2048, 1.0)], samples=False,
                    out_dir="runs/k3-sft")


def add_parser(subparsers) -> argparse.ArgumentParser:
    d = TrainConfig()
    s = subparsers.add_parser(
        "train", help="train a model (default: `tiny` on the built-in corpus, ~10 min on 2 CPU cores)",
        description="Train a K3 model with Muon+AdamW, staged context extension, checkpoints and exact resume.",
        epilog="Outputs in --out: config.json, train_config.json, metrics.jsonl, checkpoints/step-N/, final/, "
               "loss.png, samples.txt, report.md, tb/, train.lock (while training). Ctrl-C saves a checkpoint; "
               "continue with --resume. An --out that holds a run needs --resume (continue) or --overwrite (replace).")
    a = s.add_argument
    a("--preset", default=None, help=f"model preset [{d.preset}]")
    a("--config", default=None, help="model config.json / checkpoint dir (instead of --preset)")
    a("--steps", type=int_at_least(1), default=None, help=f"total optimizer steps [{DEFAULT_STEPS}]")
    a("--save-every", type=int_at_least(0), default=None, help=f"checkpoint every N steps; 0 = at the end [{d.save_every}]")
    a("--keep", type=int_at_least(1), default=None, help=f"checkpoints to keep [{d.keep}]")
    a("--out", default=None, help=f"run directory [{d.out_dir}]")
    a("--resume", action="store_true",
      help="continue the run in --out from its last checkpoint up to --steps (a stored --stop-at does not apply; "
           "settings the run's numbers depend on, e.g. --preset, --lr, --seed, --batch-tokens, cannot change)")
    a("--overwrite", action="store_true", default=None,
      help="start a new run in an --out that holds one, deleting its checkpoints, metrics and final model")
    a("--stop-at", type=int_at_least(1), default=None, help="stop (with a checkpoint) after this step; resume later")
    a("--init", default=None, help="start from these weights (fresh optimizer): a model or run directory, a released "
                                   "checkpoint, or under torchrun a DCP checkpoint (k3 convert --to dcp)")
    a("--data", nargs="+", default=None, help="corpus .txt/.jsonl files or directories [built-in pydocs corpus]")
    a("--split-sections", action="store_true", default=None, help=".txt files: one document per blank-line section")
    a("--tokenizer", default=None, help="tokenizer.json (or its dir) [BPE trained on the corpus, cached]")
    a("--balancer", default=None, choices=["qb", "qb_hist", "qb_ema", "sign", "aux_loss", "none"],
      help=f"MoE load balancer [{d.balancer}]")
    a("--lr", type=finite_float(0, lo_open=True), default=None, help=f"peak learning rate (Muon and AdamW) [{d.lr}]")
    a("--warmup", type=int_at_least(0), default=None, help="warm-up steps [5%% of --steps]")
    a("--weight-decay", type=finite_float(0), default=None, help=f"[{d.weight_decay}]")
    a("--grad-clip", type=finite_float(0), default=None, help=f"gradient-norm clip, 0 = off [{d.grad_clip}]")
    a("--batch-tokens", type=int_at_least(1), default=None, help=f"tokens per optimizer step [{DEFAULT_TOKENS_PER_STEP}]")
    a("--grad-accum", type=int_at_least(1), default=None, help=f"micro-batches per step [{d.grad_accum}]")
    a("--stages", default=None,
      help=f"context stages SEQ:SHARE,... (rows per step = batch tokens // SEQ) [{format_stages(DEFAULT_STAGES)}]")
    a("--seed", type=int, default=None, help=f"[{d.seed}]")
    a("--device", default=None, help="auto | cpu | cuda[:N] [auto]")
    a("--threads", type=int_at_least(1), default=None, help="torch CPU threads [torch default]")
    a("--activation-checkpointing", action="store_true", default=None, help="recompute layers in backward")
    a("--param-dtype", default=None, choices=["auto", "fp32", "bf16"],
      help="parameter storage: fp32 (bf16 autocast on GPU) or bf16 with fp32 master weights in the optimizer "
           "[auto: bf16 on CUDA, fp32 on CPU]")
    a("--compile", default=None, choices=["auto", "none", "modules", "layers", "model"],
      help="torch.compile the model [auto: modules on CUDA, none on CPU]")
    a("--eval-every", type=int_at_least(0), default=None, help="evaluate every N steps; 0 = before and after only [steps/4]")
    a("--val-tokens", type=int_at_least(1), default=None, help=f"validation tokens per evaluation [{d.val_tokens}]")
    a("--max-bad-steps", type=int_at_least(0), default=None, help=f"consecutive NaN/inf steps tolerated [{d.max_bad_steps}]")
    add_spike_flag(a)
    a("--no-progress", action="store_true", default=None, help="no progress bar")
    a("--no-tensorboard", action="store_true", default=None, help="no TensorBoard logs")
    a("--no-samples", action="store_true", default=None, help="no sample generations at the end")
    a("--json", action="store_true", help="print the summary as JSON")
    a("--task", default="text", choices=["text", "vision-synth", "image-text"],
      help="text: language modelling (the trainer); vision-synth: the tiny multimodal model on the synthetic image "
           "task; image-text: the tiny multimodal model on --data PAIRS.jsonl ({\"image\", \"text\"|\"messages\"}) "
           "(k3.vision.train.run_train_cli) [text]")
    a("--time-budget", type=finite_float(0, lo_open=True), default=None,
      help="vision tasks: training seconds when --steps is not given [540]")
    add_mesh_flags(s)
    s.set_defaults(fn=run)
    return s


def add_spike_flag(a) -> None:
    """--skip-grad-spikes (TrainConfig.skip_grad_spikes), shared by `k3 train` and `k3 sft`; `a` = add_argument."""
    a("--skip-grad-spikes", type=finite_float(1, lo_open=True), default=None, metavar="FACTOR",
      help=f"skip a step whose gradient norm (before clipping) is over FACTOR x the median of the last "
           f"{SPIKE_WINDOW} updated steps (from the {SPIKE_MIN_HISTORY}th on), e.g. 10; counts toward "
           f"--max-bad-steps [off]")


def add_mesh_flags(s: argparse.ArgumentParser) -> None:
    """The device-mesh flags of `k3 train` and `k3 sft` (read by k3.parallel.training.MeshFlags under torchrun)."""
    m = s.add_argument_group("distributed (under torchrun; docs/parallelism.md)")
    m.add_argument("--dp-replicate", type=int_at_least(1), default=None, help="HSDP replicas [1]")
    m.add_argument("--dp-shard", type=int_at_least(1), default=None,
                   help="FSDP2 sharding degree [what fills the world: world / (dp-replicate x cp)]")
    m.add_argument("--ep", type=int_at_least(1), default=None,
                   help="expert parallelism, folded into the dp-shard x cp ranks [1]")
    m.add_argument("--cp", type=int_at_least(1), default=None,
                   help="context parallelism: each sequence split over this many ranks, for every stage [1]")


def add_sft_parser(subparsers) -> argparse.ArgumentParser:
    """`k3 sft`: the same trainer, checkpoints and resume as `k3 train`, on chat data with assistant-only loss."""
    d = SFT_DEFAULTS
    s = subparsers.add_parser(
        "sft", help="supervised fine-tuning on the K3 chat format (loss on assistant tokens only)",
        description="Fine-tune a trained checkpoint on chats (K3 chat format: system, tools, tool calls and "
                    "results, thinking/response) with the `k3 train` trainer: packed rows with cu_seqlens, loss on "
                    "assistant tokens only, checkpoints and exact --resume. Without --data: the generated SFT set "
                    "of the built-in tasks (calculator, kv-lookup, multi-tool).",
        epilog="Outputs in --out as for k3 train (metrics.jsonl, checkpoints/, final/, loss.png, report.md).")
    a = s.add_argument
    a("--ckpt", default=None, help="the model to fine-tune: a checkpoint dir, a run's final/, or a run dir "
                                   "(required for a new run)")
    a("--data", default=None, help="chats.jsonl: one {\"messages\": [...], \"tools\": [...]} per line "
                                   "[the generated set of the built-in tasks]")
    a("--tasks", nargs="+", default=None, help="built-in tasks of the generated set [calculator kv-lookup multi-tool]")
    a("--per-task", type=int_at_least(1), default=None, help="generated conversations per task [200]")
    a("--seq-len", type=int_at_least(2), default=None, help=f"packed row length [{d['stages'][0][0]}]")
    a("--out", default=None, help=f"run directory [{d['out_dir']}]")
    a("--steps", type=int_at_least(1), default=None, help=f"optimizer steps [{d['steps']}]")
    a("--batch-tokens", type=int_at_least(1), default=None, help=f"tokens per optimizer step [{d['tokens_per_step']}]")
    a("--lr", type=finite_float(0, lo_open=True), default=None, help=f"peak learning rate [{d['lr']}]")
    a("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    a("--overwrite", action="store_true", default=None, help="replace a run in --out")
    a("--stop-at", type=int_at_least(1), default=None, help="stop (with a checkpoint) after this step")
    a("--save-every", type=int_at_least(0), default=None, help="checkpoint every N steps; 0 = at the end [0]")
    a("--keep", type=int_at_least(1), default=None, help="checkpoints to keep [2]")
    a("--warmup", type=int_at_least(0), default=None, help="warm-up steps [5%% of --steps]")
    a("--weight-decay", type=finite_float(0), default=None, help="[0.1]")
    a("--grad-clip", type=finite_float(0), default=None, help="gradient-norm clip, 0 = off [1.0]")
    a("--grad-accum", type=int_at_least(1), default=None, help="micro-batches per step [1]")
    a("--balancer", default=None, choices=["qb", "qb_hist", "qb_ema", "sign", "aux_loss", "none"],
      help="MoE load balancer [qb]")
    a("--seed", type=int, default=None, help="[0]")
    a("--device", default=None, help="auto | cpu | cuda[:N] [auto]")
    a("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    a("--activation-checkpointing", action="store_true", default=None, help="recompute layers in backward")
    a("--param-dtype", default=None, choices=["auto", "fp32", "bf16"], help="parameter storage [auto]")
    a("--compile", default=None, choices=["auto", "none", "modules", "layers", "model"], help="[auto]")
    a("--eval-every", type=int_at_least(0), default=None, help="evaluate every N steps [steps/4]")
    a("--val-tokens", type=int_at_least(1), default=None, help="validation tokens per evaluation [4096]")
    a("--max-bad-steps", type=int_at_least(0), default=None, help="consecutive NaN/inf steps tolerated [5]")
    add_spike_flag(a)
    a("--tokenizer", default=None, help="tokenizer.json (or its dir) [the checkpoint's]")
    a("--no-progress", action="store_true", default=None, help="no progress bar")
    a("--no-tensorboard", action="store_true", default=None, help="no TensorBoard logs")
    a("--json", action="store_true", help="print the summary as JSON")
    add_mesh_flags(s)
    s.set_defaults(fn=run_sft)
    return s


def build_sft_config(args) -> TrainConfig:
    from k3.errors import K3ConfigError
    from k3.train.config import resume_config
    ov = _overrides(args, _SFT_FIELDS)
    if getattr(args, "seq_len", None) is not None:
        ov["stages"] = [(int(args.seq_len), 1.0)]
    if args.resume and ov.get("overwrite"):
        raise K3ConfigError("--resume and --overwrite exclude each other (continue the run, or replace it)")
    out_dir = ov.pop("out_dir", SFT_DEFAULTS["out_dir"])
    if args.resume:
        return resume_config(out_dir, ov)
    if ov.get("init_from") is None:
        raise K3ConfigError("k3 sft: --ckpt is required (the trained checkpoint to fine-tune)")
    cfg = TrainConfig(**{k: v for k, v in SFT_DEFAULTS.items() if k != "out_dir"}, out_dir=out_dir)
    for k, v in ov.items():
        setattr(cfg, k, v)
    if "stages" not in ov and cfg.tokens_per_step < cfg.stages[0][0]:
        cfg.stages = [(cfg.tokens_per_step, 1.0)]
    cfg.validate()
    return cfg


def run_sft(args) -> int:
    return _run(args, build_sft_config(args), "k3 sft")


def _overrides(args, fields=None) -> dict:
    out = {}
    for dest, fld in (fields or _FIELDS).items():
        v = getattr(args, dest, None)
        if v is None:
            continue
        if dest in _NEGATED:
            v = not v
        if dest == "stages":
            v = parse_stages(v)
        out[fld] = v
    return out


def build_train_config(args) -> TrainConfig:
    from k3.errors import K3ConfigError
    from k3.train.config import resume_config
    ov = _overrides(args)
    if args.resume and ov.get("overwrite"):
        raise K3ConfigError("--resume and --overwrite exclude each other (continue the run, or replace it)")
    out_dir = ov.pop("out_dir", TrainConfig().out_dir)
    if args.resume:
        return resume_config(out_dir, ov)
    cfg = TrainConfig(out_dir=out_dir)
    for k, v in ov.items():
        setattr(cfg, k, v)
    cfg.validate()
    return cfg


def run(args) -> int:
    if getattr(args, "task", "text") != "text":   # the multimodal model on images
        from k3.parallel.training import torchrun_env
        if torchrun_env() is not None:            # under torchrun: DistTrainer with the vision data
            from k3.parallel.vision_train import run_train_dist
            return run_train_dist(args, build_train_config)
        from k3.parallel.training import MeshFlags
        flags = MeshFlags(*(getattr(args, k, None) for k in ("dp_replicate", "dp_shard", "cp", "ep")))
        if flags.given():
            from k3.errors import K3ConfigError
            raise K3ConfigError(f"{flags.describe()}: mesh flags need several processes; launch with torchrun, "
                                f"e.g. torchrun --nproc-per-node 2 -m k3.cli train --task {args.task} ... "
                                f"{flags.describe()}")
        from k3.vision.train import run_train_cli  # one process: its own compact loop
        return run_train_cli(args)
    return _run(args, build_train_config(args), "k3 train")


def _run(args, cfg: TrainConfig, name: str) -> int:
    import json
    from k3.train.report import format_summary
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("k3.checkpoint").setLevel(logging.WARNING)
    from k3.parallel.training import MeshFlags, make_trainer   # Trainer, or DistTrainer under torchrun
    flags = MeshFlags(*(getattr(args, k, None) for k in ("dp_replicate", "dp_shard", "cp", "ep")))
    trainer = make_trainer(cfg, flags)
    if not getattr(trainer, "is_rank0", True):   # under torchrun only rank 0 prints
        return 130 if trainer.train()["status"] == "interrupted" else 0
    model = f"from {cfg.init_from}" if cfg.init_from else f"preset {cfg.config or cfg.preset}"
    print(f"{name}: {model}, {cfg.steps} steps x {cfg.tokens_per_step} tokens, "
          f"stages {format_stages(parse_stages(cfg.stages))}, out {cfg.out_dir}"
          + (" (resume)" if cfg.resume else ""), flush=True)
    summary = trainer.train()
    if args.json:
        from k3.train.report import finite_or_none
        print(json.dumps(finite_or_none(summary), indent=2, default=str, allow_nan=False))  # strict JSON
    else:
        print(format_summary(summary), flush=True)
    return 130 if summary["status"] == "interrupted" else 0
