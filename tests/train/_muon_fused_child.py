"""Run under TRITON_INTERPRET=1 by test_optim.py: MuonAdamW(fused=True) against the foreach path on a micro K3
model (per-head, stacked experts, gate_up halves, tall and wide plain matrices), fp32 weights and bf16 weights
with fp32 masters, three steps with the same gradients. Prints one JSON object: {case id: its row} (a case that
raises records its traceback in its own row)."""
import copy
import json
import os
import sys

import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.ops.triton_interp import emulate_gpu, fix_interpreter_bf16_dot
from k3.train.optim import build_optimizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import _MICRO_MODEL  # noqa: E402  (the trainer tests' micro model, tests/conftest.py)
from helpers import case, rel_err  # noqa: E402  (tests/helpers.py)

fix_interpreter_bf16_dot()
emulate_gpu(True)   # fp32 -> bf16 stores round to nearest even, as on the GPU (the interpreter truncates)
torch.manual_seed(0)
cfg = K3Config.from_preset("tiny", **_MICRO_MODEL)
base = K3ForCausalLM(cfg)
out = {}


def compare(dt, masters):
    models = [copy.deepcopy(base).to(dt) for _ in range(2)]
    opts = [build_optimizer(m, lr=0.02, weight_decay=0.1, master_weights=masters, fused=f)
            for m, f in zip(models, (False, True))]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        grads = {n: torch.randn(p.shape, generator=g).to(dt) for n, p in models[0].named_parameters()}
        for m, o in zip(models, opts):
            for n, p in m.named_parameters():
                p.grad = grads[n].clone()
            o.step()
    worst, worst_master, n_muon = 0.0, 0.0, 0
    n_masters = 0
    for (n, pa), (_, pb) in zip(models[0].named_parameters(), models[1].named_parameters()):
        a, b = pa.detach(), pb.detach()
        worst = max(worst, rel_err(b, a))      # fused relative to the foreach run
        if masters and "master" in opts[0].state.get(pa, {}):
            n_masters += 1
            ma, mb = opts[0].state[pa]["master"], opts[1].state[pb]["master"]
            worst_master = max(worst_master, rel_err(mb, ma))
    n_muon = sum(len(gr["params"]) for gr in opts[1].param_groups if gr["use_muon"])
    ortho = sorted({gr["ortho"] for gr in opts[1].param_groups if gr["use_muon"]})
    return dict(worst=worst, worst_master=worst_master, n_muon=n_muon, orthos=ortho, n_masters=n_masters)


for name, dt, masters in (("fp32", torch.float32, False), ("bf16_masters", torch.bfloat16, True)):
    case(out, name, lambda: compare(dt, masters))
print(json.dumps(out))
