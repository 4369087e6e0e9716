"""Time the SiTU-GLU Triton kernels alone on one GPU at the `small` training step's shapes, exact tanh against the
hardware tanh (K3_SITU_TANH=approx, the default for 16-bit inputs since the sixth session), and against the eager
torch formula; prints achieved GB/s.

    python benchmarks/situ_gpu.py [--shapes 262144x512,32768x1024,32768x4096] [--json PATH]

Shapes: the routed experts of `small` at B8 T4096 run [tokens * top_k = 262144, 512], the shared experts
[32768, 1024], the dense first layer [32768, 4096]; g and u are the strided halves of one [R, 2C] projection, as in
the MoE. Why: in the compiled `small` step (fifth session profile) the kernels averaged ~0.80 ms (forward) and
~0.87 ms (backward) per call, several times the ~0.11-0.19 ms a bandwidth / issue model predicts for those shapes
(benchmarks/situ_static.py); this script times them in isolation.
"""
from __future__ import annotations

import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="262144x512,32768x1024,32768x4096")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "situ_gpu.json"))
    a = ap.parse_args()
    import torch
    from triton.testing import do_bench
    from k3.ops import activations_triton as at
    from k3.ops.activations import _situ_bwd_torch, _situ_fwd_torch
    rows = []
    for shape in a.shapes.split(","):
        R, C = (int(x) for x in shape.split("x"))
        gu = torch.randn(R, 2 * C, device="cuda", dtype=torch.bfloat16) * 4
        g, u = gu[:, :C], gu[:, C:]
        do = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
        row = dict(R=R, C=C)
        for mode in ("exact", "approx"):
            at.APPROX_TANH = mode
            row[f"fwd_{mode}_ms"] = do_bench(lambda: at.situ_fwd(g, u, 4.0, 25.0), return_mode="median")
            row[f"bwd_{mode}_ms"] = do_bench(lambda: at.situ_bwd(g, u, do, 4.0, 25.0), return_mode="median")
        at.APPROX_TANH = "exact"
        row["fwd_torch_ms"] = do_bench(lambda: _situ_fwd_torch(g, u, 4.0, 25.0), return_mode="median")
        row["bwd_torch_ms"] = do_bench(lambda: _situ_bwd_torch(g, u, do, 4.0, 25.0), return_mode="median")
        n = R * C
        for k in list(row):
            if k.endswith("_ms"):
                row[k.replace("_ms", "_GBps")] = (6 if k.startswith("fwd") else 10) * n / (row[k] * 1e-3) / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| R x C | fwd exact | fwd approx | fwd torch | bwd exact | bwd approx | bwd torch | (ms; GB/s of the kernel) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cell = lambda k: f"{r[k + '_ms']:.3f} ({r[k + '_GBps']:.0f})"
        print(f"| {r['R']} x {r['C']} | " + " | ".join(cell(k) for k in ("fwd_exact", "fwd_approx", "fwd_torch",
                                                                        "bwd_exact", "bwd_approx", "bwd_torch")) + " | |")
    with open(a.json, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
