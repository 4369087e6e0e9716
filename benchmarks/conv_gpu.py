"""Time KDA's causal short conv (kernel 4, SiLU) on one GPU at the `small` training shape: the Triton kernels
(backend "triton", k3/ops/conv_triton.py) against the torch path eager and under torch.compile (what the compiled
training step runs today), forward and forward+backward, with and without document resets.

    python benchmarks/conv_gpu.py [--shape 8x4096x1024] [--json PATH]

Why: the sixth session's kernel profile of the compiled `small` step put the Inductor kernels of the 54 q/k/v
convolutions at ~34 ms per step; reading x, dy and writing y, dx once in bf16 is ~0.1 ms per call.
"""
from __future__ import annotations

import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8x4096x1024")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "conv_gpu.json"))
    a = ap.parse_args()
    import torch
    from triton.testing import do_bench
    from k3.ops.conv import causal_conv1d
    B, T, C = (int(v) for v in a.shape.split("x"))
    x = (torch.randn(B, T, C, device="cuda") * 2).bfloat16().requires_grad_()
    w = (torch.randn(C, 1, 4, device="cuda") * 0.5).requires_grad_()
    dy = torch.randn(B, T, C, device="cuda").bfloat16()
    cu = torch.linspace(0, B * T, 9, device="cuda").round().to(torch.int32)
    xv = x.detach().reshape(1, B * T, C).requires_grad_()
    compiled = torch.compile(lambda x_, w_, cu_: causal_conv1d(x_, w_, cu_seqlens=cu_, backend="torch")[0])
    rows = []
    for name, xx, cc in (("dense", x, None), ("varlen 8 docs", xv, cu)):
        paths = {"triton": lambda: causal_conv1d(xx, w, cu_seqlens=cc, backend="triton")[0],
                 "torch eager": lambda: causal_conv1d(xx, w, cu_seqlens=cc, backend="torch")[0],
                 "torch compiled": lambda: compiled(xx, w, cc)}
        for p, fn in paths.items():
            with torch.no_grad():
                fwd = do_bench(fn, return_mode="median")
            fb = do_bench(lambda: torch.autograd.grad(fn(), (xx, w), dy.view_as(xx)), return_mode="median")
            r = dict(case=name, path=p, B=B, T=T, C=C, fwd_ms=fwd, fwd_bwd_ms=fb,
                     fwd_GBps=4 * B * T * C / fwd / 1e6, fwd_bwd_GBps=10 * B * T * C / fb / 1e6)
            rows.append(r)
            print(json.dumps(r), flush=True)
    # the backward kernel alone at each launch option the autotuner chooses among, and its pick
    from k3.ops import conv_triton as ct
    for name, xx, cc in (("dense", x, None), ("varlen 8 docs", xv, cu)):
        st = ct.token_starts(cc, xx.shape[1]) if cc is not None else None
        xd, wd, dyv = xx.detach(), w.detach().reshape(C, 4), dy.view_as(xx)
        ct.conv1d_bwd(xd, wd, dyv, st, True)
        best = ct._conv4_bwd_tuned.best_config
        r = dict(case=name, path="bwd kernel", picked=str(best),
                 configs={str(cfg): do_bench(lambda: ct.conv1d_bwd(xd, wd, dyv, st, True, config=cfg),
                                             return_mode="median") for cfg in ct.BWD_CONFIGS})
        r["bwd_ms"] = do_bench(lambda: ct.conv1d_bwd(xd, wd, dyv, st, True), return_mode="median")
        r["bwd_GBps"] = 6 * B * T * C / r["bwd_ms"] / 1e6
        rows.append(r)
        print(json.dumps(r), flush=True)
    rows, bwd_rows = [r for r in rows if "fwd_ms" in r], [r for r in rows if "fwd_ms" not in r]
    print("| case | path | fwd ms (GB/s) | fwd+bwd ms (GB/s) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['path']} | {r['fwd_ms']:.3f} ({r['fwd_GBps']:.0f}) | "
              f"{r['fwd_bwd_ms']:.3f} ({r['fwd_bwd_GBps']:.0f}) |")
    for r in bwd_rows:
        print(f"backward kernel {r['case']}: {r['bwd_ms']:.3f} ms ({r['bwd_GBps']:.0f} GB/s), autotuner picked "
              f"{r['picked']}; by (BT, BC, warps): " + ", ".join(f"{k} {v:.3f}" for k, v in r["configs"].items()))
    with open(a.json, "w") as fh:
        json.dump(rows + bwd_rows, fh, indent=1)


if __name__ == "__main__":
    main()
