"""Run under TRITON_INTERPRET=1 by test_mxfp4_triton.py; prints one JSON object: {case id: its row} (a case that
raises records its traceback in its own row). Shapes are tiny: the interpreter runs each program in numpy."""
import json
import os
import sys

import torch

from k3.ops import dispatch
from k3.ops import mxfp4_triton as mt
from k3.ops.triton_interp import emulate_gpu, fix_interpreter_bf16_dot

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import case, rel_err as rel  # noqa: E402  (tests/helpers.py)

# bf16 dots widened exactly, and fp32 -> bf16 casts rounded as on a GPU (the interpreter's own cast truncates and
# loses subnormals: the decoded weights of the scale-0 group); the fp32 dots here are IEEE, which this leaves alone
fix_interpreter_bf16_dot()
emulate_gpu(True)
torch.manual_seed(0)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequant_fp64(packed, scale):
    """The format written out (k3/checkpoint/mxfp4.py's docstring), in fp64: byte i of a row holds columns 2i (low
    nibble) and 2i+1 (high nibble); code bits 0-2 index E2M1, bit 3 is the sign; E8M0 scale 2**(s-127), 255 NaN."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()            # [E, out, in]
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    val = torch.where((codes & 8) != 0, -mag, mag)
    s = scale.double()
    mult = torch.where(scale == 255, torch.full_like(s, float("nan")), torch.pow(2.0, s - 127))
    return val * mult.repeat_interleave(32, dim=-1)


def grouped_fp64(x, counts, packed, scale):
    W = dequant_fp64(packed, scale)
    ys, r = [], 0
    for e, c in enumerate(counts):
        ys.append(x[r:r + c].double() @ W[e].T)
        r += c
    return torch.cat(ys)


# experts with 0 rows (first, middle, last), odd counts, one larger than every row tile (17 > 16); out = 40 and
# in = 160 are not multiples of the interpreter's 32 x 64 weight tile
COUNTS = [0, 5, 1, 0, 17, 3, 0]
E, OUT, IN = len(COUNTS), 40, 160
A = sum(COUNTS)
offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
packed = torch.randint(0, 256, (E, OUT, IN // 2), dtype=torch.uint8)
scale = torch.randint(118, 134, (E, OUT, IN // 32), dtype=torch.uint8)
# scale edges: 32-column groups whose scale is 0 (the subnormal 2**-127), 1, 253 and 254 for every row; the codes
# of the 253 / 254 groups kept to |v| <= 1.5 (6 * 2**127 overflows fp32), and x's columns there scaled so that every
# group's products are O(1) (x stays a normal fp32 number)
EDGE = {0: 0, 1: 254, 2: 1, 3: 253}
for g, s in EDGE.items():
    scale[:, :, g] = s
    if s > 127:
        packed[:, :, g * 16:(g + 1) * 16] &= 0b10111011


def edge_x(rows):
    x = torch.randn(rows, IN)
    for g, s in EDGE.items():
        x[:, g * 32:(g + 1) * 32] *= 2.0 ** max(-120, min(120, 127 - s))
    return x


x = edge_x(A)
ref = grouped_fp64(x, COUNTS, packed, scale)
out = {}


def kernel(xx, cfg=None, out_dtype=None):
    return rel(mt.mxfp4_grouped_matmul(xx, offs, packed, scale, out_dtype, config=cfg), ref, finite=True)


case(out, "kernel fp32", lambda: kernel(x))
# every launch option a GPU's autotuner may pick, through the same kernel
for cfg in mt.CONFIGS:
    case(out, "config {}x{}x{} w{} s{}".format(*cfg), lambda cfg=cfg: kernel(x, cfg))
def every_expert_rows():
    """Every expert has rows, most in partial tiles (the launch's row-tile bound cdiv(A, BM) + min(E, A) is tight
    here): all rows written, equal to the formula."""
    counts = [1, 1, 17, 1, 33, 16, 1]
    xs = edge_x(sum(counts))
    o = torch.tensor(counts).cumsum(0).to(torch.int32)
    return rel(mt.mxfp4_grouped_matmul(xs, o, packed, scale), grouped_fp64(xs, counts, packed, scale), finite=True)


case(out, "kernel fp32 every expert with rows", every_expert_rows)
# bf16 activations: the bf16 x values against the fp64 formula (fp32 accumulation, bf16 output rounding)
xb = x.bfloat16()
ref_b = grouped_fp64(xb, COUNTS, packed, scale)
case(out, "kernel bf16", lambda: rel(mt.mxfp4_grouped_matmul(xb, offs, packed, scale), ref_b, finite=True))
case(out, "kernel bf16 in, fp32 out", lambda: rel(mt.mxfp4_grouped_matmul(xb, offs, packed, scale, torch.float32),
                                                   ref_b, finite=True))


def nan_scale():
    """E8M0 255 is NaN (as mxfp4_decode): exactly the outputs of that weight row, for that expert's rows, are NaN."""
    s2 = scale.clone()
    s2[4, 7, 4] = 255
    y = mt.mxfp4_grouped_matmul(x, offs, packed, s2)
    nan = torch.isnan(y)
    want = torch.zeros_like(nan)
    r0 = sum(COUNTS[:4])
    want[r0:r0 + COUNTS[4], 7] = True
    return {"exact": bool((nan == want).all()), "n_nan": int(nan.sum())}


case(out, "scale 255 is NaN", nan_scale)


def check_can_fail():
    """The check above fails for a wrong layout: the nibbles swapped in the formula."""
    swapped = (packed >> 4) | (packed << 4)
    return rel(mt.mxfp4_grouped_matmul(x, offs, packed, scale), grouped_fp64(x, COUNTS, swapped, scale))


case(out, "swapped nibbles differ", check_can_fail)


def forward_paths():
    """packed_experts_forward through the Triton path against its torch path (fp32; the CPU auto choice stays
    torch), with SiTU-GLU, a few experts without tokens."""
    from k3.checkpoint.mxfp4 import mxfp4_encode
    from k3.ops.activations import situ_glu
    from k3.ops.moe import packed_experts_forward, route
    En, l, M, N, k = 8, 64, 96, 23, 3
    gu_p, gu_s = mxfp4_encode(torch.randn(En, 2 * M, l) * 0.1)
    dn_p, dn_s = mxfp4_encode(torch.randn(En, l, M) * 0.1)
    xs = torch.randn(N, l)
    idx, w, _ = route(xs, torch.randn(En, l), None, k)
    idx = torch.where(idx == 2, torch.full_like(idx, 7), idx)   # expert 2: no tokens (7 may now repeat: fine)
    calls = []
    orig = mt.mxfp4_grouped_matmul

    def spy(*a, **kw):
        calls.append(tuple(a[2].shape))
        return orig(*a, **kw)
    mt.mxfp4_grouped_matmul = spy
    try:
        res = {b: packed_experts_forward(xs, idx, w, gu_p, gu_s, dn_p, dn_s, situ_glu, backend=b)
               for b in ("torch", "triton")}
        auto = packed_experts_forward(xs, idx, w, gu_p, gu_s, dn_p, dn_s, situ_glu)
    finally:
        mt.mxfp4_grouped_matmul = orig
    return {"err": rel(res["triton"], res["torch"], finite=True), "kernel_calls": len(calls),
            "auto_equals_torch": bool(torch.equal(auto, res["torch"])),
            "cpu_auto": dispatch.resolve("moe_packed", None, "cpu"),
            "cuda_auto": dispatch.resolve("moe_packed", None, "cuda")}


case(out, "packed_experts_forward triton vs torch", forward_paths)


def opcheck():
    torch.library.opcheck(torch.ops.k3.mxfp4_grouped_mm, (x[:, :64].contiguous(), offs, packed[:, :, :32].contiguous(),
                                                          scale[:, :, :2].contiguous(), torch.float32))
    return "ok"


case(out, "opcheck", opcheck)
print(json.dumps(out))
