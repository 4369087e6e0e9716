"""What `k3 train` must not do to a user's run: run code from a checkpoint, wipe a run, let two trainings write
one directory, accept non-finite numbers, publish a NaN model, stop a resumed run at an old --stop-at, or crash
on a truncated state. A ~0.3M-parameter model on the shared micro corpus, a few steps per run."""
import json
import math
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from k3.config import K3Config
from k3.errors import CheckpointError, K3ConfigError
from k3.train.checkpointing import LOCK_NAME, STATE_FILE, find_checkpoints, load_trainer_state
from k3.train.trainer import Callback, Trainer, TrainConfig, TrainingError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_cfg(corpus, model, out, **kw):
    base = dict(out_dir=str(out), preset="tiny", model_overrides=dict(model), steps=4, tokens_per_step=128,
                stages=[(64, 1.0)], data=corpus["data"], cache_dir=corpus["cache"], lr=1e-2, val_tokens=128,
                recall_examples=2, recall_pairs=2, progress=False, tensorboard=False, samples=False, plot=False,
                seed=0, device="cpu", eval_every=0, save_every=2, keep=2)
    base.update(kw)
    return TrainConfig(**base)


def train_losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(l)["loss"] for l in f if '"train"' in l]


@pytest.fixture(scope="module")
def base_run(micro_corpus, micro_model_overrides, tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("base") / "run"
    torch.set_num_threads(1)
    Trainer(make_cfg(micro_corpus, micro_model_overrides, out)).train()
    assert [s for s, _ in find_checkpoints(str(out))] == [2, 4]
    return out


@pytest.fixture
def run_copy(base_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    return out


@pytest.fixture
def cfg(micro_corpus, micro_model_overrides):
    return lambda out, **kw: make_cfg(micro_corpus, micro_model_overrides, out, **kw)


class _Payload:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("fmt", ["torch", "pickle"])
def test_crafted_trainer_state_is_refused(run_copy, cfg, tmp_path, fmt):
    sf = os.path.join(find_checkpoints(str(run_copy))[-1][1], STATE_FILE)
    st = load_trainer_state(sf)
    marker = tmp_path / "pwned"
    st["optimizer"] = {"state": {}, "param_groups": [], "x": _Payload(marker)}
    if fmt == "torch":
        torch.save(st, sf)
    else:
        with open(sf, "wb") as f:
            pickle.dump(st, f, protocol=2)
    with pytest.raises(CheckpointError, match="refused") as e:
        Trainer(cfg(run_copy, resume=True)).train()
    assert sf in str(e.value) and not marker.exists()
    assert not (run_copy / LOCK_NAME).exists()  # the lock is released on failure
    # the refused checkpoint is left where it was (no silent fallback past a tampered file)
    assert os.path.isfile(sf)


def test_state_loads_without_pickle_and_old_numpy_rng_is_allowed(run_copy, tmp_path):
    import numpy as np
    st = load_trainer_state(os.path.join(find_checkpoints(str(run_copy))[-1][1], STATE_FILE))
    assert isinstance(st["rng"]["numpy"]["state"]["key"], torch.Tensor)
    # checkpoints written before the tensor form hold numpy's legacy RNG tuple: an explicit allow-list reads it
    old = dict(st, rng=dict(st["rng"], numpy=np.random.get_state()))
    p = str(tmp_path / "old.pt")
    torch.save(old, p)
    assert load_trainer_state(p)["rng"]["numpy"][0] == "MT19937"


def test_truncated_state_falls_back_to_previous_checkpoint(run_copy, base_run, cfg, caplog):
    last = find_checkpoints(str(run_copy))[-1][1]
    sf = os.path.join(last, STATE_FILE)
    data = open(sf, "rb").read()
    with open(sf, "wb") as f:
        f.write(data[: len(data) // 2])
    t = Trainer(cfg(run_copy, resume=True))
    s = t.train()
    assert sf in caplog.text and "resuming from the previous checkpoint" in caplog.text
    assert t.resumed_from.endswith("step-00000002") and s["status"] == "completed" and s["step"] == 4
    assert train_losses(run_copy) == train_losses(base_run)  # the fallback resumes exactly
    # every state unreadable: a CheckpointError naming the file, no traceback from torch
    for _, p in find_checkpoints(str(run_copy)):
        with open(os.path.join(p, STATE_FILE), "wb") as f:
            f.write(b"PK\x03\x04broken")
    for _ in range(2):  # and the checkpoints stay where they are
        with pytest.raises(CheckpointError, match=STATE_FILE):
            Trainer(cfg(run_copy, resume=True)).train()
    assert len(find_checkpoints(str(run_copy))) == 2


def test_existing_run_needs_resume_or_overwrite(run_copy, cfg):
    before = find_checkpoints(str(run_copy))
    with pytest.raises(K3ConfigError, match="--resume.*--overwrite"):
        Trainer(cfg(run_copy)).train()
    assert find_checkpoints(str(run_copy)) == before and (run_copy / "final").is_dir()
    s = Trainer(cfg(run_copy, steps=2, save_every=0, overwrite=True)).train()
    assert s["status"] == "completed" and [st for st, _ in find_checkpoints(str(run_copy))] == [2]
    assert len(train_losses(run_copy)) == 2


def test_run_directory_lock(run_copy, cfg):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run_copy / LOCK_NAME).write_text(f"{sleeper.pid}\n")
        with pytest.raises(K3ConfigError, match=f"in use by PID {sleeper.pid}"):
            Trainer(cfg(run_copy, resume=True)).train()
        assert (run_copy / LOCK_NAME).read_text().strip() == str(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    # the process is gone: its lock is stale and taken over
    t = Trainer(cfg(run_copy, resume=True, steps=5))
    t.setup()
    assert (run_copy / LOCK_NAME).read_text().strip() == str(os.getpid())
    with pytest.raises(K3ConfigError, match="in use by PID"):  # a second trainer in this process
        Trainer(cfg(run_copy, resume=True, steps=5)).setup()
    t.train()
    assert not (run_copy / LOCK_NAME).exists()


def test_non_finite_and_out_of_range_settings_are_refused(cfg, tmp_path):
    out = tmp_path / "new"
    for kw, flag in [({"lr": float("nan")}, "--lr"), ({"lr": float("inf")}, "--lr"),
                     ({"weight_decay": float("nan")}, "--weight-decay"), ({"grad_clip": -1.0}, "--grad-clip"),
                     ({"keep": 0}, "--keep"), ({"save_every": -1}, "--save-every"), ({"threads": -2}, "--threads"),
                     ({"max_bad_steps": -1}, "--max-bad-steps"), ({"data": [str(tmp_path / "nope.txt")]}, "--data"),
                     ({"stages": [(64, float("nan"))]}, "stage")]:
        with pytest.raises(K3ConfigError, match=flag):
            Trainer(cfg(out, **kw)).train()
        assert not out.exists()  # validated before the run directory is created


def test_nan_weights_are_never_published(cfg, tmp_path):
    class Poison(Callback):
        def on_step_end(self, trainer, rec):
            if rec["step"] == 2:
                with torch.no_grad():
                    trainer.model.lm_head.weight.fill_(float("nan"))
    out = tmp_path / "run"
    with pytest.raises(TrainingError, match="NaN/inf.*no final model"):
        Trainer(cfg(out, steps=2, save_every=0), callbacks=[Poison()]).train()
    assert not (out / "final").exists() and "failed" in (out / "report.md").read_text()
    for line in open(out / "metrics.jsonl"):  # strict JSON: the NaN validation loss is null
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c}"))


def test_checkpoint_modes_follow_umask(base_run):
    old = os.umask(0)
    os.umask(old)
    for root, dirs, files in os.walk(base_run):
        for d in dirs:
            assert os.stat(os.path.join(root, d)).st_mode & 0o777 == 0o777 & ~old, os.path.join(root, d)
        for f in files:
            assert os.stat(os.path.join(root, f)).st_mode & 0o777 == 0o666 & ~old, os.path.join(root, f)


# ------------------------------------------------------------------------------------------------ CLI

@pytest.fixture
def cli(micro_corpus, micro_model_overrides, tmp_path, monkeypatch):
    from k3.cli import main
    monkeypatch.setenv("K3_CACHE", micro_corpus["cache"])
    mcfg = tmp_path / "micro.json"
    K3Config.from_preset("tiny", **micro_model_overrides).save_json(str(mcfg))
    common = ["--config", str(mcfg), "--batch-tokens", "128", "--stages", "64:1", "--data", *micro_corpus["data"],
              "--val-tokens", "128", "--lr", "0.01"]
    flags = ["--no-progress", "--no-tensorboard", "--no-samples"]
    return lambda *a, new=True: main(["train", *a, *flags] + (common if new else []))


def steps_of(out):
    with open(out / "metrics.jsonl") as f:
        return [json.loads(l)["step"] for l in f if '"train"' in l]


def test_cli_resume_continues_past_stop_at_and_refuses_fixed_changes(cli, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli("--out", str(out), "--steps", "3", "--stop-at", "1") == 0
    assert steps_of(out) == [1] and not (out / "final").exists()
    # flags that do not change the run's numbers may change; a new --stop-at applies to this session only
    assert cli("--out", str(out), "--resume", "--stop-at", "2", "--keep", "3", "--save-every", "1", new=False) == 0
    assert steps_of(out) == [1, 2]
    capsys.readouterr()
    for bad, flag in [(["--lr", "0.02"], "--lr"), (["--preset", "small"], "--preset"), (["--seed", "1"], "--seed"),
                      (["--batch-tokens", "256"], "--batch-tokens"), (["--stages", "32:1"], "--stages")]:
        assert cli("--out", str(out), "--resume", *bad, new=False) == 2
        err = capsys.readouterr().err
        assert err.startswith("k3: error: " + flag) and "Traceback" not in err, err
    assert json.load(open(out / "train_config.json"))["preset"] == "tiny"
    assert cli("--out", str(out), "--resume", "--lr", "0.01", new=False) == 0  # an equal value is fine
    assert steps_of(out) == [1, 2, 3] and (out / "final").is_dir()
    # a plain second `k3 train` into the run is refused instead of wiping it
    assert cli("--out", str(out), "--steps", "1") == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "final").is_dir()


def test_cli_bad_numbers_are_usage_errors(cli, tmp_path, capsys):
    out = tmp_path / "run"
    for bad, flag in [(["--lr", "nan"], "--lr"), (["--threads", "-2"], "--threads"), (["--keep", "0"], "--keep"),
                      (["--save-every", "-1"], "--save-every"), (["--grad-clip", "inf"], "--grad-clip")]:
        with pytest.raises(SystemExit) as e:
            cli("--out", str(out), *bad)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}:" in err and "Traceback" not in err, err
    assert cli("--out", str(out), "--data", str(tmp_path / "missing.txt"), new=False) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "missing.txt" in err and "build_data" not in err
    assert not out.exists()


@pytest.mark.parametrize("balancer", ["qb", "qb_hist", "qb_ema", "sign", "aux_loss", "none"])
def test_every_balancers_state_loads_without_pickle(cfg, tmp_path, balancer):
    """The trainer state (optimizer, schedule, balancer, loader, RNG) is plain data for every balancer, so
    weights_only loading never refuses a checkpoint the trainer wrote itself."""
    t = Trainer(cfg(tmp_path / "run", balancer=balancer, param_dtype="bf16")).setup()
    try:
        t.train_step()
        p = str(tmp_path / STATE_FILE)
        t._write_state(t.state(), p)
        st = load_trainer_state(p)
        assert st["step"] == 1 and st["balancer"]["balancer"] == balancer
    finally:
        t.close()
