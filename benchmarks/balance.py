"""Load-balancing experiment (CPU, a few minutes): Quantile Balancing vs. the sign rule and variants.

(a) Router-level simulation. Every step draws a fresh batch of T tokens with sigmoid scores
    s_ij = σ(o_j + ε_ij), ε ~ N(0, 1), per-expert logit offsets o ~ N(0, 1.5²) (skewed experts), optionally with
    a random-walk drift o ← o + N(0, drift²) after every step. The real balancer classes of ``k3.balance`` are
    attached to a router module (top-k of s + b) and stepped after every batch. Balance is reported two ways:

    * batch MaxVio — on the step's own batch, next to its sampling-noise floor: the MaxVio of a router whose
      expected loads are exactly equal (every token takes a uniformly random k-subset) on batches of size T;
    * systematic MaxVio — of the *expected* loads under the current bias and the current distribution,
      estimated on a large fresh draw with a Rao-Blackwellised estimator: token i contributes
      P(j selected | the other experts' scores of token i) = Φ(o_j − logit(θ_ij − b_j)) (θ_ij = k-th largest
      biased score of the other experts) instead of a 0/1 count. Its own noise floor is reported as well.

(b) ``--model-runs``: a short tiny-model training run per balancer through ``k3.train`` (imported lazily;
    skipped with a message when the trainer is not available).

    python benchmarks/balance.py            # default grid, ~4 min on 2 CPU cores
    python benchmarks/balance.py --full --device cuda   # full grid (4K..128K tokens), ~10 s on a GPU
    python benchmarks/balance.py --quick    # smoke run (~1 min on 2 CPU cores)

Writes ``benchmarks/balance_results/{results.json,results.md,*.png}`` and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn

from k3.balance import load_stats, make_balancer, route_cutoffs

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "balance_results")


class ScoreRouter(nn.Module):
    """Router whose input is the score matrix (contract of k3.nn.moe.K3Router, gate matmul left out)."""

    def __init__(self, n: int, k: int):
        super().__init__()
        self.num_experts, self.top_k = n, k
        self.register_buffer("e_score_correction_bias", torch.zeros(n))

    def forward(self, scores_NE: torch.Tensor):
        idx_Nk = torch.topk(scores_NE + self.e_score_correction_bias, self.top_k, dim=-1).indices
        w_Nk = scores_NE.gather(1, idx_Nk)
        return idx_Nk, w_Nk / (w_Nk.sum(-1, keepdim=True) + 1e-20), scores_NE


def draw_logits(offsets_E: torch.Tensor, T: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(T, offsets_E.numel(), generator=gen, device=offsets_E.device) + offsets_E


def expected_loads(offsets_E, bias_E, k, T_eval, gen, chunk=8192) -> torch.Tensor:
    """Rao-Blackwellised estimate of the expected per-expert loads (per T_eval tokens)."""
    n = offsets_E.numel()
    total_E = torch.zeros(n, dtype=torch.float64, device=offsets_E.device)
    for start in range(0, T_eval, chunk):
        rows = min(chunk, T_eval - start)
        s_TE = torch.sigmoid(draw_logits(offsets_E, rows, gen))
        idx_Tk, alpha_T, beta_T = route_cutoffs(s_TE, bias_E, k)
        sel_TE = torch.zeros_like(s_TE, dtype=torch.bool).scatter_(1, idx_Tk, True)
        theta_TE = torch.where(sel_TE, alpha_T[:, None], beta_T[:, None])
        u_TE = theta_TE - bias_E
        p_TE = torch.special.ndtr(offsets_E - torch.logit(u_TE.clamp(1e-7, 1 - 1e-7)))
        p_TE = torch.where(u_TE <= 0, 1.0, torch.where(u_TE >= 1, 0.0, p_TE))
        total_E += p_TE.sum(0, dtype=torch.float64)
    return total_E


def batch_floor(n, k, T, reps, gen, chunk=16384) -> float:
    """Mean MaxVio of a router with exactly equal expected loads (uniform random k-subsets), batch size T."""
    vals = []
    for _ in range(reps):
        load_E = torch.zeros(n, dtype=torch.int64, device=gen.device)
        for start in range(0, T, chunk):
            rows = min(chunk, T - start)
            idx = torch.topk(torch.rand(rows, n, generator=gen, device=gen.device), k, dim=1).indices
            load_E += torch.bincount(idx.reshape(-1), minlength=n)
        vals.append(load_stats(load_E)["maxvio"])
    return sum(vals) / len(vals)


def sys_floor(n, k, T_eval, reps, gen) -> float:
    """Noise of the systematic-MaxVio estimator itself: identical experts (offsets 0, bias 0)."""
    z = torch.zeros(n, device=gen.device)
    vals = [load_stats(expected_loads(z, z, k, T_eval, gen))["maxvio"] for _ in range(reps)]
    return sum(vals) / len(vals)


BALANCER_SPECS = {
    "qb": ("qb", {}),
    "qb_hist": ("qb_hist", {"bins": 1000}),
    "qb_ema": ("qb_ema", {"ema": 0.25, "ema_warmup": 10}),
    "sign": ("sign", {"gamma": 1e-3}),
}


def simulate(n, k, T, steps, drift, eval_steps, T_eval, seed, balancers, device="cpu"):
    gen_o = torch.Generator(device).manual_seed(seed)
    offsets_E = 1.5 * torch.randn(n, generator=gen_o, device=device)
    gen_batch = torch.Generator(device).manual_seed(seed + 1)
    gen_eval = torch.Generator(device).manual_seed(seed + 2)
    gen_drift = torch.Generator(device).manual_seed(seed + 3)
    routers = {b: ScoreRouter(n, k).to(device) for b in balancers}
    bals = {b: make_balancer(BALANCER_SPECS[b][0], **BALANCER_SPECS[b][1]).attach(routers[b]) for b in balancers}
    hist = {b: {"batch": [], "sys": {}, "clamped": 0} for b in balancers}
    t_bal = {b: 0.0 for b in balancers}
    for t in range(steps + 1):
        if t in eval_steps:
            eval_state = gen_eval.get_state()
            for b in balancers:  # same eval draw for every balancer
                gen_eval.set_state(eval_state)
                el = expected_loads(offsets_E, routers[b].e_score_correction_bias, k, T_eval, gen_eval)
                hist[b]["sys"][t] = load_stats(el)["maxvio"]
        if t == steps:
            break
        s_TE = torch.sigmoid(draw_logits(offsets_E, T, gen_batch))  # one batch, shared by all balancers
        for b in balancers:
            _sync(device)
            t0 = time.perf_counter()
            routers[b](s_TE)
            bals[b].step()
            _sync(device)
            t_bal[b] += time.perf_counter() - t0
            m = bals[b].routers[0].last
            hist[b]["batch"].append(m["maxvio"])
            hist[b]["clamped"] += int(m.get("clamped_experts", 0))
        if drift > 0:
            offsets_E = offsets_E + drift * torch.randn(n, generator=gen_drift, device=device)
    for b in balancers:
        hist[b]["ms_per_step"] = 1000 * t_bal[b] / steps
    return hist


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def fmt(x):
    return "—" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny grid for a smoke test")
    ap.add_argument("--full", action="store_true",
                    help="full grid (T up to 128K at n=64, 64K at n=896, drift at both n); ~1 min on a GPU")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: same code, faster for --full")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--drift", type=float, default=0.02, help="random-walk std of the logit offsets per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--balancers", default="qb,qb_hist,qb_ema,sign")
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--model-runs", action="store_true", help="also run part (b): tiny-model training per balancer")
    ap.add_argument("--model-steps", type=int, default=30, help="optimizer steps per --model-runs run")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    balancers = [b.strip() for b in args.balancers.split(",") if b.strip()]

    K = 1024
    if args.quick:
        grid = [(64, 8, 4 * K, False), (64, 8, 4 * K, True), (896, 16, 16 * K, False)]
        steps = min(args.steps, 12)
    elif args.full:  # (n, k, T, drift)
        grid = [
            (64, 8, 4 * K, False), (64, 8, 16 * K, False), (64, 8, 128 * K, False),
            (64, 8, 4 * K, True), (64, 8, 16 * K, True), (64, 8, 128 * K, True),
            (896, 16, 16 * K, False), (896, 16, 64 * K, False), (896, 16, 128 * K, False),
            (896, 16, 16 * K, True), (896, 16, 64 * K, True),
        ]
        steps = args.steps
    else:  # batch sizes subsampled to keep the CPU run at a few minutes
        grid = [
            (64, 8, 4 * K, False), (64, 8, 16 * K, False), (64, 8, 16 * K, True),
            (896, 16, 16 * K, False),
        ]
        steps = min(args.steps, 25)
    eval_steps = sorted({0, 1, 2, 3, 5, 7, 10, 15, 20, 25, 30, steps} & set(range(steps + 1)))
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    results = []
    floors_cache = {}
    for n, k, T, drift in grid:
        T_eval = (256 * K if n == 64 else 64 * K) // (1 if args.full else 8)
        g = torch.Generator(args.device).manual_seed(1234)
        if (n, k, T) not in floors_cache:
            floors_cache[(n, k, T)] = (
                batch_floor(n, k, T, reps=8 if (args.full or n * T <= 64 * 16 * K) else 4, gen=g),
                sys_floor(n, k, T_eval, reps=2, gen=g),
            )
        bfloor, sfloor = floors_cache[(n, k, T)]
        t0 = time.time()
        hist = simulate(n, k, T, steps, args.drift if drift else 0.0, eval_steps, T_eval, args.seed, balancers,
                        args.device)
        print(f"[n={n} k={k} T={T // K}K drift={drift}] {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
        results.append(dict(n=n, k=k, T=T, device=args.device, drift=args.drift if drift else 0.0, T_eval=T_eval,
                            batch_floor=bfloor, sys_floor=sfloor, steps=steps, balancers=hist))
    elapsed = time.time() - t_start

    # ---- table ------------------------------------------------------------------------------------------------
    target_step = {64: 10, 896: 20}
    lines = [
        f"Balance simulation: skewed sigmoid scores (offsets ~ N(0, 1.5²)), fresh batch each step, {steps} steps, "
        f"drift = random walk σ={args.drift}/step where marked. batch = MaxVio on the step's own batch "
        f"(mean of the last 5 steps); sys = MaxVio of the expected loads (Rao-Blackwellised, T_eval tokens) at "
        f"step 10 (n=64) / 20 (n=896) and at the end; 'sys≤2×floor' = first evaluated step where sys ≤ 2× the batch "
        f"floor. Run time {elapsed:.0f} s.",
        "",
        "| n | k | T | drift | balancer | batch floor | batch (last 5) | sys floor | sys @10/20 | sys final "
        "| sys≤2×floor at step | ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        ts = target_step[res["n"]]
        for b, h in res["balancers"].items():
            sys_pts = h["sys"]
            at = next((t for t in sorted(sys_pts) if sys_pts[t] <= 2 * res["batch_floor"]), None)
            last5 = sum(h["batch"][-5:]) / len(h["batch"][-5:])
            t_near = max(t for t in sys_pts if t <= ts)
            lines.append(
                f"| {res['n']} | {res['k']} | {res['T'] // K}K | {'yes' if res['drift'] else 'no'} | {b} "
                f"| {fmt(res['batch_floor'])} | {fmt(last5)} | {fmt(res['sys_floor'])} | {fmt(sys_pts[t_near])} "
                f"| {fmt(sys_pts[max(sys_pts)])} | {'—' if at is None else at} | {h['ms_per_step']:.0f} |"
            )
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "elapsed_s": elapsed, "results": results}, f, indent=1)

    if not args.no_plots:
        plot(results, args.out)

    if args.model_runs:
        model_runs(balancers, args)


def plot(results, out_dir):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install matplotlib): no plots written", file=sys.stderr)
        return
    colors = {"qb": "C0", "qb_hist": "C1", "qb_ema": "C2", "sign": "C3"}
    groups = {}
    for res in results:
        groups.setdefault((res["n"], res["k"], bool(res["drift"])), []).append(res)
    for (n, k, drift), rs in groups.items():
        fig, axes = plt.subplots(len(rs), 2, figsize=(11, 3.2 * len(rs)), squeeze=False)
        for row, res in zip(axes, rs):
            for b, h in res["balancers"].items():
                c = colors.get(b)
                row[0].semilogy(range(len(h["batch"])), h["batch"], color=c, label=b)
                ts = sorted(h["sys"])
                row[1].semilogy(ts, [max(h["sys"][t], 1e-4) for t in ts], "o-", color=c, label=b, ms=3)
            for ax in row:
                ax.axhline(res["batch_floor"], color="k", ls="--", lw=1, label="batch noise floor")
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
            row[1].axhline(res["sys_floor"], color="gray", ls=":", lw=1, label="sys estimator floor")
            title = f"n={n} k={k} T={res['T'] // 1024}K" + (f" drift σ={res['drift']}" if drift else "")
            row[0].set_title("batch MaxVio, " + title, fontsize=9)
            row[1].set_title("systematic MaxVio (expected loads), " + title, fontsize=9)
            row[0].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"maxvio_n{n}_k{k}{'_drift' if drift else ''}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        print(f"wrote {path}", file=sys.stderr)


def model_runs(balancers, args):
    """Part (b): a short tiny-model training run per balancer through k3.train (imported lazily)."""
    try:
        from k3.train.trainer import TrainConfig, Trainer
    except Exception as e:  # trainer not there (yet)
        print(f"--model-runs skipped: k3.train unavailable ({type(e).__name__}: {e})", file=sys.stderr)
        return
    rows = []
    for b in list(dict.fromkeys(balancers + ["aux_loss", "none"])):
        out_dir = os.path.join(args.out, "model_runs", b)
        try:
            cfg = TrainConfig(balancer=b, overwrite=True, steps=args.model_steps, out_dir=out_dir, device=args.device,
                              seed=args.seed, eval_every=0)
            trainer = Trainer(cfg)
            summary = trainer.train()
        except Exception as e:
            print(f"--model-runs: balancer {b} failed/skipped ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        hist = [h for h in trainer.history if h.get("type") == "train" and not h.get("skipped")]
        last = hist[-5:] if hist else []
        mean = lambda key: (sum(h[key] for h in last if key in h) / max(1, sum(key in h for h in last)))  # noqa
        rows.append(f"| {b} | {len(hist)} | {mean('loss'):.4f} | {mean('maxvio'):.3f} | "
                    f"{mean('maxvio_max'):.3f} | {mean('dead_experts_mean'):.2f} |")
        print(f"{b}: {summary}", file=sys.stderr)
    if rows:
        table = "\n".join(["| balancer | steps | loss (last 5) | MaxVio mean | MaxVio max | dead experts |",
                           "|---|---|---|---|---|---|", *rows])
        print(table)
        with open(os.path.join(args.out, "model_runs.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
