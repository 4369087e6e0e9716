"""Shared parts of the claim scripts (benchmarks/claims/*.py): flags, running the variants through `k3.sweep`,
per-variant mean ± std tables, JSON and plots.

Every script trains the same small setup per variant and seed (default: the `tiny` preset, a few hundred steps on
the built-in corpus, CPU-sized) and reports mean ± sample std over seeds. `--micro` shrinks the model to the trainer
tests' ~0.3M-parameter variant, for a smoke run of the script itself (its numbers say nothing about the claim).

Variants that are a config key or a `k3 train` flag run as one `k3.sweep.Sweep` (its results.csv, summary.md and
plots are in OUT/sweep/); variants that differ in several keys or in their measurement callbacks
(claim_probes.py) run as one Sweep each, in OUT/<variant>/.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional, Sequence


from k3 import sweep as ksweep
from k3.train.report import finite_or_none

# the trainer tests' micro model (tests/conftest.py): for smoke runs of the scripts only
MICRO = dict(hidden_size=64, num_hidden_layers=4, vocab_size=1024, bos_token_id=768, eos_token_id=770,
             pad_token_id=1023, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
             routed_expert_hidden_size=32, kda_gate_low_rank=16, attn_res_block_size=2,
             **{"linear_attn_config.num_heads": 2, "linear_attn_config.head_dim": 16,
                "linear_attn_config.full_attn_layers": [4], "linear_attn_config.kda_layers": [1, 2, 3]})


KEEP = "all"  # --keep-outputs of the script's arguments (set by base_from_args)
TRAIN = True  # not --report-only (set by base_from_args)


def parser(name: str, doc: str, steps: int = 200, seq_len: int = 256, batch_tokens: int = 2048) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"benchmarks/claims/{name}.py", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--preset", default="tiny", help="model preset [tiny]")
    a("--steps", type=int, default=steps, help=f"optimizer steps per run [{steps}]")
    a("--seeds", type=int, default=3, help="seeds per variant [3]")
    a("--first-seed", type=int, default=0, help="the seeds are FIRST .. FIRST+SEEDS-1, to split one claim's seeds "
      "over jobs [0]")
    a("--merge", nargs="+", default=[], metavar="DIR",
      help="before running, take the finished runs of these output directories (other jobs of this claim: other "
           "seeds or variants) into --out; with them in place the script trains only what is missing and reports all")
    a("--report-only", action="store_true",
      help="train nothing: report the finished runs under --out (with --merge: report what the jobs brought, on any "
           "machine); a run still missing is named and left out of the report")
    a("--seq-len", type=int, default=seq_len, help=f"training sequence length (one stage) [{seq_len}]")
    a("--batch-tokens", type=int, default=batch_tokens, help=f"tokens per step [{batch_tokens}]")
    a("--lr", type=float, default=None, help="peak learning rate [k3 train's]")
    a("--device", default="auto")
    a("--threads", type=int, default=None)
    a("--param-dtype", default=None, choices=["auto", "fp32", "bf16"])
    a("--compile", default=None, choices=["auto", "none", "modules", "layers", "model"])
    a("--data", nargs="+", default=None, help="corpus files [built-in]")
    a("--val-tokens", type=int, default=8192, help="validation tokens per evaluation [8192]")
    a("--keep-outputs", default="all", choices=ksweep.KEEP,
      help="what a finished run keeps on disk (k3 sweep --keep-outputs): a `small` run's checkpoint + final model "
           "are ~17 GB [all]")
    a("--micro", action="store_true", help="the ~0.3M-parameter test model (smoke run of the script)")
    a("--out", default=os.path.join("runs", "claims", name), help=f"output directory [runs/claims/{name}]")
    return p


def seeds(args) -> range:
    return range(args.first_seed, args.first_seed + args.seeds)


def merge_runs(out: str, srcs: Sequence[str]) -> int:
    """Copy the finished runs of every sweep under each SRC (a directory with results.json, at any depth) into the
    same relative place under OUT, adding their rows to OUT's results.json (a row of the same point and seed is
    replaced). Returns the number of rows taken."""
    import shutil
    taken = 0
    for src in srcs:
        if not os.path.isdir(src):
            raise SystemExit(f"--merge: {src} is not a directory")
        for d, _, files in os.walk(src):
            if "results.json" not in files or "sweep.json" not in files:
                continue
            dst = os.path.join(out, os.path.relpath(d, src))
            with open(os.path.join(d, "results.json")) as f:
                new = json.load(f)
            dst_json = os.path.join(dst, "results.json")
            old = {"axes": new.get("axes", []), "rows": []}
            if os.path.isfile(dst_json):
                with open(dst_json) as f:
                    old = json.load(f)
            else:
                os.makedirs(dst, exist_ok=True)
                shutil.copy(os.path.join(d, "sweep.json"), os.path.join(dst, "sweep.json"))
            rows = old["rows"]
            for r in new.get("rows", []):
                if r.get("status") not in ("completed", "failed"):
                    continue
                shutil.copytree(os.path.join(d, r["run_dir"]), os.path.join(dst, r["run_dir"]), dirs_exist_ok=True)
                rows = [x for x in rows if (x.get("point"), x.get("seed")) != (r.get("point"), r.get("seed"))] + [r]
                taken += 1
            ksweep._atomic_write(dst_json, json.dumps({"axes": old.get("axes", []), "rows": rows}, indent=2) + "\n")
    return taken


def base_from_args(args, **extra) -> dict:
    """TrainConfig fields shared by every variant (and, first, --merge's runs taken into --out)."""
    if getattr(args, "merge", None):
        print(f"--merge: took {merge_runs(args.out, args.merge)} finished run(s) into {args.out}", file=sys.stderr)
    global KEEP, TRAIN
    KEEP = args.keep_outputs
    TRAIN = not args.report_only
    b = dict(preset=args.preset, steps=args.steps, tokens_per_step=args.batch_tokens,
             stages=[(args.seq_len, 1.0)], device=args.device, val_tokens=args.val_tokens, plot=False,
             eval_every=0)
    for k in ("lr", "threads", "param_dtype", "compile", "data"):
        v = getattr(args, k, None)
        if v is not None:
            b[k] = v
    if args.micro:
        b["model_overrides"] = dict(MICRO)
        b["val_tokens"] = min(args.val_tokens, 1024)
    b.update(extra)
    return b


def run_sweep(out: str, sets: Sequence[str], seeds: Sequence[int], base: dict, callbacks=()) -> list[dict]:
    """One k3.sweep over `sets` (KEY=V1,V2 strings) and `seeds` (`seeds(args)`); each row gets `variant` = its
    point label. A point that raised has no row (the report shows the others; run the script again to retry it)."""
    s = ksweep.Sweep(out, [ksweep.parse_set(t) for t in sets], seeds=seeds, base=base, callbacks=callbacks,
                     keep_outputs=KEEP)
    rows = s.run(train=TRAIN)
    if s.missing:
        print(f"{out}: {s.missing_text()}", file=sys.stderr)
    if s.errors:
        print(f"{out}: {len(s.errors)} run(s) raised (no row); run the script again to retry them", file=sys.stderr)
    for r in rows:
        r["variant"] = r.get("label")
        r["_run_dir"] = os.path.join(out, r["run_dir"])
    return rows


def run_variants(out: str, variants: Sequence[tuple], seeds: Sequence[int], base: dict) -> list[dict]:
    """variants: (name, [KEY=V sets, one value each], [callback factories]); one Sweep per variant in OUT/name."""
    rows = []
    for name, sets, cbs in variants:
        for r in run_sweep(os.path.join(out, name), sets, seeds, base, cbs):
            r["variant"] = name
            rows.append(r)
    return rows


def mean_std(xs) -> tuple[Optional[float], Optional[float], int]:
    xs = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    if not xs:
        return None, None, 0
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None
    return m, sd, len(xs)


def aggregate(rows: list[dict], metrics: Sequence[str]) -> list[dict]:
    """Per variant (first-seen order): {"variant", "n", metric: [mean, std]} over completed runs."""
    order, groups = [], {}
    for r in rows:
        v = r["variant"]
        if v not in groups:
            order.append(v)
            groups[v] = []
        groups[v].append(r)
    out = []
    for v in order:
        done = [r for r in groups[v] if r.get("status") == "completed"]
        g = {"variant": v, "n": len(done), "failed": len(groups[v]) - len(done)}
        for m in metrics:
            mean, sd, _ = mean_std([r.get(m) for r in done])
            g[m] = [mean, sd]
        out.append(g)
    return out


def fmt(ms, f="{:.4f}") -> str:
    mean, sd = ms
    if mean is None:
        return "-"
    return f.format(mean) + (f" ± {f.format(sd)}" if sd is not None else "")


def table(groups: list[dict], cols: Sequence[tuple]) -> str:
    """cols: (metric, header, format). A markdown table of mean ± std per variant."""
    head = ["variant", "n"] + [h for _, h, _ in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        n = str(g["n"]) + (f" (+{g['failed']} failed)" if g["failed"] else "")
        lines.append("| " + " | ".join([str(g["variant"]), n] + [fmt(g[m], f) for m, _, f in cols]) + " |")
    return "\n".join(lines)


def read_metrics(run_dir: str) -> tuple[list, list]:
    from k3.train.report import read_metrics as rm
    p = os.path.join(run_dir, "metrics.jsonl")
    return rm(p) if os.path.isfile(p) else ([], [])


def curve(rows: list[dict], variant: str, key: str) -> tuple[list, list]:
    """Mean over seeds of a per-step train metric (metrics.jsonl) for one variant."""
    per = []
    for r in rows:
        if r["variant"] == variant and r.get("status") == "completed":
            train, _ = read_metrics(r["_run_dir"])
            per.append({t["step"]: t.get(key) for t in train})
    steps = sorted(set().union(*[p.keys() for p in per])) if per else []
    ys = []
    for s in steps:
        m, _, _ = mean_std([p.get(s) for p in per])
        ys.append(float("nan") if m is None else m)
    return steps, ys


def write_json(out: str, name: str, obj) -> str:
    os.makedirs(out, exist_ok=True)
    p = os.path.join(out, f"{name}.json")
    with open(p, "w") as f:
        json.dump(finite_or_none(obj), f, indent=2, default=str)
        f.write("\n")
    return p


def plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_plot(fig, path: str) -> str:
    """Lay out, write (110 dpi) and close a figure; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt().close(fig)
    return path


def plot_by_layer(rows, variants, key: str, xlabel: str, ylabel: str, path: str, logy: bool = False,
                  ref: Optional[float] = None, seeds: bool = False) -> str:
    """Per variant, the mean over seeds of a per-layer list metric (`key`), against the layer index; `ref` draws a
    dashed reference level, `seeds` also each seed's values as small dots."""
    p = plt()
    fig, ax = p.subplots(figsize=(6.5, 4.5))
    for v in variants:
        per = [r[key] for r in rows if r["variant"] == v and r.get(key)]
        if per:
            L = min(len(x) for x in per)
            line, = ax.plot(range(L), [sum(x[i] for x in per) / len(per) for i in range(L)], marker="o", label=v)
            if seeds:
                for x in per:
                    ax.scatter(range(L), x[:L], s=9, color=line.get_color(), alpha=0.45)
    if ref is not None:
        ax.axhline(ref, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_plot(fig, path)


def plot_curves(rows, variants, key: str, ylabel: str, path: str, title: str = "", logy: bool = False,
                smooth: float = 0.3) -> str:
    p = plt()
    fig, ax = p.subplots(figsize=(7, 4.5))
    for v in variants:
        xs, ys = curve(rows, v, key)
        if xs:
            ax.plot(xs, ksweep._smooth(ys, smooth) if smooth else ys, label=str(v))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_plot(fig, path)


def plot_bars(groups, metric: str, ylabel: str, path: str, title: str = "") -> str:
    p = plt()
    fig, ax = p.subplots(figsize=(6, 4))
    xs = list(range(len(groups)))
    ys = [g[metric][0] if g[metric][0] is not None else float("nan") for g in groups]
    es = [g[metric][1] or 0.0 for g in groups]
    ax.bar(xs, ys, yerr=es, capsize=5, color="tab:blue", alpha=0.8)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(g["variant"]) for g in groups], rotation=15, fontsize=8)
    ax.set_ylabel(ylabel)
    finite = [y for y in ys if math.isfinite(y)]
    if finite:
        lo, hi = min(finite), max(finite)
        ax.set_ylim(max(0.0, lo - (hi - lo) * 2 - 0.02 * abs(lo)), hi + (hi - lo) * 0.5 + max(es + [0]) + 1e-6)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    return save_plot(fig, path)


def report(out: str, name: str, title: str, claim: str, groups, cols, rows, extra: Optional[dict] = None,
           plots: Sequence[str] = (), extra_md: str = "") -> str:
    """Print the table, write OUT/<name>.json (setup, per-variant stats, rows) and OUT/<name>.md."""
    md = (table(groups, cols) if groups else "") + (("\n\n" if groups else "") + extra_md if extra_md else "")
    print(f"\n## {title}\n\nclaim: {claim}\n\n{md}\n")
    write_json(out, name, {"claim": claim, "argv": sys.argv, "groups": groups,
                           "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
                           **(extra or {}), "plots": list(plots)})
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(f"# {title}\n\nclaim: {claim}\n\ncommand: `{' '.join(sys.argv)}`\n\n{md}\n\n"
                + "".join(f"![{os.path.basename(p)}]({os.path.basename(p)})\n" for p in plots))
    return md
