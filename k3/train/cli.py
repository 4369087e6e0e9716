"""`k3 train`: train a preset (default `tiny`) on the built-in corpus or your files. See k3/train/trainer.py."""
from __future__ import annotations

import argparse
import logging

from k3.cli import finite_float, int_at_least
from k3.train.config import (DEFAULT_STAGES, DEFAULT_STEPS, DEFAULT_TOKENS_PER_STEP, TrainConfig, format_stages,
                             parse_stages)

# flag dest -> TrainConfig field (all flags default to None so --resume can tell which ones were given)
_FIELDS = {
    "preset": "preset", "config": "config", "steps": "steps", "save_every": "save_every", "out": "out_dir",
    "data": "data", "tokenizer": "tokenizer", "balancer": "balancer", "lr": "lr", "batch_tokens": "tokens_per_step",
    "grad_accum": "grad_accum", "seed": "seed", "device": "device", "activation_checkpointing":
    "activation_checkpointing", "stages": "stages", "keep": "keep", "eval_every": "eval_every",
    "warmup": "warmup_steps", "weight_decay": "weight_decay", "grad_clip": "grad_clip", "stop_at": "stop_at",
    "max_bad_steps": "max_bad_steps", "val_tokens": "val_tokens", "split_sections": "split_sections",
    "threads": "threads", "compile": "compile", "param_dtype": "param_dtype", "no_progress": "progress",
    "no_tensorboard": "tensorboard", "no_samples": "samples", "overwrite": "overwrite",
}
_NEGATED = {"no_progress", "no_tensorboard", "no_samples"}


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
    s.set_defaults(fn=run)
    return s


def _overrides(args) -> dict:
    out = {}
    for dest, fld in _FIELDS.items():
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
    import json
    from k3.train.report import format_summary
    from k3.train.trainer import Trainer
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("k3.checkpoint").setLevel(logging.WARNING)
    if getattr(args, "task", "text") != "text":   # the multimodal model on images: its own compact loop
        from k3.vision.train import run_train_cli
        return run_train_cli(args)
    cfg = build_train_config(args)
    trainer = Trainer(cfg)
    print(f"k3 train: preset {cfg.config or cfg.preset}, {cfg.steps} steps x {cfg.tokens_per_step} tokens, "
          f"stages {format_stages(parse_stages(cfg.stages))}, out {cfg.out_dir}"
          + (" (resume)" if cfg.resume else ""), flush=True)
    summary = trainer.train()
    if args.json:
        from k3.train.report import finite_or_none
        print(json.dumps(finite_or_none(summary), indent=2, default=str, allow_nan=False))  # strict JSON
    else:
        print(format_summary(summary), flush=True)
    return 130 if summary["status"] == "interrupted" else 0
