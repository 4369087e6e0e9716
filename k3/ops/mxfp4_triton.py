"""Grouped GEMM over MXFP4-packed expert weights, dequantised in registers (CUDA; Triton's interpreter in tests).

y[rows of e] = x[rows of e] @ dequant(W_e)^T for every expert e, over rows sorted by expert (k3.ops.moe.dispatch_tokens:
`offs[e]` = the cumulative end of expert e's rows, int32). W_e [out, in] is stored as in k3/checkpoint/mxfp4.py:
`packed` uint8 [E, out, in/2] (element 2i of a row in the low nibble of byte i, 2i+1 in the high nibble) and `scale`
uint8 [E, out, in/32] (E8M0: 2**(s - 127); s = 0 is the subnormal 2**-127, s = 255 NaN, as mxfp4_decode).

One program per (row tile of one expert, out tile). The row tiles of all experts are numbered consecutively, expert
by expert (expert e has ceil(count_e / BM) of them); a program finds its expert from `offs` itself (a cumulative sum
over the padded expert axis), so the launch needs no host sync: the grid is the upper bound cdiv(A, BM) + min(E, A)
row tiles (full tiles plus one partial tile per expert with rows) and programs past the last tile run no K
iterations and store nothing. Per K block of BK inputs the program loads the x tile, the packed codes and the
scales of its [BN, BK] weight tile, decodes each E2M1 code to its fp32 bit pattern (the 16-value table {0, .5, 1, 1.5, 2, 3, 4, 6} x sign, written as exponent/mantissa bits), multiplies
by the fp32 scale built from the E8M0 byte's bits (exact: 2 significant bits times a power of two), casts to x's
dtype (exact for bf16 / fp32) and accumulates tl.dot in fp32. No full-precision copy of any weight is written to
global memory. x in bf16 / fp16 / fp32 (fp32: IEEE fp32 dots, no TF32, slow on a GPU; fp16: decoded weights above
65504 overflow, as a decode to fp16 would); y in `out_dtype`.

Opaque custom op `torch.ops.k3.mxfp4_grouped_mm` (torch.compile launches it as written). The CUDA default of the
"moe_packed" op family (k3/ops/moe.py: packed_experts_forward; `K3_BACKEND=moe_packed:torch` for the decode-then-GEMM
torch path). Launch options: triton.autotune picks among CONFIGS on a GPU's first call per (out, in, rows-per-expert
bucket); the first one under the interpreter. All compile for sm_90 without spills, on tensor cores
(tests/ops/test_mxfp4_triton.py). Timing against the torch path and dequantise-on-load: benchmarks/mxfp4_gpu.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# (BM rows, BN outputs, BK inputs, warps, stages); BM = 16 is for
# decode-sized calls (a handful of rows per expert), the others for prefill.
CONFIGS = [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 128, 4, 3), (16, 64, 128, 4, 3), (16, 128, 64, 4, 4)]
# under the interpreter: small tiles, so that the tests cross row, output and K tile edges
INTERP_CONFIG = (16, 32, 64, 4, 1)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _mxfp4_gmm_kernel(x, offs, wp, ws, y, E, OUT, IN, sxa, swe, swo, sse, sso, sya, ROWS_BUCKET,
                      EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # which expert's row tile this program is: tile ends per expert = cumsum(ceil(count_e / BM))
    ei = tl.arange(0, EP)
    ends = tl.load(offs + ei, mask=ei < E, other=0)
    prev = tl.load(offs + ei - 1, mask=(ei > 0) & (ei < E), other=0)
    tiles = (ends - prev + BM - 1) // BM
    tend = tl.cumsum(tiles, 0)
    e = tl.sum((tend <= pid_m).to(tl.int32), 0)     # = E past the last tile
    sel = ei == e
    t0 = tl.sum(tl.where(sel, tend - tiles, 0), 0)
    r0 = tl.sum(tl.where(sel, prev, 0), 0)
    r1 = tl.sum(tl.where(sel, ends, 0), 0)          # 0 when e == E: no row is in range
    rows = (r0 + (pid_m - t0) * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < r1
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < OUT
    e64 = tl.minimum(e, E - 1).to(tl.int64)
    wrow = wp + e64 * swe + n[:, None] * swo          # [BN, 1] pointers; offsets inside one expert fit int32
    srow = ws + e64 * sse + n[:, None] * sso
    kh = tl.arange(0, BK // 2)
    kg = tl.arange(0, BK // 32)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    nk = tl.where(e < E, tl.cdiv(IN, BK), 0)
    for kb in range(0, nk):
        k = kb * BK + kk
        xt = tl.load(x + rows[:, None] * sxa + k[None, :], mask=rmask[:, None] & (k < IN)[None, :], other=0.)
        kp = kb * (BK // 2) + kh
        p = tl.load(wrow + kp[None, :], mask=nmask[:, None] & (kp < IN // 2)[None, :], other=0)
        ks = kb * (BK // 32) + kg
        s = tl.load(srow + ks[None, :], mask=nmask[:, None] & (ks < IN // 32)[None, :], other=127).to(tl.uint32)
        # the two nibbles of each byte as consecutive columns: [BN, BK/2, 2] -> [BN, BK]
        c = tl.reshape(tl.join(p & 15, p >> 4), (BN, BK)).to(tl.uint32)
        mag = c & 7
        ex = mag >> 1
        mb = mag & 1
        # E2M1 -> fp32 bits: exponent field e + 126 and mantissa top bit m for e > 0; 0.5 (m = 1) or 0 for e = 0
        bits = tl.where(ex == 0, mb * (126 << 23), ((ex + 126) << 23) | (mb << 22)) | ((c & 8) << 28)
        # E8M0 -> fp32 bits (s = 0: the subnormal 2**-127; s = 255: NaN), one per 32 columns
        sbits = tl.where(s == 0, 1 << 22, s << 23)
        sbits = tl.where(s == 255, 0x7FC00000, sbits)
        v = tl.reshape(bits.to(tl.float32, bitcast=True), (BN, BK // 32, 32))
        w = tl.reshape(v * sbits.to(tl.float32, bitcast=True)[:, :, None], (BN, BK)).to(xt.dtype)
        if IEEE:
            acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(w), acc)
    tl.store(y + rows[:, None] * sya + n[None, :], acc.to(y.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


def _configs():
    from k3.ops.dispatch import triton_interpreting
    cfgs = [INTERP_CONFIG] if triton_interpreting() else CONFIGS
    return [triton.Config(dict(BM=bm, BN=bn, BK=bk), num_warps=nw, num_stages=ns) for bm, bn, bk, nw, ns in cfgs]


_mxfp4_gmm_tuned = triton.autotune(configs=_configs(), key=["OUT", "IN", "EP", "ROWS_BUCKET", "IEEE"])(
    _mxfp4_gmm_kernel)


def _check(x, offs, packed, scale, out_dtype):
    if x.dim() != 2 or packed.dim() != 3 or scale.dim() != 3:
        raise ValueError(f"mxfp4_grouped_matmul: x [A, in], packed [E, out, in/2], scale [E, out, in/32]; got "
                         f"{tuple(x.shape)}, {tuple(packed.shape)}, {tuple(scale.shape)}")
    E, OUT, half = packed.shape
    IN = x.shape[1]
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"mxfp4_grouped_matmul: packed / scale must be uint8, got {packed.dtype} / {scale.dtype}")
    if IN % 32 or half * 2 != IN or tuple(scale.shape) != (E, OUT, IN // 32):
        raise ValueError(f"mxfp4_grouped_matmul: x has {IN} inputs (a multiple of 32 needed); packed "
                         f"{tuple(packed.shape)} / scale {tuple(scale.shape)} must be [E, out, {IN // 2}] / "
                         f"[E, out, {IN // 32}]")
    if tuple(offs.shape) != (E,):
        raise ValueError(f"mxfp4_grouped_matmul: offs must be [E] = [{E}] cumulative row ends, got {tuple(offs.shape)}")
    if x.dtype not in DTYPES or out_dtype not in DTYPES:
        raise ValueError(f"mxfp4_grouped_matmul: x / out dtype must be one of {DTYPES}, got {x.dtype} / {out_dtype}")


def mxfp4_grouped_matmul(x_Al: torch.Tensor, offs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                         out_dtype: Optional[torch.dtype] = None, config: Optional[tuple] = None) -> torch.Tensor:
    """y [A, out] (`out_dtype`, default x's): y[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ dequant(W_e)^T, the
    rows of expert e contiguous and in expert order (offs [E]: cumulative row ends, offs[E-1] = A; rows past it are
    left unwritten). packed uint8 [E, out, in/2], scale uint8 [E, out, in/32] (k3.checkpoint.mxfp4's layout).
    `config` (BM, BN, BK, warps, stages) launches one option directly (tests, benchmarks); by default
    triton.autotune picks among CONFIGS."""
    out_dtype = out_dtype or x_Al.dtype
    _check(x_Al, offs, packed, scale, out_dtype)
    x = x_Al if x_Al.stride(-1) == 1 else x_Al.contiguous()
    packed = packed if packed.stride(-1) == 1 else packed.contiguous()
    scale = scale if scale.stride(-1) == 1 else scale.contiguous()
    offs = offs.to(torch.int32).contiguous()
    E, OUT, _ = packed.shape
    A, IN = x.shape
    y = torch.empty(A, OUT, device=x.device, dtype=out_dtype)
    if A == 0 or OUT == 0 or E == 0:
        return y
    ep = triton.next_power_of_2(E)
    bucket = min(256, triton.next_power_of_2(triton.cdiv(A, E)))
    args = (x, offs, packed, scale, y, E, OUT, IN, x.stride(0), packed.stride(0), packed.stride(1), scale.stride(0),
            scale.stride(1), y.stride(0), bucket)
    kw = dict(EP=ep, IEEE=x.dtype == torch.float32)
    # row tiles: at most cdiv(A, BM) full ones plus one partial tile per expert with rows (at most min(E, A) of them)
    part = min(E, A)
    if config is None:
        _mxfp4_gmm_tuned[lambda meta: (triton.cdiv(A, meta["BM"]) + part, triton.cdiv(OUT, meta["BN"]))](*args, **kw)
    else:
        bm, bn, bk, nw, ns = config
        _mxfp4_gmm_kernel[(triton.cdiv(A, bm) + part, triton.cdiv(OUT, bn))](*args, BM=bm, BN=bn, BK=bk,
                                                                               num_warps=nw, num_stages=ns, **kw)
    return y


@torch.library.custom_op("k3::mxfp4_grouped_mm", mutates_args=())
def mxfp4_grouped_mm_op(x: torch.Tensor, offs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    return mxfp4_grouped_matmul(x, offs, packed, scale, out_dtype)


@mxfp4_grouped_mm_op.register_fake
def _mxfp4_grouped_mm_fake(x, offs, packed, scale, out_dtype):
    return torch.empty(x.shape[0], packed.shape[1], device=x.device, dtype=out_dtype)
