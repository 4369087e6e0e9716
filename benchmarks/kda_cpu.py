"""CPU timing of the pure-PyTorch KDA paths: chunk_kda (torch backend) vs the token-by-token recurrent_kda.

Notable: times are medians over --reps runs after one warm-up, and the ratio is measured in the same run
(2-core dev machines are noisy). Results are checked against the reference before timing. Inputs follow K3:
in-kernel L2 norm and bounded gate (lower_bound=-5).
Usage: python benchmarks/kda_cpu.py [--T 2048 --H 4 --K 64 --V 64 --reps 5 --threads 2 --json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform

import torch

from k3.ops.kda import chunk_kda, recurrent_kda

from _common import median_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave default)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    B, T, H, K, V = a.B, a.T, a.H, a.K, a.V
    q, k, f = (torch.randn(B, T, H, K) for _ in range(3))
    v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
    A_log, dt_bias = torch.rand(H), torch.randn(H * K) * 0.5
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              output_final_state=True)

    with torch.no_grad():
        o_c, s_c = chunk_kda(q, k, v, f, beta, backend="torch", **kw)
        o_r, s_r = recurrent_kda(q, k, v, f, beta, **kw)
    err = ((o_c - o_r).abs().max() / o_r.abs().max()).item()

    def chunk_fwd():
        with torch.no_grad():
            chunk_kda(q, k, v, f, beta, backend="torch", **kw)

    def rec_fwd():
        with torch.no_grad():
            recurrent_kda(q, k, v, f, beta, **kw)

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, f, beta)]

    def chunk_fwd_bwd():
        o, s = chunk_kda(*leaves, backend="torch", **kw)
        (o.sum() + s.sum()).backward()

    rows = [("recurrent_kda fwd", median_s(rec_fwd, a.reps, warmup=1)),
            ("chunk_kda fwd", median_s(chunk_fwd, a.reps, warmup=1)),
            ("chunk_kda fwd+bwd", median_s(chunk_fwd_bwd, a.reps, warmup=1))]
    base = rows[0][1]
    print(f"KDA CPU  B={B} T={T} H={H} K={K} V={V} fp32  torch {torch.__version__}  threads "
          f"{torch.get_num_threads()}  reps {a.reps} (median)  max rel err chunk vs recurrent {err:.2e}")
    print(f"{'path':<20}{'ms':>10}{'tok/s':>12}{'recurrent/this':>16}")
    for name, t in rows:
        print(f"{name:<20}{t * 1e3:>10.1f}{B * T / t:>12.0f}{base / t:>16.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"shape": dict(B=B, T=T, H=H, K=K, V=V), "dtype": "float32", "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "machine": platform.platform(), "reps": a.reps,
                       "max_rel_err": err, "median_ms": {n: t * 1e3 for n, t in rows},
                       "speedup_vs_recurrent_fwd": {n: base / t for n, t in rows}}, fh, indent=1)


if __name__ == "__main__":
    main()
