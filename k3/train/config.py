"""The training arguments (`TrainConfig`), their validation, and what a resumed run may change.

`k3 train` flags map onto `TrainConfig` fields (k3/train/cli.py). A run stores its resolved arguments in
`RUN/train_config.json`; `--resume` reads them back (`resume_config`). Fields fall in three groups:

* `RUN_FIXED`: what the continued run's numbers depend on (model, data, batch shape, seed, optimiser settings).
  A resumed run keeps them; giving a different value is refused (`check_resume_settings`) naming the flag.
* `SESSION_ONLY`: belongs to one invocation, not to the run (`stop_at`, like Ctrl-C): never taken from the stored
  arguments, so `--resume` continues to `--steps` unless a new `--stop-at` is given.
* everything else (`--steps`, `--save-every`, `--keep`, `--eval-every`, progress / logging flags, device,
  threads, compile, ...) may change on resume; `--steps` re-times the LR schedule and context stages.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from k3.errors import K3ConfigError

log = logging.getLogger("k3.train")

__all__ = ["TrainConfig", "parse_stages", "format_stages", "resolve_compile", "resolve_param_dtype",
           "resume_config", "check_resume_settings", "resolve_device", "auto_threads", "stored_train_config", "DEFAULT_STAGES", "DEFAULT_STEPS",
           "DEFAULT_TOKENS_PER_STEP", "RUN_FIXED", "SESSION_ONLY", "FLAG_NAMES", "TRAIN_CONFIG_NAME",
           "resolve_init_checkpoint", "TASKS"]

# Default run (`k3 train` with no arguments): the `tiny` preset on the built-in corpus, sized to finish within
# ~10 minutes on 2 CPU cores including tokenizer training (see benchmarks/RESULTS.md / the trainer tests).
# Context stages scaled from K3's 8K -> 64K -> 256K -> 1M: most steps short, a few long ones at the end.
DEFAULT_STAGES = [(256, 0.6), (1024, 0.3), (2048, 0.1)]
DEFAULT_STEPS = 110  # measured: 72 steps took 4:07 on an idle-ish 2-core VM (643 tokens/s); 110 -> ~6.5 min
DEFAULT_TOKENS_PER_STEP = 2048
TRAIN_CONFIG_NAME = "train_config.json"

# TrainConfig field -> the `k3 train` flag that sets it (for messages); fields without a flag are named as such
FLAG_NAMES = {
    "preset": "--preset", "config": "--config", "steps": "--steps", "save_every": "--save-every", "out_dir": "--out",
    "data": "--data", "tokenizer": "--tokenizer", "balancer": "--balancer", "lr": "--lr",
    "tokens_per_step": "--batch-tokens", "grad_accum": "--grad-accum", "seed": "--seed", "device": "--device",
    "activation_checkpointing": "--activation-checkpointing", "stages": "--stages", "keep": "--keep",
    "eval_every": "--eval-every", "warmup_steps": "--warmup", "weight_decay": "--weight-decay",
    "grad_clip": "--grad-clip", "stop_at": "--stop-at", "max_bad_steps": "--max-bad-steps",
    "skip_grad_spikes": "--skip-grad-spikes",
    "val_tokens": "--val-tokens", "split_sections": "--split-sections", "threads": "--threads",
    "compile": "--compile", "param_dtype": "--param-dtype", "progress": "--no-progress",
    "tensorboard": "--no-tensorboard", "samples": "--no-samples", "overwrite": "--overwrite",
    "init_from": "--init (k3 train) / --ckpt (k3 sft)", "task": "the subcommand (k3 train / k3 sft)", "sft_data": "--data (k3 sft)",
    "sft_per_task": "--per-task", "sft_tasks": "--tasks",
}

# the spike rule (TrainConfig.skip_grad_spikes): the median over the last SPIKE_WINDOW updated steps' gradient norms,
# applied from SPIKE_MIN_HISTORY of them on
SPIKE_WINDOW = 50
SPIKE_MIN_HISTORY = 10

# the continued run's numbers depend on these: a resumed run keeps them (a different value is refused)
RUN_FIXED = ("preset", "config", "model_overrides", "tokens_per_step", "stages", "grad_accum", "seed", "data",
             "split_sections", "tokenizer", "lr", "adamw_lr", "weight_decay", "warmup_steps", "min_lr_ratio",
             "grad_clip", "qk_clip_tau", "balancer", "param_dtype", "init_from", "task", "sft_data", "sft_per_task",
             "sft_tasks", "skip_grad_spikes")
TASKS = ("pretrain", "sft")
# one invocation's request, not a property of the run: never read back from train_config.json
SESSION_ONLY = ("stop_at", "resume", "overwrite")


def flag(name: str) -> str:
    return FLAG_NAMES.get(name, f"TrainConfig.{name}")


def parse_stages(spec) -> list[tuple[int, float]]:
    """"256:0.6,1024:0.3,4096:0.1" (or a list of pairs) -> [(256, 0.6), ...]. A bare "512" is one stage."""
    if spec is None:
        return list(DEFAULT_STAGES)
    if isinstance(spec, str):
        out = []
        for part in spec.replace(" ", "").split(","):
            if not part:
                continue
            seq, _, share = part.partition(":")
            try:
                out.append((int(seq), float(share) if share else 1.0))
            except ValueError:
                raise K3ConfigError(f"--stages: bad stage {part!r}; expected SEQ_LEN:SHARE, e.g. 256:0.6") from None
        if not out:
            raise K3ConfigError(f"--stages: no stage in {spec!r}")
        for seq, share in out:
            if not math.isfinite(share):
                raise K3ConfigError(f"--stages: the share of stage {seq} must be a finite number, got {share}")
        return out
    return [(int(s), float(f)) for s, f in spec]


def format_stages(stages) -> str:
    return ",".join(f"{s}:{f:g}" for s, f in stages)


def resolve_compile(mode: str, device) -> str:
    """'auto' -> torch.compile of the sub-modules on CUDA (measured faster and leaner there), none on CPU."""
    import torch
    modes = ("auto", "none", "modules", "layers", "model")
    if mode not in modes:
        raise ValueError(f"compile: expected one of {', '.join(modes)}, got {mode!r}")
    if mode == "auto":
        return "modules" if torch.device(device).type == "cuda" else "none"
    return mode


def resolve_param_dtype(dtype: str, device) -> str:
    """'auto' -> bf16 weights (fp32 masters in the optimizer) on CUDA, fp32 on CPU. H200, `small` B8 T4096
    compiled, the trainer's MuonAdamW: bf16 weights 24.6% MFU vs 16.8% or less for fp32 weights under autocast
    (benchmarks/RESULTS.md, sixth session); on CPU bf16 matmuls are slower and autocast is off."""
    import torch
    if dtype not in ("auto", "fp32", "bf16"):
        raise K3ConfigError(f"--param-dtype must be auto, fp32 or bf16, got {dtype!r}")
    if dtype == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    return dtype


def auto_threads() -> int:
    """CPU threads for training: torch's default, less the cores other processes keep busy (1-minute load
    average). Oversubscribed OpenMP barriers are very slow: on 2 shared cores, 1 thread can be 2-5x faster."""
    import torch
    cur = torch.get_num_threads()
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        ncpu = os.cpu_count() or cur
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover
        return cur
    n = max(1, min(cur, int(ncpu - load + 0.5)))
    if n < cur:
        log.info("CPU: load average %.1f on %d cores -> training with %d thread(s) (--threads to override)",
                 load, ncpu, n)
    return n


def resolve_device(spec: str) -> torch.device:
    import torch
    if spec in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise K3ConfigError(f"--device {spec}: CUDA is not available")
    return dev


@dataclass
class TrainConfig:
    # model
    preset: str = "tiny"
    config: Optional[str] = None            # config.json path / preset name / checkpoint dir (wins over preset)
    model_overrides: dict = field(default_factory=dict)
    # run
    out_dir: str = "runs/k3-tiny"
    steps: int = DEFAULT_STEPS
    tokens_per_step: int = DEFAULT_TOKENS_PER_STEP
    stages: list = field(default_factory=lambda: list(DEFAULT_STAGES))
    grad_accum: int = 1
    seed: int = 0
    device: str = "auto"                    # auto | cpu | cuda | cuda:N
    threads: Optional[int] = None           # torch CPU threads; None on CPU: the cores not busy (load average)
    activation_checkpointing: bool = False
    compile: str = "auto"                   # auto (= "modules" on CUDA, "none" on CPU) | none | modules | layers | model
    # parameter storage: "fp32" (fp32 weights, bf16 autocast on GPU) or "bf16" (bf16 weights and activations, fp32
    # master weights and moments in the optimizer; the spec's fp32 names stay fp32), "auto" = bf16 on CUDA, fp32 on
    # CPU. bf16 removes autocast's per-use weight casts and fp32 activations (benchmarks/RESULTS.md, fifth and sixth
    # sessions); gradients are bf16, so with --grad-accum > 1 the micro-batch sum is rounded to bf16.
    param_dtype: str = "auto"
    resume: bool = False
    overwrite: bool = False                 # a new run may replace an existing run's outputs in out_dir
    stop_at: Optional[int] = None           # stop (with a checkpoint) after this step; the schedule still uses `steps`
    # data
    data: Optional[list] = None             # corpus files/dirs; None = built-in pydocs corpus
    split_sections: bool = False
    tokenizer: Optional[str] = None         # tokenizer.json (or dir); None = train/cached BPE for vocab_size
    # optimisation
    lr: float = 6e-3                        # Muon and AdamW (Muon updates are RMS-matched to AdamW's)
    adamw_lr: Optional[float] = None
    weight_decay: float = 0.1
    warmup_steps: Optional[int] = None      # default: 5% of steps (at least 1)
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    qk_clip_tau: float = 100.0
    balancer: str = "qb"                    # qb | qb_hist | qb_ema | sign | aux_loss | none
    max_bad_steps: int = 5                  # consecutive NaN/inf (or skipped-spike) steps tolerated
    # skip a step whose gradient norm (before clipping) is over this many times the median of the last
    # SPIKE_WINDOW updated steps' (from the SPIKE_MIN_HISTORY-th on): a huge finite gradient passes the clip at full
    # step size in a wrong direction; None = off
    skip_grad_spikes: Optional[float] = None
    # logging / evaluation / checkpoints
    save_every: int = 0                     # 0: only at the end (and on Ctrl-C)
    keep: int = 2
    eval_every: Optional[int] = None        # None: ~4 evaluations per run; 0: before and after training only
    val_tokens: int = 4096                  # validation tokens per evaluation (fixed batches)
    val_seq_len: Optional[int] = None       # default: the first stage's seq_len
    recall_examples: int = 16
    recall_pairs: int = 8
    log_every: int = 1
    progress: bool = True
    tensorboard: bool = True
    samples: bool = True
    sample_prompts: list = field(default_factory=lambda: ["The ", "Return the", "This module"])
    sample_tokens: int = 24
    plot: bool = True
    cache_dir: Optional[str] = None
    # start from a trained checkpoint (`--ckpt`: a checkpoint directory, a run's final/, or a run directory: its
    # final/ else its latest checkpoint): its config, tokenizer and weights; the optimizer starts fresh
    init_from: Optional[str] = None
    # "pretrain": next-token loss on a corpus (`data`); "sft": the K3 chat format, loss on assistant tokens only
    # (k3.rl.sft_data: `sft_data` chats.jsonl, or the generated set of `sft_tasks`, `sft_per_task` each)
    task: str = "pretrain"
    sft_data: Optional[str] = None
    sft_per_task: int = 200
    sft_tasks: list = field(default_factory=lambda: ["calculator", "kv-lookup", "multi-tool"])

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["stages"] = [list(s) for s in self.stages]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "stages" in kw:
            kw["stages"] = parse_stages(kw["stages"])
        return cls(**kw)

    def validate(self) -> None:
        """Every value in range and finite; the stages fit the batch. Touches no file (runs before RUN exists)."""
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise K3ConfigError(f"{flag(name)} must be {what}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for name in ("steps", "tokens_per_step", "grad_accum", "keep", "val_tokens", "log_every"):
            need(is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "an integer >= 1")
        for name in ("save_every", "max_bad_steps", "recall_examples", "recall_pairs", "sample_tokens"):
            need(is_int(getattr(self, name)) and getattr(self, name) >= 0, name, "an integer >= 0")
        need(is_int(self.seed), "seed", "an integer")
        for name in ("eval_every", "warmup_steps"):
            v = getattr(self, name)
            need(v is None or (is_int(v) and v >= 0), name, "an integer >= 0")
        for name in ("threads", "stop_at", "val_seq_len"):
            v = getattr(self, name)
            need(v is None or (is_int(v) and v >= 1), name, "an integer >= 1")
        need(is_num(self.lr) and self.lr > 0, "lr", "a finite number > 0")
        need(self.adamw_lr is None or (is_num(self.adamw_lr) and self.adamw_lr > 0), "adamw_lr",
             "a finite number > 0")
        for name in ("weight_decay", "grad_clip", "qk_clip_tau"):
            need(is_num(getattr(self, name)) and getattr(self, name) >= 0, name, "a finite number >= 0")
        need(is_num(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "a finite number in [0, 1]")
        need(self.skip_grad_spikes is None or (is_num(self.skip_grad_spikes) and self.skip_grad_spikes > 1),
             "skip_grad_spikes", "a finite number > 1 (a factor over the median gradient norm), or None")
        from k3.train.schedule import _validate
        _validate(self.stages)
        for seq, _ in self.stages:
            rows = self.tokens_per_step // seq
            if rows < 1:
                raise K3ConfigError(f"stage seq_len {seq} > --batch-tokens {self.tokens_per_step}: raise the tokens "
                                    f"per step or shorten the stage")
            if rows < self.grad_accum:
                raise K3ConfigError(f"stage seq_len {seq}: {rows} rows per step cannot be split into "
                                    f"--grad-accum {self.grad_accum} micro-batches")
        resolve_param_dtype(self.param_dtype, "cpu")  # names the known values
        resolve_compile_checked(self.compile)
        if self.data is not None:
            paths = [self.data] if isinstance(self.data, str) else list(self.data)
            if not paths:
                raise K3ConfigError("--data: no corpus path given")
            for p in paths:
                if not isinstance(p, str) or (p != "pydocs" and not os.path.exists(p)):
                    raise K3ConfigError(f"--data: {p!r} does not exist (give .txt/.jsonl files or directories; "
                                        f"the built-in corpus is 'pydocs')")
        if self.tokenizer is not None and not os.path.exists(self.tokenizer):
            raise K3ConfigError(f"--tokenizer: {self.tokenizer!r} does not exist")
        if self.task not in TASKS:
            raise K3ConfigError(f"TrainConfig.task must be one of {TASKS}, got {self.task!r}")
        if self.init_from is not None:
            resolve_init_checkpoint(self.init_from, allow_dcp=True)
        if self.task == "sft":
            if self.init_from is None and self.tokenizer is None:
                raise K3ConfigError("k3 sft needs --ckpt (a trained checkpoint: its tokenizer has the chat tokens)")
            if len(self.stages) != 1:
                raise K3ConfigError(f"k3 sft uses one context stage (SFT rows are packed at one length), got "
                                    f"--stages {format_stages(self.stages)}")
            need(is_int(self.sft_per_task) and self.sft_per_task >= 1, "sft_per_task", "an integer >= 1")
            if self.sft_data is not None and not os.path.isfile(self.sft_data):
                raise K3ConfigError(f"--data: SFT data file {self.sft_data!r} does not exist (a chats.jsonl)")
            from k3.rl.env import list_envs
            bad = [t for t in self.sft_tasks if t not in list_envs()]
            if not self.sft_tasks or bad:
                raise K3ConfigError(f"--tasks: unknown task(s) {bad} (built in: {', '.join(list_envs())})")


def resolve_init_checkpoint(path: str, allow_dcp: bool = False) -> str:
    """The model directory `--init` / `--ckpt` names: itself when it holds a model (config.json + safetensors), else
    a run directory's final/, else its latest checkpoint. A DCP checkpoint (a `.metadata` file: a distributed run's
    checkpoint or `k3 convert --to dcp`'s output) only with allow_dcp (the distributed trainer reads those).
    K3ConfigError when there is none."""
    def is_model(d):
        return os.path.isfile(os.path.join(d, "config.json")) and any(
            n.endswith(".safetensors") for n in os.listdir(d))
    if not isinstance(path, str) or not os.path.isdir(path):
        raise K3ConfigError(f"--ckpt: {path!r} is not a directory")
    if os.path.isfile(os.path.join(path, ".metadata")):
        if allow_dcp:
            return path
        raise K3ConfigError(f"--init: {path!r} is a DCP checkpoint: start from it under torchrun, or turn it into "
                            f"safetensors first with `k3 convert {path} OUT`")
    if is_model(path):
        return path
    if os.path.isdir(os.path.join(path, "final")) and is_model(os.path.join(path, "final")):
        return os.path.join(path, "final")
    from k3.train.checkpointing import latest_checkpoint
    last = latest_checkpoint(path)
    if last is not None and is_model(last):
        return last
    raise K3ConfigError(f"--ckpt: {path!r} holds no model (config.json + *.safetensors), no final/ and no "
                        f"checkpoints/step-N/")


def resolve_compile_checked(mode) -> None:
    try:
        resolve_compile(mode, "cpu")
    except ValueError as e:
        raise K3ConfigError(f"--{e}") from None


def stored_train_config(out_dir: str, name: str = TRAIN_CONFIG_NAME) -> Optional[dict]:
    """A run's stored arguments (RUN/train_config.json, or `name` for other run kinds) as a dict, None when there
    are none."""
    p = os.path.join(out_dir, name)
    if not os.path.isfile(p):
        return None
    try:
        with open(p) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise K3ConfigError(f"{p}: cannot read the run's stored arguments: {e}") from None
    if not isinstance(d, dict):
        raise K3ConfigError(f"{p}: expected a JSON object")
    return d


def _norm(name: str, v):
    if name == "stages" and v is not None:
        return [[int(s), float(f)] for s, f in parse_stages(v)]
    if name == "data" and isinstance(v, str):
        return [v]
    if isinstance(v, tuple):
        return list(v)
    return v


def check_resume_settings(cfg: TrainConfig, stored: dict, where: str = "") -> None:
    """Refuse a resumed run whose RUN_FIXED settings differ from the stored ones, naming the flag."""
    for name in RUN_FIXED:
        if name not in stored:
            continue
        new, old = _norm(name, getattr(cfg, name)), _norm(name, stored[name])
        if new != old:
            shown = format_stages(parse_stages(new)) if name == "stages" else new
            was = format_stages(parse_stages(old)) if name == "stages" else old
            raise K3ConfigError(
                f"{flag(name)} {shown!r} differs from the run's {was!r} ({where or TRAIN_CONFIG_NAME}): a resumed "
                f"run keeps the settings its numbers depend on, so that it continues exactly. Leave "
                f"{flag(name)} out to resume, or start a new run (another --out, or --overwrite).")


def resume_config(out_dir: str, overrides: Optional[dict] = None) -> TrainConfig:
    """The training arguments of the run in `out_dir` (its train_config.json) with `overrides` applied and
    `resume=True`; a directory without train_config.json gives TrainConfig(**overrides). Session-only fields
    (`stop_at`) are not taken from the stored arguments; a RUN_FIXED override that differs from the stored value
    is refused (K3ConfigError naming the flag)."""
    stored = stored_train_config(out_dir)
    base = TrainConfig()
    if stored is not None:
        base = TrainConfig.from_dict({k: v for k, v in stored.items() if k not in SESSION_ONLY})
    for k, v in (overrides or {}).items():
        if k == "stages":
            v = parse_stages(v)
        setattr(base, k, v)
    base.out_dir, base.resume = out_dir, True
    if stored is not None:
        check_resume_settings(base, stored, os.path.join(out_dir, TRAIN_CONFIG_NAME))
    return base
