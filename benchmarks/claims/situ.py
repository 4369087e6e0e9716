"""Claim: SiTU-GLU bounds the FFN activations, so bf16 training has smaller max |activation| and fewer loss
spikes than SwiGLU.

A `k3.sweep` over `hidden_act=situ,silu` (silu = SwiGLU) with bf16 parameters (`--param-dtype bf16` by default,
also on CPU) and a high learning rate by default (spikes are what is measured). Measured per run: max |GLU output|
(the input of every FFN down projection: dense FFN, shared and routed experts; claim_probes.GLUMaxAct) over
training and at the last step, loss spikes (steps whose loss exceeds --spike-ratio x the mean of the previous 10,
plus non-finite steps), skipped steps, final validation loss.

    python benchmarks/claims/situ.py                               # tiny, bf16, lr 2e-2, 3 seeds
    python benchmarks/claims/situ.py --micro --steps 6 --seeds 2   # smoke run
"""
import os

import common
import claim_probes


def main(argv=None):
    p = common.parser("situ", __doc__)
    p.add_argument("--spike-ratio", type=float, default=1.15)
    p.set_defaults(param_dtype="bf16", lr=2e-2)
    args = p.parse_args(argv)
    base = common.base_from_args(args, compile="none", max_bad_steps=10 ** 6)
    rows = common.run_sweep(os.path.join(args.out, "sweep"), ["hidden_act=situ,silu"], common.seeds(args), base,
                            callbacks=[claim_probes.GLUMaxAct])
    for r in rows:
        r["variant"] = {"situ": "SiTU-GLU", "silu": "SwiGLU"}[r["hidden_act"]]
        train, _ = common.read_metrics(r["_run_dir"])
        r["loss_spikes"] = claim_probes.loss_spikes(train, ratio=args.spike_ratio, skip=max(10, args.steps // 20))
        r["skipped_steps"] = sum(1 for t in train if t.get("skipped"))
    groups = common.aggregate(rows, ["glu_max_abs", "glu_max_abs_last", "loss_spikes", "skipped_steps", "val_loss",
                                     "tokens_per_s"])
    plots = [common.plot_curves(rows, ["SiTU-GLU", "SwiGLU"], "glu_max_abs", "max |GLU output| per step",
                                os.path.join(args.out, "max_act.png"), f"param dtype {args.param_dtype}",
                                logy=True, smooth=0),
             common.plot_curves(rows, ["SiTU-GLU", "SwiGLU"], "loss", "train loss (mean over seeds, raw)",
                                os.path.join(args.out, "loss.png"), f"param dtype {args.param_dtype}", smooth=0)]
    common.report(args.out, "situ", "SiTU-GLU vs SwiGLU",
                  "SiTU-GLU bounds activations: smaller max |activation|, fewer bf16 loss spikes", groups,
                  [("glu_max_abs", "max abs act (run)", "{:.1f}"), ("glu_max_abs_last", "max abs act (last step)",
                                                                  "{:.1f}"),
                   ("loss_spikes", "loss spikes", "{:.1f}"), ("skipped_steps", "non-finite steps", "{:.1f}"),
                   ("val_loss", "val loss", "{:.4f}"), ("tokens_per_s", "tokens/s", "{:.0f}")],
                  rows, {"param_dtype": args.param_dtype, "lr": args.lr, "spike_ratio": args.spike_ratio}, plots)


if __name__ == "__main__":
    main()
