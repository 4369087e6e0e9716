"""Run under TRITON_INTERPRET=1 by test_conv_triton.py; prints one JSON object: {case id: its row} (the ids are
test_conv_triton.py's parameters; a case that raises records its traceback in its own row)."""
import json
import os
import sys

import torch

from k3.ops import conv_triton as ct
from k3.ops.conv import causal_conv1d, causal_conv1d_reference

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import case, rel_err as rel  # noqa: E402  (tests/helpers.py)

torch.manual_seed(0)
# the backward's launch options checked per case (None: the autotuned default, the first of BWD_CONFIGS under the
# interpreter); $K3_TEST_LAUNCH_OPTIONS "all" (test_conv_triton.py's slow tests): every one; else ("default") one BT
# block per SPAN and the rolling kernel at one width, the most distinct (8 x 128 only widens the default's channel
# block; the second rolling width takes as long as the default)
BWD_OPTIONS = {"default": (None, (64, 64, 8), (1, 128, 1)),
               "all": (None, (64, 64, 8), (8, 128, 4), (1, 128, 1), (1, 64, 2))}
bwd_options = BWD_OPTIONS[os.environ.get("K3_TEST_LAUNCH_OPTIONS", "default")]


def ref_grads(x, w, act, cu=None):
    """fp64: the token-loop definition per document."""
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    if cu is None:
        y = causal_conv1d_reference(xd, wd, activation=act)[0]
    else:
        ys = [causal_conv1d_reference(xd[:, a:b], wd, activation=act)[0] if b > a else xd[:, a:b] * 0
              for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        y = torch.cat(ys, 1)
    return y, xd, wd


def check(x, w, act, cu=None):
    """The forward and the backward (the autotuned default and more of its launch options, bwd_options: one BT block
    per SPAN, eight, and the rolling one-row-at-a-time kernel (BT = 1) at two widths) against fp64; the worst
    backward."""
    y_ref, xd, wd = ref_grads(x, w, act, cu)
    dy = torch.randn_like(y_ref)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (xd, wd), dy)
    starts = ct.token_starts(cu, x.shape[1]) if cu is not None else None
    y = ct.conv1d_fwd(x, w, starts, act is not None)
    out = {"y": rel(y, y_ref), "dx": 0.0, "dw": 0.0}
    for cfg in bwd_options:
        dx, dw = ct.conv1d_bwd(x, w, dy.to(x.dtype), starts, act is not None, config=cfg)
        out["dx"], out["dw"] = max(out["dx"], rel(dx, dx_ref)), max(out["dw"], rel(dw, dw_ref))
    return out


out = {}
for act in ("silu", None):
    x = torch.randn(2, 150, 200) * 2
    w = torch.randn(200, 4) * 0.5
    case(out, f"fp32 {act or 'no-act'} B2 T150 C200", lambda: check(x, w, act))
cu = torch.tensor([0, 1, 1, 71, 76, 156], dtype=torch.int32)
x = torch.randn(1, 156, 130) * 2
w = torch.randn(130, 4) * 0.5
case(out, "fp32 varlen docs 1,0,70,5,80", lambda: check(x, w, "silu", cu))
case(out, "varlen without resets", lambda: {"y": rel(ct.conv1d_fwd(x, w, None, True), ref_grads(x, w, "silu", cu)[0])})
xb, wb = (torch.randn(2, 100, 256) * 2).bfloat16(), torch.randn(256, 4) * 0.5
case(out, "bf16 silu B2 T100 C256", lambda: check(xb, wb, "silu"))
# the dispatch path with autograd (custom ops + autograd.Function) against the torch path
x = (torch.randn(1, 90, 160) * 2).requires_grad_()
wc = (torch.randn(160, 1, 4) * 0.5).requires_grad_()
cu = torch.tensor([0, 30, 90], dtype=torch.int32)
calls = []
orig = ct.conv1d_fwd


def spy(*a):
    calls.append(1)
    return orig(*a)


y_r, _ = causal_conv1d(x, wc, cu_seqlens=cu, backend="torch")
dy = torch.randn_like(y_r)
g_r = torch.autograd.grad(y_r, (x, wc), dy)


def dispatch():
    calls.clear()
    ct.conv1d_fwd = spy
    try:
        y_t, st = causal_conv1d(x, wc, cu_seqlens=cu, backend="triton")
    finally:
        ct.conv1d_fwd = orig
    g_t = torch.autograd.grad(y_t, (x, wc), dy)
    return {"took_triton": bool(calls) and st is None,
            "errs": {"y": rel(y_t, y_r), "dx": rel(g_t[0], g_r[0]), "dw": rel(g_t[1], g_r[1])}}


case(out, "dispatch triton vs torch", dispatch)


def kernel_size_3():
    """the backward kernel is written for 4, so backend "triton" takes the torch path (and says why)"""
    w3 = torch.randn(160, 1, 3) * 0.5
    calls.clear()
    ct.conv1d_fwd = spy
    try:
        y3 = causal_conv1d(x.detach(), w3, backend="triton")[0]
    finally:
        ct.conv1d_fwd = orig
    r = {"took_torch": not calls and rel(y3, causal_conv1d(x.detach(), w3, backend="torch")[0]) == 0.0}
    try:
        ct.conv1d_bwd(x.detach(), w3.reshape(160, 3), dy, None, True)
        r["bwd_error"] = ""
    except ValueError as e:
        r["bwd_error"] = str(e)
    return r


case(out, "kernel size 3", kernel_size_3)


def opcheck():
    s = ct.token_starts(cu, 90)
    torch.library.opcheck(torch.ops.k3.conv1d_fwd.default, (x.detach(), wc.detach().reshape(160, 4), s, True))
    torch.library.opcheck(torch.ops.k3.conv1d_bwd.default, (x.detach(), wc.detach().reshape(160, 4), dy, s, True))
    return "ok"


case(out, "opcheck", opcheck)


def compiled():
    """torch.compile(fullgraph=True) through the dispatch, the custom ops and the autograd.Function"""
    f = torch.compile(lambda a, b, c: causal_conv1d(a, b, cu_seqlens=c, backend="triton")[0], fullgraph=True)
    y_c = f(x, wc, cu)
    g_c = torch.autograd.grad(y_c, (x, wc), dy)
    return {"y": rel(y_c, y_r), "dx": rel(g_c[0], g_r[0]), "dw": rel(g_c[1], g_r[1])}


case(out, "compiled fullgraph vs torch", compiled)
print(json.dumps(out))
