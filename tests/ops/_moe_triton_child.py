"""Run under TRITON_INTERPRET=1 by test_moe_triton.py; prints one JSON object: {case id: its row} (the ids are
test_moe_triton.py's parameters; a case that raises records its traceback in its own row)."""
import json
import os
import sys

import torch

from k3.ops import moe_triton as mt
from k3.ops.activations import situ_glu
from k3.ops.moe import experts_forward, route

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import case, rel_err as rel  # noqa: E402  (tests/helpers.py)

torch.manual_seed(0)

out = {}
# kernels against plain torch: k = 3 (not a power of two), N and L not multiples of the tiles
N, k, L = 37, 3, 200
y = torch.randn(N * k + 5, L)
idx = torch.randperm(N * k + 5)[:N * k]
w = torch.rand(N, k)
d = torch.randn(N, L)
ref_sum = (y[idx].view(N, k, L).double() * w.double().unsqueeze(-1)).sum(1)
case(out, "gather_sum", lambda: rel(mt.gather_sum(y, idx, w, k, torch.float32), ref_sum))
case(out, "gather_sum unweighted",
     lambda: rel(mt.gather_sum(y, idx, None, k, torch.float32), y[idx].view(N, k, L).double().sum(1)))
case(out, "gather_dot",
     lambda: rel(mt.gather_dot(y, idx, d, k), (y[idx].view(N, k, L).double() * d.double().unsqueeze(1)).sum(-1)))
# experts_forward with the Triton combine / dispatch backward against its torch path: output and every gradient
E, l, M, Nt, kt = 6, 64, 48, 50, 4
x = torch.randn(Nt, l).requires_grad_()
gu = (torch.randn(E, l, 2 * M) * 0.1).requires_grad_()
dn = (torch.randn(E, M, l) * 0.1).requires_grad_()
rw = torch.randn(E, l)


def experts():
    res = {}
    calls = []
    origs = {name: getattr(mt, name) for name in ("gather_sum", "gather_dot")}
    for name, f in origs.items():
        def spy(*a, _f=f, _n=name):
            calls.append(_n)
            return _f(*a)
        setattr(mt, name, spy)
    try:
        for cb in ("torch", "triton"):
            idx_k, w_k, _ = route(x, rw, None, kt)
            w_k = w_k.detach().requires_grad_()
            o = experts_forward(x, idx_k, w_k, gu, dn, situ_glu, backend="padded_bmm", combine_backend=cb)
            g = torch.autograd.grad(o, (x, gu, dn, w_k), torch.ones_like(o) * 0.1 + torch.arange(l) * 1e-3)
            res[cb] = (o, g)
    finally:
        for name, f in origs.items():
            setattr(mt, name, f)
    errs = {name: rel(a, b) for name, a, b in zip(("out", "dx", "dgate_up", "ddown", "dw"),
                                                  [res["triton"][0], *res["triton"][1]],
                                                  [res["torch"][0], *res["torch"][1]])}
    return {"errs": errs, "kernel_calls": sorted(calls)}   # the triton run: combine fwd, dispatch bwd, combine bwd


case(out, "experts_forward triton combine vs torch", experts)
idx_k, w_k, _ = route(x, rw, None, kt)
w_k = w_k.detach().requires_grad_()


def compiled():
    """torch.compile(fullgraph=True) through the dispatch, the autograd.Functions and the custom ops (grouped_mm)"""
    fc = torch.compile(lambda *a: experts_forward(*a, situ_glu, backend="grouped_mm", combine_backend="triton"),
                       fullgraph=True)
    oc = fc(x, idx_k, w_k, gu, dn)
    gc = torch.autograd.grad(oc.sum(), (x, gu, dn, w_k))
    o_ref = experts_forward(x, idx_k, w_k, gu, dn, situ_glu, backend="grouped_mm", combine_backend="torch")
    g_ref = torch.autograd.grad(o_ref.sum(), (x, gu, dn, w_k))
    return max(rel(a, b) for a, b in zip([oc, *gc], [o_ref, *g_ref]))


case(out, "compiled fullgraph vs torch", compiled)


def packed():
    """the packed SiTU node of the experts (CUDA-only in use; forced here): same output and gradients as the
    formula"""
    import k3.ops.activations as A
    A._use_triton = lambda t: True
    used = []
    orig_apply = A._SiTUGLUPacked.apply
    A._SiTUGLUPacked.apply = lambda *a: used.append(1) or orig_apply(*a)
    ref_glu = lambda g, u: A.situ_glu_reference(g, u, 4.0, 25.0)  # noqa: E731
    res_p = {}
    for pk in (None, lambda h: A.situ_glu_packed(h, 4.0, 25.0)):
        o = experts_forward(x, idx_k, w_k, gu, dn, ref_glu, backend="grouped_mm", glu_packed=pk)
        res_p[pk is None] = [o, *torch.autograd.grad(o.sum(), (x, gu, dn, w_k))]
    return {"used": len(used), "err": max(rel(a, b) for a, b in zip(res_p[False], res_p[True]))}


case(out, "packed SiTU node vs formula", packed)


def opcheck():
    torch.library.opcheck(torch.ops.k3.moe_gather_sum.default, (y, idx, w, k, torch.float32))
    torch.library.opcheck(torch.ops.k3.moe_gather_dot.default, (y, idx, d, k))
    return "ok"


case(out, "opcheck", opcheck)
print(json.dumps(out))
