"""Static (no GPU) sm_90 instruction counts of the SiTU-GLU Triton kernels (k3/ops/activations_triton.py), exact
tanh / sigmoid (exp + reciprocal) against the opt-in hardware tanh (K3_SITU_TANH=approx), at the launch shape
(1024 elements per program, 4 warps: 8 elements per thread), with the column count and row strides taken as
multiples of 16 (the JIT specializes them so at launch for the model's widths: 128-bit loads).

    python benchmarks/situ_static.py [--json out.json]

Reading the numbers: an H200 SM issues 4 warp instructions per clock (2.5e11 lane-instructions/s at 1.98 GHz),
16 MUFU ops per clock (3.2e10/s), and gets ~4.8 TB/s / 132 SMs = 3.6e10 B/s of HBM bandwidth. A kernel moving B
bytes per element is bandwidth-bound below ~7.0 * B SASS instructions and ~0.87 * B MUFU ops per element: forward
(B = 6: bf16 g, u in, o out) ~42 instructions / ~5.2 MUFU; backward (B = 10) ~70 / ~8.7.

Result (triton 3.9.0, 2026-11-30), per element: exact forward 66 instructions / 6.25 MUFU, approx 26 / 3.25;
exact backward 78 / 6.25, approx 39 / 3.25 (without the divisibility specialization, i.e. scalar 16-bit loads:
76 / 32 / 91 / 48). So by this model the exact forward is issue-bound at ~1.6x its bandwidth time (66 / 42) and
MUFU-bound at ~1.2x, the exact backward at ~1.1x; the approx kernels are under both bounds.
But in the compiled `small` step on the H200 (fifth session, benchmarks/RESULTS.md) the exact kernels averaged
~0.80 ms (forward) / ~0.87 ms (backward) per call over calls of ~85M elements on average (routed [262144, 512],
shared [32768, 1024], dense [32768, 4096]), i.e. ~0.6 TB/s: 4-5x what these bounds give. So the instruction
count is not the whole story; benchmarks/situ_gpu.py times the kernels alone (next device session) before the
approx path is judged.
"""
from __future__ import annotations

import argparse
import json

TYPES = dict(R="i32", C="i32", sg="i32", su="i32", so="i32", sd="i32", sdg="i32", b1="fp32", b2="fp32")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from k3.ops import activations_triton as at
    from k3.ops.triton_sm90 import compile_sm90, stats
    per = at.BLOCK // (4 * 32)
    rows = []
    for name, fn in (("fwd", at._situ_fwd_kernel), ("bwd", at._situ_bwd_kernel)):
        for approx in (False, True):
            st = stats(compile_sm90(fn, dict(BR=1, BC=at.BLOCK, APPROX=approx), TYPES, num_warps=4,
                                    divisible=("C", "sg", "su", "so", "sd")), 4)
            mufu = sum(n for op, n in st["ops"].items() if op.startswith("MUFU"))
            rows.append(dict(kernel=name, tanh="approx" if approx else "exact", regs=st["regs"],
                             instr=st["n_instr"], instr_per_elem=st["n_instr"] / per, mufu_per_elem=mufu / per))
            print(json.dumps(rows[-1]), flush=True)
    print("| kernel | tanh | regs | SASS instr / element | MUFU / element |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['tanh']} | {r['regs']} | {r['instr_per_elem']:.1f} | {r['mufu_per_elem']:.2f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
