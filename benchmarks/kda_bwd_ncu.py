"""Driver for Nsight Compute (ncu) reads of the KDA Triton backward's kernels on one GPU: compiles and warms the
backward at a K3 head shape, then runs ONE more backward between cudaProfilerStart / Stop, so that

    ncu --clock-control none --profile-from-start off --set full -o REPORT python3 benchmarks/kda_bwd_ncu.py

profiles exactly that call's kernels (benchmarks/gpu_run.sh stage `ncu` does this and prints the report's pages).
$K3_KDA_BWD_LAUNCH applies as everywhere (ops_bwd.env_launch). --fwd profiles our forward (c16p) instead.

    python benchmarks/kda_bwd_ncu.py [--B 1] [--T 8192] [--H 96] [--D 128] [--fwd]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=96)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--fwd", action="store_true", help="profile the forward instead of the backward")
    args = ap.parse_args()
    import torch
    from k3.ops.kda.triton import ops as fwd_ops, ops_bwd

    B, T, H, D = args.B, args.T, args.H, args.D
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v, f, do = (r(B, T, H, D).bfloat16() for _ in range(5))
    beta = r(B, T, H).sigmoid().bfloat16()
    A_log = torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=gen))
    dt_bias = r(H * D) * 0.1
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    scale = D ** -0.5
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
