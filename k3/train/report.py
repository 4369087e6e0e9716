"""End-of-run artefacts: the loss-curve PNG (matplotlib, Agg) and a short Markdown / console report."""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

__all__ = ["read_metrics", "plot_loss", "format_summary", "write_report"]


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
