"""`gpu_selfcheck()`: the Triton KDA backward against autograd through the fp32 torch chunk path on a CUDA device
(tests/gpu and benchmarks/gpu_run.sh stage `kdabwd`)."""
from __future__ import annotations

import torch

from ..chunk import chunk_kda_torch
from .chunk import TritonKDAConfig, chunk_kda_triton


def gpu_selfcheck(T: int = 1000, H: int = 8, D: int = 128, seed: int = 0, device: str = "cuda",
                  dtypes: tuple = ("bf16", "fp32")) -> dict:
    """Triton backward vs autograd through the fp32 torch chunk path at K3 head shapes (raw gate in the kernel,
    L2 norm, initial state and dht; one plain and one varlen batch). Returns {"<case>.<grad>": relative RMSE},
    plus "ms.triton_bwd" / "ms.torch_bwd" wall times of one backward. bf16 cases should stay <= ~8e-3 for
    dq/dk/dv/dh0 and <= ~2e-2 for dg/dbeta/dA_log/ddt_bias; fp32 cases ~1e-5. dtypes: which input dtypes to run
    (the fp32 kernels' first compile is slow: minutes of ptxas)."""
    import time

    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dev)
    names = ("dq", "dk", "dv", "df", "dbeta", "dh0", "dA_log", "ddt_bias")
    res = {}

    def rr(a, b):
        a, b = a.double(), b.double()
        return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))

    def grads(backend, dtype, leaves, cu, do, dht, bwd=None):
        xs = [x.detach().clone().to(dtype if i < 5 else torch.float32).requires_grad_()
              for i, x in enumerate(leaves)]
        q, k, v, f, b, h0, al, db = xs
        kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, A_log=al, dt_bias=db)
        if backend == "torch":
            o, S = chunk_kda_torch(q, k, v, f, b, **kw)
        else:  # bwd: "torch" = the recompute backward (None: $K3_KDA_TRITON_BWD, else the kernels)
            o, S = chunk_kda_triton(q, k, v, f, b, config=TritonKDAConfig(bwd=bwd), **kw)
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        ((o.float() * do).sum() + (S * dht).sum()).backward()
        torch.cuda.synchronize(dev)
        ms = (time.perf_counter() - t) * 1e3
        return [x.grad for x in xs], ms

    for case, B, cu_list in (("plain", 2, None), ("varlen", 1, [0, 1, 300, 301, 2 * T - 1, 2 * T])):
        TT = T if cu_list is None else 2 * T
        N = B if cu_list is None else len(cu_list) - 1
        cu = None if cu_list is None else torch.tensor(cu_list, device=dev)
        leaves = [rnd(B, TT, H, D), rnd(B, TT, H, D), rnd(B, TT, H, D), rnd(B, TT, H, D) * 2,
                  torch.rand(B, TT, H, generator=gen).to(dev), rnd(N, H, D, D) * 0.1,
                  torch.rand(H, generator=gen).to(dev), rnd(H * D) * 0.5]
        do, dht = rnd(B, TT, H, D), rnd(N, H, D, D)
        for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            if tag not in dtypes:
                continue
            # the reference sees the same (rounded) inputs, in fp32
            rounded = [x.to(dtype).float() if i < 5 else x for i, x in enumerate(leaves)]
            ref, ms_ref = grads("torch", torch.float32, rounded, cu, do, dht)
            grads("triton", dtype, leaves, cu, do, dht)  # warm-up / compile
            got, ms = grads("triton", dtype, leaves, cu, do, dht)
            for n, a, b in zip(names, got, ref):
                res[f"{case}.{tag}.{n}"] = rr(a, b)
            res[f"{case}.{tag}.ms.triton_bwd"] = ms
            res[f"{case}.{tag}.ms.torch_path_bwd"] = ms_ref
            if tag == "bf16":
                _, ms_old = grads("triton", dtype, leaves, cu, do, dht, bwd="torch")
                res[f"{case}.{tag}.ms.torch_recompute_bwd"] = ms_old
    return res
