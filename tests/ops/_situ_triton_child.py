"""Run under TRITON_INTERPRET=1 by test_situ.py: the SiTU-GLU Triton kernels (k3/ops/activations_triton.py) against
the torch formulas, one row per shape: {case id: [rel err of o, dg, du]} (a case that raises records its traceback in
its own row: the custom ops' equalities and opcheck are asserted inside)."""
import json
import os
import sys

import torch

from k3.ops import activations_triton as at
from k3.ops.activations import _situ_bwd_torch, _situ_fwd_torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import case, rel_err as rel  # noqa: E402  (tests/helpers.py)

torch.manual_seed(0)


def check(R, C, dt):
    gu = torch.randn(R, 2 * C) * 8
    gu = gu.to(dt)
    g, u = gu[:, :C], gu[:, C:]          # strided halves of a fused projection
    do = torch.randn(R, C).to(dt)
    o = at.situ_fwd(g, u, 4.0, 25.0)
    o_ref = _situ_fwd_torch(g, u, 4.0, 25.0)
    dg, du = at.situ_bwd(g, u, do, 4.0, 25.0)
    dg_ref, du_ref = _situ_bwd_torch(g, u, do, 4.0, 25.0)
    errs = [rel(o, o_ref), rel(dg, dg_ref), rel(du, du_ref)]
    # the custom ops torch.compile sees: same results, and schema / fake tensors / compile checked by opcheck
    assert torch.equal(torch.ops.k3.situ_fwd(g, u, 4.0, 25.0), o)
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.k3.situ_bwd(g, u, do, 4.0, 25.0), (dg, du)))
    # the packed backward (MoE gate/up): one [R, 2C] gradient with dg and du in its halves, equal to the pair
    dh = torch.ops.k3.situ_bwd_packed(gu, do, 4.0, 25.0)
    assert dh.shape == gu.shape and torch.equal(dh[:, :C], dg) and torch.equal(dh[:, C:], du)
    if R == 5:
        torch.library.opcheck(torch.ops.k3.situ_fwd.default, (g, u, 4.0, 25.0))
        torch.library.opcheck(torch.ops.k3.situ_bwd.default, (g, u, do, 4.0, 25.0))
        torch.library.opcheck(torch.ops.k3.situ_bwd_packed.default, (gu, do, 4.0, 25.0))
    return errs


def check_tiny():
    """Small |g / b1|, |u / b2| (1e-7 .. 0.5: the exact tanh's series branch and its boundary at 1/8) against fp64,
    worst element relative: the exp-based tanh alone cancels there (rel. error up to ~0.4)."""
    mag = torch.logspace(-7, -0.3, 4096)
    sign = torch.where(torch.arange(4096) % 2 == 0, 1.0, -1.0)
    g, u = (mag * sign * 4.0).view(64, 64), (mag.flip(0) * 25.0).view(64, 64)
    o = at.situ_fwd(g, u, 4.0, 25.0, train=False)
    want = _situ_fwd_torch(g.double(), u.double(), 4.0, 25.0)
    return [((o.double() - want).abs() / want.abs()).max().item()]


res = {}
case(res, "tiny.torch.float32", check_tiny)
for R, C, dt in ((5, 48, torch.float32), (33, 512, torch.float32), (3, 1536, torch.bfloat16)):
    case(res, f"{R}x{C}.{dt}", lambda: check(R, C, dt))
print(json.dumps(res))
