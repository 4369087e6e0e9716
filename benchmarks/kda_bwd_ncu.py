"""Driver for Nsight Compute (ncu) reads of the KDA Triton backward's kernels on one GPU: compiles and warms the
backward at a K3 head shape, then runs ONE more backward between cudaProfilerStart / Stop, so that

    ncu --clock-control none --profile-from-start off --set full -o REPORT python3 benchmarks/kda_bwd_ncu.py

profiles exactly that call's kernels (then `ncu -i REPORT --page details` / `--page source --csv --print-source
sass` print the report's pages).
$K3_KDA_BWD_LAUNCH applies as everywhere (bwd_config.env_launch). --fwd profiles our forward instead.

    python benchmarks/kda_bwd_ncu.py [--B 1] [--T 8192] [--H 96] [--D 128] [--fwd]
"""
from __future__ import annotations

import argparse

from _common import sibling


def main():
    sweep = sibling("kda_bwd_sweep")
    k3_inputs, shape_args = sweep.k3_inputs, sweep.shape_args
    ap = shape_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--fwd", action="store_true", help="profile the forward instead of the backward")
    args = ap.parse_args()
    import torch
    from k3.ops.kda.triton import bwd as ops_bwd, fwd as fwd_ops

    B, T, H, D = args.B, args.T, args.H, args.D
    q, k, v, f, beta, do, kw, scale = k3_inputs(B, T, H, D)
    if args.fwd:
        call = lambda: fwd_ops.kda_chunk_fwd(q, k, v, f, beta, scale, output_final_state=True, **kw)
    else:
        call = lambda: ops_bwd.kda_chunk_bwd(q, k, v, f, beta, do, None, scale, **kw)
    for _ in range(2):  # compile, then a warm call
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one {'forward' if args.fwd else 'backward'} at B{B} T{T} H{H} D{D} bf16", flush=True)


if __name__ == "__main__":
    main()
