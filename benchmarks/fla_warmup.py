"""Warm fla's Triton autotuning once per kernel key, in parallel processes, and pack the results for later runs.

fla 0.6.0 ships no tuned configs for the H200: the first `chunk_kda` call of a process autotunes every kernel
(dozens of configs each, compiled one after another), which took minutes on a fresh machine. Autotune keys hold
the head count / head dims / varlen flag but not T, so one call per (H, K, V, varlen) at a realistic length tunes
every later call of that key. Each key runs in its own process (compiles are single-threaded), all sharing one
TRITON_CACHE_DIR; fla sets cache_results=True, so the winners land there as `*.autotune.json`.

  python benchmarks/fla_warmup.py --shapes 96x128,8x128,4x64 [--pack $OUT/autotune.tgz]
  python benchmarks/fla_warmup.py --no-warm --pack $OUT/autotune.tgz  # only pack what this machine's cache holds
  python benchmarks/fla_warmup.py --unpack .tcache/autotune.tgz     # before the next run on a fresh machine

Also warms our own Triton kernels' compile (decode kernel) and fla's fused AttnRes at the given widths.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time


def cache_dir() -> str:
    d = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    os.makedirs(d, exist_ok=True)
    return d


def pack(path: str) -> int:
    d = cache_dir()
    n = 0
    with tarfile.open(path, "w:gz") as tar:
        for root, _, files in os.walk(d):
            for f in files:
                if f.endswith(".autotune.json"):
                    p = os.path.join(root, f)
                    tar.add(p, arcname=os.path.relpath(p, d))
                    n += 1
    return n


def unpack(path: str) -> int:
    with tarfile.open(path) as tar:
        names = [m for m in tar.getmembers() if m.name.endswith(".autotune.json")]
        tar.extractall(cache_dir(), members=names)
    return len(names)


def child(H: int, K: int, V: int, varlen: bool, T: int) -> dict:
    import torch
    from k3.ops.kda import chunk_kda
    dev, bf = "cuda", torch.bfloat16
    t0 = time.time()
    B = 1 if varlen else 2
    r = lambda *s: torch.randn(*s, device=dev)
    q, k, f = (r(B, T, H, K).to(bf).requires_grad_() for _ in range(3))
    v = r(B, T, H, V).to(bf).requires_grad_()
    beta = torch.rand(B, T, H, device=dev).requires_grad_()
    A_log = torch.rand(H, device=dev).requires_grad_()
    dt_bias = r(H * K).requires_grad_()
    cu = torch.tensor([0, T // 3, T // 3 + 1, T], device=dev, dtype=torch.int32) if varlen else None
    kw = dict(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
              dt_bias=dt_bias, lower_bound=-5.0, cu_seqlens=cu, backend="fla")
    N = 3 if varlen else B
    h0 = torch.zeros(N, H, K, V, device=dev)
    o, S = chunk_kda(q, k, v, f, beta, initial_state=h0, output_final_state=True, **kw)
    (o.float().sum() + S.sum()).backward()
    torch.cuda.synchronize()
    t_chunk = time.time() - t0
    with torch.no_grad():  # decode: one token per sequence (fused_recurrent through the dispatch)
        d = lambda *s: r(*s).to(bf)
        kw_d = dict(kw, cu_seqlens=None)
        chunk_kda(d(N, 1, H, K), d(N, 1, H, K), d(N, 1, H, V), d(N, 1, H, K), torch.rand(N, 1, H, device=dev),
                  initial_state=h0, output_final_state=True, **kw_d)
    torch.cuda.synchronize()
    return dict(H=H, K=K, V=V, varlen=varlen, T=T, chunk_fwd_bwd_s=t_chunk, total_s=time.time() - t0)


def child_attnres(ds: list) -> dict:
    import torch
    from k3.ops.attnres import attnres_mix
    t0 = time.time()
    for d in ds:
        for dt in (torch.bfloat16, torch.float32):
            srcs = [torch.randn(4096, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(5)]
            w = torch.randn(d, device="cuda", requires_grad=True)
            attnres_mix(srcs, w, 1e-5, backend="fla").float().sum().backward()
    torch.cuda.synchronize()
    return dict(attnres=ds, total_s=time.time() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="96x128,8x128,4x64", help="H x D (K = V = D) list")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--attnres", default="1024,2048,7168")
    ap.add_argument("--pack", default=None)
    ap.add_argument("--unpack", default=None)
    ap.add_argument("--no-warm", action="store_true", help="warm nothing (with --pack: pack the cache as it is)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=420.0)
    a = ap.parse_args()
    if a.unpack:
        print(json.dumps(dict(unpacked=unpack(a.unpack), cache=cache_dir())), flush=True)
        return
    if a.child:
        spec = json.loads(a.child)
        out = child_attnres(spec["attnres"]) if "attnres" in spec else child(**spec)
        print("RESULT " + json.dumps(out), flush=True)
        return
    if a.no_warm:
        if a.pack:
            print(json.dumps(dict(packed=pack(a.pack), to=a.pack)), flush=True)
        return
    jobs = []
    for s in a.shapes.split(","):
        H, D = (int(x) for x in s.lower().split("x"))
        for varlen in (False, True):
            jobs.append(dict(H=H, K=D, V=D, varlen=varlen, T=a.T))
    if a.attnres:
        jobs.append(dict(attnres=[int(x) for x in a.attnres.split(",")]))
    t0 = time.time()
    procs = [(j, subprocess.Popen([sys.executable, __file__, "--child", json.dumps(j)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)) for j in jobs]
    for j, p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, a.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            print(json.dumps(dict(job=j, error="timeout", tail=out[-800:])), flush=True)
            continue
        res = [l for l in out.splitlines() if l.startswith("RESULT ")]
        print(res[-1][7:] if res else json.dumps(dict(job=j, rc=p.returncode, tail=out[-1500:])), flush=True)
    print(json.dumps(dict(warmup_wall_s=time.time() - t0)), flush=True)
    if a.pack:
        print(json.dumps(dict(packed=pack(a.pack), to=a.pack)), flush=True)


if __name__ == "__main__":
    main()
