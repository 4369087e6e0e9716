"""MXFP4-packed routed experts on one GPU: the Triton grouped GEMM that dequantises tiles in registers
(`packed_experts_forward(backend="triton")`, k3/ops/mxfp4_triton.py) against the torch decode-then-GEMM path
(`backend="torch"`: selected experts decoded block by block into a scratch buffer, padded batched GEMMs) and against
the dequantise-on-load model (`experts_forward` on bf16 weights, `torch._grouped_mm`), at the `small` preset's and
one K3 layer's expert shape (`kimi-k3` = the released config: 896 experts, latent l 3584, expert width M 3072,
top-16), N tokens routed by a random sigmoid router. Per path: median ms of the whole routed-expert forward
(dispatch, both GEMMs, SiTU-GLU, combine), TFLOP/s of the two GEMMs, peak CUDA memory above the inputs during the
call, the resident expert-weight bytes, and the relative error against the bf16 grouped_mm path (same weights:
MXFP4 decoding is exact). The first Triton call per shape autotunes (5 launch options per GEMM; compile included in
the wall time, not in the timings). One JSON row per (shape, path) and the whole table at the end.

    python benchmarks/mxfp4_gpu.py [--shapes small,kimi-k3] [--tokens 4096] [--json PATH]     (H200: ~1 min)
    TRITON_INTERPRET=1 python benchmarks/mxfp4_gpu.py --device cpu --dtype float32 --shapes 8x64x96x2 --tokens 16
        (a smoke run of the script on CPU, no timing value; a shape is ExLxMxK or a preset name)
"""
from __future__ import annotations

import argparse
import json
import os
import time


def _shape(spec: str):
    """(name, E, l, M, top_k) from a preset name or ExLxMxK."""
    if "x" in spec and spec.replace("x", "").isdigit():
        E, l, M, k = (int(v) for v in spec.split("x"))
        return spec, E, l, M, k
    from k3.config import K3Config
    c = K3Config.from_preset(spec)
    return spec, c.num_experts, c.routed_expert_hidden_size, c.moe_intermediate_size, c.num_experts_per_token


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="small,kimi-k3")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "mxfp4_gpu.json"))
    a = ap.parse_args(argv)
    import torch

    from k3.checkpoint.mxfp4 import mxfp4_decode
    from k3.ops.activations import situ_glu
    from k3.ops.moe import experts_forward, packed_experts_forward, route

    dev = torch.device(a.device)
    dt = getattr(torch, a.dtype)
    cuda = dev.type == "cuda"
    if cuda:
        from triton.testing import do_bench
    else:
        def do_bench(fn, return_mode="median"):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def peak_extra_mb(fn):
        """Peak CUDA memory above what is allocated before the call (its scratch and outputs), MB."""
        if not cuda:
            return None
        sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync()
        return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)

    rows = []
    t_start = time.perf_counter()
    for spec in a.shapes.split(","):
        name, E, l, M, k = _shape(spec.strip())
        g = torch.Generator(device=dev).manual_seed(0)
        # random codes; scales 2**-8 .. 2**-3 (weights of realistic size, GLU inputs O(1))
        gp = torch.randint(0, 256, (E, 2 * M, l // 2), generator=g, device=dev, dtype=torch.uint8)
        gs = torch.randint(119, 125, (E, 2 * M, l // 32), generator=g, device=dev, dtype=torch.uint8)
        dp = torch.randint(0, 256, (E, l, M // 2), generator=g, device=dev, dtype=torch.uint8)
        ds = torch.randint(119, 125, (E, l, M // 32), generator=g, device=dev, dtype=torch.uint8)
        packed_bytes = sum(t.numel() for t in (gp, gs, dp, ds))
        # the dequantise-on-load weights in the layout experts_forward takes ([E, in, out], contiguous), decoded
        # 16 experts at a time
        gu_EIO = torch.empty(E, l, 2 * M, device=dev, dtype=dt)
        dn_EIO = torch.empty(E, M, l, device=dev, dtype=dt)
        for e0 in range(0, E, 16):
            gu_EIO[e0:e0 + 16] = mxfp4_decode(gp[e0:e0 + 16], gs[e0:e0 + 16], dt).transpose(1, 2)
            dn_EIO[e0:e0 + 16] = mxfp4_decode(dp[e0:e0 + 16], ds[e0:e0 + 16], dt).transpose(1, 2)
        dense_bytes = (gu_EIO.numel() + dn_EIO.numel()) * gu_EIO.element_size()
        x = torch.randn(a.tokens, l, generator=g, device=dev).to(dt)
        idx, w, _ = route(x, torch.randn(E, l, generator=g, device=dev).to(dt), None, k)
        flops = 2 * a.tokens * k * (l * 2 * M + M * l)
        paths = {
            "triton (packed, in-register dequant)": lambda: packed_experts_forward(x, idx, w, gp, gs, dp, ds,
                                                                                   situ_glu, backend="triton"),
            "torch (packed, block decode + bmm)": lambda: packed_experts_forward(x, idx, w, gp, gs, dp, ds,
                                                                                 situ_glu, backend="torch"),
            "bf16 grouped_mm (dequantised on load)": lambda: experts_forward(
                x, idx, w, gu_EIO, dn_EIO, situ_glu, backend="grouped_mm" if cuda else "padded_bmm"),
        }
        outs = {}
        with torch.no_grad():
            for pname, fn in paths.items():
                t0 = time.perf_counter()
                outs[pname] = fn()          # first call: Triton compiles and autotunes here
                sync()
                first_s = time.perf_counter() - t0
                ms = do_bench(fn, return_mode="median")
                r = dict(shape=name, experts=E, latent=l, inter=M, top_k=k, tokens=a.tokens, dtype=a.dtype,
                         path=pname, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), first_call_s=round(first_s, 2),
                         peak_extra_mb=peak_extra_mb(fn),
                         expert_weight_mb=round((dense_bytes if pname.startswith("bf16") else packed_bytes) / 2**20, 1))
                rows.append(r)
                print(json.dumps(r), flush=True)
            ref = outs["bf16 grouped_mm (dequantised on load)"].double()
            for r in rows:
                if r["shape"] == name:
                    o = outs[r["path"]].double()
                    r["rel_err_vs_bf16_grouped_mm"] = float((o - ref).norm() / ref.norm().clamp_min(1e-300))
        paths.clear()
        outs.clear()
        gp = gs = dp = ds = gu_EIO = dn_EIO = None  # free this shape's weights before the next one
        if cuda:
            torch.cuda.empty_cache()
    print("| shape | path | ms | TFLOP/s | peak extra MB | expert weights MB | rel err vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['path']} | {r['ms']:.3f} | {r['tflops']} | {r['peak_extra_mb']} | "
              f"{r['expert_weight_mb']} | {r['rel_err_vs_bf16_grouped_mm']:.2e} |")
    summary = {"device": torch.cuda.get_device_name() if cuda else a.device, "torch": torch.__version__,
               "wall_s": round(time.perf_counter() - t_start, 1), "rows": rows}
    print(json.dumps(summary))
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    main()
