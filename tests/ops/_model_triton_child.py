"""Run under TRITON_INTERPRET=1 by test_model_triton.py: a micro K3 model (fp32) with every opt-in Triton path of
the training step forced on (short conv, MoE combine / dispatch backward, packed SiTU node) against the same model
on its torch paths: loss and every gradient. Prints one JSON object: {case id: its row} (test_model_triton.py's
cases)."""
import json
import os
import sys

import torch

import k3.ops.activations as A
from k3 import knobs
from k3.config import K3Config
from k3.model import K3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import _MICRO_MODEL  # noqa: E402  (the trainer tests' micro model, tests/conftest.py)
from helpers import rel_err as rel  # noqa: E402  (tests/helpers.py)

torch.manual_seed(0)
cfg = K3Config.from_preset("tiny", **_MICRO_MODEL)
m = K3ForCausalLM(cfg).float().train()
with torch.no_grad():
    for n, p in m.named_parameters():
        if n.endswith("_res_proj.weight"):
            p.normal_(0, 0.5)
ids = torch.randint(0, 250, (1, 70))
cu = torch.tensor([0, 5, 5, 40, 70], dtype=torch.int32)   # documents of 5, 0, 35 and 30 tokens
from k3.ops import activations_triton as at, conv_triton as ct, moe_triton as mt  # noqa: E402
calls = {}
for mod, name in ((ct, "conv1d_fwd"), (ct, "conv1d_bwd"), (mt, "gather_sum"), (mt, "gather_dot"),
                  (at, "situ_fwd"), (at, "situ_bwd")):
    def spy(*a, _f=getattr(mod, name), _n=name, **kw):
        calls[_n] = calls.get(_n, 0) + 1
        return _f(*a, **kw)
    setattr(mod, name, spy)
res = {}
for mode in ("torch", "triton"):
    if mode == "triton":
        knobs.set(K3_BACKEND="conv:triton,moe_combine:triton")   # (the parent clears the variable)
        A._use_triton = lambda t: True      # the SiTU kernels and the packed node (CUDA-only in normal use)
    m.zero_grad(set_to_none=True)
    out = m(ids, labels=ids.roll(-1, 1), cu_seqlens=cu)
    out.loss.backward()
    res[mode] = (out.loss.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters()
                                     if p.grad is not None})
gt, gr = res["triton"][1], res["torch"][1]
print(json.dumps({"kernel calls": calls,
                  "loss": rel(res["triton"][0], res["torch"][0]),
                  "gradients": {"n": len(gt), "same_params": sorted(gt) == sorted(gr),
                                "worst": max(rel(gt[n], gr[n]) for n in gr if gr[n].norm() > 0)}}))
