"""Gradient accuracy of the KDA backends on a GPU against the fp64 token loop, on the same inputs: our Triton
backward at each scratch dtype and fla's chunk_kda (k3's `backend="fla"`, safe_gate), for the interpreter tests' bf16
cases (small heads) and K3-shaped ones. It calibrates the bf16 tolerances: a case where fla itself is over a line
says the line is stricter than the reference library's own accuracy on those inputs.

    python benchmarks/kda_bwd_accuracy.py [--options fp32,states,input] [--cases a,b] [--no-fla] [--json PATH]

Prints one row per (case, backend): each gradient's relative RMSE against the fp64 loop (recurrent_kda).
"""
from __future__ import annotations

import argparse
import json
import os


GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")
# (name, B, T, H, K, V, h0 scale, cu_seqlens): the interpreter's bf16 case (tests/ops/test_kda_triton_bwd.py `bf16`:
# gate + L2 norm + unit-scale h0 + dht), the same at K3's head size, the GPU selfcheck's shape (h0 x 0.1)
CASES = [("interp_bf16_k32", 1, 100, 2, 32, 32, 1.0, None),
         ("interp_bf16_k32_T1000", 1, 1000, 2, 32, 32, 1.0, None),
         ("interp_bf16_k128", 1, 70, 2, 128, 128, 1.0, None),
         ("k128_h0_unit", 1, 1000, 4, 128, 128, 1.0, None),
         ("selfcheck_k128", 2, 1000, 8, 128, 128, 0.1, None),
         ("selfcheck_varlen", 1, 2000, 8, 128, 128, 0.1, [0, 1, 300, 301, 1999, 2000])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--options", default="fp32,states,input")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--emulate-gpu", action="store_true",
                    help="(CPU, TRITON_INTERPRET=1) GPU-like rounding in the interpreter: tf32 dots, bf16 casts to "
                         "nearest even (k3.ops.triton_interp.emulate_gpu)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "kda_bwd_accuracy.json"))
    args = ap.parse_args()
    import torch
    from k3.ops.kda import chunk_kda, recurrent_kda
    from k3.ops.kda.triton.bwd_config import ENV_LAUNCH

    dev = torch.device(args.device)
    if args.emulate_gpu:
        from k3.ops.triton_interp import emulate_gpu, fix_interpreter_bf16_dot
        fix_interpreter_bf16_dot()
        emulate_gpu(True)

    def rr(a, b):
        a, b = a.double(), b.double()
        return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))

    def grads(fn, leaves, dtype, cu, do, dS, device):
        xs = []
        for i, x in enumerate(leaves):
            x = x.to(device)
            x = (x.to(dtype) if i < 5 else x) if dtype != torch.float64 else x.double()
            xs.append(x.detach().clone().requires_grad_())
        q, k, v, f, b, h0, al, db = xs
        o, S = fn(q, k, v, f, b, initial_state=h0, output_final_state=True,
                  cu_seqlens=None if cu is None else torch.tensor(cu, device=device),
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=al, dt_bias=db, lower_bound=-5.0)
        ((o * do.to(device, o.dtype)).sum() + (S * dS.to(device, S.dtype)).sum()).backward()
        return [x.grad for x in xs]

    res = {}
    for name, B, T, H, K, V, h0s, cu in [c for c in CASES if c[0] in args.cases.split(",")]:
        gen = torch.Generator().manual_seed(1234)
        r = lambda *s: torch.randn(*s, generator=gen)
        N = B if cu is None else len(cu) - 1
        # as the interpreter test draws them: q, k, v randn, raw gate randn * 2, beta U(0, 1), h0, A_log U(0, 1),
        # dt_bias randn * 0.5
        leaves = [r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H, K) * 2, torch.rand(B, T, H, generator=gen),
                  r(N, H, K, V) * h0s, torch.rand(H, generator=gen), r(H * K) * 0.5]
        do, dS = r(B, T, H, V), r(N, H, K, V)
        # the reference sees the bf16-rounded token inputs, in fp64 (on the GPU: the token loop is sequential)
        rounded = [x.to(torch.bfloat16).float() if i < 5 else x for i, x in enumerate(leaves)]
        ref = grads(recurrent_kda, rounded, torch.float64, cu, do, dS, dev)
        runs = [(f"triton[{o}]", "triton", o) for o in args.options.split(",")]
        runs += [] if args.no_fla else [("fla", "fla", None)]
        for tag, backend, opt in runs:
            if opt is not None:
                os.environ[ENV_LAUNCH] = json.dumps({"scratch": {"DTYPE": opt}})
            try:
                got = grads(lambda *a, **kw: chunk_kda(*a, backend=backend, **kw), leaves, torch.bfloat16, cu, do,
                            dS, dev)
                row = {g: rr(a, b) for g, a, b in zip(GRADS, got, ref)}
            except Exception as e:  # (a backend refusing a case is a result too)
                row = {"error": f"{type(e).__name__}: {e}"[:300]}
            finally:
                os.environ.pop(ENV_LAUNCH, None)
            res[f"{name}.{tag}"] = row
            print(f"{name:>22} {tag:>16}: " + (" ".join(f"{g} {row[g]:.2e}" for g in GRADS) if "error" not in row
                                                else row["error"]), flush=True)
    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
