"""SiTU-GLU forward and backward as single elementwise Triton kernels (CUDA; k3.ops.activations dispatches here).

Each reads g and u (and dout) once in their dtype, does the fp32 math of k3.ops.activations in registers and writes
the result(s) once: 3 (forward) / 5 (backward) tensor passes instead of the ~10 / ~15 of the eager formula.
Inputs may be strided views (e.g. the two halves of a fused gate/up projection): rows of stride `sg`/`su`.

tanh on 16-bit CUDA inputs (knob K3_SITU_TANH, default `auto`): training launches (the autograd forward and every
backward) use the hardware `tanh.approx.f32` for tanh and the sigmoid (0.5 + 0.5 tanh(x/2)): one MUFU op, max
relative error 2^-10.99, below bf16's 2^-8 rounding; measured on `small`'s own activations on the H200
(benchmarks/situ_tanh_error.py) the outputs stay within 0.51 bf16 ulp of fp64. Inference launches (no gradient) use
the exp-based tanh, which is exact to fp32 rounding: the two differ in ~2e-3 of bf16 outputs, so generation keeps
the exact form. `approx` / `exact` force one path everywhere; fp32 inputs and the interpreter are always exact.
The exact tanh uses an odd Taylor polynomial for |x| < 1/8, where (1 - e^-2|x|) / (1 + e^-2|x|) would cancel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3 import knobs

BLOCK = 1024
# "exact" / "approx" pins the tanh path for tests and benchmarks; None: the K3_SITU_TANH knob (k3/knobs.py), read at
# each launch (inside the custom ops, which torch.compile does not trace) and checked once here at import
APPROX_TANH = None
knobs.get("K3_SITU_TANH")


@triton.jit
def _tanh(x):
    # tanh via exp of a non-positive argument (no overflow for large |x|); below |x| = 1/8 the odd Taylor series
    # to x^7 (truncation < 2e-9 relative), where 1 - e^-2|x| would lose up to all of fp32's bits to cancellation
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    x2 = x * x
    p = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(a < 0.125, p, tl.where(x >= 0, t, -t))


@triton.jit
def _tanh_hw(x):
    """tanh.approx.f32: one MUFU op (sm_75+), max relative error 2^-10.99."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _tanh_sig(x, y, b1, b2, APPROX: tl.constexpr):
    """(tanh(x / b1), sigmoid(x), tanh(y / b2)) in fp32."""
    if APPROX:  # scalar reciprocals once: a per-element fp32 division is a multi-instruction sequence
        return _tanh_hw(x * (1.0 / b1)), 0.5 + 0.5 * _tanh_hw(0.5 * x), _tanh_hw(y * (1.0 / b2))
    else:
        return _tanh(x / b1), tl.sigmoid(x), _tanh(y / b2)


@triton.jit
def _load_tile(g, u, R, C, sg, su, BR: tl.constexpr, BC: tl.constexpr):
    """This program's [BR, BC] tile: row / column offsets, the in-bounds mask, and g, u there in fp32."""
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BC + tl.arange(0, BC))[None, :]
    m = (rows < R) & (cols < C)
    x = tl.load(g + rows * sg + cols, mask=m, other=0.).to(tl.float32)
    y = tl.load(u + rows * su + cols, mask=m, other=0.).to(tl.float32)
    return rows, cols, m, x, y


@triton.jit
def _situ_fwd_kernel(g, u, o, R, C, sg, su, so, b1, b2, BR: tl.constexpr, BC: tl.constexpr,
                     APPROX: tl.constexpr = False):
    rows, cols, m, x, y = _load_tile(g, u, R, C, sg, su, BR, BC)
    tg, s, tu = _tanh_sig(x, y, b1, b2, APPROX)
    a = b1 * tg * s
    b = b2 * tu
    tl.store(o + rows * so + cols, (a * b).to(o.dtype.element_ty), mask=m)


@triton.jit
def _situ_bwd_kernel(g, u, do, dg, du, R, C, sg, su, sd, sdg, b1, b2, BR: tl.constexpr, BC: tl.constexpr,
                     APPROX: tl.constexpr = False):
    rows, cols, m, x, y = _load_tile(g, u, R, C, sg, su, BR, BC)
    d = tl.load(do + rows * sd + cols, mask=m, other=0.).to(tl.float32)
    tg, s, tu = _tanh_sig(x, y, b1, b2, APPROX)
    da = (1.0 - tg * tg) * s + b1 * tg * s * (1.0 - s)
    tl.store(dg + rows * sdg + cols, (d * (b2 * tu) * da).to(dg.dtype.element_ty), mask=m)
    tl.store(du + rows * sdg + cols, (d * (b1 * tg * s) * (1.0 - tu * tu)).to(du.dtype.element_ty), mask=m)


def _tiles(R: int, C: int):
    bc = min(triton.next_power_of_2(max(C, 1)), BLOCK)
    br = max(1, BLOCK // bc)
    return bc, br, (triton.cdiv(R, br), triton.cdiv(C, bc))


def _rows(x: torch.Tensor):
    """(2-D view [R, C] with unit column stride, row stride) without copying when possible."""
    C = x.shape[-1]
    x2 = x.reshape(-1, C) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x2.stride(0)


def _approx(x: torch.Tensor, train: bool = True) -> bool:
    """The hardware tanh path: 16-bit inputs on a real GPU (the interpreter has no inline PTX), and the knob's
    `approx`, or its default `auto` for a training launch."""
    mode = APPROX_TANH or knobs.get("K3_SITU_TANH")
    use = mode == "approx" or (mode == "auto" and train)
    return use and x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda


def situ_fwd(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float, train: bool = True) -> torch.Tensor:
    g2, sg = _rows(g)
    u2, su = _rows(u)
    R, C = g2.shape
    o = torch.empty(R, C, device=g.device, dtype=g.dtype)
    if o.numel():
        bc, br, grid = _tiles(R, C)
        _situ_fwd_kernel[grid](g2, u2, o, R, C, sg, su, C, b1, b2, BR=br, BC=bc, APPROX=_approx(g, train), num_warps=4)
    return o.view(g.shape)


def situ_bwd(g, u, dout, b1: float, b2: float, out: torch.Tensor = None):
    """(dg, du), each [R, C] contiguous; with `out` [R, 2C] (row-contiguous), written into its two halves instead
    (the gradient of a packed [g | u] projection, no concatenation) and returned as those two views."""
    g2, sg = _rows(g)
    u2, su = _rows(u)
    d2, sd = _rows(dout)
    R, C = g2.shape
    if out is None:
        dg = torch.empty(R, C, device=g.device, dtype=g.dtype)
        du = torch.empty(R, C, device=u.device, dtype=u.dtype)
        so = C
    else:
        if out.shape != (R, 2 * C) or out.stride(1) != 1:
            raise ValueError(f"situ_bwd: out must be a row-contiguous [{R}, {2 * C}] tensor, got {tuple(out.shape)}")
        dg, du, so = out[:, :C], out[:, C:], out.stride(0)
    if dg.numel():
        bc, br, grid = _tiles(R, C)
        _situ_bwd_kernel[grid](g2, u2, d2, dg, du, R, C, sg, su, sd, so, b1, b2, BR=br, BC=bc, APPROX=_approx(g),
                               num_warps=4)
    if out is not None:
        return dg, du
    return dg.view(g.shape), du.view(u.shape)


# The kernels as opaque custom ops (what k3.ops.activations calls): torch.compile calls them through this wrapper
# instead of re-emitting the kernel source with its own launcher. Measured on the H200 in the compiled `small`
# step, the re-emitted kernels took ~0.80 / ~0.87 ms per call where the same kernels launched directly take
# 0.28 / 0.36 ms (benchmarks/situ_gpu.py), and the re-emitted hardware-tanh kernel gave a NaN loss; as custom ops
# the step went 450.0 -> 388.6 ms and the hardware tanh trains. Why the re-emitted kernels were slow is not
# established (lost 16-byte alignment hints on the strided halves are one candidate). The Python launch costs a few
# microseconds per call.
@torch.library.custom_op("k3::situ_fwd", mutates_args=())
def situ_fwd_op(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float, train: bool = True) -> torch.Tensor:
    return situ_fwd(g, u, b1, b2, train)


@situ_fwd_op.register_fake
def _situ_fwd_fake(g, u, b1, b2, train=True):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


@torch.library.custom_op("k3::situ_bwd", mutates_args=())
def situ_bwd_op(g: torch.Tensor, u: torch.Tensor, dout: torch.Tensor, b1: float,
                b2: float) -> tuple[torch.Tensor, torch.Tensor]:
    return situ_bwd(g, u, dout, b1, b2)


@situ_bwd_op.register_fake
def _situ_bwd_fake(g, u, dout, b1, b2):
    return (torch.empty_like(g, memory_format=torch.contiguous_format),
            torch.empty_like(u, memory_format=torch.contiguous_format))


@torch.library.custom_op("k3::situ_bwd_packed", mutates_args=())
def situ_bwd_packed_op(h: torch.Tensor, dout: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    """d h for out = situ(h[..., :C], h[..., C:]): both halves written by the kernel into one [R, 2C] tensor (the
    MoE's packed gate/up projection; saves the concatenation autograd would do after situ_bwd)."""
    C = h.shape[-1] // 2
    h2 = h.reshape(-1, 2 * C)
    dh = torch.empty(h2.shape, device=h.device, dtype=h.dtype)
    situ_bwd(h2[:, :C], h2[:, C:], dout.reshape(-1, C), b1, b2, out=dh)
    return dh.view(h.shape)


@situ_bwd_packed_op.register_fake
def _situ_bwd_packed_fake(h, dout, b1, b2):
    return torch.empty_like(h, memory_format=torch.contiguous_format)
