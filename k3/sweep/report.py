"""`k3 sweep`: per-point summaries (mean +- std over seeds), summary.md and plots."""
from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence


_SUMMARY_METRICS = [("val_loss", "val loss", "{:.4f}"), ("train_loss", "train loss", "{:.4f}"),
                    ("tokens_per_s", "tokens/s", "{:.0f}"), ("maxvio", "MaxVio", "{:.3f}"),
                    ("peak_mem_mb", "peak MB", "{:.0f}"), ("wall_s", "wall s", "{:.1f}")]


def _read_metrics(run_dir: str) -> tuple[list, list]:
    from k3.train.report import read_metrics
    p = os.path.join(run_dir, "metrics.jsonl")
    return read_metrics(p) if os.path.isfile(p) else ([], [])


def _mean_std(xs: list) -> tuple[Optional[float], Optional[float], int]:
    xs = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    if not xs:
        return None, None, 0
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None, 1
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)), len(xs)


def summarize(rows: list[dict]) -> list[dict]:
    """Per point (in first-seen order): {"point", "label", "values", "n", metric: (mean, std)} over its seeds."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.get("point"), []).append(r)
    out = []
    for pid, rs in groups.items():
        g = {"point": pid, "label": rs[0].get("label"), "values": json.loads(pid) if pid else {},
             "n": len(rs), "failed": sum(1 for r in rs if r.get("status") != "completed")}
        for m, _, _ in _SUMMARY_METRICS:
            mean, std, _n = _mean_std([r.get(m) for r in rs if r.get("status") == "completed"])
            g[m] = (mean, std)
        out.append(g)
    return out


def _fmt_ms(ms, fmt) -> str:
    mean, std = ms
    if mean is None:
        return "-"
    return fmt.format(mean) + (f" ± {fmt.format(std)}" if std is not None else "")


def summary_markdown(rows: list[dict], keys: Sequence[str]) -> str:
    groups = summarize(rows)
    lines = ["# k3 sweep summary", "",
             f"{len(rows)} run(s), {len(groups)} point(s). Mean ± sample std over seeds (completed runs); "
             "train loss = mean of the last 10% of steps; MaxVio = mean over the last 10% of steps.", ""]
    head = list(keys) + ["seeds"] + [name for _, name, _ in _SUMMARY_METRICS]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for g in groups:
        vals = [json.dumps(g["values"].get(k)) if isinstance(g["values"].get(k), (list, dict))
                else str(g["values"].get(k)) for k in keys]
        n = f"{g['n'] - g['failed']}" + (f" (+{g['failed']} failed)" if g["failed"] else "")
        lines.append("| " + " | ".join(vals + [n] + [_fmt_ms(g[m], f) for m, _, f in _SUMMARY_METRICS]) + " |")
    return "\n".join(lines) + "\n"


def _smooth(xs: list, alpha: float = 0.3) -> list:
    out, s = [], None
    for x in xs:
        if x is None or not math.isfinite(x):
            out.append(float("nan"))
            continue
        s = x if s is None else alpha * x + (1 - alpha) * s
        out.append(s)
    return out


def plot_results(rows: list[dict], keys: Sequence[str], out_dir: str) -> list[str]:
    """loss_curves.png (train loss per step, mean over seeds, one line per point) and final_loss.png (final val
    loss vs the first key's value, std error bars, one line per combination of the other keys)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    groups = summarize(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for g in groups:
        curves = []
        for r in rows:
            if r.get("point") != g["point"] or not r.get("run_dir"):
                continue
            train, _ = _read_metrics(os.path.join(out_dir, r["run_dir"]))
            curves.append({t["step"]: t.get("loss") for t in train})
        steps = sorted(set().union(*[c.keys() for c in curves])) if curves else []
        if not steps:
            continue
        mean = []
        for s in steps:
            xs = [c[s] for c in curves if s in c and c[s] is not None and math.isfinite(c[s])]
            mean.append(sum(xs) / len(xs) if xs else float("nan"))
        ax.plot(steps, _smooth(mean), label=f"{g['label']} (n={len(curves)})")
    written.append(_finish_plot(plt, fig, ax, "step", "train loss (EMA, mean over seeds)", bool(groups),
                                os.path.join(out_dir, "loss_curves.png")))

    fig, ax = plt.subplots(figsize=(6, 4.5))
    first = keys[0] if keys else None
    lines: dict = {}
    for g in groups:
        rest = ", ".join(f"{k.split('.')[-1]}={g['values'].get(k)}" for k in keys[1:])
        lines.setdefault(rest, []).append(g)
    xs_all = [g["values"].get(first) for g in groups] if first else []
    numeric = bool(xs_all) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs_all)
    cats = []
    for x in xs_all:
        if json.dumps(x) not in cats:
            cats.append(json.dumps(x))
    for rest, gs in lines.items():
        xs, ys, es = [], [], []
        for g in gs:
            mean, std = g["val_loss"]
            if mean is None:
                continue
            x = g["values"].get(first) if first else 0
            xs.append(x if numeric else cats.index(json.dumps(x)))
            ys.append(mean)
            es.append(std or 0.0)
        if xs:
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=4, label=rest or None, linestyle="-" if numeric else "none")
    if not numeric and cats:
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels([c.strip('"') for c in cats], rotation=20, fontsize=8)
    written.append(_finish_plot(plt, fig, ax, first or "point", "final val loss (mean ± std over seeds)",
                                any(lines) and len(lines) > 1, os.path.join(out_dir, "final_loss.png")))
    return written


def _finish_plot(plt, fig, ax, xlabel: str, ylabel: str, legend: bool, path: str) -> str:
    """Label, grid, optional legend; write `path` (PNG) and close the figure. Returns `path`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


