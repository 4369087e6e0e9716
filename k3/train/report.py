"""Run records and end-of-run artefacts: strict-JSON metrics lines, the run summary, the loss-curve PNG
(matplotlib, Agg) and a short Markdown / console report."""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Optional, Sequence

log = logging.getLogger("k3.train")

__all__ = ["finite_or_none", "read_metrics", "plot_loss", "format_summary", "write_report", "json_line", "build_summary",
           "write_artifacts", "truncate_metrics", "progress_bar", "set_postfix", "MTPSums", "balancer_record"]


# ------------------------------------------------------------------------------------------- step-record fields
class MTPSums:
    """A step's multi-token-prediction losses (models with `num_nextn_predict_layers` > 0), summed over its
    micro-batches with the loss weights: the next-token loss alone and the per-depth losses."""

    def __init__(self):
        self.main = None   # 0-dim float64 tensor
        self.depths = None  # [depths] float64

    def add(self, out, w: float) -> None:
        if getattr(out, "mtp_losses", None) is None:
            return
        self.depths = out.mtp_losses.detach().double() * w + (0 if self.depths is None else self.depths)
        self.main = out.main_loss.detach().double() * w + (0 if self.main is None else self.main)

    def values(self) -> list:
        """[main, depth 1, ...] as floats ([] without MTP): what a distributed step sums over its ranks."""
        return [] if self.main is None else [float(self.main)] + [float(x) for x in self.depths.tolist()]

    def set_values(self, v: Sequence[float]) -> None:
        if v:
            import torch
            self.main = torch.tensor(v[0], dtype=torch.float64)
            self.depths = torch.tensor(list(v[1:]), dtype=torch.float64)

    def record(self) -> dict:
        """The step record's MTP fields (`loss` is the objective: main_loss + lambda * mean(mtp_losses))."""
        if self.main is None:
            return {}
        return {"main_loss": float(self.main), "mtp_loss": float(self.depths.mean()),
                "mtp_losses": [float(x) for x in self.depths.tolist()]}


def balancer_record(balancer) -> dict:
    """The balancer's step-record fields (maxvio, maxvio_max, dead_experts_mean, min_load_ratio_min)."""
    m = balancer.metrics()
    rec = {}
    for k in ("maxvio_mean", "maxvio_max", "dead_experts_mean", "min_load_ratio_min"):
        v = m.get(f"balance/{k}")
        if v is not None:
            rec["maxvio" if k == "maxvio_mean" else k] = v
    return rec


def finite_or_none(v):
    """`v` with every NaN / inf float (in nested dicts / lists) replaced by None, for strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite_or_none(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite_or_none(x) for x in v]
    return v


def json_line(rec: dict) -> str:
    """One metrics.jsonl line in strict JSON: a NaN / inf number (a skipped step's loss) is written as null."""
    return json.dumps(finite_or_none(rec), allow_nan=False)


def read_metrics(path: str) -> tuple[list[dict], list[dict]]:
    """-> (train records, eval records) of a metrics.jsonl."""
    train, ev = [], []
    if not os.path.exists(path):
        return train, ev
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            (ev if rec.get("type") == "eval" else train).append(rec)
    return train, ev


def truncate_metrics(path: str, step: int) -> tuple[list[dict], list[dict]]:
    """Drop the records after `step` from a metrics.jsonl (a resumed run rewrites them); -> (train, eval) kept."""
    train, ev = [], []
    if not os.path.exists(path):
        return train, ev
    keep = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("step", 0) <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
                (train if rec.get("type") == "train" else ev).append(rec)
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)
    return train, ev


def progress_bar(enabled: bool, step: int, end: int):
    """A tqdm bar from `step` to `end` (None when disabled)."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=end, initial=step, desc="k3 train", unit="step", dynamic_ncols=True)


def set_postfix(pbar, rec: dict) -> None:
    post = {"loss": f"{rec['loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}", "lr": f"{rec['lr']:.2e}",
            "T": rec["seq_len"]}
    if "maxvio" in rec:
        post["maxvio"] = f"{rec['maxvio']:.2f}"
    pbar.set_postfix(post, refresh=False)


def _smooth(xs: Sequence[float], alpha: Optional[float] = None) -> list[float]:
    """Bias-corrected EMA (no lag towards the first value); alpha defaults to ~8/len, in [0.02, 0.3]."""
    if alpha is None:
        alpha = max(0.02, min(0.3, 8.0 / max(len(xs), 1)))
    out, m, w = [], 0.0, 0.0
    for x in xs:
        m = (1 - alpha) * m + alpha * x
        w = (1 - alpha) * w + alpha
        out.append(m / w)
    return out


def plot_loss(metrics_path: str, png_path: str, boundaries: Optional[Sequence[int]] = None) -> Optional[str]:
    """Train loss (raw + EMA), validation loss, and the context-stage boundaries. Returns the PNG path (None
    without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import math
    train, ev = read_metrics(metrics_path)
    train = [r for r in train if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        steps = [r["step"] for r in train]
        losses = [r["loss"] for r in train]
        ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=1, label="train loss")
        ax.plot(steps, _smooth(losses), color="tab:blue", lw=2, label="train loss (EMA)")
    ev = [r for r in ev if isinstance(r.get("val_loss"), (int, float)) and math.isfinite(r["val_loss"])]
    if ev:
        ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", color="tab:red", label="val loss")
    seqs = {}
    for r in train:
        seqs.setdefault(r.get("stage", 0), (r["step"], r.get("seq_len")))
    y0 = ax.get_ylim()[0]
    for i, (st, (s, seq)) in enumerate(sorted(seqs.items())):
        if i:
            ax.axvline(s - 0.5, color="gray", ls="--", lw=1)
        ax.text(s, y0, f" T={seq}", va="bottom", fontsize=8, color="gray")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("k3 training")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, png_path)
    return png_path


def _f(x, fmt="{:.4f}"):
    return "n/a" if x is None else fmt.format(x)


def format_summary(s: dict) -> str:
    lines = [
        f"k3 train: {s['status']} at step {s['step']}/{s['steps']} in {s['wall_time_s']:.0f} s "
        f"({s['num_params'] / 1e6:.1f}M params, {s['tokens_seen']:,} tokens, {s['tokens_per_s']:.0f} tokens/s)",
        f"  validation loss  {_f(s.get('val_loss_before'))} -> {_f(s.get('val_loss_after'))}",
        f"  train loss       {_f(s.get('train_loss_first'))} -> {_f(s.get('train_loss_last'))}"
        + (f"   ({s['skipped_steps']} skipped steps)" if s.get("skipped_steps") else ""),
    ]
    if s.get("recall_acc_after") is not None:
        lines.append(f"  recall (MQAR)    {s['recall_acc_after']:.3f} among candidates "
                     f"(chance {_f(s.get('recall_chance'), '{:.3f}')})")
    if s.get("final"):
        lines.append(f"  final model      {s['final']}")
    elif s.get("checkpoint"):
        lines.append(f"  checkpoint       {s['checkpoint']}")
    if s.get("plot"):
        lines.append(f"  loss curve       {s['plot']}")
    for p, t in s.get("samples") or []:
        lines.append(f"  sample  {p!r} -> {t!r}")
    return "\n".join(lines)


def write_report(s: dict, path: str) -> str:
    with open(path, "w") as f:
        f.write("# k3 training run\n\n```\n" + format_summary(s) + "\n```\n")
    return path


def build_summary(trainer, status: str, wall: float) -> dict:
    """The run summary dict that `Trainer.train()` returns (and report.md shows)."""
    from k3.train.checkpointing import latest_checkpoint
    cfg = trainer.cfg
    ev = trainer.eval_history
    hist = trainer.history
    trained = [r for r in hist if not r.get("skipped")]
    tps = (sum(r["tokens"] for r in hist) / sum(r["step_time"] for r in hist)) if hist else 0.0
    return {
        "status": status, "step": trainer.step, "steps": cfg.steps, "out_dir": cfg.out_dir,
        "wall_time_s": wall, "data_time_s": getattr(trainer, "data_time", 0.0),
        "tokens_seen": trainer.tokens_seen, "tokens_per_s": tps, "num_params": trainer.num_params,
        "device": str(trainer.device), "threads": getattr(trainer, "threads", None),
        "val_loss_before": ev[0]["val_loss"] if ev else None,
        "val_loss_after": ev[-1]["val_loss"] if ev else None,
        "recall_acc_after": ev[-1].get("recall_acc_cands") if ev else None,
        "recall_chance": 1.0 / cfg.recall_pairs if cfg.recall_pairs else None,
        "train_loss_first": trained[0]["loss"] if trained else None,
        "train_loss_last": trained[-1]["loss"] if trained else None,
        "skipped_steps": sum(1 for r in hist if r.get("skipped")),
        "checkpoint": latest_checkpoint(cfg.out_dir),
    }


def write_artifacts(trainer, summary: dict) -> None:
    """loss.png (if `plot`), report.md, samples.txt (if the summary has samples)."""
    cfg = trainer.cfg
    if cfg.plot:
        try:
            summary["plot"] = plot_loss(trainer._path("metrics.jsonl"), trainer._path("loss.png"),
                                        boundaries=trainer.schedule.boundaries())
        except Exception as e:
            log.warning("loss plot failed: %s", e)
    write_report(summary, trainer._path("report.md"))
    if summary.get("samples"):
        with open(trainer._path("samples.txt"), "w") as f:
            for p, s in summary["samples"]:
                f.write(f"--- prompt: {p!r}\n{p}{s}\n\n")
