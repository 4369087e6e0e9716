"""Time the MoE combine (unpermute + fp32 weighted sum of each token's k expert rows) and the dispatch backward on
one GPU at the `small` training shape, the Triton kernels (backend "triton" of "moe_combine", k3/ops/moe_triton.py)
against the torch path under torch.compile (what the compiled step runs by default), forward and forward+backward,
and each kernel alone.

    python benchmarks/moe_gpu.py [--shape 32768x8x512x64] [--json PATH]     (tokens x k x latent width x experts)
    TRITON_INTERPRET=1 python benchmarks/moe_gpu.py --device cpu --shape 64x4x32x8   (a smoke run, no timing value)

Why: the seventh session's `trainbf16-fused` stage (the Triton combine in the compiled `small` step) was 17 ms
slower than Inductor's kernels where 10 ms faster was predicted; this times the pieces before changing them.
"""
from __future__ import annotations

import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="32768x8x512x64")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "moe_gpu.json"))
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    import time

    import torch
    from triton.testing import do_bench as cuda_bench

    def do_bench(fn, return_mode="median"):
        if dev == "cuda":
            return cuda_bench(fn, return_mode=return_mode)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from k3.ops import moe_triton as mt
    from k3.ops.moe import _DispatchRows, _PermuteRows
    N, k, l, E = (int(v) for v in a.shape.split("x"))
    dev = a.device
    idx = torch.rand(N, E, device=dev).topk(k, dim=1).indices
    order = torch.argsort(idx.reshape(-1), stable=True)
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=dev))
    tok_of_a = order // k
    w = torch.rand(N, k, device=dev).requires_grad_()
    y = torch.randn(N * k, l, device=dev).bfloat16().requires_grad_()
    x = torch.randn(N, l, device=dev).bfloat16().requires_grad_()
    dout = torch.randn(N, l, device=dev).bfloat16()
    dxa = torch.randn(N * k, l, device=dev).bfloat16()

    def combine_torch(y_, w_):
        yk = _PermuteRows.apply(y_, inv, order).view(N, k, l)
        return (yk.float() * w_.float().unsqueeze(-1)).sum(1).to(y_.dtype)

    combine_compiled = torch.compile(combine_torch)
    dispatch_compiled = torch.compile(lambda x_: _DispatchRows.apply(x_, tok_of_a, inv, k, False))
    paths = {"combine": {"torch compiled": lambda: combine_compiled(y, w),
                         "triton": lambda: mt.Combine.apply(y, inv, order, w)},
             "dispatch": {"torch compiled": lambda: dispatch_compiled(x),
                          "triton bwd": lambda: _DispatchRows.apply(x, tok_of_a, inv, k, True)}}
    rows = []
    for op, ps in paths.items():
        for p, fn in ps.items():
            grads = (y, w) if op == "combine" else (x,)
            g_out = dout if op == "combine" else dxa
            with torch.no_grad():
                fwd = do_bench(fn, return_mode="median")
            fb = do_bench(lambda: torch.autograd.grad(fn(), grads, g_out), return_mode="median")
            r = dict(op=op, path=p, N=N, k=k, l=l, fwd_ms=fwd, fwd_bwd_ms=fb)
            rows.append(r)
            print(json.dumps(r), flush=True)
    ws = w.detach().reshape(-1).index_select(0, order).unsqueeze(1)
    kern = {"gather_sum k (combine fwd)": lambda: mt.gather_sum(y.detach(), inv, w.detach(), k, torch.bfloat16),
            "gather_sum 1 (combine bwd dy)": lambda: mt.gather_sum(dout, tok_of_a, ws, 1, torch.bfloat16),
            "gather_dot (combine bwd dw)": lambda: mt.gather_dot(y.detach(), inv, dout, k),
            "gather_sum k, no weights (dispatch bwd)": lambda: mt.gather_sum(dxa, inv, None, k, torch.bfloat16)}
    moved = {"gather_sum k (combine fwd)": (N * k + N) * l * 2, "gather_sum 1 (combine bwd dy)": 2 * N * k * l * 2,
             "gather_dot (combine bwd dw)": (N * k + N) * l * 2, "gather_sum k, no weights (dispatch bwd)":
             (N * k + N) * l * 2}
    for name, fn in kern.items():
        t = do_bench(fn, return_mode="median")
        r = dict(op="kernel", path=name, ms=t, GBps=moved[name] / t / 1e6)
        rows.append(r)
        print(json.dumps(r), flush=True)
    print("| op | path | fwd ms | fwd+bwd ms |\n|---|---|---|---|")
    for r in rows:
        if r["op"] != "kernel":
            print(f"| {r['op']} | {r['path']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} |")
    for r in rows:
        if r["op"] == "kernel":
            print(f"kernel {r['path']}: {r['ms']:.3f} ms ({r['GBps']:.0f} GB/s)")
    with open(a.json, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
