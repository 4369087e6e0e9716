"""The training loop: `Trainer(TrainConfig(...)).train()` is what `k3 train` runs.

One optimizer step consumes `tokens_per_step` tokens, split into `grad_accum` micro-batches of packed rows
(`cu_seqlens`, nothing crosses a document). The row length follows the context-extension stages
(`k3.train.schedule`), the token budget per step stays constant. Per step: forward/backward (bf16 autocast on GPU,
fp32 on CPU) -> grad-norm clip -> MuonAdamW step -> LR schedule -> QK-clip on MLA -> balancer step.

Run directory (`out_dir`):
    config.json            resolved model config             train_config.json   resolved training arguments
    metrics.jsonl          one JSON object per step ({"type": "train", ...}) and per evaluation ({"type": "eval"})
    checkpoints/step-XXXXXXXX/   model (k3.checkpoint layout + tokenizer.json) + trainer_state.pt (optimizer,
                           LR schedule, balancer, loader position, stage, step, RNG states) + trainer_state.json
    final/                 the final model + tokenizer (loads with k3.checkpoint.from_pretrained)
    loss.png, samples.txt, report.md, tb/ (TensorBoard, if installed)

Checkpoints are written to a hidden temp directory and renamed into place, so an interrupted save leaves the
previous checkpoint intact; only the last `keep` are kept. Ctrl-C finishes the current step, saves and returns.
A non-finite loss or gradient norm skips the step (no optimizer update, gradients zeroed); more than
`max_bad_steps` in a row stop the run with `TrainingError`.

Exact resume: `resume=True` restores everything a step depends on, so on CPU the continued run reproduces the
uninterrupted one bit for bit (same `steps`; changing `steps` on resume re-times the LR schedule and stages).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from k3.config import K3Config
from k3.errors import CheckpointError, K3ConfigError, K3Error
from k3.ops.loss import IGNORE_INDEX

log = logging.getLogger("k3.train")

__all__ = ["TrainConfig", "Trainer", "TrainingError", "Callback", "parse_stages", "format_stages",
           "find_checkpoints", "latest_checkpoint", "resume_config", "recall_batch", "greedy_generate", "DEFAULT_STAGES",
           "DEFAULT_STEPS", "DEFAULT_TOKENS_PER_STEP"]

# Default run (`k3 train` with no arguments): the `tiny` preset on the built-in corpus, sized to finish within
# ~10 minutes on 2 CPU cores including tokenizer training (see benchmarks/RESULTS.md / the trainer tests).
# Context stages scaled from K3's 8K -> 64K -> 256K -> 1M: most steps short, a few long ones at the end.
DEFAULT_STAGES = [(256, 0.6), (1024, 0.3), (2048, 0.1)]
DEFAULT_STEPS = 110  # measured: 72 steps took 4:07 on an idle-ish 2-core VM (643 tokens/s); 110 -> ~6.5 min
DEFAULT_TOKENS_PER_STEP = 2048

CKPT_PREFIX = "step-"
STATE_FILE = "trainer_state.pt"
STATE_JSON = "trainer_state.json"


class TrainingError(K3Error, RuntimeError):
    """The run cannot continue (e.g. the loss kept being NaN/inf)."""


class _Abort(KeyboardInterrupt):
    """A second Ctrl-C: stop at once, without a checkpoint."""


# ------------------------------------------------------------------------------------------------- config

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
        return out
    return [(int(s), float(f)) for s, f in spec]


def format_stages(stages) -> str:
    return ",".join(f"{s}:{f:g}" for s, f in stages)


def resolve_compile(mode: str, device) -> str:
    """'auto' -> torch.compile of the sub-modules on CUDA (measured faster and leaner there), none on CPU."""
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
    if dtype not in ("auto", "fp32", "bf16"):
        raise K3ConfigError(f"--param-dtype must be auto, fp32 or bf16, got {dtype!r}")
    if dtype == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    return dtype


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
    max_bad_steps: int = 5                  # consecutive NaN/inf steps tolerated
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
        if self.steps < 1:
            raise K3ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.grad_accum < 1:
            raise K3ConfigError(f"--grad-accum must be >= 1, got {self.grad_accum}")
        if self.lr <= 0:
            raise K3ConfigError(f"--lr must be > 0, got {self.lr}")
        for seq, _ in self.stages:
            rows = self.tokens_per_step // seq
            if rows < 1:
                raise K3ConfigError(f"stage seq_len {seq} > --batch-tokens {self.tokens_per_step}: raise the tokens "
                                    f"per step or shorten the stage")
            if rows < self.grad_accum:
                raise K3ConfigError(f"stage seq_len {seq}: {rows} rows per step cannot be split into "
                                    f"--grad-accum {self.grad_accum} micro-batches")
        resolve_param_dtype(self.param_dtype, "cpu")  # names the known values
        if self.max_bad_steps < 0 or self.keep < 1:
            raise K3ConfigError("--max-bad-steps must be >= 0 and --keep >= 1")


class Callback:
    """Hooks for tests and tools. Any method may raise KeyboardInterrupt (handled like Ctrl-C)."""

    def on_train_start(self, trainer: "Trainer") -> None: ...
    def on_loss(self, trainer: "Trainer", loss: torch.Tensor) -> torch.Tensor:  # per micro-batch, may replace
        return loss
    def on_step_end(self, trainer: "Trainer", record: dict) -> None: ...
    def on_eval(self, trainer: "Trainer", metrics: dict) -> None: ...
    def on_save(self, trainer: "Trainer", path: str) -> None: ...


# ------------------------------------------------------------------------------------------ checkpoints dir

def find_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints of a run, oldest first: [(step, path)]."""
    d = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(d):
        return []
    out = []
    for name in os.listdir(d):
        if name.startswith(CKPT_PREFIX) and os.path.isfile(os.path.join(d, name, STATE_FILE)):
            try:
                out.append((int(name[len(CKPT_PREFIX):]), os.path.join(d, name)))
            except ValueError:
                continue
    return sorted(out)


def latest_checkpoint(out_dir: str) -> Optional[str]:
    ck = find_checkpoints(out_dir)
    return ck[-1][1] if ck else None


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _atomic_torch_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_json(obj, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def resume_config(out_dir: str, overrides: Optional[dict] = None) -> TrainConfig:
    """The training arguments of the run in `out_dir` (its train_config.json) with `overrides` applied and
    `resume=True`; a directory without train_config.json gives TrainConfig(**overrides)."""
    p = os.path.join(out_dir, "train_config.json")
    base = TrainConfig()
    if os.path.isfile(p):
        with open(p) as f:
            base = TrainConfig.from_dict(json.load(f))
    for k, v in (overrides or {}).items():
        if k == "stages":
            v = parse_stages(v)
        setattr(base, k, v)
    base.out_dir, base.resume = out_dir, True
    return base


# ------------------------------------------------------------------------------------------- RNG state

def _rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all(st["cuda"])
        except (RuntimeError, IndexError):  # pragma: no cover - different GPU count
            log.warning("could not restore CUDA RNG states (different device count)")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------- eval helpers

def recall_batch(vocab_lo: int, vocab_hi: int, n_examples: int, n_pairs: int, seed: int = 1234,
                 n_queries: Optional[int] = None):
    """Multi-query associative recall (MQAR): each row is `k1 v1 k2 v2 ... kn vn  q1 a1 q2 a2 ...` with keys and
    values drawn (without repetition inside a row) from token ids [vocab_lo, vocab_hi); each query is one of the
    row's keys and must be answered with its value. Returns (input_ids [B, T], query_pos [B, Q], answers [B, Q],
    candidates [B, n]) where the model's prediction at `query_pos` should be `answers`. Deterministic in `seed`."""
    n_queries = n_pairs if n_queries is None else n_queries
    g = torch.Generator().manual_seed(seed)
    span = vocab_hi - vocab_lo
    if span < 2 * n_pairs:
        raise K3ConfigError(f"recall task: vocabulary range {span} too small for {n_pairs} pairs")
    rows, qpos, ans, cands = [], [], [], []
    for _ in range(n_examples):
        toks = torch.randperm(span, generator=g)[: 2 * n_pairs] + vocab_lo
        keys, vals = toks[:n_pairs], toks[n_pairs:]
        ctx = torch.stack([keys, vals], 1).reshape(-1)
        which = torch.randperm(n_pairs, generator=g)[:n_queries] if n_queries <= n_pairs else \
            torch.randint(0, n_pairs, (n_queries,), generator=g)
        qa = torch.stack([keys[which], vals[which]], 1).reshape(-1)
        rows.append(torch.cat([ctx, qa]))
        qpos.append(2 * n_pairs + 2 * torch.arange(n_queries))
        ans.append(vals[which])
        cands.append(vals)
    return torch.stack(rows), torch.stack(qpos), torch.stack(ans), torch.stack(cands)


@torch.no_grad()
def greedy_generate(model, ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """Plain greedy decoding without a cache (re-runs the whole prefix each token): fine for short samples."""
    out = list(ids)
    dev = model.device
    for _ in range(max_new_tokens):
        x = torch.tensor([out], dtype=torch.long, device=dev)
        logits = model(x, logits_to_keep=1).logits[0, -1]
        nxt = int(torch.argmax(logits.float()))
        out.append(nxt)
        if nxt in stop_ids:
            break
    return out[len(ids):]


def _auto_threads() -> int:
    """CPU threads for training: torch's default, less the cores other processes keep busy (1-minute load
    average). Oversubscribed OpenMP barriers are very slow: on 2 shared cores, 1 thread can be 2-5x faster."""
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


def _resolve_device(spec: str) -> torch.device:
    if spec in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise K3ConfigError(f"--device {spec}: CUDA is not available")
    return dev


# ----------------------------------------------------------------------------------------------- trainer

class Trainer:
    def __init__(self, cfg: TrainConfig, model_config: Optional[K3Config] = None,
                 callbacks: Sequence[Callback] = ()):
        self.cfg = cfg
        self.callbacks = list(callbacks)
        self._model_config = model_config
        self.step = 0                 # optimizer steps completed
        self.bad_streak = 0
        self.tokens_seen = 0
        self.train_time = 0.0         # seconds spent in training steps (all sessions)
        self.resumed_from: Optional[str] = None
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self._stop_requested = False
        self._tb = None
        self._setup_done = False

    # ------------------------------------------------------------------ setup
    @property
    def out_dir(self) -> str:
        return self.cfg.out_dir

    def _path(self, *p) -> str:
        return os.path.join(self.cfg.out_dir, *p)

    def setup(self) -> "Trainer":
        if self._setup_done:
            return self
        cfg = self.cfg
        os.makedirs(cfg.out_dir, exist_ok=True)
        ckpt = None
        if cfg.resume:
            ckpt = latest_checkpoint(cfg.out_dir)
            if ckpt is None:
                log.warning("--resume: no checkpoint in %s; starting a new run", cfg.out_dir)
        cfg.validate()
        self.device = _resolve_device(cfg.device)
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        elif self.device.type == "cpu":
            torch.set_num_threads(_auto_threads())
        self.threads = torch.get_num_threads()
        _seed_everything(cfg.seed)

        # ---- model config (a resumed run always uses the run's own config.json)
        if ckpt is not None and os.path.isfile(self._path("config.json")):
            mcfg = K3Config.from_json(self._path("config.json"))
        elif self._model_config is not None:
            mcfg = self._model_config
        else:
            mcfg = K3Config.load(cfg.config) if cfg.config else K3Config.from_preset(cfg.preset)
        if cfg.model_overrides and ckpt is None:
            mcfg = mcfg.replace(**cfg.model_overrides)

        # ---- data + tokenizer
        from k3.train.data import build_data
        first_seq = self._stage_seq_len(0)
        rows = cfg.tokens_per_step // first_seq
        tok_path = cfg.tokenizer
        if ckpt is not None and tok_path is None and os.path.isfile(os.path.join(ckpt, "tokenizer.json")):
            tok_path = ckpt
        t0 = time.time()
        self.data = build_data(cfg.data, vocab_size=mcfg.vocab_size, seq_len=first_seq, batch_size=rows,
                               seed=cfg.seed, tokenizer_path=tok_path, cache=cfg.cache_dir,
                               split_sections=cfg.split_sections)
        self.data_time = time.time() - t0
        self.tokenizer = tok = self.data.tokenizer
        if tok.vocab_size > mcfg.vocab_size:
            raise K3ConfigError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                                f"{mcfg.vocab_size}")
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        if any(getattr(mcfg, k) != v for k, v in ids.items()):
            log.info("setting the config's special token ids from the tokenizer: %s", ids)
            mcfg = mcfg.replace(**ids)
        self.model_config = mcfg

        # ---- model
        from k3.model import K3ForCausalLM
        with torch.device(self.device):
            self.model = K3ForCausalLM(mcfg)
        self.model.float()  # fp32 weights (bf16 autocast on GPU), or bf16 weights with fp32 masters in the optimizer
        self.param_dtype = resolve_param_dtype(cfg.param_dtype, self.device)
        if self.param_dtype == "bf16":
            # the release's storage dtypes: bf16, except the spec's fp32 names (A_log, dt_bias, the short convs,
            # KDA's o_norm, the routing bias that the balancers set)
            from k3.checkpoint import cast_to_storage_dtype
            cast_to_storage_dtype(self.model, torch.bfloat16)
        self.model.train()
        if cfg.activation_checkpointing:
            self.model.set_gradient_checkpointing(True)
        self.compile_mode = resolve_compile(cfg.compile, self.device)
        if self.compile_mode != "none":
            # H200, small B8 T4096: modules 45.1K tok/s (126 GiB) vs eager B4 27.6K tok/s (B8 OOM); RESULTS.md
            from k3.compile import compile_model
            compile_model(self.model, mode=self.compile_mode)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        for m in self.model.modules():
            if hasattr(m, "track_max_logit"):
                m.track_max_logit = True

        # ---- optimizer / schedule / balancer
        from k3.train.optim import build_optimizer
        from k3.train.schedule import ContextSchedule, cosine_with_warmup
        self.optimizer = build_optimizer(self.model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         adamw_lr=cfg.adamw_lr, master_weights=self.param_dtype != "fp32")
        self.warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.05 * cfg.steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(self.warmup_steps, cfg.steps, cfg.min_lr_ratio))
        self.schedule = ContextSchedule(cfg.steps, cfg.tokens_per_step, cfg.stages)
        self.balancer = self._make_balancer(mcfg)

        # ---- run directory
        if ckpt is not None:
            self.load_checkpoint(ckpt)
            self._truncate_metrics(self.step)
        else:
            self._clear_run_outputs()
        mcfg.save_json(self._path("config.json"))
        _atomic_json(self.cfg.to_dict(), self._path("train_config.json"))
        self._cleanup_tmp()
        self._setup_done = True
        return self

    def _stage_seq_len(self, idx: int) -> int:
        from k3.train.schedule import _validate
        return _validate(self.cfg.stages)[idx][0]

    def _make_balancer(self, mcfg: K3Config):
        name = (self.cfg.balancer or "none").lower()
        if mcfg.num_experts <= 0:
            return None
        try:
            from k3.balance import make_balancer
        except ImportError:
            if name != "none":
                warnings.warn(f"k3.balance is not available: training without the '{name}' balancer")
            return None
        try:
            return make_balancer(name).attach(self.model)
        except K3Error as e:
            raise K3ConfigError(f"--balancer {name}: {e}") from e

    def _clear_run_outputs(self) -> None:
        """A fresh (non-resumed) run in an existing directory: start a new metrics log; old checkpoints of a
        previous run would confuse --resume, so they are removed."""
        for name in ("metrics.jsonl",):
            p = self._path(name)
            if os.path.exists(p):
                os.remove(p)
        old = find_checkpoints(self.cfg.out_dir)
        if old:
            log.warning("new run in %s: removing %d old checkpoint(s)", self.cfg.out_dir, len(old))
            for _, p in old:
                shutil.rmtree(p, ignore_errors=True)

    def _truncate_metrics(self, step: int) -> None:
        p = self._path("metrics.jsonl")
        if not os.path.exists(p):
            return
        keep = []
        with open(p) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("step", 0) <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
        with open(p + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(p + ".tmp", p)
        for line in keep:
            rec = json.loads(line)
            (self.history if rec.get("type") == "train" else self.eval_history).append(rec)

    def _cleanup_tmp(self) -> None:
        d = self._path("checkpoints")
        if os.path.isdir(d):
            for name in os.listdir(d):
                if name.startswith("."):
                    shutil.rmtree(os.path.join(d, name), ignore_errors=True)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        stage, seq = self.schedule.stage_at(self.step)
        return {
            "step": self.step, "stage": stage, "seq_len": seq, "tokens_seen": self.tokens_seen,
            "train_time": self.train_time, "bad_streak": self.bad_streak,
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "balancer": self.balancer.state_dict() if self.balancer is not None else None,
            "loader": self.data.train.state_dict(), "rng": _rng_state(),
            "train_config": self.cfg.to_dict(), "tokenizer_fingerprint": self.tokenizer.fingerprint,
        }

    def save_checkpoint(self) -> str:
        """Write checkpoints/step-<step>/ atomically; prune to the last `keep`. Returns its path."""
        from k3.checkpoint import save_pretrained
        root = self._path("checkpoints")
        os.makedirs(root, exist_ok=True)
        name = f"{CKPT_PREFIX}{self.step:08d}"
        final = os.path.join(root, name)
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root)
        try:
            model_dir = os.path.join(tmp, "ckpt")
            save_pretrained(self.model, model_dir, tokenizer=self.tokenizer)
            st = self.state()
            self._write_state(st, os.path.join(model_dir, STATE_FILE))
            _atomic_json({k: st[k] for k in ("step", "stage", "seq_len", "tokens_seen", "train_time")}
                         | {"time": time.time()}, os.path.join(model_dir, STATE_JSON))
            _fsync_dir(model_dir)
            if os.path.isfile(os.path.join(final, STATE_FILE)):  # this step is saved already (same state)
                return final
            if os.path.exists(final):  # leftover without a state file: not a checkpoint
                shutil.rmtree(final)
            os.rename(model_dir, final)
            _fsync_dir(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for _, old in find_checkpoints(self.cfg.out_dir)[:-self.cfg.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for cb in self.callbacks:
            cb.on_save(self, final)
        return final

    def _write_state(self, state: dict, path: str) -> None:
        _atomic_torch_save(state, path)

    def load_checkpoint(self, path: str) -> None:
        from k3.checkpoint import load_state_dict
        sf = os.path.join(path, STATE_FILE)
        if not os.path.isfile(sf):
            raise CheckpointError(f"{path}: {STATE_FILE} is missing (not a training checkpoint)")
        st = torch.load(sf, map_location="cpu", weights_only=False)
        sd = load_state_dict(path, config=self.model_config)
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{path}: model keys do not match (missing {missing[:5]}, "
                                  f"unexpected {unexpected[:5]})")
        if st.get("tokenizer_fingerprint") not in (None, self.tokenizer.fingerprint):
            raise CheckpointError(f"{path}: the checkpoint was trained with a different tokenizer")
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        if self.balancer is not None and st.get("balancer") is not None:
            self.balancer.load_state_dict(st["balancer"])
        self.data.train.load_state_dict(st["loader"])
        _set_rng_state(st["rng"])
        self.step = int(st["step"])
        self.tokens_seen = int(st.get("tokens_seen", 0))
        self.train_time = float(st.get("train_time", 0.0))
        self.bad_streak = int(st.get("bad_streak", 0))
        self.resumed_from = path
        log.info("resumed from %s (step %d)", path, self.step)

    # ------------------------------------------------------------------ evaluation
    def _autocast(self):
        if self.device.type == "cuda" and self.param_dtype == "fp32":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss on fixed batches + MQAR recall accuracy. The RNG state is untouched."""
        was_training = self.model.training
        self.model.eval()
        t0 = time.time()
        try:
            seq = self.cfg.val_seq_len or self._stage_seq_len(0)
            rows = max(1, min(self.cfg.tokens_per_step, self.cfg.val_tokens) // seq)
            n_batches = max(1, self.cfg.val_tokens // (rows * seq))
            tot, n = 0.0, 0
            for b in self.data.val.batches(seq_len=seq, batch_size=rows, max_batches=n_batches):
                b = {k: v.to(self.device) for k, v in b.items()}
                with self._autocast():
                    out = self.model(**b)
                k = int(out.num_tokens)
                tot += float(out.loss) * k
                n += k
            res = {"val_loss": tot / n if n else float("nan"), "val_tokens": n}
            res.update(self._recall())
        finally:
            self.model.train(was_training)
        res["eval_time"] = time.time() - t0
        return res

    @torch.no_grad()
    def _recall(self) -> dict:
        if self.cfg.recall_examples <= 0:
            return {}
        tok = self.tokenizer
        lo, hi = 256, min(tok.special_base, self.model_config.vocab_size)  # ordinary BPE tokens (no bytes/specials)
        ids, qpos, ans, cands = recall_batch(lo, hi, self.cfg.recall_examples, self.cfg.recall_pairs)
        with self._autocast():
            logits = self.model(ids.to(self.device)).logits.float().cpu()
        at = torch.gather(logits, 1, qpos[..., None].expand(-1, -1, logits.shape[-1]))  # [B, Q, V]
        acc = float((at.argmax(-1) == ans).float().mean())
        cand_logits = torch.gather(at, 2, cands[:, None, :].expand(-1, qpos.shape[1], -1))  # [B, Q, n]
        pred = torch.gather(cands[:, None, :].expand_as(cand_logits), 2, cand_logits.argmax(-1, keepdim=True))[..., 0]
        acc_c = float((pred == ans).float().mean())
        return {"recall_acc": acc, "recall_acc_cands": acc_c, "recall_chance": 1.0 / self.cfg.recall_pairs}

    def samples(self) -> list[tuple[str, str]]:
        tok = self.tokenizer
        was_training = self.model.training
        self.model.eval()
        out = []
        try:
            gen = None
            try:
                from k3.generation import generate as gen  # noqa: F401
            except ImportError:
                gen = None
            for prompt in self.cfg.sample_prompts:
                ids = tok.encode(prompt, allow_special=False)
                new = None
                if gen is not None:
                    try:
                        with self._autocast():
                            res = gen(self.model, [ids], max_new_tokens=self.cfg.sample_tokens,
                                      stop_token_ids=[tok.eod_id, tok.eos_id])
                        new = [t for t in res[0, len(ids):].tolist() if t != self.model_config.pad_token_id]
                    except Exception as e:  # API mismatch: fall back to the simple loop
                        log.warning("k3.generation.generate failed (%s); using the plain greedy loop", e)
                        new = None
                if new is None:
                    with self._autocast():
                        new = greedy_generate(self.model, ids, self.cfg.sample_tokens,
                                              stop_ids=(tok.eod_id, tok.eos_id))
                out.append((prompt, tok.decode(new, skip_special_tokens=True)))
        finally:
            self.model.train(was_training)
        return out

    # ------------------------------------------------------------------ logging
    def _log(self, rec: dict) -> None:
        with open(self._path("metrics.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
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

    def train_step(self) -> dict:
        """One optimizer step (or a skipped one). Returns the step record (not yet logged)."""
        cfg = self.cfg
        stage, seq = self.schedule.stage_at(self.step)
        rows = cfg.tokens_per_step // seq
        t0 = time.time()
        self._loader_at_step_start = self.data.train.state_dict()
        self._phase = "compute"
        batches = self._micro_batches(seq, rows)
        counts = [int((b["labels"] != IGNORE_INDEX).sum()) for b in batches]   # host batches: no device sync
        n_total = sum(counts)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        bad = False
        aux_total = 0.0
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
        grad_norm = float("nan")
        if not bad:
            params = [p for p in self.model.parameters() if p.grad is not None]
            gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            grad_norm = float(gn)
            bad = not math.isfinite(grad_norm)
        rec: dict[str, Any] = {"type": "train"}
        clipped = 0
        self._phase = "update"
        if bad:
            self.optimizer.zero_grad(set_to_none=True)
            self._discard_balancer_stats()
            self.bad_streak += 1
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            from k3.train.optim import qk_clip
            max_logit = [float(m.last_max_logit.max()) for m in self.model.modules()
                         if getattr(m, "last_max_logit", None) is not None]
            clipped = qk_clip(self.model, tau=cfg.qk_clip_tau, optimizer=self.optimizer) if cfg.qk_clip_tau > 0 else 0
            if self.balancer is not None:
                self.balancer.step()
            self.bad_streak = 0
            if max_logit:
                rec["max_logit"] = max(max_logit)
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
        rec.update({"step": self.step, "loss": float(loss_sum) if not bad else float("nan"), "lr": lr,
                    "tokens": tokens, "tokens_per_s": tokens / max(dt, 1e-9), "step_time": dt,
                    "seq_len": seq, "stage": stage, "batch_rows": rows, "grad_norm": grad_norm,
                    "skipped": bad, "tokens_seen": self.tokens_seen, "epoch": self.data.train.epoch_progress})
        if clipped:
            rec["qk_clipped_heads"] = clipped
        if aux_total:
            rec["aux_loss"] = aux_total
        if self.balancer is not None and not bad:
            m = self.balancer.metrics()
            for k in ("maxvio_mean", "maxvio_max", "dead_experts_mean", "min_load_ratio_min"):
                v = m.get(f"balance/{k}")
                if v is not None:
                    rec["maxvio" if k == "maxvio_mean" else k] = v
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
        """Run to `steps` (or `stop_at`); returns the summary dict (also written to report.md)."""
        self.setup()
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
            pbar = self._progress(end)
            last_saved = self.step
            while self.step < end:
                if self._stop_requested:
                    raise KeyboardInterrupt
                rec = self.train_step()
                if rec["skipped"]:
                    log.warning("step %d: non-finite loss/gradient (loss %s, grad norm %s): step skipped "
                                "(%d in a row)", rec["step"], rec["loss"], rec["grad_norm"], self.bad_streak)
                self.history.append(rec)
                self._log(rec)
                if pbar is not None:
                    self._set_postfix(pbar, rec)
                    pbar.update(1)
                if self.bad_streak > cfg.max_bad_steps:
                    raise TrainingError(
                        f"stopping at step {self.step}: the loss or gradient was NaN/inf for {self.bad_streak} "
                        f"consecutive steps (limit --max-bad-steps {cfg.max_bad_steps}). Lower --lr, check the "
                        f"data, or resume from the last good checkpoint ({latest_checkpoint(cfg.out_dir)}).")
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
            print(f"\nk3 train: aborted at step {self.step}; last checkpoint: {latest_checkpoint(cfg.out_dir)}",
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

    def _progress(self, end: int):
        if not self.cfg.progress:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm is a dependency
            return None
        return tqdm(total=end, initial=self.step, desc="k3 train", unit="step", dynamic_ncols=True)

    @staticmethod
    def _set_postfix(pbar, rec: dict) -> None:
        post = {"loss": f"{rec['loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}", "lr": f"{rec['lr']:.2e}",
                "T": rec["seq_len"]}
        if "maxvio" in rec:
            post["maxvio"] = f"{rec['maxvio']:.2f}"
        pbar.set_postfix(post, refresh=False)

    # ------------------------------------------------------------------ end of run
    def _finish(self, status: str, wall: float) -> dict:
        from k3.train import report
        cfg = self.cfg
        ev = self.eval_history
        trained = [r for r in self.history if not r.get("skipped")]
        tps = (sum(r["tokens"] for r in self.history) / sum(r["step_time"] for r in self.history)) \
            if self.history else 0.0
        summary = {
            "status": status, "step": self.step, "steps": cfg.steps, "out_dir": cfg.out_dir,
            "wall_time_s": wall, "data_time_s": getattr(self, "data_time", 0.0),
            "tokens_seen": self.tokens_seen, "tokens_per_s": tps, "num_params": self.num_params,
            "device": str(self.device), "threads": getattr(self, "threads", None),
            "val_loss_before": ev[0]["val_loss"] if ev else None,
            "val_loss_after": ev[-1]["val_loss"] if ev else None,
            "recall_acc_after": ev[-1].get("recall_acc_cands") if ev else None,
            "recall_chance": 1.0 / cfg.recall_pairs if cfg.recall_pairs else None,
            "train_loss_first": trained[0]["loss"] if trained else None,
            "train_loss_last": trained[-1]["loss"] if trained else None,
            "skipped_steps": sum(1 for r in self.history if r.get("skipped")),
            "checkpoint": latest_checkpoint(cfg.out_dir),
        }
        if status == "completed":
            from k3.checkpoint import save_pretrained
            save_pretrained(self.model, self._path("final"), tokenizer=self.tokenizer)
            summary["final"] = self._path("final")
            if cfg.samples:
                try:
                    summary["samples"] = self.samples()
                except Exception as e:  # never lose a finished run over a sample
                    log.warning("sample generation failed: %s", e)
        if cfg.plot:
            try:
                summary["plot"] = report.plot_loss(self._path("metrics.jsonl"), self._path("loss.png"),
                                                   boundaries=self.schedule.boundaries())
            except Exception as e:
                log.warning("loss plot failed: %s", e)
        report.write_report(summary, self._path("report.md"))
        if summary.get("samples"):
            with open(self._path("samples.txt"), "w") as f:
                for p, s in summary["samples"]:
                    f.write(f"--- prompt: {p!r}\n{p}{s}\n\n")
        return summary
