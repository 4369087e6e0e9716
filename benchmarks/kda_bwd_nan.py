"""Diagnostic: non-finite gradients of the Triton KDA backward at K3 shapes (B1 T8K H96 bf16, the inputs of
kda_bwd_sweep.py) and smaller T / H / milder gates, with each intermediate's count (bwd.CHECK_NONFINITE).
Launch options come from $K3_KDA_BWD_LAUNCH. Usage: python benchmarks/kda_bwd_nan.py [T,H,ALOG_HI,STATES ...]
(STATES 1: with an initial state and a final-state gradient, as gpu_selfcheck has them)."""
import sys

import torch
from k3.ops.kda.triton import bwd as ops_bwd

ops_bwd.CHECK_NONFINITE = True

cases = [(8192, 96, 16, 0), (1024, 96, 16, 0), (8192, 8, 16, 0), (8192, 96, 2.7, 0), (1024, 8, 2.7, 0)]
if len(sys.argv) > 1:
    cases = [tuple(float(x) if i == 2 else int(x) for i, x in enumerate(a.split(","))) for a in sys.argv[1:]]
for T, H, alog_hi, states in cases:
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    D = 128
    q, k, v, f, do = (r(1, T, H, D).bfloat16() for _ in range(5))
    beta = r(1, T, H).sigmoid().bfloat16()
    A_log = torch.log(torch.empty(H, device="cuda").uniform_(1, alog_hi, generator=gen))
    dtb = r(H * D) * 0.1
    h0, dht = (r(1, H, D, D) * 0.1, r(1, H, D, D)) if states else (None, None)
    print(f"== T={T} H={H} exp(A_log)<={alog_hi} states={states}", flush=True)
    g = ops_bwd.kda_chunk_bwd(q, k, v, f, beta, do, dht, D ** -0.5, initial_state=h0, use_qk_l2norm_in_kernel=True,
                              use_gate_in_kernel=True, A_log=A_log, dt_bias=dtb, lower_bound=-5.0)
    torch.cuda.synchronize()
    print("grads nonfinite:", {n: int((~torch.isfinite(x)).sum()) for n, x in
                               zip(("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"), g)}, flush=True)
