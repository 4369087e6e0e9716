"""KDA: our Triton kernels (k3.ops.kda.triton) vs fla chunk_kda(safe_gate=True, lower_bound=-5) on one GPU.

Shapes: H=96, D=128 (K3), bf16 q/k/v/g, fp32 state, in-kernel gate and q/k L2 norm, ~64K tokens per call
(B = 65536 // T), T in {8K, 32K, 128K}, plus a varlen batch; forward, forward+backward, decode (B=1, 64).
Checks ours against an fp32 token-loop reference at a small shape and against fla at every timed shape.
Usage: python benchmarks/kda_triton.py [--quick] [--json PATH]. Prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rr(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "kda_triton.json"))
    ap.add_argument("--bv", default="32,64,128", help="value blocks of the state pass to try")
    ap.add_argument("--bwd", action="store_true",
                    help="also time fwd+bwd (ours = Triton fwd + torch-recompute bwd: slow; ran past a 440 s "
                         "limit on 2026-11-30 together with fla's first backward compile)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="skip remaining sections after this long")
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench
    from k3.ops.kda import recurrent_kda
    from k3.ops.kda.triton import ops as ours, chunk_kda_triton
    from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_rec
    import fla

    dev = "cuda"
    t_start = time.time()
    over = lambda: time.time() - t_start > args.budget_s
    res = {"torch": torch.__version__, "triton": triton.__version__, "fla": getattr(fla, "__version__", "?"),
           "gpu": torch.cuda.get_device_name(), "rows": []}
    print({k: v for k, v in res.items() if k != "rows"}, flush=True)
    bench = lambda f: do_bench(f, warmup=25, rep=150 if not args.quick else 50, return_mode="median")
    H, D = 96, 128
    scale = D ** -0.5
    gen = torch.Generator(device=dev).manual_seed(0)

    def make(B, T, Hh=H, grad=False):
        r = lambda *s: torch.randn(*s, device=dev, generator=gen)
        q, k, v, f = (r(B, T, Hh, D).bfloat16() for _ in range(4))
        beta = r(B, T, Hh).sigmoid().bfloat16()
        A_log = torch.log(torch.empty(Hh, device=dev).uniform_(1, 16, generator=gen))
        dt_bias = r(Hh * D) * 0.1
        ts = [q, k, v, f, beta, A_log, dt_bias]
        if grad:
            ts = [t.requires_grad_() for t in ts]
        return ts

    def ours_fwd(q, k, v, f, beta, A_log, dt_bias, cu=None, bv=None, h0=None, fs=False):
        return ours.kda_chunk_fwd(q, k, v, f, beta, scale, initial_state=h0, output_final_state=fs, cu_seqlens=cu,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                  dt_bias=dt_bias, lower_bound=-5.0, bv=bv)

    def fla_fwd(q, k, v, f, beta, A_log, dt_bias, cu=None, h0=None, fs=False):
        kw = {}
        if cu is not None:
            kw = dict(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
        return fla_chunk(q, k, v, f, beta, scale=scale, initial_state=h0, output_final_state=fs,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                         safe_gate=True, lower_bound=-5.0, **kw)

    # 1. accuracy at a small shape vs the fp32 token loop (and fla's error for comparison)
    B, T, Hs = 2, 1000, 4
    q, k, v, f, beta, A_log, dt_bias = make(B, T, Hs)
    h0 = torch.randn(B, Hs, D, D, device=dev, generator=gen) * 0.1
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    o_ref, s_ref = recurrent_kda(q.float(), k.float(), v.float(), f.float(), beta.float(), **kw)
    o1, s1 = ours_fwd(q, k, v, f, beta, A_log, dt_bias, h0=h0, fs=True)
    o2, s2 = fla_fwd(q, k, v, f, beta, A_log, dt_bias, h0=h0, fs=True)
    acc = dict(op="accuracy_vs_fp32_loop", B=B, T=T, H=Hs, ours_o=rr(o1, o_ref), ours_S=rr(s1, s_ref),
               fla_o=rr(o2, o_ref), fla_S=rr(s2, s_ref))
    od, sd = ours.kda_recurrent_fwd(q[:, :1], k[:, :1], v[:, :1], f[:, :1], beta[:, :1], scale,
                                    initial_state=h0.clone(), output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                    dt_bias=dt_bias, lower_bound=-5.0)
    o_r1, s_r1 = recurrent_kda(q[:, :1].float(), k[:, :1].float(), v[:, :1].float(), f[:, :1].float(),
                               beta[:, :1].float(), **kw)
    acc.update(decode_o=rr(od, o_r1), decode_S=rr(sd, s_r1))
    # gradient check of the (recompute) backward at a small shape
    qg_, kg_, vg_, fg_, bg_, ag_, dg_ = make(1, 300, Hs, grad=True)
    o_a, _ = chunk_kda_triton(qg_, kg_, vg_, fg_, bg_, scale=scale, use_qk_l2norm_in_kernel=True,
                              use_gate_in_kernel=True, A_log=ag_, dt_bias=dg_, lower_bound=-5.0)
    o_a.float().square().sum().backward()
    ga = [t.grad.clone() for t in (qg_, kg_, vg_, fg_, bg_)]
    for t in (qg_, kg_, vg_, fg_, bg_, ag_, dg_):
        t.grad = None
    o_b = fla_fwd(qg_, kg_, vg_, fg_, bg_, ag_, dg_)[0]
    o_b.float().square().sum().backward()
    acc.update({f"grad_{n}_vs_fla": rr(a, t.grad) for n, a, t in zip("qkvgb", ga, (qg_, kg_, vg_, fg_, bg_))})
    res["rows"].append(acc)
    print(acc, flush=True)
    del qg_, kg_, vg_, fg_, bg_, ag_, dg_

    # 3. decode: one token, fp32 state [B,H,D,D]
    for B in [1, 64]:
        if over():
            continue
        q, k, v, f, beta, A_log, dt_bias = make(B, 1)
        h0 = torch.randn(B, H, D, D, device=dev, generator=gen)
        st = h0.clone()
        row = dict(op="decode", B=B, H=H, D=D)
        try:
            row["fla_ms"] = bench(lambda: fla_rec(q, k, v, f, beta, scale=scale, initial_state=h0,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                  use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                                  lower_bound=-5.0))
            for bv in (16, 32, 64):
                row[f"ours_ms_bv{bv}"] = bench(lambda: ours.kda_recurrent_fwd(
                    q, k, v, f, beta, scale, initial_state=st, output_final_state=True,
                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                    lower_bound=-5.0, inplace=True, bv=bv))
            best = min(row[f"ours_ms_bv{bv}"] for bv in (16, 32, 64))
            row["ours_ms"] = best
            row["speedup"] = row["fla_ms"] / best
            row["ours_state_TBps"] = 2 * h0.numel() * 4 / (best * 1e-3) / 1e12
        except Exception as e:
            row["error"] = repr(e)[:300]
        print(row, flush=True)
        res["rows"].append(row)

    # 2. forward (and fwd+bwd) at K3 shapes
    Ts = [8192] if args.quick else [8192, 32768, 131072]
    bvs = [int(x) for x in args.bv.split(",")]
    tok_head = 65536 * H
    bytes_floor = tok_head * (4 * D * 2 + 2 + D * 2)  # read q,k,v,g,beta (bf16) + write o
    for T in Ts + ["varlen"]:
        if over():
            res["rows"].append(dict(op="chunk_fwd", T=T, error="skipped: time budget"))
            continue
        if T == "varlen":
            g2 = torch.Generator().manual_seed(1)
            lens = torch.randint(256, 12000, (40,), generator=g2)
            lens = lens[: int((lens.cumsum(0) <= 65536).sum())]
            lens = torch.cat([lens, torch.tensor([65536 - int(lens.sum())])])
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(dev)
            B, TT = 1, 65536
        else:
            cu, B, TT = None, max(1, 65536 // T), T
        row = dict(op="chunk_fwd", T=T, B=B, H=H, D=D, nseq=(cu.numel() - 1 if cu is not None else B))
        try:
            ins = make(B, TT)
            o_f = fla_fwd(*ins, cu=cu)[0]
            row["fla_fwd_ms"] = bench(lambda: fla_fwd(*ins, cu=cu))
            for bv in bvs:
                o_o = ours_fwd(*ins, cu=cu, bv=bv)[0]
                row[f"ours_fwd_ms_bv{bv}"] = bench(lambda: ours_fwd(*ins, cu=cu, bv=bv))
            row["ours_vs_fla_rrmse"] = rr(o_o, o_f)
            row["ours_prep_ms"] = bench(lambda: ours.kda_chunk_fwd(
                *ins[:5], scale, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                A_log=ins[5], dt_bias=ins[6], lower_bound=-5.0, prep_only=True))
            best = min(row[f"ours_fwd_ms_bv{bv}"] for bv in bvs)
            row["ours_fwd_ms"] = best
            row["speedup_fwd"] = row["fla_fwd_ms"] / best
            row["fwd_mem_floor_frac"] = bytes_floor / 4.3e12 / (best * 1e-3)
            # prep kernel alone (time split)
            del o_f, o_o
        except Exception as e:
            row["error"] = repr(e)[:300]
        print(row, flush=True)
        res["rows"].append(row)
        torch.cuda.empty_cache()
        if T in (8192, "varlen") and args.bwd and not over():
            # fwd+bwd: ours = Triton forward + backward recomputed through the torch chunk path
            Bb = 1 if T == 8192 else 1
            TTb = 8192 if T == 8192 else TT
            rowb = dict(op="chunk_fwd_bwd", T=T, B=Bb, H=H, D=D)
            try:
                ins = make(Bb, TTb, grad=True)
                cub = cu if T == "varlen" else None
                do = torch.randn(Bb, TTb, H, D, device=dev, dtype=torch.bfloat16)

                def fb_fla():
                    fla_fwd(*ins, cu=cub)[0].backward(do)

                def fb_ours():
                    chunk_kda_triton(*ins[:5], scale=scale, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                     A_log=ins[5], dt_bias=ins[6], lower_bound=-5.0, cu_seqlens=cub)[0].backward(do)
                rowb["fla_fwdbwd_ms"] = bench(fb_fla)
                rowb["ours_fwdbwd_ms"] = bench(fb_ours)
                rowb["speedup_fwdbwd"] = rowb["fla_fwdbwd_ms"] / rowb["ours_fwdbwd_ms"]
            except Exception as e:
                rowb["error"] = repr(e)[:300]
            print(rowb, flush=True)
            res["rows"].append(rowb)
            del ins
            torch.cuda.empty_cache()

    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=1)
    print("\n| op | T | B | fla ms | ours ms | speedup | note |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        if r["op"] == "chunk_fwd":
            print(f"| fwd | {r['T']} | {r['B']} | {r.get('fla_fwd_ms', float('nan')):.3f} | "
                  f"{r.get('ours_fwd_ms', float('nan')):.3f} | {r.get('speedup_fwd', float('nan')):.2f} | "
                  f"prep {r.get('ours_prep_ms', float('nan')):.2f} ms, mem floor frac "
                  f"{r.get('fwd_mem_floor_frac', float('nan')):.2f}, rrmse vs fla "
                  f"{r.get('ours_vs_fla_rrmse', float('nan')):.1e} {r.get('error', '')} |")
        elif r["op"] == "chunk_fwd_bwd":
            print(f"| fwd+bwd | {r['T']} | {r['B']} | {r.get('fla_fwdbwd_ms', float('nan')):.3f} | "
                  f"{r.get('ours_fwdbwd_ms', float('nan')):.3f} | {r.get('speedup_fwdbwd', float('nan')):.2f} | "
                  f"bwd = torch recompute {r.get('error', '')} |")
        elif r["op"] == "decode":
            print(f"| decode | 1 | {r['B']} | {r.get('fla_ms', float('nan')):.4f} | {r.get('ours_ms', float('nan')):.4f} | "
                  f"{r.get('speedup', float('nan')):.2f} | state {r.get('ours_state_TBps', float('nan')):.2f} TB/s "
                  f"{r.get('error', '')} |")
        else:
            print("|", r, "|")


if __name__ == "__main__":
    main()
