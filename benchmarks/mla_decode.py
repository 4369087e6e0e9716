"""Absorbed MLA decode attention on one GPU: the torch path of StaticDecoder vs the split-K Triton kernel.

One call computes o_lat [N, H, C] fp32 from the folded query qf [N, H, C+R] and the bf16 latent cache
[N, W, C+R] (every row's length = W - 1: the whole window visible), as `_MLA.__call__` in
k3/generation/static.py does:
- torch: bmm_acc scores [N, H, W] fp32, length mask, softmax, bmm_acc with the latent (the code of the
  "torch" path, copied below);
- triton: k3.ops.mla_decode_triton.mla_decode (split-K partials + combine).
Grid: (C, R) in {(512, 64), (256, 32)} x W in {4K, 128K, 1M} x N in {1, 8} x H in {8, 64}, bf16. Each function is
captured once as a CUDA graph and replayed; every replay is preceded by a 256 MB write that evicts L2 (as the
other layers of a decode step do), timed alone with CUDA events; median over --reps. Reported: ms, achieved GB/s
against the latent read once (N x W x (C+R) x 2 bytes), its fraction of 4.8 TB/s, the speedup, the number of
splits, and the relative RMSE of the kernel's output against the torch path's (both round q and the softmax
weights to bf16 for the dots). Then one ragged case (a 1M window holding 4K-64K tokens per row: the kernel reads
only the visible rows, the torch path the whole window) and, with --sweep, a few launch configurations of the
kernel per (C, R, H) at N=1, W=1M (the defaults are heuristics, never tuned on a GPU).

Predictions (H200, ~4.8 TB/s HBM; the kernel should run near the bandwidth floor, ~80-85% of it, plus ~10 us of
launch/combine): `small` (C=256, R=32, H=8), N=1, W=1M: 604 MB latent -> ~0.16-0.19 ms (torch: ~0.86 ms measured
inside the decoder, RESULTS.md), i.e. ~5x per MLA layer; saving ~4 ms of the 11.5 ms hybrid `small` step at 1M
(6 MLA layers) and ~17 ms of the 26.7 ms all-MLA step. C=512, R=64, H=64: 1.2 GB at N=1 -> ~0.3-0.4 ms (the two
dots are 139 kflop per latent row: still memory-bound at bf16 tensor-core rates but closer to compute-bound than
H=8). At W=4K every call is launch-bound (~10-20 us).

--smoke: the same plumbing on CPU under TRITON_INTERPRET=1 with tiny shapes (checks that the script runs, not
speed).

Usage: python benchmarks/mla_decode.py [--json PATH] [--budget-s S] [--reps R] [--sweep] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

PEAK_BPS = 4.8e12
# (block_n, num_warps, num_stages, splits factor) tried by --sweep (None: the plan's default)
SWEEP = [(None, None, None, 1), (64, 4, 3, 1), (64, 8, 2, 1), (32, 8, 2, 1), (32, 4, 3, 1), (128, 8, 2, 1),
         (16, 8, 4, 1), (None, None, None, 2), (None, None, None, 0.5)]


def torch_path(qf, buf, lens, pos, C):
    """The "torch" branch of k3.generation.static._MLA.__call__ (fp32 compute dtype)."""
    import torch
    from k3.nn.mla import bmm_acc
    s = bmm_acc(qf, buf.transpose(1, 2), torch.float32)                          # [N, H, W]
    visible = (pos.unsqueeze(0) <= lens.unsqueeze(1)).unsqueeze(1)               # [N, 1, W]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return bmm_acc(p, buf[..., :C], torch.float32)                               # [N, H, C]


def rr(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "mla_decode.json"))
    ap.add_argument("--budget-s", type=float, default=110.0, help="skip what is left after this many seconds")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also try a few kernel launch configurations")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported
    import torch
    import triton
    from k3.ops import mla_decode_triton as mdt

    if args.smoke:
        from k3.ops.triton_interp import fix_interpreter_bf16_dot
        fix_interpreter_bf16_dot()
        dev = torch.device("cpu")
        CRS, WS, NS, HS, reps = [(64, 16)], [100, 300], [1, 2], [8, 16], 1
        ragged = dict(N=2, H=8, C=64, R=16, W=400, lo=20, hi=150)
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke)")
        dev = torch.device("cuda")
        CRS, WS, NS, HS, reps = [(256, 32), (512, 64)], [4096, 131072, 1048576], [1, 8], [8, 64], args.reps
        ragged = dict(N=8, H=8, C=256, R=32, W=1048576, lo=4096, hi=65536)
    t_start = time.time()
    over = lambda: time.time() - t_start > args.budget_s
    res = {"torch": torch.__version__, "triton": triton.__version__,
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter smoke)",
           "peak_GBps": PEAK_BPS / 1e9, "rows": [], "ragged": [], "sweep": []}
    print({k: v for k, v in res.items() if not isinstance(v, list)}, flush=True)

    def save():
        tmp = args.json + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(res, fh, indent=1)
        os.replace(tmp, args.json)

    def add(key, row):
        row["t_s"] = round(time.time() - t_start, 1)
        res[key].append(row)
        print(key, row, flush=True)
        save()

    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev) if dev.type == "cuda" else None

    def timeit(fn):
        """(median ms per call, output): CUDA graph replays, L2 flushed before each; CPU: one timed call."""
        if dev.type != "cuda":
            t = time.perf_counter()
            out = fn()
            return (time.perf_counter() - t) * 1e3, out
        out = fn()                                   # compile / warm up
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gout = fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        g.replay()
        for a, b in ev:
            flush.zero_()
            a.record()
            g.replay()
            b.record()
        torch.cuda.synchronize()
        ms = statistics.median(a.elapsed_time(b) for a, b in ev)
        out = gout.clone()
        del g, gout
        return ms, out

    gen = torch.Generator(device=dev).manual_seed(0)

    def latent(N, W, D):   # drawn in bf16 (no fp32 temporary of 4x the size at N=8, W=1M)
        return torch.randn(N, W, D, device=dev, generator=gen, dtype=torch.bfloat16).mul_(0.5)

    def query(N, H, D):
        return torch.randn(N, H, D, device=dev, generator=gen) * (0.4 / D ** 0.5)

    done = False
    for C, R in CRS:
        for W in WS:
            pos = torch.arange(W, device=dev)
            for N in NS:
                if over():
                    done = True
                    break
                buf = latent(N, W, C + R)
                lens = torch.full((N,), W - 1, dtype=torch.long, device=dev)
                nbytes = buf.numel() * buf.element_size()
                for H in HS:
                    qf = query(N, H, C + R)
                    p = mdt.plan(N, H, W, C, R, buf.dtype, dev)
                    ms_t, o_t = timeit(lambda: torch_path(qf, buf, lens, pos, C))
                    ms_k, o_k = timeit(lambda: mdt.mla_decode(qf, buf, lens, C, p))
                    add("rows", dict(C=C, R=R, W=W, N=N, H=H, latent_MB=round(nbytes / 1e6, 1),
                                     ms_torch=round(ms_t, 4), ms_triton=round(ms_k, 4),
                                     speedup=round(ms_t / ms_k, 2), GBps_torch=round(nbytes / ms_t / 1e6, 1),
                                     GBps_triton=round(nbytes / ms_k / 1e6, 1),
                                     frac_peak_triton=round(nbytes / (ms_k * 1e-3) / PEAK_BPS, 3),
                                     splits=p.splits, BN=p.BN, warps=p.num_warps, stages=p.num_stages,
                                     rr_vs_torch=rr(o_k, o_t)))
                    del o_t, o_k
                del buf
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            if done:
                break
        if done:
            break

    # ragged: a reserved window much longer than the rows (the kernel reads only positions <= lens)
    if not over():
        g = ragged
        buf = latent(g["N"], g["W"], g["C"] + g["R"])
        lens = torch.randint(g["lo"], g["hi"], (g["N"],), device=dev, generator=gen)
        qf = query(g["N"], g["H"], g["C"] + g["R"])
        pos = torch.arange(g["W"], device=dev)
        p = mdt.plan(g["N"], g["H"], g["W"], g["C"], g["R"], buf.dtype, dev)
        ms_t, o_t = timeit(lambda: torch_path(qf, buf, lens, pos, g["C"]))
        ms_k, o_k = timeit(lambda: mdt.mla_decode(qf, buf, lens, g["C"], p))
        vis = int((lens + 1).sum()) * (g["C"] + g["R"]) * buf.element_size()
        add("ragged", dict(g, visible_MB=round(vis / 1e6, 1), ms_torch=round(ms_t, 4), ms_triton=round(ms_k, 4),
                           speedup=round(ms_t / ms_k, 2), GBps_visible_triton=round(vis / ms_k / 1e6, 1),
                           splits=p.splits, rr_vs_torch=rr(o_k, o_t)))
        del buf, o_t, o_k

    # launch-configuration sweep at N=1 and the longest window
    if args.sweep:
        W = WS[-1]
        for C, R in CRS:
            buf = latent(1, W, C + R)
            lens = torch.full((1,), W - 1, dtype=torch.long, device=dev)
            nbytes = buf.numel() * buf.element_size()
            for H in HS:
                qf = query(1, H, C + R)
                base = mdt.plan(1, H, W, C, R, buf.dtype, dev)
                for bn, nw, ns, fs in SWEEP[:2] if args.smoke else SWEEP:
                    if over():
                        break
                    splits = max(1, int(base.splits * fs))
                    p = mdt.plan(1, H, W, C, R, buf.dtype, dev, splits=splits, block_n=bn, num_warps=nw,
                                 num_stages=ns)
                    try:
                        ms_k, _ = timeit(lambda: mdt.mla_decode(qf, buf, lens, C, p))
                        err = None
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                        ms_k, err = float("nan"), f"{type(e).__name__}: {e}"[:200]
                    add("sweep", dict(C=C, R=R, H=H, W=W, N=1, BN=p.BN, warps=p.num_warps, stages=p.num_stages,
                                      splits=p.splits, ms=round(ms_k, 4),
                                      GBps=round(nbytes / ms_k / 1e6, 1) if ms_k == ms_k else None, error=err))
            del buf
    res["elapsed_s"] = round(time.time() - t_start, 1)
    save()
    print("done in", res["elapsed_s"], "s ->", args.json, flush=True)


if __name__ == "__main__":
    main()
