"""Claim: staged context extension (most steps short, a few long ones at the end) reaches the long-context loss
of training at the final length directly, at lower cost.

A `k3.sweep` over `train.stages`: staged (--short for --short-share of the steps, then --long) vs direct (--long
for all steps). Both see the same tokens per step and steps (equal tokens); the cost is reported as training time
(wall seconds of the steps) and as training FLOPs (`k3.info.train_flops_per_token` at each step's row length,
summed over the run's steps: MLA attention FLOPs grow with the row length, so the direct run costs more per
token). Validation runs at --long (`val_seq_len`). Two more direct rows at equal cost: `--equal-time` gives the
direct run only as many steps as fit in the staged run's mean training time (from a first calibration pass: "direct
(equal time)"); `--equal-flops` as many as fit in the staged run's training FLOPs (counted from its logged steps, so
it never gets more: "direct (equal FLOPs)"; independent of the machine and of jobs sharing it).

    python benchmarks/claims/stages.py                          # tiny, 256 -> 1024, 3 seeds
    python benchmarks/claims/stages.py --micro --steps 6 --seeds 2 --short 64 --long 128 --batch-tokens 256
"""
import json
import os

import common


def train_flops(run_dir: str) -> float | None:
    """Training FLOPs of one run: sum over its logged steps of tokens x FLOPs per token at the step's row length."""
    from k3.config import K3Config
    from k3.info import train_flops_per_token
    try:
        cfg = K3Config.from_json(os.path.join(run_dir, "config.json"))
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            steps = [r for r in map(json.loads, f) if r.get("type") == "train"]
    except (OSError, ValueError):
        return None
    per_t: dict[int, float] = {}
    total = 0.0
    for r in steps:
        t = int(r["seq_len"])
        if t not in per_t:
            per_t[t] = train_flops_per_token(cfg, t)["total"]
        total += r["tokens"] * per_t[t]
    return total if steps else None


def main(argv=None):
    p = common.parser("stages", __doc__, batch_tokens=4096)
    p.add_argument("--short", type=int, default=256)
    p.add_argument("--long", type=int, default=1024)
    p.add_argument("--short-share", type=float, default=0.75)
    p.add_argument("--equal-time", action="store_true", help="also a direct run cut to the staged run's time")
    p.add_argument("--equal-flops", action="store_true", help="also a direct run cut to the staged run's FLOPs")
    args = p.parse_args(argv)
    base = common.base_from_args(args, val_seq_len=args.long)
    staged = f"{args.short}:{args.short_share:g},{args.long}:{1 - args.short_share:g}"
    direct = f"{args.long}:1"
    rows = common.run_sweep(os.path.join(args.out, "sweep"), [f"train.stages={staged};{direct}"], common.seeds(args), base)
    for r in rows:
        r["variant"] = "staged" if len(r["train.stages"]) > 1 else "direct"

    def direct_run(name: str, steps: int, what: str) -> list[dict]:
        more = common.run_sweep(os.path.join(args.out, name), [f"train.stages={direct}"], common.seeds(args),
                                dict(base, steps=steps))
        for r in more:
            r["variant"] = f"direct (equal {what}, {steps} steps)"
        return more
    if args.equal_time:
        g0 = common.aggregate(rows, ["train_time_s"])
        t_staged = next((g["train_time_s"][0] for g in g0 if g["variant"] == "staged"), None)
        t_direct = next((g["train_time_s"][0] for g in g0 if g["variant"] == "direct"), None)
        if t_staged is None or t_direct is None:
            raise SystemExit("stages.py --equal-time: no finished staged and direct run to calibrate the time from "
                             f"(see {os.path.join(args.out, 'sweep', 'results.csv')}); fix the failed runs and rerun")
        rows += direct_run("equal_time", max(1, int(args.steps * t_staged / max(t_direct, 1e-9))), "time")
    if args.equal_flops:
        done = [r for r in rows if r["variant"] == "staged" and r.get("status") == "completed"]
        flops = [f for f in (train_flops(r["_run_dir"]) for r in done) if f]
        if not flops:
            raise SystemExit("stages.py --equal-flops: no finished staged run to count the FLOPs of (see "
                             f"{os.path.join(args.out, 'sweep', 'results.csv')}); fix the failed runs and rerun")
        from k3.config import K3Config
        from k3.info import train_flops_per_token
        mcfg = K3Config.from_json(os.path.join(done[0]["_run_dir"], "config.json"))
        per_step = args.batch_tokens * train_flops_per_token(mcfg, args.long)["total"]
        rows += direct_run("equal_flops", max(1, int(min(flops) / per_step)), "FLOPs")
    for r in rows:
        f = train_flops(r["_run_dir"]) if r.get("status") == "completed" else None
        r["train_pflop"] = None if f is None else f / 1e15
    groups = common.aggregate(rows, ["val_loss", "train_loss", "train_time_s", "train_pflop", "tokens_per_s",
                                     "peak_mem_mb"])
    plots = [common.plot_curves(rows, [g["variant"] for g in groups], "loss", "train loss (EMA; rows of the stage's "
                                "length)", os.path.join(args.out, "loss.png")),
             common.plot_bars(groups, "val_loss", f"val loss at {args.long} tokens",
                              os.path.join(args.out, "val_loss.png"))]
    common.report(args.out, "stages", "staged context extension vs direct long training",
                  "staged extension reaches the direct run's long-context loss at lower cost", groups,
                  [("val_loss", f"val loss @{args.long}", "{:.4f}"), ("train_time_s", "train time s", "{:.1f}"),
                   ("train_pflop", "train PFLOP", "{:.3f}"),
                   ("tokens_per_s", "tokens/s", "{:.0f}"), ("peak_mem_mb", "peak MB", "{:.0f}")],
                  rows, {"staged": staged, "direct": direct}, plots)


if __name__ == "__main__":
    main()
