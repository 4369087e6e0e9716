"""KDA forward on one GPU: every variant of our Triton forward (k3.ops.kda.triton.ops.FWD_VARIANTS) vs fla
chunk_kda(safe_gate=True, lower_bound=-5, in-kernel gate and q/k L2 norm), plus decode; fwd+bwd behind --bwd.

One command, about 6 minutes on a fresh H200 including compiles; rows are appended to --json as they are measured
and --budget-s skips whatever is left. In order:
0. fla warm-up at a tiny T (its autotune keys do not depend on T); prints how long it took.
1. Accuracy, B1 T1024 H96 D128 bf16, varlen [1, 299, 724], initial state: each variant (default config) and fla vs
   the fp32 token loop (relative RMSE of o and of the final state), and each variant's first-call seconds.
2. Forward at H96 D128 bf16, ~64K tokens per call: B8 T8K, a varlen batch of mixed lengths, B2 T32K, B1 T128K.
   Per shape: fla; the parallel prep kernel alone (c16, c64*); every variant over a short config list at the
   first shape, then its best config and its heuristic default at the others; each variant's o vs fla's; and the
   fraction of the memory floor (q, k, v, g, beta read + o written once, at 4.8 TB/s).
3. Decode (one token, fp32 state updated in place), B1 and B64: ours vs fla fused_recurrent_kda (run right after
   the first forward shape, so a budget cut does not drop it).
4. --bwd: fwd+bwd at B1 T8K and varlen (default forward variant + the backend's backward) vs fla.
--smoke: the same plumbing on CPU under TRITON_INTERPRET=1 with tiny shapes: checks that the script runs, not
speed. fla is skipped (with a warning) wherever it does not import.

Variants (design in k3/ops/kda/triton/__init__.py) and predictions for the forward at B8 T8K H96 D128 bf16
(fla 19.7 ms and c16 17.2 ms were measured on 2026-11-30; memory floor 1.7 ms at 4.8 TB/s):
- c16 (two kernels, 16-token steps): 17.2 ms (measured). The sequential pass takes 512 dependent steps per
  sequence, each a chain of small M=16 dots: latency-bound.
- c64 (prep on 64-token chunks + the same sequential pass on 64-token steps): predict 7.5 ms (6-10), 2.6x fla.
  Prep reads 1026 B and writes 1152 B per token-head (qg, kd, W, U at 256 B, Aqk at 128 B): 13.7 GB, ~3.5 ms at
  ~3.9 TB/s, with ~2 ms of exp/FMA/mma work overlapped -> ~4.5 ms. Sequential pass: 4x fewer, M=64 (wgmma)
  steps; reads ~1.4 KB per token-head (value blocks re-read the K-wide tiles from L2) -> ~2.3 ms, 0.7 TFLOP of
  dots, ~1.5 us dependent chain per step hidden by 1-3 programs per SM -> ~3 ms.
- c64s (prep, lean sequential pass storing every 64-token state and u', chunk-parallel output): predict 9.5 ms.
  Same prep; the split moves +1.5 KB per token-head through HBM (state written and read back at 512 B, u' at
  256 B each way, ~+2.4 ms) to take two of the four dots off the sequential pass. It wins only where c64's pass
  is latency-bound with too few programs (B1 T128K: 96 sequence-heads); predicted slower than c64 at B8 T8K.
- c64f (one kernel per sequence-head: prep into an L2-resident scratch, barrier, state step): predict 9 ms with a
  wide range (4-15). HBM bytes are the floor (1.3 KB per token-head, 1.7 ms), but the per-chunk prep runs
  serially inside each of only 768 programs with the full 128x128 fp32 state in registers (1 CTA of 8 warps
  per SM): latency-bound; much worse at B1 T128K (96 programs < 132 SMs).
Other shapes (c64): B2 T32K 8.5 ms (value blocks of 32), varlen 8 ms, B1 T128K 9 ms (value blocks of 16:
768 programs of 2048 steps); c64s within ~1 ms of c64 at B1 T128K.
Decode is unchanged (one program per sequence/head/value block, state read and written once).

Usage: python benchmarks/kda_triton.py [--json PATH] [--budget-s S] [--variants c16,c64,...] [--bwd] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PREDICTED_MS_B8_T8K = {"fla": 19.7, "c16": 17.2, "c64": 7.5, "c64s": 9.5, "c64f": 9.0}
# Sequential-kernel configs tried at the first shape (first = the heuristic default there). bv: value columns per
# program; num_warps/num_stages of the sequential kernel (c64f: of the fused kernel, always 1 stage).
CONFIGS = {
    "c16": [dict(bv=128)],  # bv=64 18.4 ms, bv=32 21.2 ms on 2026-11-30
    "c64": [dict(bv=64, num_warps=4, num_stages=2), dict(bv=64, num_warps=4, num_stages=1),
            dict(bv=128, num_warps=8, num_stages=2), dict(bv=128, num_warps=8, num_stages=1),
            dict(bv=32, num_warps=4, num_stages=2)],
    "c64s": [dict(bv=64, num_warps=4, num_stages=2), dict(bv=32, num_warps=4, num_stages=2),
             dict(bv=128, num_warps=8, num_stages=2)],
    "c64f": [dict(num_warps=8)],  # 4 warps would hold the 128x128 fp32 state in 128 regs/thread: spills
}
PREP_WARPS = {"c16": [4], "c64": [8, 4]}  # prep kernel (shared by c64, c64s; c64f inlines it)
HBM_TBPS = 4.8


def rr(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def cfg_name(c):
    return ",".join(f"{k}={v}" for k, v in c.items()) or "default"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "kda_triton.json"))
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip what is left after this many seconds")
    ap.add_argument("--variants", default="c16,c64,c64s,c64f")
    ap.add_argument("--bwd", action="store_true", help="also time fwd+bwd (slow: fla's backward autotune)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton
    from k3.ops.kda import recurrent_kda
    from k3.ops.kda.triton import chunk_kda_triton, ops as ours

    t_start = time.time()
    over = lambda: time.time() - t_start > args.budget_s
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        ours.fwd_variant(v)  # validates the name
    try:
        from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_rec
        import fla
        fla_version = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - any import failure means "no fla": time ours alone
        fla_chunk = fla_rec = None
        fla_version = f"not importable ({type(e).__name__}: {e})"[:200]
        print(f"WARNING: fla is not importable ({e}); timing our kernels only", flush=True)
    if args.smoke:
        sys.path.insert(0, os.path.join(ROOT, "tests", "ops"))
        from test_kda_triton import fix_interpreter_bf16_dot
        fix_interpreter_bf16_dot()
        dev, H, D = "cpu", 2, 32
    else:
        dev, H, D = "cuda", 96, 128
    res = {"torch": torch.__version__, "triton": triton.__version__, "fla": fla_version,
           "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter smoke)",
           "default_variant": ours.fwd_variant(), "predicted_ms_B8_T8K": PREDICTED_MS_B8_T8K, "rows": []}
    print({k: v for k, v in res.items() if k != "rows"}, flush=True)

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
    else:
        from triton.testing import do_bench
        bench = lambda f: do_bench(f, warmup=25, rep=100, return_mode="median")

    def timed_first(f):
        """seconds of a first call (compile + autotune + run)."""
        sync()
        t = time.time()
        out = f()
        sync()
        return out, round(time.time() - t, 2)

    scale = D ** -0.5
    gen = torch.Generator(device=dev).manual_seed(0)

    def make(B, T, grad=False):
        r = lambda *s: torch.randn(*s, device=dev, generator=gen)
        q, k, v, f = (r(B, T, H, D).bfloat16() for _ in range(4))
        beta = r(B, T, H).sigmoid().bfloat16()
        A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16, generator=gen))
        dt_bias = r(H * D) * 0.1
        ts = [q, k, v, f, beta, A_log, dt_bias]
        if grad:
            ts = [t.requires_grad_() for t in ts]
        return ts

    gk = lambda ins: dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=ins[5], dt_bias=ins[6],
                          lower_bound=-5.0)

    def ours_fwd(ins, variant, cfg, cu=None, h0=None, fs=False, prep_only=False):
        return ours.kda_chunk_fwd(*ins[:5], scale, initial_state=h0, output_final_state=fs, cu_seqlens=cu,
                                  variant=variant, prep_only=prep_only, **gk(ins), **cfg)

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

    # 1. accuracy vs the fp32 token loop (and each variant's first call = compile of its default config)
    T_acc = 1024 if not args.smoke else 100
    cu_acc = torch.tensor([0, 1, 300, T_acc] if not args.smoke else [0, 1, 37, T_acc], device=dev)
    ins = make(1, T_acc)
    h0 = torch.randn(3, H, D, D, device=dev, generator=gen) * 0.1
    kw_ref = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_acc, **gk(ins))
    o_ref, s_ref = recurrent_kda(*(x.float() for x in ins[:5]), **kw_ref)
    acc = dict(op="accuracy_vs_fp32_loop", T=T_acc, H=H, D=D, lens=cu_acc.diff().tolist())
    if fla_chunk is not None:
        try:
            o2, s2 = fla_fwd(ins, cu=cu_acc, h0=h0, fs=True)
            acc.update(fla_o=rr(o2, o_ref), fla_S=rr(s2, s_ref))
        except Exception as e:  # noqa: BLE001
            acc["fla_error"] = repr(e)[:200]
    for v in variants:
        try:
            (o1, s1), secs = timed_first(lambda: ours_fwd(ins, v, {}, cu=cu_acc, h0=h0, fs=True))
            acc.update({f"{v}_o": rr(o1, o_ref), f"{v}_S": rr(s1, s_ref), f"{v}_first_call_s": secs})
        except Exception as e:  # noqa: BLE001
            acc[f"{v}_error"] = repr(e)[:300]
    add(acc)
    del ins, o_ref, s_ref

    # 2. forward at K3 shapes
    if args.smoke:
        shapes = [("B2_T200", 2, 200, None), ("varlen", 1, 300, [0, 1, 64, 65, 300])]
    else:
        g2 = torch.Generator().manual_seed(1)
        lens = torch.randint(256, 12000, (40,), generator=g2)
        lens = lens[: int((lens.cumsum(0) <= 65536 - 1).sum())]
        lens = torch.cat([lens, torch.tensor([1, 65536 - 1 - int(lens.sum())])])  # incl. a 1-token document
        shapes = [("B8_T8K", 8, 8192, None), ("varlen", 1, 65536, [0] + lens.cumsum(0).tolist()),
                  ("B2_T32K", 2, 32768, None), ("B1_T128K", 1, 131072, None)]
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

    best_cfg = {}
    prep_warps = {}
    for si, (name, B, T, cu_list) in enumerate(shapes):
        if over():
            add(dict(op="chunk_fwd", shape=name, error="skipped: time budget"))
            continue
        cu = None if cu_list is None else torch.tensor(cu_list, device=dev)
        tok_heads = B * T * H
        floor_ms = tok_heads * (4 * D * 2 + 2 + D * 2) / (HBM_TBPS * 1e12) * 1e3
        row = dict(op="chunk_fwd", shape=name, B=B, T=T, H=H, D=D,
                   nseq=(len(cu_list) - 1 if cu_list else B), mem_floor_ms=floor_ms)
        ins = make(B, T)
        o_fla = None
        if fla_chunk is not None:
            try:
                o_fla = fla_fwd(ins, cu=cu)[0]
                row["fla_ms"] = bench(lambda: fla_fwd(ins, cu=cu))
            except Exception as e:  # noqa: BLE001
                row["fla_error"] = repr(e)[:200]
        # prep kernel alone (c64, c64s share it); at the first shape pick its num_warps
        for v, pv in (("c16", "c16"), ("c64", "c64")):
            if not any(x == v or (pv == "c64" and x == "c64s") for x in variants) or over():
                continue
            for pw in (PREP_WARPS[pv] if si == 0 else [prep_warps.get(pv, PREP_WARPS[pv][0])]):
                try:
                    ours_fwd(ins, v, dict(prep_warps=pw), cu=cu, prep_only=True)
                    row[f"{v}_prep_ms_w{pw}"] = bench(lambda: ours_fwd(ins, v, dict(prep_warps=pw), cu=cu,
                                                                       prep_only=True))
                except Exception as e:  # noqa: BLE001
                    row[f"{v}_prep_w{pw}_error"] = repr(e)[:200]
            got = {pw: row[f"{v}_prep_ms_w{pw}"] for pw in PREP_WARPS[pv] if f"{v}_prep_ms_w{pw}" in row}
            if si == 0 and got:
                prep_warps[pv] = min(got, key=got.get)
        for v in variants:
            pw = {} if v in ("c16", "c64f") or "c64" not in prep_warps else dict(prep_warps=prep_warps["c64"])
            if si == 0:
                cfgs = CONFIGS[v]
            else:
                cfgs = [best_cfg[v]] if v in best_cfg else []
                cfgs = cfgs + [{}] if {} not in cfgs else cfgs  # heuristic default for this shape
            times = {}
            for c in cfgs:
                if over():
                    row[f"{v}_skipped"] = "time budget"
                    break
                cc = dict(c, **pw)
                try:
                    o_v, secs = timed_first(lambda: ours_fwd(ins, v, cc, cu=cu)[0])
                    if o_fla is not None and f"{v}_vs_fla_rrmse" not in row:
                        row[f"{v}_vs_fla_rrmse"] = rr(o_v, o_fla)
                    del o_v
                    times[cfg_name(c)] = bench(lambda: ours_fwd(ins, v, cc, cu=cu))
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
                if si == 0:
                    best_cfg[v] = next(c for c in cfgs if cfg_name(c) == bname)
        add(row)
        del ins, o_fla
        if dev == "cuda":
            torch.cuda.empty_cache()
        if si == 0:
            run_decode()

    # 4. fwd+bwd (default forward variant + the backend's backward) vs fla
    if args.bwd:
        for name, B, T, cu_list in [s for s in shapes if s[0] in ("B8_T8K", "varlen", "B2_T200")]:
            if over():
                add(dict(op="chunk_fwd_bwd", shape=name, error="skipped: time budget"))
                continue
            Bb = 1 if cu_list is None else B
            cu = None if cu_list is None else torch.tensor(cu_list, device=dev)
            rowb = dict(op="chunk_fwd_bwd", shape=name, B=Bb, T=T, H=H, D=D, fwd_variant=ours.fwd_variant())
            try:
                ins = make(Bb, T, grad=True)
                do = torch.randn(Bb, T, H, D, device=dev, dtype=torch.bfloat16)

                def fb_ours():
                    chunk_kda_triton(*ins[:5], scale=scale, cu_seqlens=cu, **gk(ins))[0].backward(do)
                if fla_chunk is not None:
                    rowb["fla_fwdbwd_ms"] = bench(lambda: fla_fwd(ins, cu=cu)[0].backward(do))
                rowb["ours_fwdbwd_ms"] = bench(fb_ours)
                if "fla_fwdbwd_ms" in rowb:
                    rowb["speedup_fwdbwd"] = rowb["fla_fwdbwd_ms"] / rowb["ours_fwdbwd_ms"]
            except Exception as e:  # noqa: BLE001
                rowb["error"] = repr(e)[:300]
            add(rowb)
            if dev == "cuda":
                torch.cuda.empty_cache()

    res["total_s"] = round(time.time() - t_start, 1)
    save()
    nan = float("nan")
    print(f"\nforward ms (best config), H={H} D={D} bf16; predicted at B8 T8K: {PREDICTED_MS_B8_T8K}")
    print("| shape | fla | " + " | ".join(variants) + " | best speedup | best floor frac |")
    print("|---|---|" + "---|" * len(variants) + "---|---|")
    for r in res["rows"]:
        if r["op"] == "chunk_fwd" and "error" not in r:
            ms = {v: r.get(f"{v}_ms", nan) for v in variants}
            ok = {v: t for v, t in ms.items() if t == t}
            bv = min(ok, key=ok.get) if ok else None
            cells = " | ".join(f"{ms[v]:.2f} ({r.get(f'{v}_cfg', '-')})" for v in variants)
            print(f"| {r['shape']} | {r.get('fla_ms', nan):.2f} | {cells} | "
                  f"{(r.get(f'{bv}_speedup', nan) if bv else nan):.2f} ({bv}) | "
                  f"{(r.get(f'{bv}_floor_frac', nan) if bv else nan):.2f} |")
        elif r["op"] == "decode":
            print(f"| decode B{r['B']} | {r.get('fla_ms', nan):.4f} | ours {r.get('ours_ms', nan):.4f} ms, "
                  f"state {r.get('ours_state_TBps', nan):.2f} TB/s {r.get('error', '')} |")
        else:
            print("|", r, "|")
    print(f"total {res['total_s']} s; json: {args.json}")


if __name__ == "__main__":
    main()
