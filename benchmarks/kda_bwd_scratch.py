"""Accuracy of the KDA Triton backward's scratch options on a GPU: `selfcheck.gpu_selfcheck` (bf16 inputs, T = 1000,
H = 8, D = 128, plain and varlen batches, against the fp32 torch chunk path) once per `scratch` DTYPE.

    python benchmarks/kda_bwd_scratch.py [--options fp32,input] [--json PATH]

Prints one row per option: each gradient's relative RMSE (bf16 limits: 8e-3 dq/dk/dv/dh0, 2e-2 the rest).
"""
from __future__ import annotations

import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--options", default="fp32,input")
    ap.add_argument("--T", type=int, default=1000)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "kda_bwd_scratch.json"))
    args = ap.parse_args()
    from k3.ops.kda.triton.selfcheck import gpu_selfcheck
    from k3.ops.kda.triton.bwd_config import ENV_LAUNCH
    rows = {}
    for opt in args.options.split(","):
        os.environ[ENV_LAUNCH] = json.dumps({"scratch": {"DTYPE": opt}})
        res = gpu_selfcheck(T=args.T, H=8, D=128, dtypes=("bf16",))
        rows[opt] = {k: v for k, v in res.items() if ".ms." not in k}
        worst = {n: max(v for k, v in rows[opt].items() if k.endswith("." + n))
                 for n in ("dq", "dk", "dv", "df", "dbeta", "dh0", "dA_log", "ddt_bias")}
        print(f"scratch={opt}: worst of plain/varlen " + " ".join(f"{n} {v:.2e}" for n, v in worst.items()),
              flush=True)
    os.environ.pop(ENV_LAUNCH, None)
    with open(args.json, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
