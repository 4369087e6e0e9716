"""Activations. SiTU-GLU (architecture.md §2): a = b1*tanh(g/b1)*sigmoid(g), b = b2*tanh(u/b2), out = a*b in fp32, cast back.
|a| < b1, |b| < b2, so |out| < b1*b2; it reduces to SwiGLU as both betas grow.

`situ_glu` is one autograd node that saves only its inputs g and u (in their own dtype) and recomputes the fp32
intermediates in backward: plain autograd over the formula kept six fp32 tensors of the expert width alive per
call (~96 KB per token per MoE layer at top-8, latent 512), which is what ran `small` out of memory at 32K tokens
per step on an H200. Derivatives, with tg = tanh(g/b1), s = sigmoid(g), tu = tanh(u/b2):
  d out/d g = b2*tu * ((1 - tg^2)*s + b1*tg*s*(1 - s)),   d out/d u = b1*tg*s * (1 - tu^2).
On CUDA the forward and backward are each one Triton kernel (k3/ops/activations_triton.py), called as the opaque
custom ops torch.ops.k3.situ_fwd / situ_bwd. On CPU the plain
formula under autograd is kept by default: recomputing three transcendentals in backward made fwd+bwd 1.6x slower
there ([8192, 512] fp32, 1 thread: 97 vs 61 ms), and CPU runs are small; the K3_SITU_NODE knob (k3/knobs.py)
forces the node on CPU, K3_SITU_TRITON=0 keeps CUDA on the eager formula.
"""
import importlib.util

import torch
import torch.nn.functional as F

from k3 import knobs
from k3.ops import f32


def _situ_fwd_torch(g, u, b1, b2):
    g32, u32 = f32(g), f32(u)
    a = b1 * torch.tanh(g32 / b1) * torch.sigmoid(g32)
    b = b2 * torch.tanh(u32 / b2)
    return (a * b).to(g.dtype)


def _situ_bwd_torch(g, u, dout, b1, b2):
    g32, u32, d32 = f32(g), f32(u), f32(dout)
    tg, s, tu = torch.tanh(g32 / b1), torch.sigmoid(g32), torch.tanh(u32 / b2)
    da = (1 - tg * tg) * s + b1 * tg * s * (1 - s)
    dg = d32 * (b2 * tu) * da
    du = d32 * (b1 * tg * s) * (1 - tu * tu)
    return dg.to(g.dtype), du.to(u.dtype)


# whether triton is installed, decided once at import (find_spec does not import it): a plain constant, so
# torch.compile reads a global instead of tracing through an lru_cache wrapper (Dynamo warned about that on the H200)
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _use_triton(x: torch.Tensor) -> bool:
    if not x.is_cuda or not knobs.get("K3_SITU_TRITON"):
        return False
    return _HAVE_TRITON


def _fwd(g, u, b1, b2, train: bool = True):
    if _use_triton(g) and g.shape == u.shape:
        from k3.ops import activations_triton  # noqa: F401  (registers torch.ops.k3.situ_*)
        return torch.ops.k3.situ_fwd(g, u, b1, b2, train)
    return _situ_fwd_torch(g, u, b1, b2)


def _bwd(g, u, dout, b1, b2):
    if _use_triton(g) and g.shape == u.shape == dout.shape:
        from k3.ops import activations_triton  # noqa: F401
        return torch.ops.k3.situ_bwd(g, u, dout, b1, b2)
    return _situ_bwd_torch(g, u, dout, b1, b2)


class _SiTUGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, b1, b2):
        ctx.b = (b1, b2)
        ctx.save_for_backward(g, u)
        return _fwd(g, u, b1, b2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        g, u = ctx.saved_tensors
        dg, du = _bwd(g, u, dout.contiguous() if dout.is_cuda else dout, *ctx.b)
        return dg, du, None, None


class _SiTUGLUPacked(torch.autograd.Function):
    """situ_glu(h[..., :C], h[..., C:]) for a packed [g | u] projection h; saves h, and its backward kernel writes
    both halves of dh into one tensor (CUDA)."""

    @staticmethod
    def forward(ctx, h, b1, b2):
        ctx.b = (b1, b2)
        ctx.save_for_backward(h)
        g, u = h.chunk(2, dim=-1)
        return _fwd(g, u, b1, b2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        (h,) = ctx.saved_tensors
        from k3.ops import activations_triton  # noqa: F401
        return torch.ops.k3.situ_bwd_packed(h, dout.contiguous(), *ctx.b), None, None


def situ_glu_packed(h: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """situ_glu of the two halves of the last dimension of h (the MoE's packed gate/up output). On CUDA with
    Triton the gradient of h comes out of one kernel (no concatenation of dg and du); elsewhere as situ_glu."""
    if _use_triton(h) and torch.is_grad_enabled() and h.requires_grad:
        return _SiTUGLUPacked.apply(h, float(beta1), float(beta2))
    return situ_glu(*h.chunk(2, dim=-1), beta1, beta2)


def _use_node(x: torch.Tensor) -> bool:
    return x.is_cuda or knobs.get("K3_SITU_NODE")


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    if g.shape != u.shape:
        g, u = torch.broadcast_tensors(g, u)
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        if not _use_node(g):
            return _situ_fwd_torch(g, u, beta1, beta2)
        return _SiTUGLU.apply(g, u, float(beta1), float(beta2))
    return _fwd(g, u, float(beta1), float(beta2), train=False)


def situ_glu_reference(g: torch.Tensor, u: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """The formula under plain autograd (tests compare the fused node against it)."""
    return _situ_fwd_torch(g, u, beta1, beta2)


def silu_glu(g: torch.Tensor, u: torch.Tensor, beta1: float = 0.0, beta2: float = 0.0) -> torch.Tensor:
    return F.silu(g) * u


def get_glu(name: str):
    if name == "situ":
        return situ_glu
    if name in ("silu", "swiglu"):
        return silu_glu
    raise ValueError(f"unknown hidden_act {name!r}")
