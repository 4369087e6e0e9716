"""MuonAdamW's elementwise Muon work as two Triton kernels per tensor (CUDA; Triton's interpreter in tests).

- momentum: buf <- mu*buf + g; u = g + mu*buf (Nesterov) or buf, written directly in the Newton-Schulz dtype
  (bf16 on CUDA: what the batched Newton-Schulz reads anyway), one pass instead of a grad cast + three foreach ops.
- apply: w <- w*(1 - lr*wd) - lr*scale*O for the raw Newton-Schulz output O (still in the block layout: for
  "gate_up" the kernel maps a parameter element to its block element), the fp32 master w and the 16-bit weight in
  one pass; replaces O.float(), the scale, the gate_up un-permute, and three foreach ops.
Why: on the H200 the trainer's optimizer for `small` took 103 ms per step, 17 (momentum) + 11 (apply) + ~5 (cast
and scale of the output) of it elementwise passes over ~1.4 B fp32 elements (benchmarks/optim_gpu.py); these two
kernels move ~12 bytes per element each. Measured there (2026-11-30, benchmarks/RESULTS.md): the optimizer
106.8 -> 82.4 ms per step, the recipe's step 488.8 -> 450.8 ms. The CUDA default of build_optimizer
(`K3_MUON_FUSED=0` turns it off).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _momentum_kernel(mg, mbuf, mu_out, n_el, mu, NESTEROV: tl.constexpr, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = off < n_el
    gv = tl.load(mg + off, mask=m, other=0.).to(tl.float32)
    b = mu * tl.load(mbuf + off, mask=m, other=0.) + gv
    tl.store(mbuf + off, b, mask=m)
    if NESTEROV:
        uv = gv + mu * b
    else:
        uv = b
    tl.store(mu_out + off, uv.to(mu_out.dtype.element_ty), mask=m)


@triton.jit
def _apply_kernel(ao, aw, ap, n_el, decay, step, l_rows, m_cols, HAS_P: tl.constexpr, GATE_UP: tl.constexpr,
                  BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = off < n_el
    if GATE_UP:  # parameter [E, l, 2m] element (e, i, h*m + j) <- block (2e + h, i, j) of the [2E, l, m] output
        row = 2 * m_cols
        e = off // (l_rows * row)
        rem = off - e * (l_rows * row)
        i = rem // row
        c = rem - i * row
        h = c // m_cols
        src = ((2 * e + h) * l_rows + i) * m_cols + (c - h * m_cols)
    else:
        src = off
    ov = tl.load(ao + src, mask=msk, other=0.).to(tl.float32)
    wv = tl.load(aw + off, mask=msk, other=0.).to(tl.float32) * decay - step * ov
    tl.store(aw + off, wv.to(aw.dtype.element_ty), mask=msk)
    if HAS_P:
        tl.store(ap + off, wv.to(ap.dtype.element_ty), mask=msk)


def momentum(grad: torch.Tensor, buf: torch.Tensor, mu: float, nesterov: bool, dtype: torch.dtype) -> torch.Tensor:
    """Updates `buf` (fp32, contiguous) in place; returns the direction u in `dtype`, grad's shape."""
    g = grad.contiguous()
    u = torch.empty(g.shape, device=g.device, dtype=dtype)
    n = g.numel()
    if n:
        _momentum_kernel[(triton.cdiv(n, BLOCK),)](g, buf, u, n, float(mu), NESTEROV=bool(nesterov), BLOCK=BLOCK,
                                                   num_warps=8)
    return u


def apply(o_blocks: torch.Tensor, target: torch.Tensor, param: Optional[torch.Tensor], lr: float, wd: float,
          scale: float, ortho: str) -> None:
    """target <- target*(1 - lr*wd) - lr*scale*O (O: the tensor's Newton-Schulz output in its block layout, any
    dtype); with `param` (a 16-bit weight whose fp32 master is `target`) the weight becomes the master's rounding."""
    n = target.numel()
    if not n:
        return
    if not (o_blocks.is_contiguous() and target.is_contiguous() and (param is None or param.is_contiguous())):
        raise ValueError("fused Muon apply: contiguous tensors only")
    gate_up = ortho == "gate_up"
    l_rows, m_cols = (target.shape[-2], target.shape[-1] // 2) if gate_up else (1, 1)
    _apply_kernel[(triton.cdiv(n, BLOCK),)](o_blocks, target, param if param is not None else target, n,
                                            1.0 - lr * wd, lr * scale, l_rows, m_cols, HAS_P=param is not None,
                                            GATE_UP=gate_up, BLOCK=BLOCK, num_warps=8)
