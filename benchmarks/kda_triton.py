"""KDA forward on one GPU: our Triton forward (k3.ops.kda.triton.fwd: the prep kernel kda_intra_wy_fwd_kernel, then
the walk kda_state_output_fwd_kernel) vs fla chunk_kda(safe_gate=True, lower_bound=-5, in-kernel gate and q/k L2
norm); decode behind --decode, fwd+bwd behind --bwd. Default run = the study of the prep kernel: each option set of
fwd.PREP_DEFAULT (PREP_SWEEP below), each alone (prep_only) and inside the full forward, at B8 T8K and B1 T128K.

One command (about 5-8 minutes on a fresh H200, mostly compiles); rows are appended to --json as they are measured
and --budget-s skips whatever is left (the sweep is ordered by how much each row is needed). In order:
0. fla warm-up at a tiny T (its autotune keys do not depend on T); prints how long it took.
1. Accuracy vs the fp32 token loop (relative RMSE of o and of the final state), B2 T2048 H96 D128 bf16 with an
   initial state, two inputs: "random" (randn q/k/v/gate, as fla's tests) and "hard" (nearly collinear keys, weak
   decay, beta in [0.5, 1]: |n| ~ 1 in the intra-chunk system, where tf32 repeated squaring fails). Rows: fla, our
   default forward ("fwd"), every prep sweep config; with each one's first-call seconds (compile).
2. Per shape (--shapes, default B8_T8K,B1_T128K; also varlen, B2_T32K): fla; every prep sweep config's prep alone
   and full forward at the first shape, the --top best (by prep time) plus the default at the others;
   registers/spills of each prep kernel; the default full forward ("fwd"), o vs fla, floor fraction.
2d. (first shape; every shape with --state-every-shape) every STATE_SWEEP option set of the walk (--state-configs
   to pick, 'none' to skip): the full forward; walk ms = forward - prep alone.
3. --decode: one token, fp32 state updated in place, B1 and B64, ours vs fla fused_recurrent_kda.
4. --bwd: fwd+bwd at every --shapes shape (the backend's forward and backward) vs fla, one sequence of T tokens for
   the fixed shapes (B1 T8K / T32K / T128K), the whole batch for varlen; per-kernel CUDA times of both.
--smoke: the same plumbing on CPU under TRITON_INTERPRET=1 with tiny shapes and GPU-like rounding (checks that the
script runs, not speed; a 4-config sweep). fla is skipped (with a warning) wherever it does not import.
--static: no GPU needed: compile every prep sweep config for sm_90 (triton's bundled ptxas) and print registers,
spills, shared memory, resident programs/warps per SM and SASS counts per chunk.
--static-what prep,state (default both): "state" also compiles the walk (on the grid BV 32/64/128 x 4/8 warps x
1/2/3 stages, and every STATE_SWEEP option set of fwd.STATE_CFG_DEFAULT) and prints registers, spills, programs per
SM, SASS of the loop body per 16-token step, a one-warp in-order issue simulation of that body (cycles per step) and
a calibrated model of the walk's ms at B8 T8K.
Measured numbers and the history of the forward (the earlier variants c16 / c64 / c64s / c64f and the "v2" walk):
benchmarks/RESULTS.md, docs/LOG.md.

Usage: python benchmarks/kda_triton.py [--json PATH] [--budget-s S] [--shapes ...]
       [--prep-configs JSON] [--top N] [--decode] [--bwd] [--smoke] [--static]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


PREDICTED_MS_B8_T8K = {"fla": 19.7, "fwd": 9.5}  # measured 10.97 (third session)
# prep option sets (overrides of fwd.PREP_DEFAULT = c=1, 2 warps, maxnreg=None, block inverse, tf32 Aqk/Akk,
# heads-fastest, whole-K tiles), in the order they are timed, with the predicted prep time at B8 T8K (ms) and what
# the row isolates. Keys: see fwd.PREP_DEFAULT. The predictions come from `--static` (sm_90 compile with triton
# 3.9 on a CPU: registers, spills, programs per SM, SASS warp-instructions per chunk I) and one crude model
# calibrated on the old prep (I = 10,144, 8 warps per SM, 12.4 ms => 1.39 instructions per clock per SM):
#   t = 2,980 chunks per SM * I / IPC / 1.755 GHz,  IPC = 1.39 * (resident warps per SM / 8) ** 0.6,
# i.e. the prep is taken to be issue- and latency-bound (not bandwidth-bound: floor ~2.8-3.2 ms) and more resident
# warps hide more latency. The register counts on the H200 (triton 3.6) are recorded per row as n_regs/n_spills.
PREP_SWEEP = [
    ("default", {}, 7.1, "fwd.PREP_DEFAULT: c=1 chunk per program on 2 warps, no register cap (= c1_w2; 6.40 ms, third session)"),
    ("c1_w2_r128", dict(maxnreg=128), 4.9, "the second session's default: registers capped at 128 (8 programs / 16 warps per SM); measured 13.8 ms (spills)"),
    ("c1_w2", dict(maxnreg=None), 7.1, "no register cap (~250 registers: 4 programs per SM); the default since the third session"),
    ("c1_w2_r168", dict(maxnreg=168), 5.6, "cap 168: 6 programs per SM, fewer spills"),
    ("kb32_c1_w1_r128", dict(kb=32, num_warps=1, maxnreg=128), 5.3, "K in blocks of 32, one warp per chunk, cap 128"),
    ("kb32_c1_w2", dict(kb=32, maxnreg=None), 6.7, "K in blocks of 32 on 2 warps, no cap (~110 registers)"),
    ("c2_w4_r128", dict(c=2, num_warps=4, maxnreg=128), 5.9, "2 chunks per program (batched dots) on 4 warps, cap 128"),
    ("c1_w4_r128", dict(num_warps=4, maxnreg=128), 7.1, "1 chunk on 4 warps (as the old prep), cap 128"),
    ("c1_w4_ieee_chunkfast", dict(num_warps=4, maxnreg=None, inv="ieee", head_fast=False), 8.2,
     "old structure (4 warps, fp32 FMA squaring inverse, chunks-fastest grid, no cap) + two exps instead of four + "
     "no chunk-table load: the elementwise savings alone"),
    ("c1_w4_chunkfast", dict(num_warps=4, maxnreg=None, head_fast=False), 8.0, "+ block inverse on tensor cores"),
    ("c1_w4", dict(num_warps=4, maxnreg=None), 7.9, "+ heads-fastest grid"),
    ("c2_w4", dict(c=2, num_warps=4, maxnreg=None), 8.2, "2 chunks per program on 4 warps, no cap"),
    ("kb32_c1_w1", dict(kb=32, num_warps=1, maxnreg=None), 6.2, "K blocks of 32, one warp, no cap"),
    ("kb64_c1_w2", dict(kb=64, maxnreg=128), 6.6, "K in blocks of 64 on 2 warps, cap 128"),
    ("kb32_c2_w4", dict(kb=32, c=2, num_warps=4, maxnreg=None), 7.1, "K blocks of 32, 2 chunks on 4 warps"),
    ("c1_w4_loop4_prefetch", dict(num_warps=4, maxnreg=None, loop=4, prefetch=True), 8.5,
     "4 warps, 4 tiles per program with the next tile's loads in flight during compute"),
    ("c1_w2_r128_loop4", dict(loop=4, maxnreg=128), 5.6, "default with 4 tiles per program (per-program setup amortised)"),
    ("c1_w2_r128_blkn", dict(inv="blkn", maxnreg=128), 5.1, "default + one Newton step (tf32x3 residual): its cost"),
    ("c1_w2_r128_qkbf16", dict(qk="bf16", maxnreg=128), 4.8, "default with bf16 Aqk/Akk operands (~5e-3 more error)"),
    ("c4_w4", dict(c=4, num_warps=4, maxnreg=None), 8.0, "one warp per chunk, 4 chunks per program (spills)"),
]
SMOKE_SWEEP = ["default", "kb32_c1_w1_r128", "c2_w4", "c1_w4_loop4_prefetch"]
SHAPES = {"B8_T8K": (8, 8192), "B2_T32K": (2, 32768), "B1_T128K": (1, 131072), "varlen": (1, 65536),
          "B1_T8K": (1, 8192)}
HBM_TBPS = 4.8


def rr(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def cfg_name(c):
    return ",".join(f"{k}={v}" for k, v in c.items()) or "default"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "kda_triton.json"))
    ap.add_argument("--budget-s", type=float, default=540.0, help="skip what is left after this many seconds")
    ap.add_argument("--shapes", default="B8_T8K,B1_T128K", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--prep-configs", default=None,
                    help="JSON: list of sweep names and/or {name: overrides} objects (default: all of PREP_SWEEP)")
    ap.add_argument("--top", type=int, default=2, help="best preps (first shape) carried to the other shapes")
    ap.add_argument("--decode", action="store_true", help="also time decode (one token) vs fla")
    ap.add_argument("--bwd", action="store_true", help="also time fwd+bwd (slow: fla's backward autotune)")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the accuracy rows (timing only)")
    ap.add_argument("--ours-envs", default="", help="fwd+bwd: also time ours under these environments, one JSON "
                    "object {label: {VAR: value}} (e.g. K3_KDA_BWD_LAUNCH / K3_KDA_STATE_CFG variants), same process")
    ap.add_argument("--bwd-only", action="store_true",
                    help="only the fwd+bwd rows (with each kernel's CUDA time): no accuracy or forward rows")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--static", action="store_true",
                    help="no GPU: compile the preps for sm_90 and print registers/spills/occupancy/SASS counts")
    ap.add_argument("--static-what", default="prep,state",
                    help="--static: 'prep' (prep kernels), 'state' (sequential pass: BV x warps x stages grid + "
                         "STATE_SWEEP), 'state-sweep' (STATE_SWEEP only)")
    ap.add_argument("--state-configs", default=None,
                    help="comma list of STATE_SWEEP names timed at the first shape (default: all; 'none': skip)")
    ap.add_argument("--state-every-shape", action="store_true",
                    help="time the --state-configs at every shape (default: the first shape only)")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as F
    import triton
    from k3.ops.kda import recurrent_kda
    from k3.ops.kda.triton import chunk_kda_triton, fwd as ours

    t_start = time.time()
    over = lambda: time.time() - t_start > args.budget_s
    variants = ["fwd"]  # (the rows' name of our default forward)
    shape_names = [s for s in args.shapes.split(",") if s]
    for s in shape_names:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: unknown {s!r} (known: {sorted(SHAPES)})")
    sweep_all = {name: (ov, pred, why) for name, ov, pred, why in PREP_SWEEP}
    if args.prep_configs:
        sweep = {}
        for item in json.loads(args.prep_configs):
            if isinstance(item, str):
                sweep[item] = sweep_all[item]
            else:
                sweep.update({n: (ov, None, "from --prep-configs") for n, ov in item.items()})
    else:
        sweep = {n: sweep_all[n] for n in (SMOKE_SWEEP if args.smoke else sweep_all)}
    for ov, _, _ in sweep.values():
        ours.prep_config(ov)  # validates
    state_all = {n: (ov, pred, why) for n, ov, pred, why in STATE_SWEEP}
    if args.state_configs == "none":
        state_sweep = {}
    elif args.state_configs:
        state_sweep = {n: state_all[n] for n in args.state_configs.split(",") if n}
    else:
        order = STATE_ORDER + [n for n in state_all if n not in STATE_ORDER]
        state_sweep = {n: state_all[n] for n in (SMOKE_STATE if args.smoke else order)}
    for ov, _, _ in state_sweep.values():
        ours.state_config(ov)  # validates
    if args.static:
        jp = args.json if args.json.endswith(".json") and "--json" in sys.argv else None
        what = args.static_what.split(",")
        if "prep" in what:
            static_report(sweep, jp)
        if "state" in what or "state-sweep" in what:
            state_static_report(state_sweep, jp and jp[:-5] + "_state.json", grid="state" in what)
        return
    try:
        from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_rec
        import fla
        fla_version = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - any import failure means "no fla": time ours alone
        fla_chunk = fla_rec = None
        fla_version = f"not importable ({type(e).__name__}: {e})"[:200]
        print(f"WARNING: fla is not importable ({e}); timing our kernels only", flush=True)
    if args.smoke:
        from k3.ops.triton_interp import emulate_gpu, fix_interpreter_bf16_dot
        fix_interpreter_bf16_dot()
        emulate_gpu(True)  # GPU-like rounding (tf32 dots, bf16 casts to nearest) for the accuracy rows
        dev, H, D = "cpu", 2, 32
    else:
        dev, H, D = "cuda", 96, 128
    res = {"torch": torch.__version__, "triton": triton.__version__, "fla": fla_version,
           "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter smoke)",
           "prep_default": ours.PREP_DEFAULT, "predicted_ms_B8_T8K": PREDICTED_MS_B8_T8K,
           "prep_sweep": {n: dict(cfg=ov, predicted_prep_ms=p, why=w) for n, (ov, p, w) in sweep.items()},
           "rows": []}
    print({k: v for k, v in res.items() if k not in ("rows", "prep_sweep")}, flush=True)

    def save():
        tmp = args.json + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(res, fh, indent=1)
        os.replace(tmp, args.json)

    def add(row):
        row["t_s"] = round(time.time() - t_start, 1)
        res["rows"].append(row)
        print(row, flush=True)
        save()

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    if args.smoke:
        def bench(f):
            t = time.time()
            f()
            return (time.time() - t) * 1e3
        bench_fb = bench
    else:
        from triton.testing import do_bench
        bench = lambda f: do_bench(f, warmup=25, rep=100, return_mode="median")
        # fwd+bwd rows: at 75-200 ms per call the defaults above time one call after one warm-up, and a first call's
        # allocations (fla's cached blocks still held) showed as 100.5 ms against 73.7-74.1 for the same varlen
        # fwd+bwd (seventeenth session): at least three warm-up calls and five timed ones
        bench_fb = lambda f: do_bench(f, warmup=600, rep=1000, return_mode="median")

    def timed_first(f):
        """seconds of a first call (compile + autotune + run)."""
        sync()
        t = time.time()
        out = f()
        sync()
        return out, round(time.time() - t, 2)

    scale = D ** -0.5
    gen = torch.Generator(device=dev).manual_seed(0)

    def make(B, T, grad=False, hard=False):
        r = lambda *s: torch.randn(*s, device=dev, generator=gen)
        q, k, v, f = (r(B, T, H, D) for _ in range(4))
        beta = r(B, T, H).sigmoid()
        if hard:  # nearly collinear keys (per sequence and head), weak decay (g ~ -0.01), large beta
            k = F.normalize(r(B, 1, H, D) + 0.03 * k, dim=-1)
            f = -6.0 + 0.1 * f
            beta = 0.5 + 0.5 * torch.rand(B, T, H, device=dev, generator=gen)
        A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16, generator=gen))
        dt_bias = r(H * D) * 0.1
        ts = [q.bfloat16(), k.bfloat16(), v.bfloat16(), f.bfloat16(), beta.bfloat16(), A_log, dt_bias]
        if grad:
            ts = [t.requires_grad_() for t in ts]
        return ts

    gk = lambda ins: dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=ins[5], dt_bias=ins[6],
                          lower_bound=-5.0)

    def ours_fwd(ins, cfg, cu=None, h0=None, fs=False, prep_only=False):
        return ours.kda_chunk_fwd(*ins[:5], scale, initial_state=h0, output_final_state=fs, cu_seqlens=cu,
                                  prep_only=prep_only, **gk(ins), **cfg)

    def fla_fwd(ins, cu=None, h0=None, fs=False):
        kw = {} if cu is None else dict(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
        return fla_chunk(*ins[:5], scale=scale, initial_state=h0, output_final_state=fs, safe_gate=True, **gk(ins),
                         **kw)

    # 0. fla warm-up at a tiny T (compile + autotune once)
    if fla_chunk is not None:
        ins = make(1, 256)
        _, secs = timed_first(lambda: fla_fwd(ins))
        add(dict(op="fla_warmup", T=256, first_call_s=secs))
        print(f"fla warm-up (compile + autotune at T=256): {secs:.1f} s", flush=True)

    # 1. accuracy vs the fp32 token loop: fla, our default forward, each prep sweep config; random and hard inputs
    B_acc, T_acc = (2, 2048) if not args.smoke else (1, 100)
    for case in () if args.bwd_only or args.no_accuracy else ("random", "hard"):
        if over():
            add(dict(op="accuracy_vs_fp32_loop", case=case, error="skipped: time budget"))
            continue
        ins = make(B_acc, T_acc, hard=case == "hard")
        h0 = torch.randn(B_acc, H, D, D, device=dev, generator=gen) * 0.1
        o_ref, s_ref = recurrent_kda(*(x.float() for x in ins[:5]), initial_state=h0, output_final_state=True,
                                     **gk(ins))
        acc = dict(op="accuracy_vs_fp32_loop", case=case, B=B_acc, T=T_acc, H=H, D=D)
        if fla_chunk is not None:
            try:
                o2, s2 = fla_fwd(ins, h0=h0, fs=True)
                acc.update(fla_o=rr(o2, o_ref), fla_S=rr(s2, s_ref))
            except Exception as e:  # noqa: BLE001
                acc["fla_error"] = repr(e)[:200]
        runs = [("fwd", {})] + [(f"prep[{n}]", dict(prep_cfg=ov)) for n, (ov, _, _) in sweep.items()
                                if n != "default"]
        for key, cfg in runs:
            if over():
                acc[f"{key}_skipped"] = "time budget"
                continue
            try:
                (o1, s1), secs = timed_first(lambda: ours_fwd(ins, cfg, h0=h0, fs=True))
                acc.update({f"{key}_o": rr(o1, o_ref), f"{key}_S": rr(s1, s_ref), f"{key}_first_call_s": secs})
            except Exception as e:  # noqa: BLE001
                acc[f"{key}_error"] = repr(e)[:300]
        add(acc)
        del ins, o_ref, s_ref

    # 2. per shape: fla, preps alone (the prep sweep), full forwards
    if args.smoke:
        shapes = [("B2_T200", 2, 200, None), ("varlen", 1, 300, [0, 1, 64, 65, 300])][:max(1, len(shape_names))]
    else:
        shapes = []
        for s in shape_names:
            B, T = SHAPES[s]
            cu_list = None
            if s == "varlen":
                g2 = torch.Generator().manual_seed(1)
                lens = torch.randint(256, 12000, (40,), generator=g2)
                lens = lens[: int((lens.cumsum(0) <= 65536 - 1).sum())]
                lens = torch.cat([lens, torch.tensor([1, 65536 - 1 - int(lens.sum())])])  # incl. a 1-token document
                cu_list = [0] + lens.cumsum(0).tolist()
            shapes.append((s, B, T, cu_list))

    def run_decode():
        """3. decode: one token, fp32 state [B, H, D, D] updated in place (run after the first shape)."""
        for B in [1, 64]:
            if over():
                add(dict(op="decode", B=B, error="skipped: time budget"))
                continue
            ins = make(B, 1)
            h0 = torch.randn(B, H, D, D, device=dev, generator=gen)
            st = h0.clone()
            row = dict(op="decode", B=B, H=H, D=D)
            try:
                if fla_rec is not None:
                    row["fla_ms"] = bench(lambda: fla_rec(*ins[:5], scale=scale, initial_state=h0,
                                                          output_final_state=True, **gk(ins)))
                bvs = [bv for bv in (16, 32, 64) if bv <= D]
                for bv in bvs:
                    row[f"ours_ms_bv{bv}"] = bench(lambda: ours.kda_recurrent_fwd(
                        *ins[:5], scale, initial_state=st, output_final_state=True, inplace=True, bv=bv, **gk(ins)))
                best = min(row[f"ours_ms_bv{bv}"] for bv in bvs)
                row["ours_ms"] = best
                if "fla_ms" in row:
                    row["speedup"] = row["fla_ms"] / best
                row["ours_state_TBps"] = 2 * h0.numel() * 4 / (best * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:300]
            add(row)

    prep_rank = []  # prep sweep names by prep time at the first shape
    for si, (name, B, T, cu_list) in enumerate([] if args.bwd_only else shapes):
        if over():
            add(dict(op="chunk_fwd", shape=name, error="skipped: time budget"))
            continue
        cu = None if cu_list is None else torch.tensor(cu_list, device=dev)
        tok_heads = B * T * H
        floor_ms = tok_heads * (4 * D * 2 + 2 + D * 2) / (HBM_TBPS * 1e12) * 1e3
        prep_floor_ms = tok_heads * (8 * D * 2 + 2 + 16 * 2 + D * 4 / 16) / (HBM_TBPS * 1e12) * 1e3
        row = dict(op="chunk_fwd", shape=name, B=B, T=T, H=H, D=D,
                   nseq=(len(cu_list) - 1 if cu_list else B), mem_floor_ms=floor_ms, prep_mem_floor_ms=prep_floor_ms)
        ins = make(B, T)
        o_fla = None
        if fla_chunk is not None:
            try:
                o_fla = fla_fwd(ins, cu=cu)[0]
                row["fla_ms"] = bench(lambda: fla_fwd(ins, cu=cu))
            except Exception as e:  # noqa: BLE001
                row["fla_error"] = repr(e)[:200]
        # 2b. prep sweep: prep alone and full forward per config
        if True:
            names = list(sweep) if si == 0 else list(dict.fromkeys(["default"] + prep_rank[:args.top]))
            prep, full = {}, {}
            for n in names:
                if over():
                    row[f"prep[{n}]_skipped"] = "time budget"
                    continue
                cc = dict(prep_cfg=sweep[n][0])
                try:
                    _, secs = timed_first(lambda: ours_fwd(ins, cc, cu=cu, prep_only=True))
                    prep[n] = bench(lambda: ours_fwd(ins, cc, cu=cu, prep_only=True))
                    row[f"prep[{n}]_prep_ms"] = prep[n]
                    row[f"prep[{n}]_prep_kernel"] = dict(ours.kernel_info("prep"), first_call_s=secs)
                    o_v = ours_fwd(ins, cc, cu=cu)[0]
                    if o_fla is not None:
                        row[f"prep[{n}]_vs_fla_rrmse"] = rr(o_v, o_fla)
                    del o_v
                    full[n] = bench(lambda: ours_fwd(ins, cc, cu=cu))
                    row[f"prep[{n}]_ms"] = full[n]
                    if "fla_ms" in row:
                        row[f"prep[{n}]_speedup"] = row["fla_ms"] / full[n]
                except Exception as e:  # noqa: BLE001
                    row[f"prep[{n}]_error"] = repr(e)[:300]
            if si == 0 and prep:
                prep_rank = sorted(prep, key=prep.get)
                row["prep_rank"] = prep_rank
            if prep:
                bn = min(prep, key=prep.get)
                row["prep_best"] = bn
                row["prep_best_ms"] = prep[bn]
                row["prep_best_floor_frac"] = prep_floor_ms / prep[bn]
            if full:
                bn = min(full, key=full.get)
                row["prep_best_full"] = bn
                row["prep_best_full_ms"] = full[bn]
        # 2c. the default full forward (the sweep above has the other prep configs)
        for v in variants:
            cfgs = [{}]
            times = {}
            for c in cfgs:
                if over():
                    row[f"{v}_skipped"] = "time budget"
                    break
                try:
                    o_v, secs = timed_first(lambda: ours_fwd(ins, c, cu=cu)[0])
                    if o_fla is not None and f"{v}_vs_fla_rrmse" not in row:
                        row[f"{v}_vs_fla_rrmse"] = rr(o_v, o_fla)
                    del o_v
                    times[cfg_name(c)] = bench(lambda: ours_fwd(ins, c, cu=cu))
                    row[f"{v}_first_call_s[{cfg_name(c)}]"] = secs
                except Exception as e:  # noqa: BLE001
                    row[f"{v}_error[{cfg_name(c)}]"] = repr(e)[:300]
            if times:
                bname = min(times, key=times.get)
                row[f"{v}_ms"] = times[bname]
                row[f"{v}_cfg"] = bname
                row[f"{v}_all_ms"] = times
                row[f"{v}_floor_frac"] = floor_ms / times[bname]
                if "fla_ms" in row:
                    row[f"{v}_speedup"] = row["fla_ms"] / times[bname]
        # 2d. walk option sets (STATE_SWEEP) at the first shape (or every one)
        if (si == 0 or args.state_every_shape) and state_sweep:
            try:
                ours_fwd(ins, {}, cu=cu, prep_only=True)
                prep_ms = bench(lambda: ours_fwd(ins, {}, cu=cu, prep_only=True))
                row["state_prep_ms"] = prep_ms
            except Exception as e:  # noqa: BLE001
                prep_ms = None
                row["state_prep_error"] = repr(e)[:200]
            st = {}
            for n, (ov, pred, _) in state_sweep.items():
                if over():
                    row[f"state[{n}]_skipped"] = "time budget"
                    continue
                cc = dict(state_cfg=ov)
                try:
                    o_v, secs = timed_first(lambda: ours_fwd(ins, cc, cu=cu)[0])
                    if o_fla is not None:
                        row[f"state[{n}]_vs_fla_rrmse"] = rr(o_v, o_fla)
                    del o_v
                    st[n] = bench(lambda: ours_fwd(ins, cc, cu=cu))
                    row[f"state[{n}]_fwd_ms"] = st[n]
                    if "fla_ms" in row:
                        row[f"state[{n}]_speedup"] = row["fla_ms"] / st[n]
                    if prep_ms is not None:
                        row[f"state[{n}]_seq_ms"] = st[n] - prep_ms
                    row[f"state[{n}]_predicted_seq_ms"] = pred
                    row[f"state[{n}]_kernel"] = dict(ours.kernel_info("state"), first_call_s=secs)
                except Exception as e:  # noqa: BLE001
                    row[f"state[{n}]_error"] = repr(e)[:300]
            if st:
                bn = min(st, key=st.get)
                row["state_best"], row["state_best_fwd_ms"] = bn, st[bn]
        add(row)
        del ins, o_fla
        if dev == "cuda":
            torch.cuda.empty_cache()
        if si == 0 and args.decode:
            run_decode()

    # 4. fwd+bwd (the backend's forward and backward) vs fla
    if args.bwd or args.bwd_only:
        # every requested shape, one sequence of T tokens for the fixed ones (B1 T8K / T32K / T128K) and the whole
        # varlen batch (the fp32 backward scratch at B8 T8K would be ~43 GB next to fla's buffers)
        for name, B, T, cu_list in shapes:
            if over():
                add(dict(op="chunk_fwd_bwd", shape=name, error="skipped: time budget"))
                continue
            Bb = 1 if cu_list is None else B
            cu = None if cu_list is None else torch.tensor(cu_list, device=dev)
            rowb = dict(op="chunk_fwd_bwd", shape=name, B=Bb, T=T, H=H, D=D)
            try:
                ins = make(Bb, T, grad=True)
                do = torch.randn(Bb, T, H, D, device=dev, dtype=torch.bfloat16)

                def no_grads():
                    # each call's input grads land in fresh tensors on both sides: no accumulation add, and no
                    # second set of 16 GB grads live at T128K (eleventh session; before, both sides included a
                    # grad += add of ~0.55 ms at B1 T8K)
                    for x in ins:
                        x.grad = None

                def fb_ours():
                    no_grads()
                    chunk_kda_triton(*ins[:5], scale=scale, cu_seqlens=cu, **gk(ins))[0].backward(do)

                def fb_fla():
                    no_grads()
                    fla_fwd(ins, cu=cu)[0].backward(do)
                if fla_chunk is not None:
                    rowb["fla_fwdbwd_ms"] = bench_fb(fb_fla)
                    if dev == "cuda":
                        torch.cuda.empty_cache()
                        no_grads()
                        rowb["fla_peak_gb"] = peak_gb(fb_fla)
                rowb["ours_fwdbwd_ms"] = bench_fb(fb_ours)
                # the forward alone as training runs it (gradients on: tensors saved, final state stored), so
                # fwd+bwd splits into its two halves on both sides (seventeenth session)
                rowb["ours_fwd_ms"] = bench_fb(lambda: chunk_kda_triton(*ins[:5], scale=scale, cu_seqlens=cu, **gk(ins)))
                if fla_chunk is not None:
                    rowb["fla_fwd_ms"] = bench_fb(lambda: fla_fwd(ins, cu=cu))
                for label, env in (json.loads(args.ours_envs) if args.ours_envs else {}).items():
                    old_env = {n: os.environ.get(n) for n in env}
                    os.environ.update({n: str(x) for n, x in env.items()})
                    try:
                        rowb[f"ours_fwdbwd_ms[{label}]"] = bench_fb(fb_ours)
                        rowb[f"ours_fwd_ms[{label}]"] = bench_fb(
                            lambda: chunk_kda_triton(*ins[:5], scale=scale, cu_seqlens=cu, **gk(ins)))
                        if dev == "cuda":
                            no_grads()
                            rowb[f"ours_peak_gb[{label}]"] = peak_gb(fb_ours)
                    except Exception as e:  # noqa: BLE001
                        rowb[f"ours_error[{label}]"] = repr(e)[:300]
                    finally:
                        for n, x in old_env.items():
                            if x is None:
                                os.environ.pop(n, None)
                            else:
                                os.environ[n] = x
                    print(f"{name} [{label}]: fwd+bwd {rowb.get(f'ours_fwdbwd_ms[{label}]')} ms, forward "
                          f"{rowb.get(f'ours_fwd_ms[{label}]')}, peak {rowb.get(f'ours_peak_gb[{label}]')} GB",
                          flush=True)
                if dev == "cuda":
                    no_grads()
                    rowb["ours_peak_gb"] = peak_gb(fb_ours)
                if "fla_fwdbwd_ms" in rowb:
                    rowb["speedup_fwdbwd"] = rowb["fla_fwdbwd_ms"] / rowb["ours_fwdbwd_ms"]
                if dev == "cuda":  # where the time goes, kernel by kernel (one fwd+bwd under torch.profiler)
                    try:
                        rowb["ours_kernels_ms"] = kernel_breakdown(fb_ours)
                        if fla_chunk is not None:
                            rowb["fla_kernels_ms"] = kernel_breakdown(fb_fla)
                    except Exception as e:  # noqa: BLE001 - keep the timings above
                        rowb["kernels_error"] = repr(e)[:300]
            except Exception as e:  # noqa: BLE001
                rowb["error"] = repr(e)[:300]
            add(rowb)
            if dev == "cuda":
                torch.cuda.empty_cache()

    res["total_s"] = round(time.time() - t_start, 1)
    save()
    summary(res, variants, sweep, H, D)
    print(f"total {res['total_s']} s; json: {args.json}")


def peak_gb(fn) -> float:
    """Peak CUDA memory allocated (GB) during one call of fn (fwd + bwd: saved tensors, scratch, the input grads it
    leaves), above what was allocated before it."""
    import torch
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 1e9, 2)


def kernel_breakdown(fn, top: int = 12) -> dict:
    """CUDA time (ms) per kernel name of one call of fn (after one warm-up call), largest first: the
    per-kernel split a fwd+bwd comparison needs before any redesign (docs/LOG.md, third session)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    tot = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if us > 0:
            tot[ev.key[:80]] = tot.get(ev.key[:80], 0.0) + us / 1e3
    return dict(sorted(tot.items(), key=lambda kv: -kv[1])[:top])


def print_rows(first: str, keys, rows: dict) -> None:
    """A markdown table: one row per name, the keys as columns ('-' where missing; the error where there is one)."""
    print(f"| {first} | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for n, r in rows.items():
        print(f"| {n} | " + (" | ".join(str(r.get(k, "-")) for k in keys) if "error" not in r else r["error"]) + " |")


def static_report(sweep, json_path=None, H=96, D=128):
    """--static (no GPU needed): compile every prep sweep config for sm_90 with triton's bundled
    ptxas (B8 T8K-like arguments, bf16, fused gate + L2 norm) and print registers, spill stack, shared memory,
    resident programs / chunks / warps per SM, and SASS counts per 16-token chunk (warp-instructions summed over the
    program's warps; MUFU, MMA and barriers per program). The K-block loops are unrolled, so counts are per chunk
    as executed (the LOOP loop's body is counted once)."""
    import triton
    from k3.ops.kda.triton import fwd as ours
    from k3.ops.kda.triton.intra_fwd import kda_intra_wy_fwd_kernel
    from k3.ops.triton_sm90 import compile_sm90, stats

    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    sig = dict(q=bf, k=bf, v=bf, g=bf, beta=bf, A_log=f32, dt_bias=f32, qg_out=bf, kd_out=bf, w_out=bf, u_out=bf,
               aqk_out=bf, eg_out=f32, chunk_tok=i32, chunk_end=i32, NC="i32", NP="i32", Tseq="i32", NCT="i32",
               T0="i32", scale="fp32", lower_bound="fp32", Ttot="i32")

    def build(fn, consts, launch):
        return compile_sm90(fn, consts, sig, **launch)

    def measure(ck, nw, c):
        st = stats(ck, nw)
        ops_ = st["ops"]
        cta = st["cta_per_SM"]
        return dict(regs=st["regs"], spill_stack_B=st["stack_B"], smem_KB=round(st["smem_B"] / 1024, 1),
                    cta_per_SM=cta, chunks_per_SM=cta * c, warps_per_SM=cta * nw,
                    warp_instr_per_chunk=round(st["n_instr"] * nw / c),
                    mufu_per_chunk=round(ops_["MUFU"] * nw / c), mma_per_chunk=round(ops_["HMMA"] * nw / c),
                    bar_per_program=ops_["BAR"])

    rows = {}
    for n, (ov, _, _) in sweep.items():
        cfg = ours.prep_config(ov)
        consts, launch = ours.prep_meta(cfg, H, D, D, varlen=False, USE_GATE=True, L2NORM=True)
        try:
            rows[f"prep[{n}]"] = measure(build(kda_intra_wy_fwd_kernel, consts, launch), launch["num_warps"],
                                         cfg["c"])
        except Exception as e:  # noqa: BLE001
            rows[f"prep[{n}]"] = dict(error=repr(e)[:300])
    keys = ["regs", "spill_stack_B", "smem_KB", "cta_per_SM", "chunks_per_SM", "warps_per_SM",
            "warp_instr_per_chunk", "mufu_per_chunk", "mma_per_chunk", "bar_per_program"]
    print(f"static sm_90 compile (triton {triton.__version__}), H={H} D={D} bf16")
    print_rows("prep", keys, rows)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(dict(triton=triton.__version__, H=H, D=D, rows=rows), fh, indent=1)


# Walk option sets (fwd.STATE_CFG_DEFAULT keys), timed after the forward rows at the first shape (the walk time is the
# full forward minus the prep alone in the same run). The "v2" walk kernel's sets (kernel / ch / prefetch / out_late /
# fold) were removed with the kernel (best 4.08 ms vs base_s3 3.94 at B8 T8K, third session: docs/LOG.md).
# Predicted walk ms at B8 T8K H96 D128 bf16 (measured 4.6 ms with the old 2-stage default); the basis is
# `--static` (triton 3.9 sm_90 compile on a CPU): registers/spills, programs per SM and a one-warp in-order issue
# simulation of the loop body's SASS (fixed latencies, STATE_LAT) -> cycles per 16-token step, then
#   t = waves * 512 steps * max(sim cycles, resident programs * issue cycles of one program) / 1.755 GHz * CAL
# with CAL fitted so that the measured "base" row (BV 128, 4 warps, 2 stages) gives 4.6 ms. Ranges about +-40%.
STATE_SWEEP = [
    ("base", dict(num_stages=2), 4.6, "kda_state_output_fwd_kernel, BV 128, 4 warps, 2 stages (measured ~4.6 ms, "
     "2026-11-30)"),
    ("base_w8", dict(num_warps=8), 8.2, "BV 128 on 8 warps: the [128, 128] fp32 state is 64 registers a thread, "
     "no spill (4 warps: 255 registers + 184 B spill stack)"),
    ("base_w8_s3", dict(num_warps=8, num_stages=3), 5.9, "+ a 3-stage cp.async pipeline (loads 2 steps ahead)"),
    ("base_bv64_w4", dict(bv=64, num_warps=4), 6.4, "BV 64 on 4 warps (1,536 programs; K-wide tiles read twice)"),
]
# long sequences (B x H < 2 x SMs): more, smaller value blocks (fourth session), e.g.
#   --state-configs long_bv32_s3,long_bv64_s3,long_bv16_s3,base_s3 --shapes B1_T128K,B2_T32K
STATE_SWEEP += [
    ("long_bv16_s3", dict(bv=16, num_stages=3), None, "BV 16: 4x the programs of BV 64 at N*H = 192, 2x of BV 32"),
    ("long_bv16_w2_s3", dict(bv=16, num_warps=2, num_stages=3), None, "BV 16 on 2 warps: more programs per SM"),
    ("long_bv64_s3", dict(bv=64, num_stages=3), None, "BV 64 (the pick at N*H = 192): control"),
    ("long_bv32_s3", dict(bv=32, num_stages=3), None, "BV 32 (the pick at N*H = 96): control"),
]
STATE_SWEEP += [
    ("base_s3", dict(num_stages=3), 3.3, "base with a 3-stage cp.async pipeline (loads two steps ahead): best of the "
     "static grid"),
    ("base_w8_r128", dict(num_warps=8, maxnreg=128), 5.4, "8 warps capped at 128 registers: 2 programs per SM"),
]
STATE_SWEEP += [  # eighth session: prep of piece p + 1 overlapped with the walk of piece p (ops `pipe`); predicted
    # from the fifth session's split (B1 T128K: prep 12.8 + walk ~11 ms; B2 T32K ~6.4 + 5.6; B8 T8K ~6.4 + 4.0) as
    # max(prep + last walk piece, first prep piece + walk) plus ~15% for the two kernels sharing SMs and memory
    ("nopipe", dict(pipe=0, num_stages=3), None, "not pipelined (control; the default pipelines sequences > 8K)"),
    ("pipe1k", dict(pipe=1024, num_stages=3), None, "1,024-token pieces (B1 T8K: 8 pieces; sixteenth session)"),
    ("pipe2k", dict(pipe=2048, num_stages=3), None, "2,048-token pieces (B8 T8K: 4 pieces; predicted ~8 ms)"),
    ("pipe4k", dict(pipe=4096, num_stages=3), None, "4,096-token pieces (B2 T32K: 8; predicted ~7.5 ms)"),
    ("pipe8k", dict(pipe=8192, num_stages=3), None, "8,192-token pieces (B1 T128K: 16; predicted ~15 ms)"),
    ("pipe16k", dict(pipe=16384, num_stages=3), None, "16,384-token pieces (B1 T128K: 8)"),
    ("pipe8k_bv64", dict(pipe=8192, bv=64, num_stages=3), None, "8,192-token pieces, BV 64 (half the walk programs, "
     "more SM room for the prep)"),
    ("pipe8k_lpt", dict(pipe=8192, lpt=True, num_stages=3), None, "8,192-token pieces, longest documents' walks "
     "first (varlen)"),
    ("pipe4k_lpt", dict(pipe=4096, lpt=True, num_stages=3), None, "4,096-token pieces, longest first (varlen)"),
    # seventeenth session: longest first became real (a sequence-major grid; before, the sort acted inside each head's
    # group of programs only) and the default at varlen; these are the grid-order controls
    ("nopipe_grid", dict(pipe=0, lpt=False, num_stages=3), None, "not pipelined, walks in grid order"),
    ("pipe8k_grid", dict(pipe=8192, lpt=False, num_stages=3), None, "8,192-token pieces, walks in grid order"),
    ("nopipe_bv64", dict(pipe=0, bv=64, num_stages=3), None, "not pipelined, BV 64 (twice the walk programs)"),
]
STATE_ORDER = ["base", "base_s3", "base_w8_r128", "base_w8_s3", "base_bv64_w4", "base_w8"]
SMOKE_STATE = ["base", "base_s3", "pipe1k"]
# fixed latencies (cycles) of the one-warp SASS simulation in --static (assumed, not measured)
STATE_LAT = dict(global_=600, shared=30, local=30, hmma=32, hmma_interval=8, hgmma_per_n=1, mufu=20, alu=6, bar=20)


def _sass_body(sass):
    """Instructions [(addr, opcode, operands)] of the longest loop (backward branch) of the first kernel in SASS."""
    import re
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Za-z0-9_]+)*)\s*([^;]*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4), m.group(5).strip()))
    best = None
    for a, op, mods, opd in ins:
        if op == "BRA":
            t = re.match(r"(?:`\()?(?:\.L_x_\d+\)?)?\s*0x([0-9a-f]+)", opd)
            if t and int(t.group(1), 16) < a and (best is None or a - int(t.group(1), 16) > best[1] - best[0]):
                best = (int(t.group(1), 16), a)
    if best is None:
        return ins, []
    return ins, [x for x in ins if best[0] <= x[0] <= best[1]]


def _regs(tok, width):
    import re
    m = re.match(r"-?\|?(U?R)(\d+)", tok)
    if not m or tok.startswith("RZ") or tok.startswith("URZ"):
        return []
    return [f"{m.group(1)}{int(m.group(2)) + i}" for i in range(width)]


def _sim_body(body, nw, reps=4):
    """One warp's in-order issue through `reps` copies of the loop body with register scoreboarding and fixed
    latencies (STATE_LAT): cp.async groups (LDGSTS/LDGDEPBAR/DEPBAR), HMMA pipe interval (x warps per scheduler),
    HGMMA serialised on the tensor pipe until WARPGROUP.DEPBAR, BAR.SYNC after the warp's shared stores. Returns
    cycles per loop iteration (steady state: iterations 3-4)."""
    import re
    L = STATE_LAT
    ready, t, hmma_free, pipe_free = {}, 0, 0, 0
    groups, pend_async, gmma_done, smem_done = [], 0, 0, 0
    ends = []
    share = max(1, nw // 4)
    for _ in range(reps):
        for _a, op, mods, opd in body:
            ops_ = [x.strip() for x in opd.split(",")] if opd else []
            w = 4 if ".128" in mods else 2 if ".64" in mods else 1
            store = op.startswith("ST") or op in ("RED", "LDGSTS", "BAR", "BRA", "WARPGROUP", "DEPBAR", "LDGDEPBAR",
                                                   "MEMBAR", "FENCE", "NOP", "EXIT", "UTMALDG", "SYNCS")
            dst = [] if store or not ops_ else ops_[0]
            srcs = ops_ if store else ops_[1:]
            if op == "HMMA":
                dw, sw = 4, [4, 2, 4]
            elif op == "LDSM":
                dw, sw = (4 if mods.endswith(".4") else 2 if mods.endswith(".2") else 1), []
            elif op == "HGMMA":
                n = int(re.search(r"64x(\d+)x", mods).group(1))
                dw, sw = n // 2, [n // 2] * 3
            else:
                dw, sw = w, [w] * len(srcs)
            dregs = _regs(dst, dw) if dst else []
            sregs = [r for tok, ww in zip(srcs, sw + [1] * len(srcs)) for r in _regs(tok, ww)]
            if store:
                sregs = [r for tok in srcs for r in _regs(tok, w)]
            issue = max([t + 1] + [ready.get(r, 0) for r in sregs])
            lat = L["alu"]
            if op == "DEPBAR":
                m = re.search(r"0x([0-9a-f]+)", opd)
                keep = int(m.group(1), 16) if m else 0
                waitfor = groups[:len(groups) - keep] if keep else groups
                issue = max([issue] + waitfor)
                groups = groups[len(groups) - keep:] if keep else []
            elif op == "LDGSTS":
                pend_async = max(pend_async, issue + L["global_"])
            elif op == "LDGDEPBAR":
                groups.append(pend_async)
                pend_async = 0
            elif op == "BAR":
                issue = max(issue, smem_done) + L["bar"]
            elif op == "WARPGROUP" and "DEPBAR" in mods:
                issue = max(issue, gmma_done)
            elif op == "HGMMA":
                start = max(issue, pipe_free)
                pipe_free = start + n * L["hgmma_per_n"]
                gmma_done = pipe_free
                for r in dregs:
                    ready[r] = 1 << 40  # until the WARPGROUP.DEPBAR
            elif op == "HMMA":
                start = max(issue, hmma_free)
                hmma_free = start + L["hmma_interval"] * share
                lat = start - issue + L["hmma"]
            elif op in ("LDG", "LDC") or op.startswith("LDG"):
                lat = L["global_"] if op == "LDG" else L["shared"]
            elif op in ("LDS", "LDSM", "SHFL", "S2R"):
                lat = L["shared"]
            elif op in ("LDL", "STL"):
                lat = L["local"]
            elif op == "MUFU":
                lat = L["mufu"]
            if op in ("STS", "STSM", "STL"):
                smem_done = max(smem_done, issue + L["shared"])
            t = issue
            if op == "WARPGROUP" and "DEPBAR" in mods:
                for r, v in list(ready.items()):
                    if v == 1 << 40:
                        ready[r] = issue
            elif op != "HGMMA":
                for r in dregs:
                    ready[r] = issue + lat
        ends.append(t)
    return (ends[-1] - ends[-3]) / 2 if len(ends) >= 3 else float("nan")


def state_static_report(state_sweep, json_path=None, H=96, D=128, grid=True):
    """--static, the walk: compile kda_state_output_fwd_kernel for every BV in (32, 64, 128) x num_warps (4, 8) x
    num_stages (1, 2, 3) (grid=True) and every STATE_SWEEP option set for sm_90, and print registers, spill stack,
    shared memory, programs per SM, SASS of the loop body per 16-token step (warp-instructions of one program, HMMA
    (mma.sync) and HGMMA (wgmma) per warp, MUFU, BAR, local spill loads/stores), the one-warp simulated cycles per
    step (see _sim_body) and the modelled sequential ms at B8 T8K (see STATE_SWEEP)."""
    import collections
    import math
    import triton
    from k3.ops.kda.triton import fwd as ours
    from k3.ops.kda.triton.state_fwd import kda_state_output_fwd_kernel
    from k3.ops.triton_sm90 import compile_sm90, sass, stats

    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    sig = dict(qg=bf, kd=bf, w=bf, u=bf, aqk=bf, eg=f32, o=bf, h0=f32, ht=f32, cu=i32, seq_chunk=i32, Ttot="i32",
               states=bf, uns=bf, save_chunk=i32, save_off="i32")
    N, nc, ghz, n_sm = 8, 512, 1.755, 132

    def one(scfg):
        bv = scfg["bv"] or 128
        launch = ours.state_launch(scfg, bv, D)
        nw, ch = launch["num_warps"], 1
        consts = dict(H=H, K=D, V=D, BT=16, BV=bv, HAS_H0=True, STORE_HT=True, SAVE=0)
        ck = compile_sm90(kda_state_output_fwd_kernel, consts, sig, **launch)
        st = stats(ck, nw)
        _, body = _sass_body(sass(ck))
        cnt = collections.Counter(op for _, op, _, _ in body)
        regs, stack, shared, cta = st["regs"], st["stack_B"], st["smem_B"], st["cta_per_SM"]
        sim = _sim_body(body, nw) / ch
        issue = len(body) * nw / 4 / ch  # cycles of the 4 schedulers one program's step takes
        progs = N * H * (D // bv)
        waves = math.ceil(progs / (n_sm * cta))
        per_sm = min(cta, math.ceil(progs / n_sm))
        model = waves * nc * max(sim, per_sm * issue) / ghz / 1e6
        return dict(bv=bv, warps=nw, stages=launch["num_stages"], regs=regs, spill_stack_B=stack,
                    smem_KB=round(shared / 1024, 1), cta_per_SM=cta, programs=progs, waves=waves,
                    warp_instr_per_step=round(len(body) * nw / ch), hmma_per_warp_step=round(cnt["HMMA"] / ch, 1),
                    hgmma_per_step=round(cnt["HGMMA"] / ch, 1), mufu_per_warp_step=round(cnt["MUFU"] / ch, 1),
                    bar_per_step=round(cnt["BAR"] / ch, 1), ldl_stl_per_warp_step=round((cnt["LDL"] + cnt["STL"]) / ch, 1),
                    ldgsts_ldg_per_warp_step=round((cnt["LDGSTS"] + cnt["LDG"]) / ch, 1),
                    sim_cycles_per_step=round(sim), issue_cycles_per_step=round(issue), model_ms_raw=model)

    rows = {}
    cfgs = []
    if grid:
        cfgs += [(f"grid bv{bv} w{nw} s{ns}", dict(bv=bv, num_warps=nw, num_stages=ns))
                 for bv in (128, 64, 32) for nw in (4, 8) for ns in (1, 2, 3)]
    cfgs += [(f"sweep {n}", ov) for n, (ov, _, _) in state_sweep.items()]
    for name, ov in cfgs:
        try:
            rows[name] = one(ours.state_config(ov))
        except Exception as e:  # noqa: BLE001
            rows[name] = dict(error=repr(e)[:300])
        print(name, rows[name], flush=True)
    ref = rows.get("sweep base") or one(ours.state_config({}))
    cal = 4.6 / ref["model_ms_raw"] if ref.get("model_ms_raw") else float("nan")
    for r in rows.values():
        if "model_ms_raw" in r:
            r["model_ms"] = round(r["model_ms_raw"] * cal, 2)
    keys = ["bv", "warps", "stages", "regs", "spill_stack_B", "smem_KB", "cta_per_SM", "waves", "warp_instr_per_step",
            "hmma_per_warp_step", "hgmma_per_step", "mufu_per_warp_step", "bar_per_step", "ldl_stl_per_warp_step",
            "ldgsts_ldg_per_warp_step", "sim_cycles_per_step", "issue_cycles_per_step", "model_ms"]
    print(f"\nstatic sm_90 compile of the sequential pass (triton {triton.__version__}), H={H} D={D} bf16, "
          f"B8 T8K model (calibration x{cal:.2f} so that 'base' = 4.6 ms)")
    print_rows("config", keys, rows)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(dict(triton=triton.__version__, H=H, D=D, calibration=cal, lat=STATE_LAT, rows=rows), fh,
                      indent=1)
    return rows


def summary(res, variants, sweep, H, D):
    """Markdown tables: accuracy, the prep sweep (prep alone and full forward per shape), the variants."""
    nan = float("nan")
    rows = res["rows"]
    fwd = [r for r in rows if r["op"] == "chunk_fwd" and "error" not in r]
    acc = {r["case"]: r for r in rows if r["op"] == "accuracy_vs_fp32_loop" and "error" not in r}
    fb = [r for r in rows if r["op"] == "chunk_fwd_bwd" and "error" not in r]
    if fb:  # (--bwd-only / --bwd)
        print(f"\nH={H} D={D} bf16. Forward + backward, ms (fla in the same process; peak = memory allocated during "
              "one fwd+bwd)")
        print("| shape | fla | ours | ours / fla speed | forward alone fla / ours | peak GB fla / ours |")
        print("|---|---|---|---|---|---|")
        for r in fb:
            print(f"| {r['shape']} (run at B{r.get('B')} T{r.get('T')}) | {r.get('fla_fwdbwd_ms', nan):.2f} | "
                  f"{r.get('ours_fwdbwd_ms', nan):.2f} | {r.get('speedup_fwdbwd', nan):.3f}x | "
                  f"{r.get('fla_fwd_ms', nan):.2f} / {r.get('ours_fwd_ms', nan):.2f} | "
                  f"{r.get('fla_peak_gb', nan)} / {r.get('ours_peak_gb', nan)} |")
    if acc:
        print(f"\nH={H} D={D} bf16. Accuracy: rel. RMSE of o / final state vs the fp32 token loop "
              f"({', '.join(acc)} inputs)")
        keys = ["fla"] + list(variants) + [f"prep[{n}]" for n in sweep if n != "default"]
        print("| run | " + " | ".join(acc) + " |")
        print("|---|" + "---|" * len(acc))
        for key in keys:
            cells = [f"{a.get(key + '_o', nan):.2e} / {a.get(key + '_S', nan):.2e}" for a in acc.values()]
            print(f"| {key} | " + " | ".join(cells) + " |")
    if sweep and any("prep_best" in r for r in fwd):
        print("\nPrep kernel alone / full forward, ms (regs/spills at the first shape)")
        print("| prep | predicted prep | " + " | ".join(f"{r['shape']} prep | {r['shape']} fwd" for r in fwd)
              + " | regs/spills |")
        print("|---|---|" + "---|---|" * len(fwd) + "---|")
        first = fwd[0]
        for n, (_, pred, _) in sweep.items():
            cells = " | ".join(f"{r.get(f'prep[{n}]_prep_ms', nan):.2f} | {r.get(f'prep[{n}]_ms', nan):.2f}"
                               for r in fwd)
            ki = first.get(f"prep[{n}]_prep_kernel", {})
            print(f"| prep[{n}] | {pred if pred is not None else '-'} | {cells} | "
                  f"{ki.get('n_regs', '-')}/{ki.get('n_spills', '-')} |")
    if fwd:
        print("\nFull forward, ms (best config); fla in the same run")
        print("| shape | fla | " + " | ".join(variants) + " | best prep config | best speedup vs fla |")
        print("|---|---|" + "---|" * len(variants) + "---|---|")
    for r in fwd:
        ms = {v: r.get(f"{v}_ms", nan) for v in variants}
        if "prep_best_full_ms" in r:
            ms["prep*"] = r["prep_best_full_ms"]
        ok = {v: t for v, t in ms.items() if t == t}
        bv = min(ok, key=ok.get) if ok else None
        cells = " | ".join(f"{ms[v]:.2f} ({r.get(f'{v}_cfg', '-')})" for v in variants)
        best = r.get("fla_ms", nan) / ok[bv] if bv else nan
        print(f"| {r['shape']} | {r.get('fla_ms', nan):.2f} | {cells} | "
              f"{r.get('prep_best_full', '-')} {r.get('prep_best_full_ms', nan):.2f} | {best:.2f} ({bv}) |")
    if fwd and any(k.startswith("state[") and k.endswith("_fwd_ms") for k in fwd[0]):
        r = fwd[0]
        print(f"\nWalk options ({r['shape']}): full forward, walk = forward - prep alone "
              f"({r.get('state_prep_ms', nan):.2f} ms), predicted walk")
        print("| state_cfg | fwd ms | seq ms | predicted seq ms | regs/spills | vs fla |")
        print("|---|---|---|---|---|---|")
        for k in [k for k in r if k.startswith("state[") and k.endswith("_fwd_ms")]:
            n = k[6:-8]
            ki = r.get(f"state[{n}]_kernel", {})
            print(f"| {n} | {r[k]:.2f} | {r.get(f'state[{n}]_seq_ms', nan):.2f} | "
                  f"{r.get(f'state[{n}]_predicted_seq_ms', '-')} | {ki.get('n_regs', '-')}/{ki.get('n_spills', '-')} | "
                  f"{r.get(f'state[{n}]_vs_fla_rrmse', nan):.1e} |")
    for r in rows:
        if r["op"] == "decode":
            print(f"decode B{r['B']}: fla {r.get('fla_ms', nan):.4f} ms, ours {r.get('ours_ms', nan):.4f} ms, "
                  f"state {r.get('ours_state_TBps', nan):.2f} TB/s {r.get('error', '')}")
        elif r["op"] not in ("chunk_fwd", "chunk_fwd_bwd", "accuracy_vs_fp32_loop") or "error" in r:
            print(r)


if __name__ == "__main__":
    main()
