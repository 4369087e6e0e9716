"""Time the trainer's optimizer (MuonAdamW: per-head Muon + AdamW, fp32 masters for bf16 weights) alone on one GPU
for the parameters of a preset, by phase, against torch's fused AdamW on the same parameters.

    python benchmarks/optim_gpu.py [--preset small] [--steps 5] [--json PATH]

Why: in the compiled `small` training step (B8 T4096, bf16 weights) the trainer's optimizer added ~210 ms per step
over fused AdamW (trainmaster vs trainbf16 stages); the Newton-Schulz GEMMs alone are ~22 TFLOP (~40 ms). Phases:
momentum (fp32 casts of the grads, buffer update, Nesterov direction), Newton-Schulz (all Muon blocks, batched by
shape), apply (decay + update of the masters, copy to the bf16 weights), AdamW groups; then the whole step with
the fused Triton momentum / apply kernels (`fused=True`, the CUDA default since the seventh session).
"""
from __future__ import annotations

import argparse
import json
import os
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "optim_gpu.json"))
    a = ap.parse_args()
    import torch
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.train.optim import build_optimizer, orthogonalize_many
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = K3ForCausalLM(K3Config.from_preset(a.preset)).to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def timed(fn, n=a.steps):
        fn()
        sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t) / n * 1e3

    res = dict(preset=a.preset, device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
               torch=torch.__version__, params=sum(p.numel() for p in params), tensors=len(params))
    torch.set_grad_enabled(False)
    opt = build_optimizer(model, lr=1e-4, master_weights=True, fused=False)   # the foreach path, by phase
    res["muon_adamw_step_ms"] = timed(opt.step)
    muon = [g for g in opt.param_groups if g["use_muon"]]
    moms = [opt._momentum(g) for g in muon]
    res["muon_params"] = sum(p.numel() for ps, _ in moms for p in ps)
    res["phase_momentum_ms"] = timed(lambda: [opt._momentum(g) for g in muon])
    us = [u for _, uu in moms for u in uu]
    orthos = [g["ortho"] for g, (ps, _) in zip(muon, moms) for _ in ps]
    res["phase_newton_schulz_ms"] = timed(lambda: orthogonalize_many(us, orthos))
    dirs = orthogonalize_many(us, orthos)
    spans, i = [], 0
    for g, (ps, _) in zip(muon, moms):
        spans.append((g, ps, dirs[i:i + len(ps)]))
        i += len(ps)
    res["phase_apply_ms"] = timed(lambda: [opt._apply(ps, d, g["lr"], g["weight_decay"]) for g, ps, d in spans])
    adam_groups = [g for g in opt.param_groups if not g["use_muon"]]
    res["phase_adamw_groups_ms"] = timed(lambda: [opt._adamw_group(g) for g in adam_groups])
    del opt, dirs, us, moms, spans
    if dev == "cuda":   # the Triton momentum / apply kernels (k3/train/optim_triton.py; the CUDA default)
        fopt = build_optimizer(model, lr=1e-4, master_weights=True, fused=True)
        res["muon_adamw_fused_step_ms"] = timed(fopt.step)
        del fopt
    ref = torch.optim.AdamW(params, lr=1e-4, fused=(dev == "cuda"))
    res["torch_fused_adamw_ms"] = timed(ref.step)
    print(json.dumps(res), flush=True)
    with open(a.json, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
