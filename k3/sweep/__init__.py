"""`k3 sweep`: run a grid of training runs (config keys x train settings x seeds) and tabulate, summarise and plot them.

    k3 sweep --preset tiny --set linear_attn_config.gate_lower_bound=-6,-5,-4,-3 --seeds 3 --steps 200 \\
        --out sweeps/gmin [-- any k3 train flags, e.g. --batch-tokens 1024 --stages 256:1]

Keys of `--set KEY=V1,V2,...` (repeatable; several `--set` make the cartesian product):

* a K3Config key, as a dotted path into the dataclass tree: `hidden_act`, `attn_res_block_size`,
  `linear_attn_config.gate_lower_bound`, ... (`model.` in front is accepted and dropped);
* a training setting, `train.` + a TrainConfig field or the `k3 train` flag's name: `train.lr`, `train.balancer`,
  `train.batch_tokens` (= `train.tokens_per_step`), `train.stages`, `train.warmup`, ...

Values are separated by commas; when a value itself holds commas (`train.stages=256:0.6,1024:0.4`, a layer list),
separate the values with `;` instead. A key with one value is a fixed override for every run. List and dict
values are JSON (`linear_attn_config.full_attn_layers=[4,8];[8]`), booleans true/false, `null` for an optional key.
Every point is checked before anything runs: an unknown key, a value of the wrong type, or a value the model's or
the trainer's validation rejects is refused (`K3ConfigError` naming the key).

Outputs in `--out DIR`:

    sweep.json                 the sweep's base settings (a later invocation with other run-fixed settings is refused)
    runs/<point>/seed<S>/      one `k3 train` run directory per point and seed
    results.csv, results.json  one row per point and seed (the values, final train / val loss, tokens/s, MaxVio,
                               peak memory, wall time, status, run directory)
    summary.md                 mean +- std (over seeds) per point
    loss_curves.png            train loss per step, mean over seeds, one line per point
    final_loss.png             final validation loss vs the first swept key's value, error bars = std over seeds

Resuming: run the same command again. A point whose row is present (for the same `--steps`) is not run again; a
point without a row whose run directory holds a checkpoint continues from it (the trainer's `resume`); results are
written after every point, so an interrupted sweep loses at most the point it was running (and keeps that point's
last checkpoint). A larger `--steps` continues every point's run to the new length. A point that raises (a full
disk, out of memory) is reported with its traceback and gets no row: the sweep goes on with the others, exits
non-zero, and the next invocation runs that point again. (A run that stops on its own, e.g. on non-finite losses, gets
a row with status `failed` and is not re-run.) `--report-only` trains nothing: it rewrites the results, summary and
plots from the finished runs (e.g. runs copied in from other machines) and names each run still missing.

Disk: every run keeps its end checkpoint (model + optimizer state) and its final model by default
(`--keep-outputs all`); a 1.4B-parameter run leaves ~17 GB. `--keep-outputs final` deletes a completed run's
checkpoints once its row is written, `--keep-outputs none` its final model too (metrics, plots and the row stay; a
larger `--steps` then trains those points from the start).

Execution: sequentially in this process (default on CPU), or one subprocess per point (`--subprocess`); with
`--gpus N` on CUDA, N subprocesses at a time, each with its own `CUDA_VISIBLE_DEVICES`.

Times: `wall_s` is the wall time of the run in the invocation that finished it (a resumed point: the resumed part,
incl. setup and evaluations); `train_time_s` the time of its optimizer steps over all sessions; `tokens_per_s` the
trained tokens over that time.

Peak memory: on CUDA `torch.cuda.max_memory_allocated` of the run; on CPU the process's peak RSS (VmHWM, reset
before each in-process run where Linux allows it, so it is the run's own peak plus what the process already held).
"""
from __future__ import annotations

import argparse
import copy
import csv
import json
import logging
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

from k3 import knobs
from k3.errors import K3ConfigError
from k3.train.report import finite_or_none

from .keys import (_SWEEP_OWNED, Axis, KeySpec, Point, _train_parser, expand_grid, parse_set,  # noqa: F401
                   resolve_key)
from .report import _read_metrics, _smooth, plot_results, summarize, summary_markdown  # noqa: F401

log = logging.getLogger("k3.sweep")

__all__ = ["Axis", "Point", "Sweep", "parse_set", "expand_grid", "resolve_key", "summarize", "add_parser",
           "RESULT_COLUMNS"]

KEEP = ("all", "final", "none")    # --keep-outputs: what a completed run leaves on disk
# metric columns of a result row, in results.csv order (after the swept keys and the seed)
RESULT_COLUMNS = ["status", "steps", "val_loss", "train_loss", "train_loss_last", "val_loss_before", "tokens_per_s",
                  "maxvio", "maxvio_max", "peak_mem_mb", "wall_s", "train_time_s", "num_params", "device", "point",
                  "run_dir", "error"]


# ----------------------------------------------------------------------------------------------- one run

def _peak_rss_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> Optional[float]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except Exception:  # pragma: no cover
        return None


def _tail_mean(xs: list) -> Optional[float]:
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    if not xs:
        return None
    n = max(1, len(xs) // 10)
    return sum(xs[-n:]) / n


def _resolve_callbacks(callbacks) -> list:
    """One fresh callback per run from each item: a zero-argument factory (a Callback class), a "module:attr" name
    of one (subprocess runs), or a Callback object (used as is, shared by the runs)."""
    import importlib
    from k3.train.trainer import Callback
    out = []
    for cb in callbacks or ():
        if isinstance(cb, str):
            mod, _, attr = cb.partition(":")
            if not attr:
                raise K3ConfigError(f"sweep callback {cb!r}: expected module:attr")
            try:
                cb = getattr(importlib.import_module(mod), attr)
            except (ImportError, AttributeError) as e:
                raise K3ConfigError(f"sweep callback {cb!r}: {e}") from None
        if isinstance(cb, type) or (callable(cb) and not isinstance(cb, Callback)):
            cb = cb()
        out.append(cb)
    return out


def run_point(train_cfg: dict, callbacks: Sequence = ()) -> dict:
    """Train one point (TrainConfig as a dict; resumes when its run directory holds a checkpoint) in this process
    and return its result row's metrics. `callbacks` (k3.train.trainer.Callback objects or "module:attr" factory
    names) go to the Trainer; a callback with a `sweep_metrics()` method adds its dict to the row."""
    import torch
    from k3.train.checkpointing import find_checkpoints
    from k3.train.config import TrainConfig
    from k3.train.trainer import Trainer, TrainingError
    cfg = TrainConfig.from_dict(train_cfg)
    cfg.model_overrides = dict(train_cfg.get("model_overrides") or {})
    cfg.resume = bool(find_checkpoints(cfg.out_dir))
    cfg.overwrite = not cfg.resume
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        _peak_rss_reset()
    t0 = time.time()
    row: dict[str, Any] = {"status": "failed", "error": None, "resumed": cfg.resume}
    cbs: list = []
    try:
        cbs = _resolve_callbacks(callbacks)
        s = Trainer(cfg, callbacks=cbs).train()
        row["status"] = s["status"]
    except TrainingError as e:
        row["error"] = str(e)
        s = {}
    row["wall_s"] = time.time() - t0
    row["peak_mem_mb"] = (torch.cuda.max_memory_allocated() / 2 ** 20) if cuda else _peak_rss_mb()
    train, evals = _read_metrics(cfg.out_dir)
    trained = [r for r in train if not r.get("skipped")]
    row.update({
        "steps": cfg.steps, "val_loss": evals[-1].get("val_loss") if evals else None,
        "val_loss_before": evals[0].get("val_loss") if evals else None,
        "train_loss": _tail_mean([r.get("loss") for r in trained]),
        "train_loss_last": trained[-1]["loss"] if trained else None,
        "tokens_per_s": s.get("tokens_per_s"), "maxvio": _tail_mean([r.get("maxvio") for r in trained]),
        "maxvio_max": max((r["maxvio"] for r in trained if isinstance(r.get("maxvio"), (int, float))), default=None),
        "train_time_s": sum(r.get("step_time", 0.0) for r in train), "num_params": s.get("num_params"),
        "device": s.get("device"),
    })
    if row["status"] == "completed":
        for cb in cbs:
            if hasattr(cb, "sweep_metrics"):
                row.update(cb.sweep_metrics())
    return row


def _worker_main(spec_path: str) -> int:
    """`python -m k3.sweep --worker SPEC.json`: run one point, write its row next to the spec."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with open(spec_path) as f:
        spec = json.load(f)
    row = run_point(spec["train"], spec.get("callbacks") or ())
    tmp = spec["row_path"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(finite_or_none(row), f)
    os.replace(tmp, spec["row_path"])
    return 0


# ----------------------------------------------------------------------------------------------- the sweep

def _free_memory() -> None:
    """After a point raised: drop what its frames held (a CUDA OOM leaves the model and optimizer referenced)."""
    import gc
    gc.collect()
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Sweep:
    """A grid of training runs. `base` holds TrainConfig fields for every run (incl. `model_overrides`, `preset`,
    `config`, `steps`); `axes` the swept keys; `seeds` the seeds of each point. `plan()` validates every point
    (nothing is written); `run()` trains the points that have no result row and writes the results."""

    def __init__(self, out_dir: str, axes: Sequence[Axis] = (), seeds: Sequence[int] = (0,),
                 base: Optional[dict] = None, gpus: int = 0, subprocess: bool = False, plot: bool = True,
                 echo: Callable[[str], None] = print, callbacks: Sequence = (), keep_outputs: str = "all"):
        self.out_dir = out_dir
        if keep_outputs not in KEEP:
            raise K3ConfigError(f"--keep-outputs: one of {', '.join(KEEP)}, got {keep_outputs!r}")
        self.keep_outputs = keep_outputs
        self.axes = list(axes)
        self.seeds = [int(s) for s in seeds]
        self.base = dict(base or {})
        self.gpus = int(gpus)
        self.subprocess = bool(subprocess) or self.gpus > 0
        self.plot = plot
        self.echo = echo
        self.callbacks = list(callbacks)
        if self.subprocess and any(not isinstance(c, str) for c in self.callbacks):
            raise K3ConfigError("sweep callbacks: subprocess runs take callbacks as \"module:attr\" names")
        self.ran: list[tuple[str, int]] = []      # (point id, seed) trained by the last run()
        self.skipped: list[tuple[str, int]] = []  # finished before
        self.errors: list[tuple[str, int]] = []   # raised in the last run(): no row, run again by the next run()
        self.missing: list[tuple[str, int]] = []  # not trained by a run(train=False)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise K3ConfigError(f"--seeds: need at least one seed, without repeats, got {self.seeds}")
        for k in self.base:
            if k in ("out_dir", "resume", "overwrite", "seed"):
                raise K3ConfigError(f"sweep base: `{k}` is set by the sweep ({_SWEEP_OWNED.get(k, k)})")

    # ------------------------------------------------------------------ planning / validation
    def points(self) -> list[Point]:
        return expand_grid(self.axes)

    def train_config(self, point: Point, seed: int) -> "Any":
        """The TrainConfig of one point and seed (validated: K3ConfigError naming the swept key)."""
        from k3.train.config import TrainConfig
        cfg = TrainConfig(out_dir=self.run_dir(point, seed), seed=seed, progress=False, samples=False,
                          tensorboard=False)
        for k, v in copy.deepcopy(self.base).items():
            setattr(cfg, k, v)
        cfg.model_overrides = dict(self.base.get("model_overrides") or {})
        for key, v in point.values.items():
            spec = next(a.spec for a in self.axes if a.key == key)
            if spec.target == "model":
                cfg.model_overrides[spec.field] = copy.deepcopy(v)
            else:
                setattr(cfg, spec.field, copy.deepcopy(v))
        try:
            cfg.validate()
        except K3ConfigError as e:
            swept = [a.key for a in self.axes if a.spec.target == "train"]
            raise K3ConfigError(f"sweep point {point.label}: {e}"
                                + (f" (swept training keys: {', '.join(swept)})" if swept else "")) from None
        if cfg.balancer not in ("qb", "qb_hist", "qb_ema", "sign", "aux_loss", "none"):
            raise K3ConfigError(f"train.balancer: unknown balancer {cfg.balancer!r}")
        return cfg

    def model_config(self, cfg) -> "Any":
        from k3.config import K3Config
        base = K3Config.load(cfg.config) if cfg.config else K3Config.from_preset(cfg.preset)
        return base.replace(**cfg.model_overrides) if cfg.model_overrides else base

    def plan(self) -> list[tuple[Point, int, Any]]:
        """Every (point, seed, TrainConfig), validated: the model config of each point is built (its validation
        names the key), the train settings checked. Raises K3ConfigError before anything runs."""
        out = []
        models_checked = set()
        for p in self.points():
            for seed in self.seeds:
                cfg = self.train_config(p, seed)
                mkey = json.dumps([cfg.preset, cfg.config, cfg.model_overrides], sort_keys=True, default=str)
                if mkey not in models_checked:
                    try:
                        self.model_config(cfg)
                    except K3ConfigError as e:
                        raise K3ConfigError(f"sweep point {p.label}: {e}") from None
                    except (TypeError, KeyError, ValueError) as e:
                        raise K3ConfigError(f"sweep point {p.label}: the model config rejects it: {e}") from None
                    models_checked.add(mkey)
                out.append((p, seed, cfg))
        return out

    def run_dir(self, point: Point, seed: int) -> str:
        return os.path.join(self.out_dir, "runs", point.dirname, f"seed{seed}")

    # ------------------------------------------------------------------ state
    def _path(self, name: str) -> str:
        return os.path.join(self.out_dir, name)

    def _signature(self, cfg) -> dict:
        """The run-fixed settings of the sweep's base (a later invocation must agree on them)."""
        from k3.train.config import RUN_FIXED
        swept = {a.spec.field for a in self.axes if a.spec.target == "train"}
        d = cfg.to_dict()
        sig = {k: d.get(k) for k in RUN_FIXED if k not in ("seed", "model_overrides") and k not in swept}
        swept_model = {a.spec.field for a in self.axes if a.spec.target == "model"}
        sig["model_overrides"] = {k: v for k, v in (cfg.model_overrides or {}).items() if k not in swept_model}
        return json.loads(json.dumps(sig, default=str))

    def load_rows(self) -> list[dict]:
        p = self._path("results.json")
        if not os.path.isfile(p):
            return []
        try:
            with open(p) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise K3ConfigError(f"{p}: cannot read the sweep's results: {e}") from None
        rows = d.get("rows") if isinstance(d, dict) else None
        if not isinstance(rows, list):
            raise K3ConfigError(f"{p}: expected {{\"rows\": [...]}}")
        return rows

    def _stored_axes(self) -> list:
        p = self._path("results.json")
        try:
            with open(p) as f:
                axes = json.load(f).get("axes")
            return [a for a in axes if isinstance(a, str)] if isinstance(axes, list) else []
        except (OSError, ValueError, AttributeError):
            return []

    def _check_signature(self, sig: dict) -> None:
        p = self._path("sweep.json")
        if not os.path.isfile(p):
            return
        with open(p) as f:
            old = json.load(f).get("base", {})
        for k in sorted(set(old) | set(sig)):
            if k in old and k in sig and old[k] != sig[k]:
                raise K3ConfigError(
                    f"{p}: the sweep in {self.out_dir} was run with {k} = {old[k]!r}, now {sig[k]!r}; its results "
                    f"would not be comparable. Use another --out for other base settings (sweep the key with --set "
                    f"to compare values).")

    # ------------------------------------------------------------------ run
    def run(self, train: bool = True) -> list[dict]:
        """Train every point and seed without a finished row; write the results after each. Returns all rows.
        train=False (`--report-only`): train nothing, rewrite the results, summary and plots from the finished runs;
        `self.missing` lists the (point id, seed) runs left out."""
        plan = self.plan()
        if not plan:
            raise K3ConfigError("the sweep has no point")
        sig = self._signature(plan[0][2])
        self._check_signature(sig)
        os.makedirs(self.out_dir, exist_ok=True)
        _atomic_write(self._path("sweep.json"), json.dumps(
            {"base": sig, "axes": [{"key": a.key, "values": a.texts} for a in self.axes], "seeds": self.seeds,
             "argv": sys.argv}, indent=2, default=str) + "\n")
        rows = self.load_rows()
        done = {(r.get("point"), r.get("seed"), r.get("steps")) for r in rows if r.get("status") in ("completed", "failed")}
        todo = []
        self.ran, self.skipped, self.errors, self.missing = [], [], [], []
        for p, seed, cfg in plan:
            if (p.id, seed, cfg.steps) in done:
                self.skipped.append((p.id, seed))
            else:
                todo.append((p, seed, cfg))
        self.echo(f"k3 sweep: {len(plan)} run(s) ({len(self.points())} point(s) x {len(self.seeds)} seed(s)), "
                  f"{len(self.skipped)} finished before, {len(todo)} to run -> {self.out_dir}"
                  + ("" if train or not todo else " (report only: not trained)"))
        if not train:
            self.missing = [(p.id, seed) for p, seed, _ in todo]
            todo = []

        def record(p: Point, seed: int, cfg, metrics: dict) -> None:
            row = {**{a.key: p.values.get(a.key) for a in self.axes}, "seed": seed, **metrics,
                   "point": p.id, "label": p.label, "run_dir": os.path.relpath(cfg.out_dir, self.out_dir)}
            nonlocal rows
            rows = [r for r in rows if not (r.get("point") == p.id and r.get("seed") == seed)] + [row]
            self.ran.append((p.id, seed))
            self.write(rows)
            if row.get("status") == "completed":
                self._prune(cfg.out_dir)
            vl = row.get("val_loss")
            self.echo(f"  [{len(self.ran)}/{len(todo)}] {p.label} seed {seed}: {row['status']}, val loss "
                      f"{vl if vl is None else f'{vl:.4f}'}, {row.get('wall_s', 0):.1f}s")

        if self.subprocess:
            self._run_subprocesses(todo, record)
        else:
            for p, seed, cfg in todo:
                try:
                    m = run_point(cfg.to_dict(), self.callbacks)
                except Exception as e:  # noqa: BLE001 -- one point's crash (disk, memory) does not end the sweep
                    log.error("sweep point %s seed %d raised", p.label, seed, exc_info=True)
                    self.errors.append((p.id, seed))
                    self.echo(f"  {p.label} seed {seed}: raised {type(e).__name__}: {e}; no row (run the sweep "
                              f"again to retry it)")
                    _free_memory()
                    continue
                if m["status"] == "interrupted":
                    self.write(rows)
                    raise KeyboardInterrupt
                if m["status"] in ("completed", "failed"):
                    record(p, seed, cfg, m)
        self.write(rows)
        return rows

    def missing_text(self) -> str:
        """The runs a run(train=False) left out, in one line."""
        return (f"{len(self.missing)} run(s) not trained (--report-only): "
                + ", ".join(f"{pid} seed {seed}" for pid, seed in self.missing))

    def _run_subprocesses(self, todo, record) -> None:
        slots = list(range(self.gpus)) if self.gpus > 0 else [None]
        queue = list(todo)
        running: dict = {}  # slot -> (Popen, p, seed, cfg, row_path)
        env_base = knobs.child_env()
        try:
            while queue or running:
                for slot in slots:
                    if slot in running or not queue:
                        continue
                    p, seed, cfg = queue.pop(0)
                    os.makedirs(cfg.out_dir, exist_ok=True)
                    spec_path = os.path.join(cfg.out_dir, "sweep_point.json")
                    row_path = os.path.join(cfg.out_dir, "sweep_row.json")
                    if os.path.exists(row_path):
                        os.remove(row_path)
                    _atomic_write(spec_path, json.dumps({"train": cfg.to_dict(), "row_path": row_path,
                                                         "callbacks": self.callbacks}, default=str))
                    env = dict(env_base)
                    if slot is not None:
                        env["CUDA_VISIBLE_DEVICES"] = str(slot)
                    with open(os.path.join(cfg.out_dir, "sweep_worker.log"), "a") as logf:
                        proc = subprocess.Popen([sys.executable, "-m", "k3.sweep", "--worker", spec_path],
                                                env=env, stdout=logf, stderr=subprocess.STDOUT)
                    running[slot] = (proc, p, seed, cfg, row_path)
                time.sleep(0.2)
                for slot, (proc, p, seed, cfg, row_path) in list(running.items()):
                    if proc.poll() is None:
                        continue
                    del running[slot]
                    if proc.returncode == 0 and os.path.isfile(row_path):
                        with open(row_path) as f:
                            m = json.load(f)
                        if m.get("status") in ("completed", "failed"):
                            record(p, seed, cfg, m)
                    else:
                        self.errors.append((p.id, seed))
                        self.echo(f"  {p.label} seed {seed}: worker exited with {proc.returncode} (see "
                                  f"{os.path.join(cfg.out_dir, 'sweep_worker.log')}); run the sweep again to resume")
        except KeyboardInterrupt:
            # Ctrl-C: the workers save a checkpoint on SIGINT (the trainer's Ctrl-C handling); wait for them
            import signal
            for proc, *_ in running.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for proc, *_ in running.values():
                try:
                    proc.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    pass
            raise
        finally:
            for proc, *_ in running.values():
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:  # pragma: no cover
                        proc.kill()

    def _prune(self, run_dir: str) -> None:
        """--keep-outputs final / none: a completed run's checkpoints (and with none its final model) go once its
        row is written."""
        import shutil
        for name in {"all": (), "final": ("checkpoints",), "none": ("checkpoints", "final")}[self.keep_outputs]:
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)

    # ------------------------------------------------------------------ outputs
    def write(self, rows: list[dict]) -> None:
        """results.json, results.csv, summary.md and (with `plot`) the plots, from `rows`."""
        os.makedirs(self.out_dir, exist_ok=True)
        keys = [a.key for a in self.axes]
        for k in self._stored_axes():
            if k not in keys:
                keys.append(k)
        extra = []
        for r in rows:
            for k in r:
                if k not in keys and k not in extra and k not in RESULT_COLUMNS and k not in ("seed", "label", "resumed"):
                    extra.append(k)
        _atomic_write(self._path("results.json"), json.dumps(
            {"axes": keys, "rows": finite_or_none(rows)}, indent=2, default=str) + "\n")
        cols = keys + ["seed"] + RESULT_COLUMNS + extra + ["label", "resumed"]
        tmp = self._path("results.csv.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            for r in rows:
                w.writerow({k: (json.dumps(v) if isinstance(v, (list, dict)) else v)
                            for k, v in finite_or_none(r).items()})
        os.replace(tmp, self._path("results.csv"))
        _atomic_write(self._path("summary.md"), summary_markdown(rows, keys))
        if self.plot and rows:
            try:
                plot_results(rows, keys, self.out_dir)
            except Exception as e:  # a plot never loses results
                log.warning("sweep plots failed: %s", e)


# ----------------------------------------------------------------------------------------------- CLI

def add_parser(subparsers) -> argparse.ArgumentParser:
    from k3.flags import int_at_least
    s = subparsers.add_parser(
        "sweep", help="run a grid of training runs (config keys / train settings x seeds), tabulate and plot",
        description="Train every combination of the --set values for each seed, then write results.csv/.json, "
                    "summary.md (mean ± std over seeds) and plots to --out. Run it again to resume.",
        epilog="Keys: a K3Config dotted path (linear_attn_config.gate_lower_bound, attn_res_block_size, hidden_act) "
               "or train.<setting> (train.lr, train.balancer, train.batch_tokens, train.stages). Values: V1,V2,... "
               "or V1;V2;... when a value holds commas (train.stages=256:0.5,1024:0.5;1024:1). Flags after `--` "
               "go to every run (k3 train's flags, e.g. -- --batch-tokens 1024 --stages 256:1). Example: k3 sweep "
               "--preset tiny --set linear_attn_config.gate_lower_bound=-6,-5,-4,-3 --seeds 3 --steps 200 "
               "--out sweeps/gmin")
    a = s.add_argument
    a("--preset", default=None, help="model preset of every run [tiny]")
    a("--config", default=None, help="model config.json / checkpoint dir (instead of --preset)")
    a("--set", dest="sets", action="append", default=[], metavar="KEY=V1,V2,...",
      help="a swept key and its values (repeat for a grid)")
    a("--seeds", type=int_at_least(1), default=1, help="seeds per point [1]")
    a("--first-seed", type=int, default=0, help="the seeds are FIRST .. FIRST+SEEDS-1 [0]")
    a("--steps", type=int_at_least(1), default=None, help="optimizer steps per run [k3 train's default]")
    a("--out", required=True, help="sweep directory (results, summary, plots, runs/)")
    a("--gpus", type=int_at_least(0), default=0,
      help="run N points at a time, one subprocess per GPU (CUDA_VISIBLE_DEVICES) [0: sequential]")
    a("--subprocess", action="store_true", help="run each point in its own process (sequentially)")
    a("--dry-run", action="store_true", help="validate and list the runs; train nothing")
    a("--report-only", action="store_true",
      help="train nothing: rewrite results, summary and plots from the finished runs (e.g. after copying runs in)")
    a("--no-plot", action="store_true", help="no plots")
    a("--keep-outputs", choices=KEEP, default="all",
      help="what a completed run keeps on disk: all (end checkpoint + final model), final (the final model), none "
           "(metrics only) [all]")
    a("train_args", nargs="*", metavar="-- TRAIN_FLAGS", help="k3 train flags for every run (after `--`)")
    s.set_defaults(fn=run_cli)
    return s


def base_from_train_args(train_args: Sequence[str]) -> dict:
    """The `k3 train` flags after `--` -> TrainConfig overrides (argparse errors name the flag)."""
    from k3.train import cli as train_cli
    args = list(train_args)
    if args and args[0] == "--":
        args = args[1:]
    ns = _train_parser().parse_args(args)
    for dest in ("out", "resume", "overwrite", "seed", "json", "stop_at"):
        if getattr(ns, dest, None) not in (None, False):
            raise K3ConfigError(f"--{dest.replace('_', '-')} after `--`: the sweep sets it (use --out / --seeds on "
                                f"k3 sweep; a sweep is resumed by running it again)")
    return train_cli._overrides(ns)


def run_cli(args) -> int:
    import torch
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("k3.checkpoint").setLevel(logging.WARNING)
    base = base_from_train_args(args.train_args)
    for name in ("preset", "config", "steps"):
        v = getattr(args, name)
        if v is not None:
            if name in base and base[name] != v:
                raise K3ConfigError(f"--{name} given both to k3 sweep ({v}) and after `--` ({base[name]})")
            base[name] = v
    axes = [parse_set(t) for t in args.sets]
    if args.gpus and not torch.cuda.is_available():
        raise K3ConfigError(f"--gpus {args.gpus}: CUDA is not available (leave --gpus out to run sequentially)")
    if args.gpus and args.gpus > torch.cuda.device_count():
        raise K3ConfigError(f"--gpus {args.gpus}: only {torch.cuda.device_count()} GPU(s) visible")
    sweep = Sweep(args.out, axes, seeds=range(args.first_seed, args.first_seed + args.seeds), base=base,
                  gpus=args.gpus, subprocess=args.subprocess, plot=not args.no_plot, keep_outputs=args.keep_outputs)
    if args.dry_run:
        plan = sweep.plan()
        print(f"k3 sweep: {len(plan)} run(s), all valid:")
        for p, seed, cfg in plan:
            print(f"  {p.label} seed {seed} -> {cfg.out_dir}")
        return 0
    rows = sweep.run(train=not args.report_only)
    print(open(os.path.join(args.out, "summary.md")).read(), end="")
    if sweep.missing:
        print(f"k3 sweep: {sweep.missing_text()}")
    bad = [r for r in rows if r.get("status") != "completed"]
    if bad:
        print(f"k3 sweep: {len(bad)} run(s) failed (see results.csv, column error)")
    if sweep.errors:
        print(f"k3 sweep: {len(sweep.errors)} run(s) raised and have no row; run the same command again to retry them")
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2]))
    from k3.cli import main
    sys.exit(main(["sweep", *sys.argv[1:]]))
