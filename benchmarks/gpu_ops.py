"""GPU op benchmarks on one H200: our dispatch vs the anchor measured in the same run.

Sections (--only kda,attn,moe,attnres; default all):
- kda: k3.ops.kda.chunk_kda (auto dispatch -> fla) vs fla.ops.kda.chunk_kda called directly, K3 shapes H=96 D=128,
  T = 8K/32K/128K (~64K tokens per call), fwd and fwd+bwd. The ratio should be ~1 (dispatch overhead ~0).
- attn: MLA-shaped causal attention (Dqk=192, Dv=128) through k3.ops.attention.causal_attention ("flash" backend,
  V padded / not padded, varlen) vs torch SDPA flash at Dq=Dv=128 (the anchor op) on the same B,T,H.
- moe: one Stable LatentMoE layer (k3.nn.moe.LatentMoE, bf16) fwd+bwd vs a dense GEMM of the same FLOPs.
- attnres: attnres_mix via "fla" and "compile" vs the eager fp32 "torch" path.
Timing: triton.testing.do_bench median; inputs random; outputs checked against the reference path first.
Usage: python benchmarks/gpu_ops.py [--only kda] [--quick] [--json $OUT/gpu_ops.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import torch

DEV = "cuda"
BF = torch.bfloat16
ROWS = []


def bench(fn, quick=False):
    from triton.testing import do_bench
    return do_bench(fn, warmup=10 if quick else 25, rep=60 if quick else 200, return_mode="median")


def add(**row):
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# --------------------------------------------------------------------------------------------------------- KDA
def sec_kda(quick):
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from k3.ops.kda import chunk_kda
    H, D = 96, 128
    Ts = [8192, 32768, 131072]
    for T in Ts:
        B = max(1, 65536 // T)
        mk = lambda: torch.randn(B, T, H, D, device=DEV, dtype=BF, requires_grad=True)
        q, k, v, f = mk(), mk(), mk(), mk()
        beta = torch.rand(B, T, H, device=DEV).requires_grad_()
        A_log = torch.log(torch.empty(H, device=DEV).uniform_(1, 16)).requires_grad_()
        dt_bias = (torch.randn(H * D, device=DEV) * 0.5).requires_grad_()
        ours = lambda: chunk_kda(q, k, v, f, beta, scale=D ** -0.5, use_qk_l2norm_in_kernel=True,
                                 use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)[0]
        direct = lambda: fla_chunk_kda(q, k, v, f, beta, scale=D ** -0.5, use_qk_l2norm_in_kernel=True,
                                       use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, safe_gate=True,
                                       lower_bound=-5.0)[0]
        o1, o2 = ours(), direct()
        err = rel(o1, o2)
        do = torch.randn_like(o1)

        def fb(fn):
            def run():
                q.grad = k.grad = v.grad = f.grad = beta.grad = A_log.grad = dt_bias.grad = None
                fn().backward(do)
            return run
        t = {}
        for name, fn in (("fla", direct), ("k3", ours), ("fla2", direct)):
            t[name + "_fwd"] = bench(fn, quick)
            t[name + "_fb"] = bench(fb(fn), quick)
        fla_f = min(t["fla_fwd"], t["fla2_fwd"])
        fla_b = min(t["fla_fb"], t["fla2_fb"])
        add(section="kda", B=B, T=T, H=H, D=D, k3_fwd_ms=t["k3_fwd"], fla_fwd_ms=fla_f, fwd_ratio=t["k3_fwd"] / fla_f,
            k3_fwdbwd_ms=t["k3_fb"], fla_fwdbwd_ms=fla_b, fwdbwd_ratio=t["k3_fb"] / fla_b,
            fla_repeat_spread=abs(t["fla_fwd"] - t["fla2_fwd"]) / fla_f, rel_diff_vs_fla=err,
            k3_Mtok_s_fwdbwd=B * T / t["k3_fb"] / 1e3)
        del q, k, v, f, beta, o1, o2, do
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------- attention
def sec_attn(quick):
    import torch.nn.functional as F
    from k3.ops import attention_cuda
    from k3.ops.attention import causal_attention
    H, Dq, Dv = 96, 192, 128
    for T in (8192, 32768):
        B = max(1, 32768 // T)
        q = torch.randn(B, T, H, Dq, device=DEV, dtype=BF, requires_grad=True)
        k = torch.randn(B, T, H, Dq, device=DEV, dtype=BF, requires_grad=True)
        v = torch.randn(B, T, H, Dv, device=DEV, dtype=BF, requires_grad=True)
        scale = Dq ** -0.5
        flops_f = 2 * B * H * T * T / 2 * (Dq + Dv)    # causal: QK^T and PV over half the square
        # anchor: SDPA flash at equal head dims 128 (K3 v head dim), same B, T, H, [B,H,T,D] layout
        qa = torch.randn(B, H, T, 128, device=DEV, dtype=BF, requires_grad=True)
        ka, va = torch.randn_like(qa).requires_grad_(), torch.randn_like(qa).requires_grad_()
        anchor = lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True)
        flops_anchor = 2 * B * H * T * T / 2 * (128 + 128)

        def variant(pad, varlen=None, be="flash"):
            def fn():
                attention_cuda.PAD_V = pad
                if varlen is not None:
                    attention_cuda.VARLEN = varlen
                cu = None
                if varlen is not None:
                    cu = torch.arange(0, B * T + 1, T // 4, device=DEV, dtype=torch.int32)
                    return causal_attention(q.reshape(1, B * T, H, Dq), k.reshape(1, B * T, H, Dq),
                                            v.reshape(1, B * T, H, Dv), scale, cu_seqlens=cu, backend=be)[0]
                return causal_attention(q, k, v, scale, backend=be)[0]
            return fn
        variants = {"flash_padV": variant(True), "sdpa_noPad(efficient)": variant(False),
                    "varlen_padV_4docs": variant(True, "varlen"), "flex_4docs": variant(False, "flex")}
        if T <= 8192:
            variants["old_tiled_mask(sdpa)"] = variant(True, None, "sdpa")
        ref = variant(True)()
        ta_f = bench(anchor, quick)
        oa = anchor(); doa = torch.randn_like(oa)
        ta_b = bench(lambda: anchor().backward(doa), quick)
        add(section="attn", variant="anchor torch SDPA flash D=128", B=B, T=T, H=H, fwd_ms=ta_f, fwdbwd_ms=ta_b,
            fwd_TFLOPs=flops_anchor / ta_f / 1e9, fwdbwd_TFLOPs=3.5 * flops_anchor / ta_b / 1e9)
        for name, fn in variants.items():
            try:
                o = fn()
                err = rel(o[:, :T // 4], ref[:, :T // 4]) if "docs" not in name else float("nan")
                do = torch.randn_like(o)
                tf = bench(fn, quick)
                tb = bench(lambda: fn().backward(do), quick)
                docs = "docs" in name
                fl = flops_f / (4 if docs else 1)
                add(section="attn", variant=name, B=B, T=T, H=H, Dq=Dq, Dv=Dv, fwd_ms=tf, fwdbwd_ms=tb,
                    fwd_TFLOPs=fl / tf / 1e9, fwdbwd_TFLOPs=3.5 * fl / tb / 1e9, rel_diff_first_quarter=err,
                    fwd_ratio_vs_anchor=tf / ta_f * (1 if not docs else 4) * flops_anchor / flops_f)
            except Exception as e:
                add(section="attn", variant=name, T=T, error=repr(e)[:300])
        attention_cuda.PAD_V, attention_cuda.VARLEN = False, "auto"
        del q, k, v, qa, ka, va
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------- MoE
def sec_moe(quick):
    from k3.config import K3Config
    from k3.nn.moe import LatentMoE, init_moe_
    cases = [dict(name="K3 layer, 896 experts scaled to 112 (8-way EP slice), top-16", d=7168, l=3584, M=3072,
                  E=112, k=16, S=2, N=16384),
             dict(name="small preset layer, 64 experts top-8", d=1024, l=512, M=512, E=64, k=8, S=2, N=32768)]
    for c in cases:
        cfg = K3Config.from_preset("small", hidden_size=c["d"], routed_expert_hidden_size=c["l"],
                                   moe_intermediate_size=c["M"], num_experts=c["E"], num_experts_per_token=c["k"],
                                   num_shared_experts=c["S"])
        layer = LatentMoE(cfg)
        init_moe_(layer, 0.02)
        for n, p in layer.named_parameters():
            if p.dim() == 2 and "gate.weight" not in n:
                torch.nn.init.normal_(p, std=0.02)
        layer = layer.to(DEV, BF)
        x = torch.randn(c["N"], c["d"], device=DEV, dtype=BF, requires_grad=True)
        N, d, l, M, E, k, S = c["N"], c["d"], c["l"], c["M"], c["E"], c["k"], c["S"]
        flops = 2 * N * (d * E + d * l + k * 3 * l * M + l * d + 3 * d * S * M)  # router, down, experts, up, shared
        y = layer(x)
        dy = torch.randn_like(y)
        tf = bench(lambda: layer(x), quick)

        def fb():
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            layer(x).backward(dy)
        tb = bench(fb, quick)
        # dense GEMM of equal FLOPs: [N, d] @ [d, X]
        X = max(128, int(round(flops / (2 * N * d) / 128)) * 128)
        w = torch.randn(d, X, device=DEV, dtype=BF, requires_grad=True)
        xd = torch.randn(N, d, device=DEV, dtype=BF, requires_grad=True)
        yd = xd @ w
        dyd = torch.randn_like(yd)
        td_f = bench(lambda: xd @ w, quick)
        td_b = bench(lambda: (xd @ w).backward(dyd), quick)
        dflops = 2 * N * d * X
        add(section="moe", case=c["name"], N=N, fwd_ms=tf, fwdbwd_ms=tb, fwd_TFLOPs=flops / tf / 1e9,
            fwdbwd_TFLOPs=3 * flops / tb / 1e9, dense_fwd_TFLOPs=dflops / td_f / 1e9,
            dense_fwdbwd_TFLOPs=3 * dflops / td_b / 1e9, fwdbwd_ratio_vs_dense=(tb / flops) / (td_b / dflops))
        del layer, x, y, w, xd
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------- AttnRes
def sec_attnres(quick):
    from k3.ops import dispatch
    from k3.ops.attnres import attnres_mix
    cases = [(9, 16384, 7168, BF), (5, 65536, 2048, BF), (5, 32768, 1024, torch.float32)]
    for S, N, d, dt in cases:
        srcs = [torch.randn(N, d, device=DEV, dtype=dt, requires_grad=True) for _ in range(S)]
        w = (torch.randn(d, device=DEV) * 0.05).requires_grad_()
        ref = attnres_mix(srcs, w, 1e-5, backend="torch")
        do = torch.randn_like(ref)
        byts = (S + 1) * N * d * srcs[0].element_size()
        t = {}
        for be in ("torch", "fla", "compile"):
            if not dispatch._REGISTRY["attnres"][be][0]():
                continue
            fn = lambda be=be: attnres_mix(srcs, w, 1e-5, backend=be)
            err = rel(fn(), ref)
            tf = bench(fn, quick)
            tb = bench(lambda: fn().backward(do), quick)
            t[be] = (tf, tb, err)
        base = t["torch"]
        for be, (tf, tb, err) in t.items():
            add(section="attnres", backend=be, S=S, N=N, d=d, dtype=str(dt).split(".")[-1], fwd_ms=tf,
                fwdbwd_ms=tb, fwd_TBps=byts / tf / 1e9, speedup_fwd_vs_eager=base[0] / tf,
                speedup_fwdbwd_vs_eager=base[1] / tb, rel_err_vs_eager=err)
        del srcs, w
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="kda,attn,moe,attnres")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "gpu_ops.json"))
    a = ap.parse_args()
    import triton
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, python=platform.python_version())
    try:
        import fla
        meta["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:
        meta["fla"] = repr(e)
    print(json.dumps(meta), flush=True)
    for s in a.only.split(","):
        t0 = time.time()
        try:
            {"kda": sec_kda, "attn": sec_attn, "moe": sec_moe, "attnres": sec_attnres}[s](a.quick)
        except Exception as e:
            import traceback
            traceback.print_exc()
            add(section=s, error=repr(e)[:500])
        print(f"# section {s}: {time.time() - t0:.1f}s", flush=True)
        json.dump(dict(meta=meta, rows=ROWS), open(a.json, "w"), indent=1)
    print("\n| section | what | numbers |\n|---|---|---|")
    for r in ROWS:
        r = dict(r)
        sec = r.pop("section")
        what = r.pop("variant", r.pop("case", r.pop("backend", "")))
        print(f"| {sec} | {what} | " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in r.items()) + " |")


if __name__ == "__main__":
    main()
