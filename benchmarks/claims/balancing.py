"""Claim: Quantile Balancing balances the experts quickly without an auxiliary loss.

Measured: MaxVio (max expert load / mean load - 1, mean over MoE layers, from the balancer metrics) over training
and the final validation loss, for `--balancer qb` (K3's Quantile Balancing), `sign` (DeepSeek-V3's sign-rule bias
update) and `aux_loss` (a load-balancing auxiliary loss), optionally `none`. A `k3.sweep` over `train.balancer`.

    python benchmarks/claims/balancing.py                       # tiny, 200 steps, 3 seeds (CPU: long)
    python benchmarks/claims/balancing.py --micro --steps 20 --seeds 2   # smoke run
"""
import os

import common


def steps_to_balance(steps, ys, threshold):
    """First step from which the (EMA-smoothed) MaxVio stays below `threshold`; None if never."""
    from k3.sweep import _smooth
    sm = _smooth(ys, 0.3)
    for i in range(len(sm)):
        if all(v < threshold for v in sm[i:] if v == v):
            return steps[i]
    return None


def main(argv=None):
    p = common.parser("balancing", __doc__)
    p.add_argument("--balancers", default="qb,sign,aux_loss", help="balancers to compare [qb,sign,aux_loss]")
    p.add_argument("--threshold", type=float, default=0.5, help="MaxVio threshold for 'balanced' [0.5]")
    args = p.parse_args(argv)
    base = common.base_from_args(args)
    rows = common.run_sweep(os.path.join(args.out, "sweep"), [f"train.balancer={args.balancers}"], common.seeds(args), base)
    for r in rows:
        r["variant"] = r["train.balancer"]
        train, _ = common.read_metrics(r["_run_dir"])
        xs = [t["step"] for t in train if t.get("maxvio") is not None]
        ys = [t["maxvio"] for t in train if t.get("maxvio") is not None]
        r["steps_to_balance"] = steps_to_balance(xs, ys, args.threshold) if xs else None
        r["maxvio_first"] = ys[0] if ys else None
    names = args.balancers.split(",")
    metrics = ["maxvio_first", "maxvio", "steps_to_balance", "val_loss", "train_loss", "tokens_per_s"]
    groups = common.aggregate(rows, metrics)
    plots = [common.plot_curves(rows, names, "maxvio", "MaxVio (EMA, mean over seeds)",
                                os.path.join(args.out, "maxvio.png"), "MaxVio over training", logy=True),
             common.plot_curves(rows, names, "loss", "train loss (EMA)", os.path.join(args.out, "loss.png"))]
    common.report(args.out, "balancing", "Quantile Balancing vs sign rule vs aux loss",
                  "QB balances quickly without an aux loss", groups,
                  [("maxvio_first", "MaxVio step 1", "{:.3f}"), ("maxvio", "MaxVio final (last 10%)", "{:.3f}"),
                   ("steps_to_balance", f"steps to MaxVio<{args.threshold}", "{:.0f}"),
                   ("val_loss", "val loss", "{:.4f}"), ("tokens_per_s", "tokens/s", "{:.0f}")],
                  rows, {"threshold": args.threshold}, plots)


if __name__ == "__main__":
    main()
