"""How much of the KDA backward's sequential passes could hide behind its parallel kernels (a probe for a pipelined
backward, before writing one): records one backward's kernel launches (bwd.kda_chunk_bwd at a K3 head shape),
then replays them on one GPU, each kernel alone and pairs of them at once (the first on the current stream, the
second on a high-priority side stream, as the pipelined forward runs its walks), and prints each pair's time
against the sum of its parts. The replayed values are meaningless (atomics add again, passes re-read what later
kernels overwrote); only the times count.

    python benchmarks/kda_bwd_overlap.py [--B 1] [--T 8192] [--H 96] [--D 128] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os

from _common import sibling


# (main-stream kernels, side-stream kernels): what a pipelined backward would run at once
PAIRS = [
    (("matrices",), ("states",)), (("wy",), ("states",)), (("matrices", "wy"), ("states",)),
    (("matrices", "wy"), ("dstates",)), (("value",), ("dstates",)), (("inter",), ("dstates",)), (("intra",), ("dstates",)),
    (("gate_norm",), ("dstates",)), (("inter", "intra"), ("dstates",)), (("value", "inter", "intra", "gate_norm"), ("dstates",)),
    (("inter", "intra"), ("states",)), (("value", "inter", "intra", "gate_norm"), ("states", "dstates")),
]


def main():
    sweep = sibling("kda_bwd_sweep")
    k3_inputs, shape_args = sweep.k3_inputs, sweep.shape_args
    ap = shape_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "kda_bwd_overlap.json"))
    args = ap.parse_args()
    import torch
    from k3.ops.kda.triton import bwd as ops_bwd

    launches = {}

    class Rec:
        def __init__(self, name, kern):
            self.name, self.kern = name, kern

        def __getitem__(self, grid):
            def go(*a, **kw):
                launches[self.name] = (self.kern, grid, a, kw)
                return self.kern[grid](*a, **kw)
            return go

    kb = ops_bwd  # (the module whose globals the backward launches)
    names = [n for n, _, _ in ops_bwd.kernel_table()]
    orig = {}
    for n, kern, _ in ops_bwd.kernel_table():
        attr = next(a for a, x in vars(kb).items() if x is kern)
        orig[attr] = kern
        setattr(kb, attr, Rec(n, kern))
    B, T, H, D = args.B, args.T, args.H, args.D
    q, k, v, f, beta, do, kw, scale = k3_inputs(B, T, H, D)
    try:
        for _ in range(2):
            ops_bwd.kda_chunk_bwd(q, k, v, f, beta, do, None, scale, **kw)
    finally:
        for attr, kern in orig.items():
            setattr(kb, attr, kern)
    torch.cuda.synchronize()
    main_s = torch.cuda.current_stream()
    side = torch.cuda.Stream(priority=-1)
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")

    def run(n):
        kern, grid, a, kwa = launches[n]
        kern[grid](*a, **kwa)

    def timed(main_ks, side_ks=()):
        ts = []
        for _ in range(args.reps):
            flush.zero_()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(main_s)
            if side_ks:
                side.wait_stream(main_s)
                with torch.cuda.stream(side):
                    for n in side_ks:
                        run(n)
            for n in main_ks:
                run(n)
            if side_ks:
                main_s.wait_stream(side)
            e1.record(main_s)
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1))
        ts.sort()
        return ts[len(ts) // 2]

    alone = {n: timed((n,)) for n in names}
    res = {"shape": f"B{B} T{T} H{H} D{D} bf16", "alone_ms": alone, "all_serial_ms": timed(tuple(names)), "pairs": []}
    print(f"{res['shape']}: alone " + ", ".join(f"{n} {t:.3f}" for n, t in alone.items())
          + f"; all serial {res['all_serial_ms']:.3f} ms", flush=True)
    for m, s in PAIRS:
        ser = timed(m + s)
        both = timed(m, s)
        part_m, part_s = timed(m), timed(s)
        row = dict(main=list(m), side=list(s), serial_ms=ser, overlapped_ms=both, main_ms=part_m, side_ms=part_s,
                   hidden_frac=(ser - both) / part_s if part_s else 0.0)
        res["pairs"].append(row)
        print(f"{'+'.join(m):>16} || {'+'.join(s):<15} serial {ser:.3f}  overlapped {both:.3f}  (main {part_m:.3f}, "
              f"side {part_s:.3f}: {100 * row['hidden_frac']:.0f}% of the side hidden)", flush=True)
    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
