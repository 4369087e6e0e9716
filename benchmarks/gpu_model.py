"""Model-level GPU benchmark on one H200: training tokens/s, peak memory and MFU of a preset (default `small`),
a per-component time breakdown, torch.compile graph breaks, and the longest sequence that trains / prefills.

FLOPs per token (printed): 6 * active params (k3.info.count_params: matmul weights incl. lm_head, routed experts
counted top_k/E, embedding excluded) + attention terms: MLA causal softmax attention 3 * 2*H*(Dqk+Dv)*T/2 per
layer, KDA (chunk C=64) 3 * H*(2*C*(K+V) + 6*K*V) per layer. MFU = FLOPs/token * tokens/s / 685e12 (bf16 GEMM
rate measured on this H200, benchmarks/RESULTS.md). Params fp32 + bf16 autocast (or --bf16-params: every weight
bf16), fused AdamW (or --optimizer k3: the trainer's Muon + AdamW, with fp32 master weights when the parameters
are bf16; `k3 train --param-dtype bf16` also keeps the spec's fp32 names in fp32).
Random token ids (never zeros). Sections: --train, --breakdown, --explain, --profile, --longest-train,
--longest-prefill (each one is optional; --all runs them all).
Usage: python benchmarks/gpu_model.py --all [--preset small --batch 8 --seq 4096 --compile none|modules]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import time

import torch

from k3.config import K3Config
from k3.info import train_flops_per_token as flops_per_token
from k3.model import K3ForCausalLM

DEV = "cuda"
PEAK = 685e12
OUT = os.environ.get("OUT", ".")
RES = {}


def log(**kw):
    print(json.dumps(kw, default=str), flush=True)
    RES.setdefault("log", []).append(kw)
    json.dump(RES, open(os.path.join(OUT, "gpu_model.json"), "w"), indent=1, default=str)


def make_model(cfg, bf16_params):
    torch.manual_seed(0)
    m = K3ForCausalLM(cfg).to(DEV)
    if bf16_params:
        m = m.to(torch.bfloat16)
    return m


def make_optimizer(model, a):
    """fused torch AdamW (the anchor's), or with --optimizer k3 the trainer's MuonAdamW (fp32 masters for bf16
    parameters)."""
    if getattr(a, "optimizer", "adamw") == "k3":
        from k3.train.optim import build_optimizer
        return build_optimizer(model, lr=1e-4, master_weights=a.bf16_params)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def amp(bf16_params):
    return contextlib.nullcontext() if bf16_params else torch.autocast("cuda", dtype=torch.bfloat16)


def batch(cfg, B, T, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=DEV, generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, T), device=DEV, generator=g)
    return ids, labels


def train_steps(model, opt, ids, labels, n, bf16_params):
    for _ in range(n):
        with amp(bf16_params):
            loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def sec_train(a, cfg):
    fl = flops_per_token(cfg, a.seq)
    log(section="flops_per_token", T=a.seq, **fl)
    results = {}
    for mode in a.compile.split(","):
        for B in a.batches:  # largest batch that fits (OOM -> next)
            torch._dynamo.reset()
            model = opt = None
            try:
                model = make_model(cfg, a.bf16_params)
                model.loss_chunk_size = a.loss_chunk
                if mode != "none":
                    from k3.compile import compile_model
                    compile_model(model, mode=mode, loss=not a.eager_loss)
                opt = make_optimizer(model, a)
                ids, labels = batch(cfg, B, a.seq)
                torch.cuda.reset_peak_memory_stats()
                t0 = time.time()
                loss = train_steps(model, opt, ids, labels, a.warmup, a.bf16_params)
                torch.cuda.synchronize()
                warm_s = time.time() - t0
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                loss = train_steps(model, opt, ids, labels, a.steps, a.bf16_params)
                torch.cuda.synchronize()
            except torch.OutOfMemoryError:
                log(section="train", compile=mode, B=B, T=a.seq, error="OOM",
                    peak_mem_GiB=torch.cuda.max_memory_allocated() / 2 ** 30)
                del model, opt
                torch.cuda.empty_cache()
                continue
            dt = (time.perf_counter() - t0) / a.steps
            tok_s = B * a.seq / dt
            r = dict(section="train", compile=mode, B=B, T=a.seq, bf16_params=a.bf16_params,
                     optimizer=getattr(a, "optimizer", "adamw"), step_ms=dt * 1e3,
                     tokens_per_s=tok_s, mfu=fl["total"] * tok_s / PEAK, mfu_6N_only=fl["dense"] * tok_s / PEAK,
                     peak_mem_GiB=torch.cuda.max_memory_allocated() / 2 ** 30, warmup_s=warm_s, loss=loss.item())
            log(**r)
            results[mode] = r
            a.fit[mode] = B
            a.batch = B
            del model, opt
            torch.cuda.empty_cache()
            break
    return results


def sec_breakdown(a, cfg):
    """fwd+bwd time of each component at the training shape, times its count per step, vs the measured step."""
    from triton.testing import do_bench
    from k3.ops.attnres import attnres_mix
    model = make_model(cfg, a.bf16_params)
    B, T, d = a.batch, a.seq, cfg.hidden_size
    L = model.model.layers
    types = cfg.layer_types
    kda_i, mla_i = types.index("kda"), types.index("mla")
    moe_i = next(i for i in range(len(L)) if hasattr(L[i], "block_sparse_moe"))
    x = torch.randn(B, T, d, device=DEV, requires_grad=True)
    rows = []

    def t_fb(fn):
        def run():
            x.grad = None
            with amp(a.bf16_params):
                y = fn()
            y.float().sum().backward()
        return do_bench(run, warmup=5, rep=40, return_mode="median")
    n_mix = 2 * len(L) + 1
    nsrc = 1 + math.ceil(len(L) / cfg.attn_res_block_size) // 2 + 1
    srcs = [torch.randn(B * T, d, device=DEV, requires_grad=True) for _ in range(nsrc)]
    w = torch.randn(d, device=DEV, requires_grad=True)
    labels = torch.randint(0, cfg.vocab_size, (B, T), device=DEV)
    comps = [("KDA attention (incl. projections, conv, gate, out-norm)", types.count("kda"),
              lambda: L[kda_i].self_attn(L[kda_i].input_layernorm(x))),
             ("MLA attention (incl. projections)", types.count("mla"),
              lambda: L[mla_i].self_attn(L[mla_i].input_layernorm(x))),
             ("LatentMoE (router, latent proj, experts, shared)", sum(hasattr(l, "block_sparse_moe") for l in L),
              lambda: L[moe_i].block_sparse_moe(x)),
             ("dense FFN (layer 0)", sum(hasattr(l, "mlp") for l in L), lambda: L[0].mlp(x)),
             (f"AttnRes mix ({nsrc} sources, fp32)", n_mix, lambda: attnres_mix(srcs, w, 1e-5)),
             ("lm_head + chunked CE loss", 1, lambda: model.loss(x, labels)[0])]
    total = 0.0
    for name, cnt, fn in comps:
        try:
            t = t_fb(fn)
            rows.append(dict(component=name, count=cnt, ms_each=t, ms_total=t * cnt))
            total += t * cnt
        except Exception as e:
            rows.append(dict(component=name, error=repr(e)[:200]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    t = do_bench(lambda: opt.step(), warmup=3, rep=20, return_mode="median")
    rows.append(dict(component="AdamW step (fused, fp32)", count=1, ms_each=t, ms_total=t))
    total += t
    for r in rows:
        log(section="breakdown", B=B, T=T, **r)
    log(section="breakdown", component="sum of components", ms_total=total)
    del model, opt, srcs
    torch.cuda.empty_cache()


def sec_explain(a, cfg):
    from k3.compile import explain
    model = make_model(cfg, a.bf16_params)
    x = torch.randn(1, 1024, cfg.hidden_size, device=DEV)
    types = cfg.layer_types
    L = model.model.layers
    for name, i in (("KDA layer", types.index("kda") if types[0] != "kda" else 1), ("MLA layer", types.index("mla"))):
        blocks = [x.clone()]
        with amp(a.bf16_params):
            r = explain(L[i], x, blocks)
        log(section="explain", what=f"decoder layer {i} ({name})", **r)
    for name, m in (("KDAAttention", L[1].self_attn), ("MLAAttention", L[types.index("mla")].self_attn),
                    ("LatentMoE", L[1].block_sparse_moe)):
        with amp(a.bf16_params):
            r = explain(m, x)
        log(section="explain", what=name, **r)
    torch._dynamo.reset()
    del model


def sec_profile(a, cfg):
    from torch.profiler import ProfilerActivity, profile
    model = make_model(cfg, a.bf16_params)
    mode = a.profile_compile
    if mode != "none":  # Inductor kernels keep their fused op names (triton_poi_fused_mul_to_copy_...)
        from k3.compile import compile_model
        compile_model(model, mode=mode, loss=not a.eager_loss)
    opt = make_optimizer(model, a)
    B = a.fit.get(mode, a.batch)  # the batch that fitted in this mode in --train (else the smallest --batch)
    ids, labels = batch(cfg, B, a.seq)
    log(section="profile", B=B, T=a.seq, compile=mode, bf16_params=a.bf16_params)
    train_steps(model, opt, ids, labels, 2, a.bf16_params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_steps(model, opt, ids, labels, 2, a.bf16_params)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    table = ka.table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70)
    open(os.path.join(OUT, f"profile_{a.preset}_{mode}.txt"), "w").write(table)
    # kernel-level totals (device time) grouped by a name pattern
    groups = {"fla KDA kernels": ("kda", "chunk_", "wy_", "recompute", "l2norm", "fwd_h", "bwd_dh", "gate"),
              "flash attention": ("flash", "fmha", "attention"),
              "attnres (fla)": ("attnres",),
              "grouped GEMM": ("grouped", "group_gemm", "ragged"),
              "GEMM (cuBLAS/cutlass)": ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul"),
              "optimizer": ("adam", "multi_tensor"),
              "index/sort/scatter": ("index", "sort", "scatter", "gather", "topk", "radix", "cumsum"),
              "casts/copies": ("direct_copy", "copy_kernel", "to_copy", "convert"),
              "reductions/elementwise": ("elementwise", "reduce", "vectorized", "unrolled", "triton_")}
    tot = {}
    all_t = 0.0
    kernels = []
    for e in ka:
        dt = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if not dt or getattr(e, "device_type", None) is not None and "CUDA" not in str(e.device_type):
            continue
        all_t += dt
        kernels.append((dt / 2 / 1e3, e.count // 2, e.key))
        nm = e.key.lower()
        g = next((k for k, pats in groups.items() if any(p in nm for p in pats)), "other")
        tot[g] = tot.get(g, 0.0) + dt
    for g, v in sorted(tot.items(), key=lambda kv: -kv[1]):
        log(section="profile", group=g, ms_per_step=v / 2 / 1e3, share=v / max(all_t, 1))
    # every kernel by device time: ms per step, calls per step, name (what the groups above hide)
    kernels.sort(reverse=True)
    with open(os.path.join(OUT, f"kernels_{a.preset}_{mode}_{getattr(a, 'optimizer', 'adamw')}.txt"), "w") as fh:
        fh.writelines(f"{ms:9.3f} ms {n:6d} x  {k[:200]}\n" for ms, n, k in kernels)
    for ms, n, k in kernels[:45]:
        print(f"[kernel] {ms:8.3f} ms/step {n:5d} calls  {k[:110]}")
    print(table[:6000])
    del model, opt


def _try(fn):
    try:
        t0 = time.time()
        fn()
        torch.cuda.synchronize()
        return True, time.time() - t0, torch.cuda.max_memory_allocated() / 2 ** 30, ""
    except torch.OutOfMemoryError as e:
        return False, 0.0, torch.cuda.max_memory_allocated() / 2 ** 30, "OOM"
    except Exception as e:
        return False, 0.0, 0.0, repr(e)[:200]


def sec_longest(a, cfg, train: bool):
    model = make_model(cfg, a.bf16_params)
    if train:
        model.set_gradient_checkpointing(True)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        model.eval()
    T = a.long_start
    t_start = time.time()
    best = None
    while T <= a.long_max:
        ids, labels = batch(cfg, 1, T)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if train:
            def step():
                with amp(a.bf16_params):
                    loss = model(ids, labels=labels).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            def step():
                with torch.no_grad(), amp(a.bf16_params):
                    model(ids, logits_to_keep=1)
        ok, dt, mem, err = _try(step)
        dt_warm = None
        if ok and time.time() - t_start + 1.5 * dt < a.long_budget:  # a second call: without first-use costs
            ok2, dt2, mem2, err2 = _try(step)
            dt_warm, mem = (dt2, max(mem, mem2)) if ok2 else (None, mem)
        log(section="longest_train" if train else "longest_prefill", T=T, ok=ok, seconds_first=dt,
            seconds_second=dt_warm, peak_mem_GiB=mem,
            tokens_per_s=T / (dt_warm or dt) if ok and dt else None, error=err)
        del ids, labels
        if not ok:
            break
        best = T
        if time.time() - t_start + 2.5 * dt > a.long_budget:
            log(section="longest_train" if train else "longest_prefill", note="stopped by time budget", next_T=2 * T)
            break
        T *= 2
    log(section="longest_train" if train else "longest_prefill", longest_ok=best)
    if train:
        del opt
    del model
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", default="8", help="batch size, or a list tried largest first until one fits")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", default="none", help="comma list of none,modules,layers,model")
    ap.add_argument("--bf16-params", action="store_true")
    ap.add_argument("--eager-loss", action="store_true", help="do not compile the chunked cross-entropy")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "k3"],
                    help="fused torch AdamW, or the trainer's Muon + AdamW (fp32 masters with --bf16-params)")
    ap.add_argument("--profile-compile", default="none", help="--profile: compile mode of the profiled model "
                    "(none = eager; modules/layers/model as in --compile)")
    ap.add_argument("--loss-chunk", type=int, default=4096)
    ap.add_argument("--long-start", type=int, default=32768)
    ap.add_argument("--long-max", type=int, default=1 << 21)
    ap.add_argument("--long-budget", type=float, default=120.0, help="seconds per longest-* search")
    for s in ("train", "breakdown", "explain", "profile", "longest-train", "longest-prefill", "all"):
        ap.add_argument("--" + s, action="store_true")
    a = ap.parse_args()
    a.batches = [int(x) for x in str(a.batch).split(",")]
    a.batch = a.batches[-1]
    a.fit = {}  # compile mode -> largest batch that trained
    import triton
    cfg = K3Config.from_preset(a.preset)
    RES["meta"] = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                       torch=torch.__version__, triton=triton.__version__, argv=sys.argv, preset=a.preset)
    print(json.dumps(RES["meta"]), flush=True)
    allp = a.all
    secs = [("train", lambda: sec_train(a, cfg)), ("breakdown", lambda: sec_breakdown(a, cfg)),
            ("explain", lambda: sec_explain(a, cfg)), ("profile", lambda: sec_profile(a, cfg)),
            ("longest_train", lambda: sec_longest(a, cfg, True)),
            ("longest_prefill", lambda: sec_longest(a, cfg, False))]
    for name, fn in secs:
        if allp or getattr(a, name):
            t0 = time.time()
            try:
                fn()
            except Exception as e:
                import traceback
                traceback.print_exc()
                log(section=name, error=repr(e)[:500])
            print(f"# section {name}: {time.time() - t0:.1f}s", flush=True)
    print("\n| section | numbers |\n|---|---|")
    for r in RES.get("log", []):
        r = dict(r)
        sec = r.pop("section")
        print(f"| {sec} | " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in r.items()) + " |")


if __name__ == "__main__":
    main()
