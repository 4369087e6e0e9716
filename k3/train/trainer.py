"""The training loop: `Trainer(TrainConfig(...)).train()` is what `k3 train` runs.

One optimizer step consumes `tokens_per_step` tokens, split into `grad_accum` micro-batches of packed rows
(`cu_seqlens`, nothing crosses a document). The row length follows the context-extension stages
(`k3.train.schedule`), the token budget per step stays constant. Per step: forward/backward (bf16 autocast on GPU,
fp32 on CPU) -> grad-norm clip -> MuonAdamW step -> LR schedule -> QK-clip on MLA -> balancer step.

Run directory (`out_dir`):
    config.json            resolved model config             train_config.json   resolved training arguments
    metrics.jsonl          one strict-JSON object per step ({"type": "train", ...}) and per evaluation
                           ({"type": "eval"}); a non-finite number (a skipped step's loss) is written as null
    checkpoints/step-XXXXXXXX/   model (k3.checkpoint layout + tokenizer.json) + trainer_state.pt (optimizer,
                           LR schedule, balancer, loader position, stage, step, RNG states) + trainer_state.json
    final/                 the final model + tokenizer (loads with k3.checkpoint.from_pretrained)
    loss.png, samples.txt, report.md, tb/ (TensorBoard, if installed)
    train.lock             the PID of the training writing the directory (removed at the end)

Arguments and what a resumed run may change: `k3.train.config`. Checkpoints (atomic save, keep, safe loading,
fallback past a truncated state, the lock): `k3.train.checkpointing`. Validation loss, recall, samples:
`k3.train.probes`. Summary and end-of-run files: `k3.train.report`.

A new run in a directory that holds a run is refused unless `overwrite=True` (`--overwrite`) or `resume=True`.
Checkpoints are written to a hidden temp directory and renamed into place, so an interrupted save leaves the
previous checkpoint intact; only the last `keep` are kept. Ctrl-C finishes the current step, saves and returns.
A non-finite loss or gradient norm skips the step (no optimizer update, gradients zeroed), and so does, with
`skip_grad_spikes` F (`--skip-grad-spikes`), a finite gradient norm over F x the median of the last SPIKE_WINDOW
updated steps' (a huge finite gradient would pass the clip at full step size in a wrong direction); more than
`max_bad_steps` skipped steps in a row stop the run with `TrainingError`. A run whose final weights or validation
loss are not finite fails with `TrainingError` and writes no `final/`.

Post-training (`k3 sft`): `init_from` (`--ckpt`) starts from a trained checkpoint's config, tokenizer and weights
(fresh optimizer); `task="sft"` trains on the K3 chat format with the loss on assistant tokens only
(k3.rl.sft_data: a chats.jsonl or the generated set of the built-in tasks, one context stage). `Trainer(cfg,
data=factory)` takes any external data source with the same interface (see `Trainer.__init__`).

Exact resume: `resume=True` restores everything a step depends on, so on CPU the continued run reproduces the
uninterrupted one bit for bit (same `steps`; changing `steps` on resume re-times the LR schedule and stages).
"""
from __future__ import annotations

import logging
import math
import os
import signal
import statistics
import threading
import time
import warnings
from contextlib import nullcontext
from typing import Any, Optional, Sequence

import torch

from k3.config import K3Config
from k3.errors import K3ConfigError, K3Error
from k3.ops.loss import IGNORE_INDEX
from k3.train import checkpointing as ckpt_io
from k3.train import report
from k3.train.report import MTPSums, balancer_record
from k3.train.checkpointing import (CKPT_PREFIX, STATE_FILE, STATE_JSON, RunLock, find_checkpoints,  # noqa: F401
                                    latest_checkpoint, open_run_dir)
from k3.train.config import SPIKE_MIN_HISTORY, SPIKE_WINDOW  # noqa: F401 (re-exported)
from k3.train.config import (DEFAULT_STAGES, DEFAULT_STEPS, DEFAULT_TOKENS_PER_STEP, TrainConfig,  # noqa: F401
                             auto_threads, check_resume_settings, format_stages, parse_stages, resolve_compile,
                             resolve_device, resolve_param_dtype, resume_config, stored_train_config)
from k3.train.probes import greedy_generate, recall_batch  # noqa: F401

log = logging.getLogger("k3.train")

__all__ = ["TrainConfig", "Trainer", "TrainingError", "Callback", "parse_stages", "format_stages",
           "find_checkpoints", "latest_checkpoint", "resume_config", "recall_batch", "greedy_generate", "DEFAULT_STAGES",
           "DEFAULT_STEPS", "DEFAULT_TOKENS_PER_STEP"]

_RUN_OUTPUTS = ("metrics.jsonl", "final")  # with checkpoints/step-*: what marks a directory as holding a run


class TrainingError(K3Error, RuntimeError):
    """The run cannot continue (e.g. the loss kept being NaN/inf), or its result is not finite."""


class _Abort(KeyboardInterrupt):
    """A second Ctrl-C: stop at once, without a checkpoint."""


class Callback:
    """Hooks for tests and tools. Any method but `on_step_record` may raise KeyboardInterrupt (handled like
    Ctrl-C)."""

    def on_train_start(self, trainer: "Trainer") -> None: ...
    def on_loss(self, trainer: "Trainer", loss: torch.Tensor) -> torch.Tensor:  # per micro-batch, may replace
        return loss
    def on_step_record(self, trainer: "Trainer", record: dict) -> None:
        """Add fields to the step record before it is logged (metrics.jsonl, TensorBoard, history); must not
        raise. on_step_end runs after the record is written, so fields it adds are not logged."""
    def on_step_end(self, trainer: "Trainer", record: dict) -> None: ...
    def on_eval(self, trainer: "Trainer", metrics: dict) -> None: ...
    def on_save(self, trainer: "Trainer", path: str) -> None: ...


# ----------------------------------------------------------------------------------------------- trainer

class Trainer:
    def __init__(self, cfg: TrainConfig, model_config: Optional[K3Config] = None,
                 callbacks: Sequence[Callback] = (), data=None):
        """data: an external data source instead of `cfg.data` -- a callable (tokenizer, seq_len, batch_size,
        seed) -> an object with `tokenizer`, `train` (next_batch(seq_len, batch_size), state_dict(),
        load_state_dict(), epoch_progress) and `val` (batches(seq_len, batch_size, max_batches)), e.g.
        k3.rl.sft_data.build_sft_data. The tokenizer comes from `cfg.tokenizer`, the run's checkpoint when
        resuming, or `cfg.init_from`. `cfg.task == "sft"` uses k3.rl.sft_data when `data` is None."""
        self.cfg = cfg
        self._data_factory = data
        self.callbacks = list(callbacks)
        self._model_config = model_config
        self.step = 0                 # optimizer steps completed
        self.bad_streak = 0
        self.grad_norm_window: list[float] = []   # the last SPIKE_WINDOW updated steps' gradient norms (spike rule)
        self.tokens_seen = 0
        self.train_time = 0.0         # seconds spent in training steps (all sessions)
        self.resumed_from: Optional[str] = None
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self._stop_requested = False
        self._tb = None
        self._lock: Optional[RunLock] = None
        self._setup_done = False

    # ------------------------------------------------------------------ setup
    @property
    def out_dir(self) -> str:
        return self.cfg.out_dir

    def _path(self, *p) -> str:
        return os.path.join(self.cfg.out_dir, *p)

    def holds_run(self) -> bool:
        """Whether out_dir holds (part of) a run: checkpoints, metrics or a final model."""
        return bool(find_checkpoints(self.cfg.out_dir)) or any(os.path.exists(self._path(n)) for n in _RUN_OUTPUTS)

    def setup(self) -> "Trainer":
        """Validate the arguments (before anything is written), take the run directory's lock, build data, model,
        optimizer and schedules, and restore the last checkpoint when resuming."""
        if self._setup_done:
            return self
        cfg = self.cfg
        cfg.validate()
        held = None
        if not cfg.resume and not cfg.overwrite and self.holds_run():
            held = (f"{cfg.out_dir} already holds a training run ({len(find_checkpoints(cfg.out_dir))} "
                    f"checkpoint(s)): continue it with --resume, replace it with --overwrite, or choose another --out")
        self._lock = open_run_dir(cfg.out_dir, self._setup, refuse=held, remove_created=True)
        self._setup_done = True
        return self

    def close(self) -> None:
        """Release the run directory's lock (train() does this at its end)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _setup(self) -> None:
        cfg = self.cfg
        ckpt = state = None
        if cfg.resume:
            stored = stored_train_config(cfg.out_dir)
            if stored is not None and find_checkpoints(cfg.out_dir):  # refused before any file is touched
                check_resume_settings(cfg, stored, self._path("train_config.json"))
            ckpt, state = ckpt_io.pick_resume_checkpoint(cfg.out_dir)
            if ckpt is None:
                log.warning("--resume: no checkpoint in %s; starting a new run", cfg.out_dir)
        self.device = resolve_device(cfg.device)
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        elif self.device.type == "cpu":
            torch.set_num_threads(auto_threads())
        self.threads = torch.get_num_threads()
        ckpt_io.seed_everything(cfg.seed)

        init = None
        if cfg.init_from is not None:
            from k3.train.config import resolve_init_checkpoint
            init = resolve_init_checkpoint(cfg.init_from)
        mcfg = self._run_model_config(ckpt, init)

        # ---- data + tokenizer
        from k3.train.data import build_data
        first_seq = self._stage_seq_len(0)
        rows = cfg.tokens_per_step // first_seq
        tok_path = self._tokenizer_path(ckpt, init)
        t0 = time.time()
        factory = self._resolved_data_factory()
        if factory is not None:
            self.data = factory(self._factory_tokenizer(tok_path), first_seq, rows, cfg.seed)
        else:
            self.data = build_data(cfg.data, vocab_size=mcfg.vocab_size, seq_len=first_seq, batch_size=rows,
                                   seed=cfg.seed, tokenizer_path=tok_path, cache=cfg.cache_dir,
                                   split_sections=cfg.split_sections)
        self.data_time = time.time() - t0
        self.tokenizer = self.data.tokenizer
        self.model_config = mcfg = self._fit_tokenizer(mcfg, self.tokenizer)

        # ---- model (k3.train.build)
        from k3.train.build import build_model
        self.model, self.param_dtype, self.compile_mode = build_model(cfg, mcfg, self.device)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        if init is not None and ckpt is None:
            self._load_init_weights(init)

        # ---- optimizer / schedule / balancer
        from k3.train.optim import build_optimizer
        from k3.train.build import make_balancer
        from k3.train.schedule import ContextSchedule, cosine_with_warmup
        self.optimizer = build_optimizer(self.model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         adamw_lr=cfg.adamw_lr, master_weights=self.param_dtype != "fp32")
        self.warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.05 * cfg.steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(self.warmup_steps, cfg.steps, cfg.min_lr_ratio))
        self.schedule = ContextSchedule(cfg.steps, cfg.tokens_per_step, cfg.stages)
        self.balancer = make_balancer(cfg.balancer, self.model, mcfg)

        # ---- run directory
        if ckpt is not None:
            self.load_checkpoint(ckpt, state)
            self.history, self.eval_history = report.truncate_metrics(self._path("metrics.jsonl"), self.step)
        else:
            ckpt_io.clear_run_outputs(cfg.out_dir)
        mcfg.save_json(self._path("config.json"))
        ckpt_io.atomic_json(self.cfg.to_dict(), self._path("train_config.json"))
        ckpt_io.cleanup_tmp(cfg.out_dir)

    # setup steps the distributed trainer shares (k3.parallel.training)
    def _run_model_config(self, ckpt: Optional[str], init: Optional[str]) -> K3Config:
        """The model config (a resumed run always uses the run's own config.json; then --init's, the one given,
        --config or --preset; model overrides on a new run)."""
        cfg = self.cfg
        if ckpt is not None and os.path.isfile(self._path("config.json")):
            mcfg = K3Config.from_json(self._path("config.json"))
        elif init is not None:
            mcfg = K3Config.load(init)
        elif self._model_config is not None:
            mcfg = self._model_config
        else:
            mcfg = K3Config.load(cfg.config) if cfg.config else K3Config.from_preset(cfg.preset)
        if cfg.model_overrides and ckpt is None:
            mcfg = mcfg.replace(**cfg.model_overrides)
        return mcfg

    def _resolved_data_factory(self):
        """The run's data factory, or None for `cfg.data` through `k3.train.data.build_data` (pre-training text):
        the external one given as `Trainer(data=...)`, else for `task == "sft"` k3.rl.sft_data's (chats.jsonl or
        the generated set of the built-in tasks, assistant-only labels). `k3.parallel.setup.build_run_data`
        resolves it here too, so `k3 sft` under torchrun trains on the same SFT batches as in one process."""
        if self._data_factory is not None:
            return self._data_factory
        cfg = self.cfg
        if cfg.task != "sft":
            return None
        from k3.rl.sft_data import build_sft_data

        def sft_factory(tok, seq_len, batch_size, seed):
            return build_sft_data(tok, seq_len, batch_size, seed=seed, data=cfg.sft_data,
                                  n_per_task=cfg.sft_per_task, tasks=cfg.sft_tasks)
        return sft_factory

    def _factory_tokenizer(self, tok_path: Optional[str], optional: bool = False):
        """The tokenizer a data factory gets: the one at `tok_path` (`_tokenizer_path`); without one
        K3ConfigError, or None when `optional` (a factory that brings its own tokenizer)."""
        if tok_path is None:
            if optional:
                return None
            what = "k3 sft" if self._data_factory is None and self.cfg.task == "sft" else "an external data source"
            raise K3ConfigError(f"{what} needs a tokenizer: --tokenizer, or --ckpt with a tokenizer.json")
        from k3.train.data import HFTokenizer, get_tokenizer
        return HFTokenizer(get_tokenizer(path=tok_path))

    def _tokenizer_path(self, ckpt: Optional[str], init: Optional[str]) -> Optional[str]:
        """--tokenizer, else the tokenizer.json of the checkpoint resumed / started from (None: build one)."""
        tok_path = self.cfg.tokenizer
        for src in (ckpt, init):
            if src is not None and tok_path is None and os.path.isfile(os.path.join(src, "tokenizer.json")):
                tok_path = src
        return tok_path

    @staticmethod
    def _fit_tokenizer(mcfg: K3Config, tok) -> K3Config:
        """The config with the tokenizer's special ids (its vocabulary must fit the model's)."""
        if tok.vocab_size > mcfg.vocab_size:
            raise K3ConfigError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                                f"{mcfg.vocab_size}")
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        if any(getattr(mcfg, k) != v for k, v in ids.items()):
            log.info("setting the config's special token ids from the tokenizer: %s", ids)
            mcfg = mcfg.replace(**ids)
        return mcfg

    def _load_init_weights(self, path: str) -> None:
        """The weights of `--ckpt` (every model key must match; the optimizer starts fresh)."""
        from k3.checkpoint import load_state_dict
        from k3.errors import CheckpointError
        sd = load_state_dict(path, config=self.model_config)
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"--ckpt {path}: model keys do not match (missing {missing[:5]}, unexpected "
                                  f"{unexpected[:5]})")
        log.info("initialised from %s", path)

    def _stage_seq_len(self, idx: int) -> int:
        from k3.train.schedule import _validate
        return _validate(self.cfg.stages)[idx][0]

    # ------------------------------------------------------------------ checkpoints (k3.train.checkpointing)
    def state(self) -> dict:
        """Everything a step depends on, as tensors / numbers / strings / containers (loads with weights_only)."""
        stage, seq = self.schedule.stage_at(self.step)
        return {
            "step": self.step, "stage": stage, "seq_len": seq, "tokens_seen": self.tokens_seen,
            "train_time": self.train_time, "bad_streak": self.bad_streak, "grad_norm_window": self.grad_norm_window,
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "balancer": self.balancer.state_dict() if self.balancer is not None else None,
            "loader": self.data.train.state_dict(), "rng": ckpt_io.rng_state(),
            "train_config": self.cfg.to_dict(), "tokenizer_fingerprint": self.tokenizer.fingerprint,
        }

    def latest_checkpoint_path(self) -> Optional[str]:
        """The run's newest checkpoint (None: none yet); the distributed trainer's are DCP directories."""
        return latest_checkpoint(self.cfg.out_dir)

    def save_checkpoint(self) -> str:
        """Write checkpoints/step-<step>/ atomically; prune to the last `keep`. Returns its path."""
        return ckpt_io.save_checkpoint(self)

    def _write_state(self, state: dict, path: str) -> None:
        ckpt_io.atomic_torch_save(state, path)

    def load_checkpoint(self, path: str, state: Optional[dict] = None) -> None:
        ckpt_io.restore_checkpoint(self, path, state)

    # ------------------------------------------------------------------ evaluation (k3.train.probes)
    def _autocast(self):
        if self.device.type == "cuda" and self.param_dtype == "fp32":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    # evaluation hooks of k3.train.probes.evaluate (the distributed trainer slices and sums over its ranks)
    def _eval_batch(self, b: dict, seq: int) -> dict:
        return {k: v.to(self.device) for k, v in b.items()}

    def _sum_over_ranks(self, values: list) -> list:
        return values

    def _recall_enabled(self) -> bool:
        return True

    def evaluate(self) -> dict:
        """Validation loss on fixed batches + MQAR recall accuracy. The RNG state is untouched."""
        from k3.train.probes import evaluate
        return evaluate(self)

    def samples(self) -> list[tuple[str, str]]:
        from k3.train.probes import samples
        return samples(self)

    # ------------------------------------------------------------------ logging
    def _log(self, rec: dict) -> None:
        with open(self._path("metrics.jsonl"), "a") as f:
            f.write(report.json_line(rec) + "\n")
        if self._tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v):
                    self._tb.add_scalar(f"{rec.get('type', 'train')}/{k}", v, rec["step"])

    def _open_tensorboard(self) -> None:
        if not self.cfg.tensorboard:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warnings.warn("tensorboard is not installed: skipping TensorBoard logs (pip install tensorboard)")
            return
        self._tb = SummaryWriter(self._path("tb"))

    # ------------------------------------------------------------------ one step
    def _micro_batches(self, seq: int, rows: int) -> list[dict]:
        ga = self.cfg.grad_accum
        sizes = [rows // ga + (1 if i < rows % ga else 0) for i in range(ga)]
        return [self.data.train.next_batch(seq, r) for r in sizes]

    def _begin_step(self) -> tuple:
        """(start time, stage, seq_len, rows, micro-batches) of the next step; the loader position is kept for a
        rollback."""
        stage, seq = self.schedule.stage_at(self.step)
        rows = self.cfg.tokens_per_step // seq
        t0 = time.time()
        self._loader_at_step_start = self.data.train.state_dict()
        self._phase = "compute"
        return t0, stage, seq, rows, self._micro_batches(seq, rows)

    def train_step(self) -> dict:
        """One optimizer step (or a skipped one). Returns the step record (not yet logged)."""
        t0, stage, seq, rows, batches = self._begin_step()
        counts = [int((b["labels"] != IGNORE_INDEX).sum()) for b in batches]   # host batches: no device sync
        n_total = sum(counts)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        bad = False
        aux_total = 0.0
        mtp = MTPSums()   # MTP runs (num_nextn_predict_layers > 0): per-depth and next-token losses
        for b, n_b in zip(batches, counts):
            b = {k: v.to(self.device, non_blocking=True) for k, v in b.items()}
            with self._autocast():
                out = self.model(**b)
            loss = out.loss.float()
            for cb in self.callbacks:
                loss = cb.on_loss(self, loss)
            w = n_b / max(n_total, 1)
            obj = loss * w
            if self.balancer is not None:
                aux = self.balancer.aux_loss()
                if isinstance(aux, torch.Tensor) and aux.requires_grad:
                    obj = obj + aux.to(obj.device) * (1.0 / len(batches))
                    aux_total += float(aux.detach())
            # backward is queued before the host looks at the loss: a non-finite loss leaves non-finite gradients,
            # which the skipped step below discards (checking first made the host wait for the forward while the
            # GPU had nothing queued)
            obj.backward()
            if not torch.isfinite(loss.detach()):
                bad = True
                break
            loss_sum += loss.detach().double() * w
            mtp.add(out, w)
        return self._finish_step(t0, stage, seq, rows, loss_sum, bad, aux_total, mtp)

    # the parts of a step the distributed trainer shares (k3.parallel.training), with its reductions as hooks
    def _spike_median(self, grad_norm: float) -> Optional[float]:
        """The median of the recent gradient norms when `grad_norm` is a spike under `skip_grad_spikes`, else None."""
        f = self.cfg.skip_grad_spikes
        if f is None or len(self.grad_norm_window) < SPIKE_MIN_HISTORY:
            return None
        med = statistics.median(self.grad_norm_window)
        return med if grad_norm > f * med else None

    def _clip_grad_norm(self, params: list) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf"))

    def _reduce_max_logit(self, local: list) -> Optional[float]:
        return max(local) if local else None

    def _qk_clip(self) -> int:
        from k3.train.optim import qk_clip
        return qk_clip(self.model, tau=self.cfg.qk_clip_tau, optimizer=self.optimizer)

    def _finish_step(self, t0: float, stage: int, seq: int, rows: int, loss, bad: bool, aux_total: float,
                     mtp: "MTPSums") -> dict:
        """After the backward passes: clip, update (or skip a bad step), LR schedule, counters; returns the step
        record (`loss`, `mtp` already summed over the ranks)."""
        grad_norm = float("nan")
        rec: dict[str, Any] = {"type": "train"}
        if not bad:
            params = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = float(self._clip_grad_norm(params))
            bad = not math.isfinite(grad_norm)
            med = self._spike_median(grad_norm) if not bad else None
            if med is not None:
                bad, rec["grad_spike_median"] = True, med
            elif not bad:
                self.grad_norm_window = (self.grad_norm_window + [grad_norm])[-SPIKE_WINDOW:]
        clipped = 0
        self._phase = "update"
        if bad:
            self.optimizer.zero_grad(set_to_none=True)
            self._discard_balancer_stats()
            self.bad_streak += 1
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            local = [float(m.last_max_logit.max()) for m in self.model.modules()
                     if getattr(m, "last_max_logit", None) is not None]
            max_logit = self._reduce_max_logit(local)
            clipped = self._qk_clip() if self.cfg.qk_clip_tau > 0 else 0
            if self.balancer is not None:
                self.balancer.step()
            self.bad_streak = 0
            if local:
                rec["max_logit"] = max_logit
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.time() - t0
        tokens = rows * seq
        self.step += 1
        self.tokens_seen += tokens
        self.train_time += dt
        self._phase = "idle"
        spike = "grad_spike_median" in rec   # a skipped spike keeps its (finite) loss in the record
        rec.update({"step": self.step, "loss": float(loss) if not bad or spike else float("nan"), "lr": lr,
                    "tokens": tokens, "tokens_per_s": tokens / max(dt, 1e-9), "step_time": dt,
                    "seq_len": seq, "stage": stage, "batch_rows": rows, "grad_norm": grad_norm,
                    "skipped": bad, "tokens_seen": self.tokens_seen, "epoch": self.data.train.epoch_progress})
        if clipped:
            rec["qk_clipped_heads"] = clipped
        if not bad:
            rec.update(mtp.record())
        if aux_total:
            rec["aux_loss"] = aux_total
        if self.balancer is not None and not bad:
            rec.update(balancer_record(self.balancer))
        return rec

    def _discard_balancer_stats(self) -> None:
        b = self.balancer
        if b is None:
            return
        b.discard_stats()

    # ------------------------------------------------------------------ loop
    def _rollback_partial_step(self) -> None:
        """Interrupted between fetching a step's batches and updating: undo the data position and the
        gradients, so the checkpoint is exactly the state after the last completed step."""
        if getattr(self, "_phase", "idle") != "compute":
            return
        self.data.train.load_state_dict(self._loader_at_step_start)
        self.optimizer.zero_grad(set_to_none=True)
        self._discard_balancer_stats()
        self._phase = "idle"

    def _on_sigint(self, signum, frame):
        if self._stop_requested:  # second Ctrl-C: give up immediately
            raise _Abort
        self._stop_requested = True
        log.warning("Ctrl-C: finishing the current step, saving a checkpoint (Ctrl-C again to abort)")

    def train(self) -> dict:
        """Run to `steps` (or `stop_at`); returns the summary dict (also written to report.md). The run
        directory stays locked until the end."""
        self.setup()
        try:
            return self._train()
        finally:
            self.close()

    def _train(self) -> dict:
        cfg = self.cfg
        t_start = time.time()
        self._open_tensorboard()
        old_handler = None
        if threading.current_thread() is threading.main_thread():
            old_handler = signal.signal(signal.SIGINT, self._on_sigint)
        status = "completed"
        pbar = None
        try:
            for cb in self.callbacks:
                cb.on_train_start(self)
            if not self.eval_history or self.resumed_from is None:
                self._run_eval()
            self.first_eval = self.eval_history[0] if self.eval_history else None
            end = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
            eval_every = cfg.eval_every if cfg.eval_every is not None else max(1, cfg.steps // 4)
            pbar = report.progress_bar(cfg.progress, self.step, end)
            last_saved = self.step
            while self.step < end:
                if self._stop_requested:
                    raise KeyboardInterrupt
                rec = self.train_step()
                if rec["skipped"] and "grad_spike_median" in rec:
                    log.warning("step %d: gradient norm %.4g is over %g x the median %.4g of the last %d updated "
                                "steps: step skipped (--skip-grad-spikes; %d in a row)", rec["step"], rec["grad_norm"],
                                cfg.skip_grad_spikes, rec["grad_spike_median"], len(self.grad_norm_window),
                                self.bad_streak)
                elif rec["skipped"]:
                    log.warning("step %d: non-finite loss/gradient (loss %s, grad norm %s): step skipped "
                                "(%d in a row)", rec["step"], rec["loss"], rec["grad_norm"], self.bad_streak)
                for cb in self.callbacks:
                    cb.on_step_record(self, rec)
                self.history.append(rec)
                self._log(rec)
                if pbar is not None:
                    report.set_postfix(pbar, rec)
                    pbar.update(1)
                if self.bad_streak > cfg.max_bad_steps:
                    raise TrainingError(
                        f"stopping at step {self.step}: the loss or gradient was NaN/inf"
                        f"{' (or a --skip-grad-spikes spike)' if cfg.skip_grad_spikes is not None else ''} for "
                        f"{self.bad_streak} consecutive steps (limit --max-bad-steps {cfg.max_bad_steps}). Lower "
                        f"--lr, check the "
                        f"data, or resume from the last good checkpoint ({self.latest_checkpoint_path()}).")
                for cb in self.callbacks:
                    cb.on_step_end(self, rec)
                if eval_every and self.step % eval_every == 0 and self.step < end:
                    self._run_eval()
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < end:
                    self.save_checkpoint()
                    last_saved = self.step
            if self.step >= cfg.steps:
                self._run_eval()
            if self.step != last_saved or not find_checkpoints(cfg.out_dir):
                self.save_checkpoint()
            if self.step < cfg.steps:
                status = "stopped"
        except _Abort:
            print(f"\nk3 train: aborted at step {self.step}; last checkpoint: {self.latest_checkpoint_path()}",
                  flush=True)
            raise
        except KeyboardInterrupt:
            status = "interrupted"
            if getattr(self, "_phase", "idle") == "update":  # pragma: no cover - only a raise inside an update
                raise
            self._rollback_partial_step()
            if pbar is not None:
                pbar.close()
                pbar = None
            path = self.save_checkpoint()
            print(f"\nk3 train: interrupted at step {self.step}/{cfg.steps}; checkpoint saved to {path}\n"
                  f"          continue with: k3 train --out {cfg.out_dir} --resume", flush=True)
        finally:
            if pbar is not None:
                pbar.close()
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
            if self._tb is not None:
                self._tb.flush()
        summary = self._finish(status, time.time() - t_start)
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        return summary

    def _run_eval(self) -> dict:
        m = self.evaluate()
        rec = {"type": "eval", "step": self.step, **m}
        self.eval_history.append(rec)
        self._log(rec)
        for cb in self.callbacks:
            cb.on_eval(self, rec)
        return rec

    # ------------------------------------------------------------------ end of run
    def _finish(self, status: str, wall: float) -> dict:
        cfg = self.cfg
        summary = report.build_summary(self, status, wall)
        from k3.train.probes import non_finite_result
        failure = non_finite_result(self) if status == "completed" else None
        if failure is not None:
            summary["status"] = "failed"
            report.write_artifacts(self, summary)
            raise TrainingError(f"the run reached step {self.step} but {failure}; no final model was written "
                                f"(lower --lr or check the data; last checkpoint: {summary['checkpoint']})")
        if status == "completed":
            from k3.checkpoint import save_pretrained
            save_pretrained(self.model, self._path("final"), tokenizer=self.tokenizer)
            summary["final"] = self._path("final")
            if cfg.samples:
                try:
                    summary["samples"] = self.samples()
                except Exception as e:  # never lose a finished run over a sample
                    log.warning("sample generation failed: %s", e)
        report.write_artifacts(self, summary)
        return summary
