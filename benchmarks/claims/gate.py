"""Claim: the bounded KDA decay (g = lb * sigmoid(.), lb = gate_lower_bound) makes every causal 16-token tile a
dense matmul in fp32 range and raises throughput, at no loss in quality.

Measured:
1. kernel time of `k3.ops.kda.chunk_kda` forward + backward with the gate fused in-kernel, bounded
   (lower_bound=--lower-bound) vs unbounded (the Kimi-Linear / fla softplus gate, lower_bound=None), for each
   backend given (`torch`; on CUDA also `fla` (fla's safe_gate M=16 path when bounded) and `triton`, which takes
   bounded gates only: the table says when a backend fell back to another);
2. training loss at equal steps: the model with its bounded gate vs the same model with the softplus gate
   (`linear_attn_config.gate_lower_bound=null`; its dt_bias init gives the same initial decays), one k3.sweep.

    python benchmarks/claims/gate.py                                    # tiny, 3 seeds, CPU-sized
    python benchmarks/claims/gate.py --micro --steps 6 --seeds 2 --kernel-shape 1,256,2,32   # smoke run
    python benchmarks/claims/gate.py --device cuda --kernel-shape 1,8192,96,128 --backends fla,triton,torch
"""
import logging
import os
import statistics
import time

import common


class _Catch(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.msgs = []

    def emit(self, record):
        self.msgs.append(record.getMessage())


def kernel_times(shape, backends, lower_bound, device, iters, dtype_name):
    import torch
    from k3.ops.kda import chunk_kda
    B, T, H, K = shape
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    g = torch.Generator(device="cpu").manual_seed(0)

    def t(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dev, dtype).requires_grad_()
    q, k, v, f = t(B, T, H, K), t(B, T, H, K), t(B, T, H, K), t(B, T, H, K)
    beta = torch.rand(B, T, H, generator=g).to(dev, dtype).requires_grad_()
    A_log = torch.zeros(H, device=dev, requires_grad=True)
    dt_bias = torch.randn(H * K, generator=g).to(dev).requires_grad_()
    do = torch.randn(B, T, H, K, generator=g).to(dev, dtype)
    out = []
    catch = _Catch()
    lg = logging.getLogger("k3")
    lg.addHandler(catch)
    old = lg.level
    lg.setLevel(logging.INFO)
    try:
        for be in backends:
            for name, lb in (("bounded", lower_bound), ("softplus", None)):
                catch.msgs.clear()
                row = {"backend": be, "gate": name, "shape": list(shape), "dtype": dtype_name, "device": str(dev)}
                try:
                    def step():
                        o, _ = chunk_kda(q, k, v, f, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                         A_log=A_log, dt_bias=dt_bias, lower_bound=lb, backend=be)
                        o.backward(do)
                        for x in (q, k, v, f, beta, A_log, dt_bias):
                            x.grad = None
                    step()  # warm-up / compile
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    ts = []
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        step()
                        if dev.type == "cuda":
                            torch.cuda.synchronize()
                        ts.append((time.perf_counter() - t0) * 1e3)
                    row["ms"] = statistics.median(ts)
                    row["ms_min"] = min(ts)
                    with torch.no_grad():
                        o, _ = chunk_kda(q, k, v, f, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                         A_log=A_log, dt_bias=dt_bias, lower_bound=lb, backend=be)
                    row["finite"] = bool(torch.isfinite(o).all())
                except Exception as e:  # a backend that cannot run here
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                row["fallback"] = "; ".join(m for m in catch.msgs if "cannot run" in m or "using" in m) or None
                out.append(row)
    finally:
        lg.removeHandler(catch)
        lg.setLevel(old)
    return out


def main(argv=None):
    p = common.parser("gate", __doc__)
    p.add_argument("--lower-bound", type=float, default=-5.0, help="the bounded gate's lower bound [-5]")
    p.add_argument("--kernel-shape", default="1,1024,4,64", help="B,T,H,K of the kernel timing [1,1024,4,64]")
    p.add_argument("--backends", default=None, help="kda backends to time [torch on CPU; fla,triton,torch on CUDA]")
    p.add_argument("--kernel-iters", type=int, default=5)
    p.add_argument("--kernel-dtype", default=None, choices=["fp32", "bf16"], help="[bf16 on CUDA, fp32 on CPU]")
    p.add_argument("--no-train", action="store_true", help="kernel timing only")
    p.add_argument("--no-kernel", action="store_true", help="training runs only")
    args = p.parse_args(argv)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    backends = (args.backends or ("fla,triton,torch" if cuda else "torch")).split(",")
    shape = [int(x) for x in args.kernel_shape.split(",")]
    kt = [] if args.no_kernel else kernel_times(shape, backends, args.lower_bound, args.device, args.kernel_iters,
                                                args.kernel_dtype or ("bf16" if cuda else "fp32"))
    kmd = (f"kernel time, chunk_kda fwd+bwd with the gate in-kernel, B,T,H,K = {shape}, "
           f"{kt[0]['dtype'] if kt else ''} on {kt[0]['device'] if kt else ''}, {torch.get_num_threads()} thread(s), "
           f"median of {args.kernel_iters}:\n\n| backend | gate | median ms | min ms | finite | fell back / error |\n"
           "|---|---|---|---|---|---|\n")
    for r in kt:
        kmd += (f"| {r['backend']} | {r['gate']} | {r.get('ms', float('nan')):.2f} | {r.get('ms_min', float('nan')):.2f}"
                f" | {r.get('finite')} | {r.get('error') or r.get('fallback') or ''} |\n")
    rows, groups = [], []
    plots = []
    if not args.no_train:
        base = common.base_from_args(args)
        rows = common.run_sweep(os.path.join(args.out, "sweep"),
                                [f"linear_attn_config.gate_lower_bound={args.lower_bound},null"], common.seeds(args), base)
        for r in rows:
            r["variant"] = "softplus" if r["linear_attn_config.gate_lower_bound"] is None else "bounded"
            train, _ = common.read_metrics(r["_run_dir"])
            r["skipped_steps"] = sum(1 for t in train if t.get("skipped"))
        groups = common.aggregate(rows, ["val_loss", "train_loss", "tokens_per_s", "skipped_steps"])
        plots.append(common.plot_curves(rows, ["bounded", "softplus"], "loss", "train loss (EMA, mean over seeds)",
                                        os.path.join(args.out, "loss.png"), "bounded vs softplus KDA gate"))
    os.makedirs(args.out, exist_ok=True)
    if kt:
        plots.append(plot_kernel(kt, shape, backends, os.path.join(args.out, "kernel_time.png")))
    common.report(args.out, "gate", "bounded vs softplus KDA gate",
                  "the bounded decay makes causal tiles dense matmuls and raises throughput", groups,
                  [("val_loss", "val loss", "{:.4f}"), ("train_loss", "train loss", "{:.4f}"),
                   ("tokens_per_s", "tokens/s", "{:.0f}"), ("skipped_steps", "skipped steps", "{:.1f}")],
                  rows, {"kernel": kt}, plots, extra_md=kmd)


def plot_kernel(kt: list, shape: list, backends: list, path: str) -> str:
    """Bars of median fwd+bwd ms per backend and gate; a backend that cannot run a gate (it fell back to another
    backend or failed) gets no bar but a note, so a fallback's time is never shown as that backend's."""
    plt = common.plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ok = [r for r in kt if "ms" in r]
    labels = sorted({r["backend"] for r in kt}, key=backends.index)
    top = max((r["ms"] for r in ok if not r.get("fallback")), default=1.0)
    for j, gate in enumerate(("bounded", "softplus")):
        xs, ys = [], []
        for i, b in enumerate(labels):
            r = next((r for r in kt if r["backend"] == b and r["gate"] == gate), None)
            x = i + 0.4 * j
            if r is None or "ms" not in r or r.get("fallback"):
                ax.text(x, 0.02 * top, "cannot run\n(" + ("falls back" if r and r.get("fallback") else "error") + ")",
                        ha="center", va="bottom", fontsize=7, rotation=90)
                continue
            xs.append(x)
            ys.append(r["ms"])
        ax.bar(xs, ys, width=0.4, label=gate, color=f"C{j}")
    ax.set_xticks([i + 0.2 for i in range(len(labels))])
    ax.set_xticklabels(labels)
    ax.set_ylabel("chunk_kda fwd+bwd, median ms")
    ax.set_title(f"shape B,T,H,K={shape}", fontsize=9)
    ax.legend()
    return common.save_plot(fig, path)


if __name__ == "__main__":
    main()
