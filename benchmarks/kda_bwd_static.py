"""Static (no GPU) sm_90 report of the KDA Triton backward kernels (k3/ops/kda/triton/bwd_*.py).

Compiles every backward kernel ahead of time for sm_90 with triton's bundled ptxas, at the launch parameters
`bwd_config.launch_config` gives the real launches (BV, num_warps, num_stages; 64-token chunks at K <= 128), bf16
token tensors, fused gate + L2 norm, initial state and dht, and prints registers/thread, spill stack (bytes per
thread, cuobjdump STACK), shared memory, resident programs per SM, and SASS instruction counts of the kernel
body (total, HMMA, MUFU; loop bodies are counted once, not per iteration).

    python benchmarks/kda_bwd_static.py [--H 96 8] [--N 8] [--K 128] [--V 128] [--json out.json]

N is the number of sequences: with H it sets N*H, which picks the value block of the sequential passes.

The record below is of the third-to-fifth sessions' kernels; prep, grad_v and grad_k ("v1") were removed in the
fifth session when the non-recomputing split (pmat, pwu, gv, gw, gi2, gfin) measured 2x faster on the H200
(benchmarks/RESULTS.md). Running the script reports the current kernels; at the end of the fifth session
(triton 3.9.0, H = 96, N = 8, bf16; H200 time per kernel at B1 T8K in brackets):

| kernel | BV | warps | stages | regs | stack B | smem KB | CTA/SM | SASS | MMA | MUFU | H200 ms |
|---|---|---|---|---|---|---|---|---|---|---|---|
| pmat | - | 4 | 1 | 255 | 512 | 64 | 2 | 9744 | 272 | 117 | 3.92 |
| pwu | 64 | 4 | 1 | 192 | 0 | 32 | 2 | 2984 | 16 | 137 | 1.83 |
| states | 64 | 4 | 2 | 166 | 0 | 88 | 2 | 1120 | 16 | 0 | ~0.65 |
| dstates | 64 | 4 | 2 | 227 | 0 | 144 | 1 | 1448 | 28 | 0 | ~1.0 |
| gv | 32 | 4 | 1 | 255 | 208 | 64 | 2 | 1832 | 64 | 0 | 3.03 |
| gw | 32 | 8 | 2 | 255 | 40 | 68 | 1 | 3568 | 72 | 77 | 3.79 |
| gi2 | - | 4 | 1 | 180 | 0 | 66 | 2 | 2344 | 64 | 80 | 3.55 |
| gfin | - | 4 | 1 | 255 | 8 | 4 | 2 | 2288 | 0 | 37 | 1.67 |

Numbers (triton 3.9.0, sm_90, bf16, K = V = 128, N = 8; ~70 s for all kernels on 2 cores). H = 96 and H = 8 give
the same prep/grad numbers (H only enters strides); the sequential passes differ through BV (64 at H = 96,
16 at H = 8). stack = spill bytes per thread; stl/ldl = local store/load instructions in the SASS.

| kernel (H = 96)       | warps | regs | stack B | smem KB | SASS  | MMA  | MUFU | stl/ldl   |
|-----------------------|-------|------|---------|---------|-------|------|------|-----------|
| prep   before         | 4     | 255  | 4888    | 64      | 41072 | (a)  | 505  | 3221/5341 |
| prep   after          | 8     | 255  | 1224    | 68      | 14952 | 736  | 257  | 404/496   |
| states (unchanged)    | 4     | 166  | 0       | 88      | 1120  | 16   | 0    | 0/0       |
| dstates (unchanged)   | 4     | 227  | 0       | 144     | 1448  | 28   | 0    | 0/0       |
| grad   before         | 8     | 255  | 5760    | 168     | 39008 | (a)  | 570  | 3015/4148 |
| grad   after tf32x3   | 8     | 255  | 4856    | 152     | 33784 | 1092 | 570  | 2253/3185 |
| grad_v (K split)      | 4     | 255  | 600     | 64      | 12272 | 340  | 182  | 136/181   |
| grad_k (K split)      | 8     | 255  | 184     | 88      | 5384  | 226  | 63   | 48/49     |
(a) the first version of this script counted HMMA only (0: sm_90 tensor-core dots are HGMMA); MMA = both.
H = 8: grad_v 600 B, grad_k 176 B (same shape).

What changed (1): `_unit_lower_inv` (the 64x64 inverse of both kernels, ten chained 64x64x64 products) ran exact-fp32
FMA dots, which hold whole 64-wide operand rows in registers; it now uses 3-pass tf32 tensor-core dots (~fp32
accuracy; the interpreter tests pass at unchanged tolerances). The prep runs 8 warps instead of 4 (4 warps
after the change: 1832 B of spills; 16 warps: 128 registers, 3000 B). Tried without gain and dropped: 16 warps
for grad (6832 B), num_stages=1 (same spills), d(q e^G) in a second value loop (5016 B), scaling the intra-chunk
row operands once per chunk instead of per tile (prep 1408 B at 8 warps).

What changed (2): the grad kernel is split in two, both per (chunk, head), with fp32 scratch between them:
- grad_v: Aq and L accumulated over BK = 32 column blocks of the raw q, k (the L2 norm applied afterwards as a
  row/column scaling), T, then W and k e^(G_l - G) written per column block to scratch; the value loop (BV = 16)
  forms u' and du' with K-blocked products against W / k e^(G_l - G) re-read from scratch (L1/L2) and the stored
  states, writes u', du', dv and the per-chunk T, L, tril(dAq), sum_V dXv U^T, sum_V dXv v.
- grad_k: pass A over BK = 16 column blocks: dW = -du' S0^T, dXk = T^T dW (over W in the scratch), the W side of
  dN; pass B per column block: d(q e^G), d(k e^(G_l - G)), the intra-chunk backward, dG -> dg/df, dq, dk (pre-norm
  to the scratch with the L2 norm); pass C: the L2 norm's backward from the full-row sums.
No [BT, K] fp32 tile is live across a loop any more. Tuning (static, K = V = 128 bf16): grad_v at 8 warps /
2 stages needs 248 KB of shared memory (does not fit), 1 stage 1104 B; 4 warps BK = 32: 664 B (BV = 32), 600 B
(BV = 16), BK = 16: 656 B; 16 warps 2040 B. grad_k BK = 64: 2272 B, BK = 32: 776 B, BK = 16: 184 B; 4 or 16 warps
worse; re-loading dAq / dL per block instead of keeping them live: worse (1056 B at BK = 32). What is left in
grad_v (600 B) is most likely the tf32x3 64x64 inverse at 4 warps (the prep kernel, which has the same inverse,
keeps 1224 B).
Cost: extra fp32 scratch while the two kernels run, 3 KiB per token-head at K = V = 128 (W/dXk, k e^(G_l - G),
u', du' at 4 B each, plus 4 BT x BT matrices per chunk), and extra reads: the states twice more (grad_k's passes A
and B; mostly L2), u'/du'/W/k e^(G_l - G) written and read back once or twice, q/k/g re-read per pass (3x).

Prediction (not measured): the prep was bound by its spill traffic and ~27k FMA-dot instructions; 2.7x fewer
instructions and 4x less spill should make it ~2-3x faster. The split gradient runs 17.7K SASS instructions in
two programs instead of 33.8K in one and ~0.8 KB of spills per (chunk, head) thread pair instead of 4.9 KB
(1.2 MB of local memory traffic per 256-thread program before, beyond L1): expect the gradient step ~1.5-2x
faster in GPU time despite ~2x more bytes read (extra ~3-4 KB per token-head of fp32 scratch and state reads,
mostly L2 hits at K3 shapes), grad_v now the larger half; the backward as a whole perhaps 25-35% faster if the
gradient step was ~half of it. To be checked on the H200 (gpu_selfcheck's ms.triton_bwd).
"""
from __future__ import annotations

import argparse
import json
import math

import torch

F32_PTRS = {"A_log", "dt_bias", "eg", "eg_out", "h0", "dht", "states", "dstates", "dh0", "dal_part", "ddt_part",
            "ws", "ks", "uns", "dus", "cmat", "cdb", "x1s", "x2s", "dgis", "nkp", "dbp", "aqf", "gcs", "rqk", "sqk"}
I32_PTRS = {"chunk_tok", "chunk_end", "cu", "seq_chunk", "order"}
SCALARS = {"scale": "fp32", "lower_bound": "fp32", "Ttot": "i32"}


def _signature(fn, consts, dtype="bf16"):
    """Argument types as launched at `dtype` token inputs (the default scratch's pointers in that dtype)."""
    from k3.ops.kda.triton import bwd_config as ob
    lowp = dtype in ("bf16", "fp16")
    t = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)[dtype]
    scratch = ob.SCRATCH_PTRS[ob.launch_config(128, 128, 1, t)["scratch"]["DTYPE"]] if lowp else ()
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in SCALARS:
            sig[n] = SCALARS[n]
        elif n in I32_PTRS:
            sig[n] = "*i32"
        elif n in F32_PTRS and n not in scratch:
            sig[n] = "*fp32"
        else:
            sig[n] = f"*{dtype}"
    return sig


def compile_sm90(fn, consts, num_warps, num_stages, dtype="bf16", maxnreg=None):
    from k3.ops.triton_sm90 import compile_sm90 as comp
    extra = {} if maxnreg is None else dict(maxnreg=maxnreg)
    return comp(fn, consts, _signature(fn, consts, dtype), num_warps, num_stages, **extra)


def measure(ck, num_warps):
    """Registers, spill stack, shared memory, programs per SM and SASS counts of a compiled kernel."""
    from k3.ops.triton_sm90 import stats
    st = stats(ck, num_warps)
    ops = st["ops"]
    return dict(regs=st["regs"], stack_B=st["stack_B"], smem_KB=round(st["smem_B"] / 1024, 1),
                cta_per_SM=st["cta_per_SM"], sass=st["n_instr"], hmma=ops["HMMA"] + ops["HGMMA"], mufu=ops["MUFU"],
                stl=ops["STL"], ldl=ops["LDL"])


def cases(H, N, K, V, dtype=torch.bfloat16):
    """(name, kernel, constexprs, launch) of every backward kernel as bwd.kda_chunk_bwd launches it."""
    from k3.ops.kda.triton import bwd_config as ob
    from k3.ops.kda.triton.bwd import kernel_table
    BT = ob.chunk_len(K)
    lc = ob.launch_config(K, V, N * H, dtype)
    const = dict(H=H, K=K, V=V, BT=BT, TS=ob.TS, REF=ob.REF, LOG2_TS=int(math.log2(ob.TS)),
                 LOG2_NB=int(math.log2(BT // ob.TS)), USE_GATE=True, L2NORM=True, IEEE=dtype == torch.float32,
                 NKW=0 if lc["inter"]["ATOMIC"] or lc["value"]["DNU"] else K // lc["inter"]["BK"],
                 NDB=0 if lc["inter"]["ATOMIC"] else K // lc["inter"]["BK"], DNW=not lc["value"]["DNU"], UPCAST=False,
                 NSQ=K // lc["intra"]["BK"] + K // lc["inter"]["BK"] if lc["intra"]["RED"] else 0, RED=lc["intra"]["RED"],
                 F32_W=not (lc["value"]["PRE"] and lc["value"]["DNU"]),
                 F32_K=not lc["value"]["PRE"], FUSED=lc["intra"]["FIN"],
                 NKI=K // lc["intra"]["BK"] + (K // lc["inter"]["BK"] if lc["intra"]["RED"] else 0),
                 SQK=lc["gate_norm"]["ONEPASS"] and not lc["intra"]["FIN"], AQF=not lc["value"]["PRE"])
    seq = dict(H=H, K=K, V=V, BT=BT, IEEE=dtype == torch.float32, UPCAST=False, STORE_U=lc["value"]["PRE"],
               SF32=lc["value"]["PRE"] and lc["value"]["PRE_F32"])
    out = []
    for name, fn, extra in kernel_table():
        cfg = dict(lc[name])
        consts = dict(const if extra == "chunk" else seq)
        if extra == "states":
            consts["HAS_H0"] = True
        elif extra == "dstates":
            consts["HAS_DHT"] = True
        consts.update({k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages", "maxnreg")})
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
        out.append((name, fn, consts, dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                           maxnreg=cfg["maxnreg"])))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--H", type=int, nargs="+", default=[96, 8])
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import triton
    rows = []
    keys = ["regs", "stack_B", "smem_KB", "cta_per_SM", "sass", "hmma", "mufu", "stl", "ldl"]
    print(f"static sm_90 compile (triton {triton.__version__}), K={args.K} V={args.V} N={args.N} bf16, gate + L2")
    print("| H | kernel | BV | warps | stages | " + " | ".join(keys) + " |")
    print("|---|---|---|---|---|" + "---|" * len(keys))
    for H in args.H:
        for name, fn, consts, launch in cases(H, args.N, args.K, args.V):
            try:
                r = measure(compile_sm90(fn, consts, **launch), launch["num_warps"])
            except Exception as e:  # noqa: BLE001
                r = dict(error=repr(e)[:300])
            r.update(H=H, kernel=name, BV=consts.get("BV", "-"), **launch)
            rows.append(r)
            cells = " | ".join(str(r.get(k, "-")) for k in keys) if "error" not in r else r["error"]
            print(f"| {H} | {name} | {r['BV']} | {launch['num_warps']} | {launch['num_stages']} | {cells} |",
                  flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(triton=triton.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
