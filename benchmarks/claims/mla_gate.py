"""Claim: the MLA output gate (o * sigmoid(g_proj x)) removes the attention sink: without it, attention piles
onto the first token.

A `k3.sweep` over `mla_use_output_gate=true,false`. Measured after training, on fixed validation rows of
--probe-len tokens fed as in training (documents packed, attention inside each): the attention probability on each
document's first token, per MLA layer, averaged over heads and every later query (claim_probes.FirstTokenMass),
against what uniform causal attention would give the same queries (the ratio: 1 = no preference); and the final
validation loss.

    python benchmarks/claims/mla_gate.py                               # tiny, 3 seeds
    python benchmarks/claims/mla_gate.py --micro --steps 6 --seeds 2   # smoke run
"""
import os

import common
import claim_probes


def main(argv=None):
    p = common.parser("mla_gate", __doc__)
    p.add_argument("--probe-len", type=int, default=None, help="tokens per probe row [--seq-len]")
    args = p.parse_args(argv)
    base = common.base_from_args(args)
    T = args.probe_len or args.seq_len

    def probe():
        return claim_probes.FirstTokenMass(seq_len=T, rows=4)
    rows = common.run_sweep(os.path.join(args.out, "sweep"), ["mla_use_output_gate=true,false"], common.seeds(args), base,
                            callbacks=[probe])
    for r in rows:
        r["variant"] = "gate" if r["mla_use_output_gate"] else "no gate"
        u, by_layer = r.get("uniform_mass"), r.get("first_token_mass_by_layer")
        if u and by_layer:
            r["first_token_ratio_by_layer"] = [m / u for m in by_layer]
    groups = common.aggregate(rows, ["first_token_mass", "uniform_mass", "first_token_ratio", "val_loss",
                                     "tokens_per_s"])
    plots = [common.plot_bars(groups, "first_token_ratio", "first-token attention mass / uniform",
                              os.path.join(args.out, "first_token_mass.png"),
                              f"mean over MLA layers, heads, queries; 1 = uniform (rows of {T})")]
    plots.append(common.plot_by_layer(rows, ["gate", "no gate"], "first_token_ratio_by_layer",
                                      "MLA layer (index among MLA layers)",
                                      "first-token attention mass / uniform (dots: seeds)",
                                      os.path.join(args.out, "first_token_mass_by_layer.png"), ref=1.0, seeds=True))
    common.report(args.out, "mla_gate", "MLA output gate vs none: attention sink",
                  "the MLA output gate removes the first-token attention sink", groups,
                  [("first_token_mass", "first-token mass", "{:.5f}"), ("uniform_mass", "uniform", "{:.5f}"),
                   ("first_token_ratio", "mass / uniform", "{:.2f}"),
                   ("val_loss", "val loss", "{:.4f}"), ("tokens_per_s", "tokens/s", "{:.0f}")],
                  rows, {"probe_len": T}, plots)


if __name__ == "__main__":
    main()
