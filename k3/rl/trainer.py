"""`k3 rl`: GRPO-family RL of a trained checkpoint on a registered environment (`RLRunner(RLConfig(...)).run()`).

Per step: collect `prompts_per_step` groups of `group_size` rollouts through `k3.generate` (sampler log-probs and
routed experts recorded; prompt seeds `seed_offset + step * prompts_per_step + i`, disjoint from the generated SFT
set's), apply the output filter (filtered -> reward 0), append every trajectory to the audit log, run the
human-review gate (`review_every`: a rejected batch is not trained on), one `grpo_update` (routing replayed,
truncated importance sampling against the sampler log-probs, optional KL to the `--ckpt` model), one
`metrics.jsonl` row.

Run directory (`out_dir`):
    rl_config.json        the resolved arguments          metrics.jsonl    one strict-JSON row per step
    audit.jsonl           every trajectory (prompt, calls, outputs, rewards, filter decision)
    eval.jsonl            greedy reward on fixed held-out prompts (`eval_prompts`), before and after training;
                          with `eval_samples` K also the sampled reward (K samples per prompt, fixed sampler seeds)
    review/               batches for human review and their approve/reject files
    checkpoints/step-XXXXXXXX/   model + tokenizer + trainer_state.pt (optimizer, step, RNG, rollout counter),
                          written atomically, read back with the project's safe loader (weights_only)
    final/                the trained model;  rewards.png: the reward curve;  train.lock while running

Exact resume (`resume=True`): the model, optimizer, RNG states and the rollout engine's call counter (which seeds
every generate call) are restored, so the continued run writes the same rows as an uninterrupted one. Paused
partial rollouts (`iteration_budget`) are not stored: on resume they restart, so with an iteration budget resume
is not bit-exact.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from k3.errors import K3ConfigError

log = logging.getLogger("k3.rl")

__all__ = ["RLConfig", "RLRunner", "RL_FIXED", "evaluate_reward"]

CONFIG_NAME = "rl_config.json"

# what the continued run's numbers depend on: a resumed run keeps them (a different value is refused)
RL_FIXED = ("ckpt", "env", "env_options", "group_size", "prompts_per_step", "lr", "warmup_steps", "weight_decay",
            "train_params", "param_lrs",
            "kl_coef", "neg_adv_scale", "clip_low", "clip_high", "tis_cap", "epochs", "max_grad_norm", "temperature",
            "top_p", "top_k",
            "max_turns", "max_tokens", "max_new_tokens_per_turn", "iteration_budget", "thinking", "replay", "seed",
            "seed_offset", "normalize_std", "filter_rules", "skip_uniform_groups", "train_dtype")
SESSION_ONLY = ("resume", "overwrite", "stop_at")
# RL_FIXED settings added after runs were stored without them: the value those runs ran with (a resume of such a run
# keeps it; before --train-dtype, every RL training forward ran in fp32)
LEGACY_FIXED = {"train_dtype": "fp32"}
FLAGS = {"ckpt": "--ckpt", "env": "--env", "group_size": "--group-size", "prompts_per_step": "--prompts-per-step",
         "steps": "--steps", "lr": "--lr", "warmup_steps": "--warmup-steps", "kl_coef": "--kl-coef",
         "neg_adv_scale": "--neg-adv-scale",
         "clip_low": "--clip-low", "clip_high": "--clip-high", "tis_cap": "--tis-cap", "review_every": "--review-every",
         "filter_rules": "--filter-rules", "iteration_budget": "--iteration-budget", "max_tokens": "--max-tokens",
         "max_new_tokens_per_turn": "--max-new-tokens", "max_turns": "--max-turns", "temperature": "--temperature",
         "seed": "--seed", "epochs": "--epochs", "weight_decay": "--weight-decay", "train_params": "--train-params",
         "param_lrs": "--param-lr",
         "max_grad_norm": "--grad-clip", "save_every": "--save-every", "keep": "--keep",
         "eval_prompts": "--eval-prompts", "eval_samples": "--eval-samples", "out_dir": "--out", "top_p": "--top-p", "top_k": "--top-k",
         "env_options": "--env-option", "thinking": "--thinking", "replay": "--no-replay",
         "seed_offset": "--seed-offset", "normalize_std": "--no-std-norm",
         "skip_uniform_groups": "--skip-uniform-groups", "review_timeout": "--review-timeout",
         "train_dtype": "--train-dtype"}


def _flag(name: str) -> str:
    return FLAGS.get(name, f"RLConfig.{name}")


@dataclass
class RLConfig:
    ckpt: Optional[str] = None               # the policy to train (checkpoint dir, a run's final/, or a run dir)
    env: str = "calculator"
    env_options: dict = field(default_factory=dict)
    out_dir: str = "runs/k3-rl"
    steps: int = 50
    group_size: int = 8
    prompts_per_step: int = 4
    # optimisation (AdamW, constant LR after an optional linear warmup)
    lr: float = 1e-4
    warmup_steps: int = 0                    # linear LR warmup over the first N RL steps (AdamW's first updates
    #                                          are sign-like, lr on every parameter: a fine-tuned policy can collapse)
    weight_decay: float = 0.0
    train_params: Optional[str] = None       # regex (re.search on parameter names): train only the matching
    #                                          parameters, freeze the rest (e.g. "lm_head|^model\\.norm" for a tiny
    #                                          model whose full-model updates are too noisy); None = all
    param_lrs: Optional[Dict[str, float]] = None   # {regex: lr}: parameters whose name matches a regex
    #                                          (re.search, the first match in order) get that LR, the rest `lr`
    #                                          (warm-up scales every group alike). E.g. {"^model\\.norm\\.": 0.1}
    #                                          with lr 1e-5: the final norm (the output's scale) moves fast, the
    #                                          rest of the fine-tuned policy by tiny steps
    max_grad_norm: float = 1.0               # 0 = off
    epochs: int = 1                          # optimizer steps per batch (the first one is on-policy: ratio 1)
    train_dtype: str = "auto"                # the training forwards: "bf16" autocast (fp32 weights, optimizer and
    #                                          log-probs), "fp32", or "auto" = bf16 on CUDA, fp32 elsewhere. The
    #                                          old and new log-probs share it (first ratio still 1); the sampler's
    #                                          fp32 log-probs differ by bf16 noise, which TIS corrects
    # GRPO
    kl_coef: float = 0.0                     # > 0: k3 KL to the --ckpt model (kept frozen)
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0                     # 0 = no truncated importance sampling
    normalize_std: bool = True
    neg_adv_scale: float = 1.0               # scale of negative advantages (0: learn from successes only)
    skip_uniform_groups: bool = False        # train only on groups whose rewards differ (the others have
    #                                          advantage 0 everywhere: no policy gradient, only compute)
    replay: bool = True                      # replay the rollout's expert choices in the training forward
    # rollouts
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_turns: int = 4
    max_tokens: int = 1024                   # whole trajectory (prompt + turns + tool results)
    max_new_tokens_per_turn: int = 64
    iteration_budget: Optional[int] = None   # generated tokens per trajectory per step (partial rollouts)
    thinking: bool = False
    seed: int = 0
    seed_offset: int = 10 ** 9               # prompt seeds start here (the generated SFT set uses < 10**9)
    # safety
    filter_rules: Optional[str] = None       # JSON rules file (k3.rl.safety)
    review_every: int = 0
    review_timeout: float = 3600.0
    # run
    eval_prompts: int = 0                    # greedy reward on this many held-out prompts before / after
    eval_samples: int = 0                    # > 0: also the sampled reward (this many samples per eval prompt at
    #                                          the RL temperature, the same sampler seeds before and after): the
    #                                          quantity GRPO optimises
    save_every: int = 0                      # 0: only at the end
    keep: int = 2
    device: str = "auto"
    threads: Optional[int] = None
    plot: bool = True
    resume: bool = False
    overwrite: bool = False
    stop_at: Optional[int] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RLConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> None:
        def need(ok, name, what):
            if not ok:
                raise K3ConfigError(f"{_flag(name)} must be {what}, got {getattr(self, name)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for n in ("steps", "group_size", "prompts_per_step", "epochs", "max_turns", "max_tokens",
                  "max_new_tokens_per_turn", "keep"):
            need(is_int(getattr(self, n)) and getattr(self, n) >= 1, n, "an integer >= 1")
        for n in ("top_k", "review_every", "eval_prompts", "eval_samples", "save_every", "seed_offset",
                  "warmup_steps"):
            need(is_int(getattr(self, n)) and getattr(self, n) >= 0, n, "an integer >= 0")
        need(is_int(self.seed), "seed", "an integer")
        need(self.train_dtype in ("auto", "fp32", "bf16"), "train_dtype", "one of auto, fp32, bf16")
        for n in ("iteration_budget", "threads", "stop_at"):
            v = getattr(self, n)
            need(v is None or (is_int(v) and v >= 1), n, "an integer >= 1")
        need(is_num(self.lr) and self.lr > 0, "lr", "a finite number > 0")
        need(is_num(self.temperature) and self.temperature > 0, "temperature", "a finite number > 0")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(is_num(self.clip_low) and 0 <= self.clip_low < 1, "clip_low", "in [0, 1)")
        need(is_num(self.neg_adv_scale) and 0 <= self.neg_adv_scale <= 1, "neg_adv_scale", "in [0, 1]")
        for n in ("weight_decay", "max_grad_norm", "kl_coef", "clip_high", "tis_cap", "review_timeout"):
            need(is_num(getattr(self, n)) and getattr(self, n) >= 0, n, "a finite number >= 0")
        if self.train_params is not None:
            try:
                re.compile(self.train_params)
            except (re.error, TypeError) as e:
                raise K3ConfigError(f"--train-params must be a regular expression, got {self.train_params!r}: "
                                    f"{e}") from None
        if self.param_lrs is not None:
            if not isinstance(self.param_lrs, dict):
                raise K3ConfigError(f"--param-lr must be a mapping {{regex: lr}}, got {self.param_lrs!r}")
            for rx, v in self.param_lrs.items():
                try:
                    re.compile(rx)
                except (re.error, TypeError) as e:
                    raise K3ConfigError(f"--param-lr {rx!r}: not a regular expression: {e}") from None
                if not (is_num(v) and v > 0):
                    raise K3ConfigError(f"--param-lr {rx!r}: the LR must be a finite number > 0, got {v!r}")
        if self.group_size < 2:
            log.warning("--group-size 1: every group-normalised advantage is 0 (nothing is learned)")
        from k3.rl.env import list_envs
        if self.env not in list_envs():
            raise K3ConfigError(f"--env {self.env!r} is not a registered environment (built in: "
                                f"{', '.join(list_envs())})")
        if self.filter_rules is not None and not os.path.isfile(self.filter_rules):
            raise K3ConfigError(f"--filter-rules: {self.filter_rules!r} does not exist")
        if self.ckpt is None:
            raise K3ConfigError("k3 rl: --ckpt is required (the policy to train)")
        from k3.train.config import resolve_init_checkpoint
        resolve_init_checkpoint(self.ckpt)
        from k3.train.config import resolve_device
        resolve_device(self.device)

    def rollout_config(self, **kw):
        from k3.rl.rollout import RolloutConfig
        c = RolloutConfig(group_size=self.group_size, max_turns=self.max_turns,
                          max_new_tokens_per_turn=self.max_new_tokens_per_turn, max_tokens=self.max_tokens,
                          iteration_budget=self.iteration_budget, do_sample=True, temperature=self.temperature,
                          top_p=self.top_p, top_k=self.top_k, thinking=self.thinking, record_routing=self.replay,
                          seed=self.seed)
        for k, v in kw.items():
            setattr(c, k, v)
        return c

    def grpo_config(self):
        from k3.rl.grpo import GRPOConfig
        return GRPOConfig(group_size=self.group_size, eps_low=self.clip_low, eps_high=self.clip_high,
                          normalize_std=self.normalize_std, kl_coef=self.kl_coef, neg_adv_scale=self.neg_adv_scale,
                          tis_cap=self.tis_cap if self.tis_cap > 0 else None)


def select_trainable(model, pattern: Optional[str]) -> List[torch.nn.Parameter]:
    """The parameters to optimise: all of them (pattern None), or those whose name matches `pattern`
    (re.search); the others get requires_grad=False. No match -> K3ConfigError naming the pattern."""
    if pattern is None:
        return [p for p in model.parameters() if p.requires_grad]
    rx = re.compile(pattern)
    out = []
    for n, p in model.named_parameters():
        keep = bool(rx.search(n))
        p.requires_grad_(keep)
        if keep:
            out.append(p)
    if not out:
        names = [n for n, _ in model.named_parameters()]
        raise K3ConfigError(f"--train-params {pattern!r} matches no parameter (names look like "
                            f"{', '.join(names[:3])}, ..., {names[-1]})")
    log.info("--train-params %r: training %d of %d parameters", pattern, sum(p.numel() for p in out),
             sum(p.numel() for p in model.parameters()))
    return out


def param_groups(model, params: List[torch.nn.Parameter], lr: float,
                 param_lrs: Optional[Dict[str, float]] = None) -> List[dict]:
    """Optimizer groups over `params` (trainable parameters of `model`): with `param_lrs` {regex: lr}, each
    parameter goes to the group of the first regex that matches its name (re.search), the rest to one group at
    `lr`; every group carries "base_lr" (the LR after warm-up) and "group_name". A regex that matches no trainable
    parameter -> K3ConfigError naming it. Empty groups are left out."""
    names = {id(p): n for n, p in model.named_parameters()}
    rules = [(rx, re.compile(rx), float(v)) for rx, v in (param_lrs or {}).items()]
    buckets: Dict[Optional[str], List[torch.nn.Parameter]] = {rx: [] for rx, _, _ in rules}
    buckets[None] = []
    for p in params:
        n = names.get(id(p), "")
        hit = next((rx for rx, c, _ in rules if c.search(n)), None)
        buckets[hit].append(p)
    for rx, _, _ in rules:
        if not buckets[rx]:
            raise K3ConfigError(f"--param-lr {rx!r} matches no trained parameter")
    groups = [{"params": buckets[rx], "lr": v, "base_lr": v, "group_name": rx} for rx, _, v in rules]
    if buckets[None]:
        groups.append({"params": buckets[None], "lr": lr, "base_lr": lr, "group_name": "default"})
    for g in groups[:-1] if buckets[None] else groups:
        log.info("--param-lr %r: %d parameters at lr %g", g["group_name"], sum(p.numel() for p in g["params"]),
                 g["lr"])
    return groups


def stored_config(out_dir: str) -> Optional[dict]:
    from k3.train.config import stored_train_config
    return stored_train_config(out_dir, CONFIG_NAME)


def resume_rl_config(out_dir: str, overrides: Optional[dict] = None) -> RLConfig:
    """The stored arguments of the run in `out_dir` with `overrides`; an override of a RL_FIXED setting that
    differs from the stored one is refused (naming the flag)."""
    stored = stored_config(out_dir)
    if stored is not None:
        stored = {**{k: v for k, v in LEGACY_FIXED.items() if k not in stored}, **stored}
    base = RLConfig() if stored is None else RLConfig.from_dict({k: v for k, v in stored.items()
                                                                 if k not in SESSION_ONLY})
    for k, v in (overrides or {}).items():
        if stored is not None and k in RL_FIXED and k in stored and stored[k] != v:
            raise K3ConfigError(f"{_flag(k)} {v!r} differs from the run's {stored[k]!r} "
                                f"({os.path.join(out_dir, CONFIG_NAME)}): a resumed run keeps the settings its "
                                f"numbers depend on. Leave {_flag(k)} out to resume, or start a new run.")
        setattr(base, k, v)
    base.out_dir, base.resume = out_dir, True
    return base


@torch.no_grad()
def evaluate_reward(model, tokenizer, cfg: RLConfig, n: int, seed_base: Optional[int] = None,
                    samples: int = 0) -> Dict[str, Any]:
    """Greedy rollouts (one per prompt) on `n` fixed held-out prompts: {"reward_mean", "rewards", "finish"};
    with samples > 0, `samples` sampled rollouts per prompt instead (the RL temperature / top-p / top-k, sampler
    seeds fixed by cfg.seed: two calls on the same model give the same samples), "rewards" then holds each
    prompt's mean reward."""
    from k3.rl.rollout import RolloutEngine
    base = cfg.seed_offset * 2 if seed_base is None else seed_base
    if samples:
        rc = cfg.rollout_config(group_size=int(samples), record_routing=False, compute_logprobs=False,
                                iteration_budget=None)
    else:
        rc = cfg.rollout_config(group_size=1, do_sample=False, record_routing=False, compute_logprobs=False)
    eng = RolloutEngine(model, tokenizer, cfg.env, rc, env_options=cfg.env_options)
    groups = eng.collect([base + i for i in range(n)])
    r = [statistics.fmean(t.reward for t in g) for g in groups]
    fin: Dict[str, int] = {}
    for g in groups:
        for t in g:
            fin[t.finish_reason] = fin.get(t.finish_reason, 0) + 1
    return {"reward_mean": statistics.fmean(r) if r else 0.0, "rewards": r, "finish": fin,
            "generated_tokens": eng.stats["generated_tokens"], "seconds": eng.stats["generate_seconds"]}


class RLRunner:
    """setup() -> run() -> summary dict (module doc)."""

    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        self.callbacks: list = []          # k3.train.checkpointing.save_checkpoint calls on_save
        self.step = 0
        self.tokens_seen = 0
        self.train_time = 0.0
        self.history: List[dict] = []
        self.eval_rewards: Dict[str, List[float]] = {}   # "start" / "end" -> per-prompt greedy rewards
        self._lock = None

    def _path(self, *p) -> str:
        return os.path.join(self.cfg.out_dir, *p)

    def holds_run(self) -> bool:
        from k3.train.checkpointing import find_checkpoints
        return bool(find_checkpoints(self.cfg.out_dir)) or any(
            os.path.exists(self._path(n)) for n in ("metrics.jsonl", "final"))

    # ------------------------------------------------------------------ setup
    def setup(self) -> "RLRunner":
        from k3.train.checkpointing import open_run_dir
        cfg = self.cfg
        cfg.validate()
        held = None
        if not cfg.resume and not cfg.overwrite and self.holds_run():
            held = (f"{cfg.out_dir} already holds a run: continue it with --resume, replace it with --overwrite, "
                    f"or choose another --out")
        self._lock = open_run_dir(cfg.out_dir, self._setup, refuse=held)
        return self

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _setup(self) -> None:
        from k3.checkpoint import from_pretrained
        from k3.rl.rollout import RolloutEngine
        from k3.rl.safety import AuditLog, OutputFilter, ReviewHook
        from k3.train import checkpointing as ckpt_io
        from k3.train.config import auto_threads, resolve_device, resolve_init_checkpoint
        from k3.tokenizer import load_tokenizer
        cfg = self.cfg
        ckpt = st = None
        if cfg.resume:
            ckpt, st = ckpt_io.pick_resume_checkpoint(cfg.out_dir)
            if ckpt is None:
                log.warning("--resume: no checkpoint in %s; starting a new run", cfg.out_dir)
        self.device = resolve_device(cfg.device)
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        elif self.device.type == "cpu":
            torch.set_num_threads(auto_threads())
        ckpt_io.seed_everything(cfg.seed)
        init = resolve_init_checkpoint(cfg.ckpt)
        src = ckpt if ckpt is not None else init
        self.tokenizer = load_tokenizer(src)
        self.model = from_pretrained(src, device=self.device, dtype=torch.float32)
        self.model_config = self.model.config
        bf16 = cfg.train_dtype == "bf16" or (cfg.train_dtype == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if bf16 else None
        self.model.eval()
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model = self.model if ckpt is None else from_pretrained(init, device=self.device,
                                                                             dtype=torch.float32)
            if self.ref_model is self.model:
                self.ref_model = copy.deepcopy(self.model)
            self.ref_model.eval().requires_grad_(False)
        params = select_trainable(self.model, cfg.train_params)
        self.optimizer = torch.optim.AdamW(param_groups(self.model, params, cfg.lr, cfg.param_lrs), lr=cfg.lr,
                                           weight_decay=cfg.weight_decay)
        self.engine = RolloutEngine(self.model, self.tokenizer, cfg.env, cfg.rollout_config(),
                                    env_options=cfg.env_options)
        self.grpo = cfg.grpo_config()
        self.filter = OutputFilter.from_json(cfg.filter_rules) if cfg.filter_rules else None
        self.audit = AuditLog(self._path("audit.jsonl"))
        self.review = ReviewHook(cfg.out_dir, cfg.review_every, timeout_s=cfg.review_timeout)
        if ckpt is not None:
            self._restore(ckpt, st)
        else:
            ckpt_io.clear_run_outputs(cfg.out_dir)
            for n in ("audit.jsonl", "eval.jsonl"):
                if os.path.exists(self._path(n)):
                    os.remove(self._path(n))
        ckpt_io.atomic_json(cfg.to_dict(), self._path(CONFIG_NAME))
        ckpt_io.cleanup_tmp(cfg.out_dir)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        from k3.train.checkpointing import rng_state
        return {"step": self.step, "stage": 0, "seq_len": self.cfg.max_tokens, "tokens_seen": self.tokens_seen,
                "train_time": self.train_time, "optimizer": self.optimizer.state_dict(), "scheduler": None,
                "loader": {"rollout_calls": self.engine.calls}, "rng": rng_state(),
                "rl_config": self.cfg.to_dict(), "tokenizer_fingerprint": getattr(self.tokenizer, "fingerprint", None)}

    def _write_state(self, state: dict, path: str) -> None:
        from k3.train.checkpointing import atomic_torch_save
        atomic_torch_save(state, path)

    def save_checkpoint(self) -> str:
        from k3.train.checkpointing import save_checkpoint
        return save_checkpoint(self)

    def _restore(self, path: str, st: dict) -> None:
        from k3.errors import CheckpointError
        from k3.train.checkpointing import set_rng_state
        if st.get("tokenizer_fingerprint") not in (None, getattr(self.tokenizer, "fingerprint", None)):
            raise CheckpointError(f"{path}: the checkpoint was trained with a different tokenizer")
        try:
            self.optimizer.load_state_dict(st["optimizer"])
            self.engine.calls = int(st["loader"]["rollout_calls"])
            set_rng_state(st["rng"])
            self.step = int(st["step"])
            self.tokens_seen = int(st.get("tokens_seen", 0))
            self.train_time = float(st.get("train_time", 0.0))
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: the RL state does not fit this run: {type(e).__name__}: {e}") from None
        self.history = _truncate_jsonl(self._path("metrics.jsonl"), self.step)
        _truncate_jsonl(self._path("audit.jsonl"), self.step)
        log.info("resumed from %s (step %d)", path, self.step)

    # ------------------------------------------------------------------ one step
    def lr_at(self, step: int, base: Optional[float] = None) -> float:
        """The LR of RL step `step` (1-based) for a group whose LR is `base` (default: --lr): linear warmup over
        warmup_steps, then constant."""
        w = self.cfg.warmup_steps
        return (self.cfg.lr if base is None else base) * (min(1.0, step / w) if w else 1.0)

    def rl_step(self) -> dict:
        from k3.rl.loop import flatten_groups, grpo_update, metrics_row
        from k3.rl.safety import apply_filter
        cfg = self.cfg
        P = cfg.prompts_per_step
        t0 = time.perf_counter()
        ids = [self.step * P + i for i in range(P)]
        self.model.eval()
        groups = self.engine.collect([cfg.seed_offset + g for g in ids], ids)
        rollout_s = time.perf_counter() - t0
        trajs = [t for g in groups for t in g]
        apply_filter(trajs, self.filter)
        step = self.step + 1
        self.audit.write(step, trajs)
        decision = self.review.review(step, trajs) if trajs else "skipped"
        upd: Dict[str, Any] = {}
        t1 = time.perf_counter()
        train_groups = groups
        if cfg.skip_uniform_groups:
            train_groups = [g for g in groups if len({t.reward for t in g}) > 1]
        if train_groups and decision != "rejected":
            ttrajs, adv = flatten_groups(train_groups, self.grpo)
            for g in self.optimizer.param_groups:
                g["lr"] = self.lr_at(step, g.get("base_lr"))
            self.model.train()
            upd = grpo_update(self.model, self.optimizer, ttrajs, adv, self.grpo, ref_model=self.ref_model,
                              replay=cfg.replay, epochs=cfg.epochs, temperature=cfg.temperature,
                              max_grad_norm=cfg.max_grad_norm or None, autocast_dtype=self.autocast_dtype)
            self.model.eval()
        train_s = time.perf_counter() - t1 if upd else 0.0
        row = metrics_row(step, trajs, upd, rollout_s, train_s)
        row.update({"review": decision, "lr": self.optimizer.param_groups[-1]["lr"],
                    "groups_trained": len(train_groups) if upd else 0,
                    "rollout_s": rollout_s, "train_s": train_s, "pending_groups": len(self.engine.pending)})
        for k in ("grad_norm", "ratio_mean", "ratio_min", "ratio_max", "tis_weight_mean", "tis_capped_frac",
                  "pg_loss", "packed_tokens"):
            if k in upd:
                row[k] = upd[k]
        self.step = step
        self.tokens_seen += row["generated_tokens"]
        self.train_time += rollout_s + train_s
        return row

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        self.setup()
        try:
            return self._run()
        finally:
            self.close()

    def _log(self, path: str, rec: dict) -> None:
        from k3.rl.safety import strict_json
        with open(path, "a") as f:
            f.write(strict_json(rec) + "\n")

    def _eval(self, when: str) -> Optional[dict]:
        if not self.cfg.eval_prompts:
            return None
        ev = evaluate_reward(self.model, self.tokenizer, self.cfg, self.cfg.eval_prompts)
        self.eval_rewards[when] = list(ev["rewards"])
        rec = {"type": "eval", "when": when, "step": self.step, "stderr": _stderr(ev["rewards"]),
               **{k: v for k, v in ev.items() if k != "rewards"}}
        log.info("eval (%s, step %d): greedy reward %.3f on %d prompts", when, self.step, ev["reward_mean"],
                 self.cfg.eval_prompts)
        if self.cfg.eval_samples:
            es = evaluate_reward(self.model, self.tokenizer, self.cfg, self.cfg.eval_prompts,
                                 samples=self.cfg.eval_samples)
            self.eval_rewards["sampled_" + when] = list(es["rewards"])
            rec.update({"sampled_reward_mean": es["reward_mean"], "sampled_stderr": _stderr(es["rewards"]),
                        "samples": self.cfg.eval_samples, "sampled_seconds": es["seconds"]})
            log.info("eval (%s, step %d): sampled reward %.3f (%d samples x %d prompts, T=%g)", when, self.step,
                     es["reward_mean"], self.cfg.eval_samples, self.cfg.eval_prompts, self.cfg.temperature)
        self._log(self._path("eval.jsonl"), rec)
        return rec

    def _run(self) -> dict:
        cfg = self.cfg
        t_start = time.time()
        first_eval = self._eval("start") if self.step == 0 else None
        end = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
        status, last_saved = "completed", self.step
        try:
            while self.step < end:
                row = self.rl_step()
                self.history.append(row)
                self._log(self._path("metrics.jsonl"), row)
                log.info("step %d: reward %.3f +- %.3f, kl %.4f, entropy %.3f, clip %.3f, rollout %.0f tok/s, "
                         "train %.0f tok/s%s", row["step"], row["reward_mean"], row["reward_std"], row["kl"] or 0,
                         row["entropy"] or 0, row["clip_frac"] or 0, row["rollout_tokens_per_s"] or 0,
                         row["train_tokens_per_s"] or 0,
                         f" ({row['review']})" if row["review"] != "skipped" else "")
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < end:
                    self.save_checkpoint()
                    last_saved = self.step
        except KeyboardInterrupt:
            status = "interrupted"
        from k3.train.checkpointing import find_checkpoints, latest_checkpoint
        if self.step != last_saved or not find_checkpoints(cfg.out_dir):
            self.save_checkpoint()
        if status == "completed" and self.step < cfg.steps:
            status = "stopped"
        last_eval = None
        if status == "completed":
            last_eval = self._eval("end")
            from k3.checkpoint import save_pretrained
            save_pretrained(self.model, self._path("final"), tokenizer=self.tokenizer)
        plot = self.plot() if cfg.plot else None
        rows = self.history
        summary = {"status": status, "step": self.step, "steps": cfg.steps, "out_dir": cfg.out_dir,
                   "wall_time_s": time.time() - t_start,
                   "reward_first": rows[0]["reward_mean"] if rows else None,
                   "reward_last": rows[-1]["reward_mean"] if rows else None,
                   "reward_curve": [r["reward_mean"] for r in rows],
                   "eval_reward_start": first_eval["reward_mean"] if first_eval else None,
                   "eval_reward_end": last_eval["reward_mean"] if last_eval else None,
                   "eval_sampled_start": (first_eval or {}).get("sampled_reward_mean"),
                   "eval_sampled_end": (last_eval or {}).get("sampled_reward_mean"),
                   **self._eval_stats(),
                   "rollout_tokens_per_s": _mean([r["rollout_tokens_per_s"] for r in rows]),
                   "train_tokens_per_s": _mean([r["train_tokens_per_s"] for r in rows if r["train_s"]]),
                   "checkpoint": latest_checkpoint(cfg.out_dir), "plot": plot,
                   "final": self._path("final") if status == "completed" else None}
        return summary

    def _eval_stats(self) -> Dict[str, Any]:
        """The eval's size and standard errors; with both evals (the same prompts) the paired difference
        end - start and its standard error (the per-prompt differences' std / sqrt(n))."""
        st, en = self.eval_rewards.get("start"), self.eval_rewards.get("end")
        out: Dict[str, Any] = {"eval_prompts": self.cfg.eval_prompts,
                               "eval_stderr_start": _stderr(st) if st else None,
                               "eval_stderr_end": _stderr(en) if en else None}
        if st and en and len(st) == len(en):
            d = [b - a for a, b in zip(st, en)]
            out["eval_delta"] = statistics.fmean(d)
            out["eval_delta_stderr"] = _stderr(d)
        st, en = self.eval_rewards.get("sampled_start"), self.eval_rewards.get("sampled_end")
        if st:
            out["eval_samples"] = self.cfg.eval_samples
            out["eval_sampled_stderr_start"] = _stderr(st)
        if en:
            out["eval_sampled_stderr_end"] = _stderr(en)
        if st and en and len(st) == len(en):
            d = [b - a for a, b in zip(st, en)]
            out["eval_sampled_delta"] = statistics.fmean(d)
            out["eval_sampled_delta_stderr"] = _stderr(d)
        return out

    def plot(self) -> Optional[str]:
        """rewards.png: reward mean (+- std) per step, and the greedy eval reward when measured."""
        rows = self.history
        if not rows:
            return None
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning("matplotlib is not installed: no reward plot")
            return None
        x = [r["step"] for r in rows]
        m = [r["reward_mean"] for r in rows]
        s = [r["reward_std"] or 0.0 for r in rows]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(x, m, label="reward mean (rollouts)")
        ax.fill_between(x, [a - b for a, b in zip(m, s)], [a + b for a, b in zip(m, s)], alpha=0.2)
        ev = []
        if os.path.exists(self._path("eval.jsonl")):
            with open(self._path("eval.jsonl")) as f:
                ev = [json.loads(ln) for ln in f if ln.strip()]
        if ev:
            err = [2 * (e.get("stderr") or 0.0) for e in ev]
            ax.errorbar([e["step"] for e in ev], [e["reward_mean"] for e in ev], yerr=err, color="k", fmt="x",
                        capsize=4, label=f"greedy eval, {self.cfg.eval_prompts} held-out prompts (+- 2 s.e.)",
                        zorder=3)
        ax.set_xlabel("RL step")
        ax.set_ylabel("reward")
        ax.set_title(f"k3 rl --env {self.cfg.env}")
        ax.legend(loc="best")
        fig.tight_layout()
        p = self._path("rewards.png")
        fig.savefig(p, dpi=100)
        plt.close(fig)
        return p


def _stderr(xs) -> Optional[float]:
    """Standard error of the mean (population std / sqrt(n)); None for fewer than 2 values."""
    xs = list(xs or [])
    return statistics.pstdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None


def _mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.fmean(xs) if xs else None


def _truncate_jsonl(path: str, step: int) -> List[dict]:
    """Keep the rows of a JSONL log with step <= `step` (a resumed run rewrites the rest); -> kept rows."""
    if not os.path.exists(path):
        return []
    keep, rows = [], []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("step", 0) <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
                rows.append(rec)
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)
    return rows
