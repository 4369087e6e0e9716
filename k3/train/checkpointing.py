"""Training checkpoints of a run directory: atomic save, pruning to the last `keep`, safe loading of the
trainer state, RNG states, and the run-directory lock.

Layout: `RUN/checkpoints/step-XXXXXXXX/` holds the model (k3.checkpoint layout + tokenizer.json),
`trainer_state.pt` (optimizer, LR schedule, balancer, loader position, stage, step, RNG states) and
`trainer_state.json` (a readable summary). A checkpoint is written into a hidden temp directory and renamed into
place, so an interrupted save leaves the previous checkpoint intact.

No code runs from a checkpoint: `trainer_state.pt` is read with `torch.load(weights_only=True)` (tensors, numbers,
strings and containers only; older checkpoints' numpy RNG arrays through an explicit allow-list of numpy's array
reconstruction). Anything else, e.g. a pickle whose `__reduce__` calls a function, is refused with
`CheckpointError` naming the file. A truncated or unreadable state raises `CorruptStateError`, and resuming falls
back to the previous kept checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import tempfile
import time
from typing import Optional

import numpy as np
import torch

from k3.checkpoint.io import apply_umask_modes
from k3.errors import CheckpointError, K3ConfigError

log = logging.getLogger("k3.train")

__all__ = ["CKPT_PREFIX", "STATE_FILE", "STATE_JSON", "LOCK_NAME", "CorruptStateError", "find_checkpoints",
           "latest_checkpoint", "load_trainer_state", "pick_resume_checkpoint", "save_checkpoint",
           "restore_checkpoint", "RunLock", "open_run_dir", "atomic_json", "atomic_torch_save", "rng_state",
           "set_rng_state", "seed_everything", "apply_umask_modes", "clear_run_outputs", "cleanup_tmp",
           "restore_training_state"]

CKPT_PREFIX = "step-"
STATE_FILE = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
LOCK_NAME = "train.lock"
_REQUIRED = ("step", "optimizer", "scheduler", "loader", "rng")


class CorruptStateError(CheckpointError):
    """A training state file that is truncated or unreadable (as opposed to one refused as unsafe)."""


# ------------------------------------------------------------------------------------------ files

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


def fsync_dir(path: str) -> None:
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


def atomic_torch_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_json(obj, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ RNG

def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) RNG states as tensors / numbers / strings only (loads with weights_only)."""
    npst = np.random.get_state(legacy=False)
    st = {"python": random.getstate(),
          "numpy": {"bit_generator": str(npst["bit_generator"]),
                    "state": {"key": torch.from_numpy(np.asarray(npst["state"]["key"], dtype=np.int64)),
                              "pos": int(npst["state"]["pos"])},
                    "has_gauss": int(npst["has_gauss"]), "gauss": float(npst["gauss"])},
          "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    npst = st["numpy"]
    if isinstance(npst, dict):
        key = npst["state"]["key"]
        key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
        np.random.set_state({"bit_generator": npst["bit_generator"],
                             "state": {"key": key.astype(np.uint32), "pos": int(npst["state"]["pos"])},
                             "has_gauss": int(npst["has_gauss"]), "gauss": float(npst["gauss"])})
    else:  # checkpoints written before the tensor form: numpy's legacy tuple
        np.random.set_state(npst)
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all(st["cuda"])
        except (RuntimeError, IndexError):  # pragma: no cover - different GPU count
            log.warning("could not restore CUDA RNG states (different device count)")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------ state file

def _legacy_numpy_globals() -> list:
    """numpy array reconstruction (no code of the file's choosing): checkpoints written before the RNG state was
    stored as tensors hold numpy's MT19937 key as an ndarray."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    out = [_reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out += [getattr(dtypes, n) for n in ("UInt32DType", "Int64DType") if hasattr(dtypes, n)]
    return out


def load_trainer_state(path: str) -> dict:
    """Read a `trainer_state.pt` without running code from it. Raises CheckpointError (unsafe content: an object
    outside the allow-list) or CorruptStateError (missing, truncated, unreadable, or not a training state)."""
    if not os.path.isfile(path):
        raise CorruptStateError(f"{path} is missing (not a training checkpoint)")
    try:
        with torch.serialization.safe_globals(_legacy_numpy_globals()):
            st = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "Weights only load failed" in text or "Unsupported global" in text or "not an allowed global" in text:
            first = next((ln.strip() for ln in text.splitlines() if "Unsupported" in ln or "GLOBAL" in ln), "")
            raise CheckpointError(
                f"{path}: refused: the file holds Python objects outside the training-state allow-list (tensors, "
                f"numbers, strings, lists, dicts){' - ' + first if first else ''}. Loading it could run code; "
                f"only resume from checkpoints you wrote.") from None
        raise CorruptStateError(f"{path}: cannot read the training state (corrupt or truncated?): {e}") from None
    except Exception as e:  # zip / EOF / OS errors on truncated or damaged files
        raise CorruptStateError(f"{path}: cannot read the training state (corrupt or truncated?): "
                                f"{type(e).__name__}: {e}") from None
    if not isinstance(st, dict) or any(k not in st for k in _REQUIRED):
        missing = [k for k in _REQUIRED if not isinstance(st, dict) or k not in st]
        raise CorruptStateError(f"{path}: not a training state (missing {', '.join(missing)})")
    return st


def pick_resume_checkpoint(out_dir: str) -> tuple[Optional[str], Optional[dict]]:
    """The newest checkpoint whose training state reads, with that state: (path, state), or (None, None) when
    the run has no checkpoint. A corrupt / truncated newer state is warned about, renamed to `step-N.corrupt`
    (kept for inspection, no longer a checkpoint) and the previous kept checkpoint is used. A state refused as
    unsafe raises CheckpointError (no fallback: someone changed the run's files)."""
    ckpts = find_checkpoints(out_dir)
    errors, corrupt = [], []
    for _, path in reversed(ckpts):
        sf = os.path.join(path, STATE_FILE)
        try:
            st = load_trainer_state(sf)
        except CorruptStateError as e:
            errors.append(str(e))
            corrupt.append(path)
            continue
        for bad, err in zip(corrupt, errors):  # only once a fallback exists: never leave a run without checkpoints
            aside = bad + ".corrupt"
            if os.path.exists(aside):
                shutil.rmtree(aside, ignore_errors=True)
            os.rename(bad, aside)
            log.warning("%s\n  -> moved aside to %s; resuming from the previous checkpoint %s", err, aside, path)
        return path, st
    if errors:
        raise CheckpointError("--resume: no readable checkpoint in " + out_dir + ":\n  " + "\n  ".join(errors))
    return None, None


# ------------------------------------------------------------------------------------------ save / restore

def save_checkpoint(trainer) -> str:
    """Write `checkpoints/step-<step>/` of `trainer` atomically; prune to the last `keep`. Returns its path."""
    from k3.checkpoint import save_pretrained
    root = trainer._path("checkpoints")
    os.makedirs(root, exist_ok=True)
    name = f"{CKPT_PREFIX}{trainer.step:08d}"
    final = os.path.join(root, name)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root)
    try:
        model_dir = os.path.join(tmp, "ckpt")
        save_pretrained(trainer.model, model_dir, tokenizer=trainer.tokenizer)
        st = trainer.state()
        trainer._write_state(st, os.path.join(model_dir, STATE_FILE))
        atomic_json({k: st[k] for k in ("step", "stage", "seq_len", "tokens_seen", "train_time")}
                    | {"time": time.time()}, os.path.join(model_dir, STATE_JSON))
        apply_umask_modes(model_dir)
        fsync_dir(model_dir)
        if os.path.isfile(os.path.join(final, STATE_FILE)):  # this step is saved already (same state)
            return final
        if os.path.exists(final):  # leftover without a state file: not a checkpoint
            shutil.rmtree(final)
        os.rename(model_dir, final)
        fsync_dir(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for _, old in find_checkpoints(trainer.cfg.out_dir)[:-trainer.cfg.keep]:
        shutil.rmtree(old, ignore_errors=True)
    for cb in trainer.callbacks:
        cb.on_save(trainer, final)
    return final


def restore_checkpoint(trainer, path: str, st: Optional[dict] = None) -> None:
    """Load the model weights and the training state of checkpoint `path` into `trainer` (`st`: the state,
    already read by `load_trainer_state`)."""
    from k3.checkpoint import load_state_dict
    sf = os.path.join(path, STATE_FILE)
    if st is None:
        st = load_trainer_state(sf)
    sd = load_state_dict(path, config=trainer.model_config)
    missing, unexpected = trainer.model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path}: model keys do not match (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]})")
    restore_training_state(trainer, path, st, sf)
    log.info("resumed from %s (step %d)", path, trainer.step)


def restore_training_state(trainer, path: str, st: dict, where: str, optimizer: bool = True) -> None:
    """The training state `st` of checkpoint `path` (read from `where`, named in errors) into `trainer`: optimizer
    (unless `optimizer=False`: the distributed trainer's DCP load restored it), scheduler, balancer, loader
    position, RNG and step counters; the tokenizer must be the checkpoint's. Sets `trainer.resumed_from`."""
    if st.get("tokenizer_fingerprint") not in (None, trainer.tokenizer.fingerprint):
        raise CheckpointError(f"{path}: the checkpoint was trained with a different tokenizer")
    try:
        if optimizer:
            trainer.optimizer.load_state_dict(st["optimizer"])
        trainer.scheduler.load_state_dict(st["scheduler"])
        if trainer.balancer is not None and st.get("balancer") is not None:
            trainer.balancer.load_state_dict(st["balancer"])
        trainer.data.train.load_state_dict(st["loader"])
        set_rng_state(st["rng"])
        trainer.step = int(st["step"])
        trainer.tokens_seen = int(st.get("tokens_seen", 0))
        trainer.train_time = float(st.get("train_time", 0.0))
        trainer.bad_streak = int(st.get("bad_streak", 0))
        trainer.grad_norm_window = [float(x) for x in st.get("grad_norm_window", [])]
    except (CheckpointError, K3ConfigError):
        raise
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise CheckpointError(f"{where}: the training state does not fit this run: {type(e).__name__}: {e}") from None
    trainer.resumed_from = path


def clear_run_outputs(out_dir: str) -> None:
    """A fresh run (`overwrite`, or `resume` without a checkpoint) in an existing directory: a new metrics log;
    the previous run's checkpoints and final model would confuse --resume and readers, so they are removed."""
    p = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(p):
        os.remove(p)
    old = find_checkpoints(out_dir)
    if old:
        log.warning("new run in %s: removing %d old checkpoint(s)", out_dir, len(old))
        for _, p in old:
            shutil.rmtree(p, ignore_errors=True)
    if os.path.isdir(os.path.join(out_dir, "final")):
        shutil.rmtree(os.path.join(out_dir, "final"), ignore_errors=True)


def cleanup_tmp(out_dir: str) -> None:
    """Remove the hidden temp directories an interrupted save left in RUN/checkpoints."""
    d = os.path.join(out_dir, "checkpoints")
    if os.path.isdir(d):
        for name in os.listdir(d):
            if name.startswith("."):
                shutil.rmtree(os.path.join(d, name), ignore_errors=True)


# ------------------------------------------------------------------------------------------ lock

_HELD: set = set()   # lock files this process holds


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    except OSError:  # pragma: no cover
        return False
    return True


class RunLock:
    """`RUN/train.lock` holding the PID of the training that writes RUN. A lock of a live process refuses a second
    training ("RUN is in use by PID N"); a lock left by a dead process (or one this process no longer holds) is
    taken over."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_NAME)
        self.held = False

    def acquire(self) -> "RunLock":
        key = os.path.realpath(self.path)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                pid = self._owner()
                if pid is not None and _pid_alive(pid) and (pid != os.getpid() or key in _HELD):
                    raise K3ConfigError(f"{self.out_dir} is in use by PID {pid} (another `k3 train` writes to it; "
                                        f"wait for it, or remove {self.path} if that process is not a training)")
                log.warning("taking over the stale lock %s (PID %s is not running)", self.path, pid)
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            self.held = True
            _HELD.add(key)
            return self
        raise K3ConfigError(f"{self.out_dir}: could not take the lock {self.path}")  # pragma: no cover

    def _owner(self) -> Optional[int]:
        try:
            with open(self.path) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        _HELD.discard(os.path.realpath(self.path))
        if self._owner() == os.getpid():
            try:
                os.remove(self.path)
            except FileNotFoundError:  # pragma: no cover
                pass


def open_run_dir(out_dir: str, setup, *, refuse: Optional[str] = None, remove_created: bool = False) -> RunLock:
    """The set-up shared by `k3 train` / `k3 sft` (Trainer) and `k3 rl` (RLRunner): refuse a run directory that
    holds a run (`refuse`: the K3ConfigError message, given when the caller found a run there and neither --resume
    nor --overwrite), create the directory, take its lock (RunLock), then call `setup()`. When setup raises, the
    lock is released (and with `remove_created` the directory this call created is removed again if empty) and the
    error propagates. -> the held lock (release it when the run ends)."""
    if refuse is not None:
        raise K3ConfigError(refuse)
    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    lock = RunLock(out_dir).acquire()
    try:
        setup()
    except BaseException:
        lock.release()
        if created and remove_created:
            try:
                os.rmdir(out_dir)  # a rejected run leaves no empty directory behind
            except OSError:
                pass
        raise
    return lock
