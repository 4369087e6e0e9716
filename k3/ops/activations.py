"""Activations. SiTU-GLU (spec §2): a = b1*tanh(g/b1)*sigmoid(g), b = b2*tanh(u/b2), out = a*b in fp32, cast back.
|a| < b1, |b| < b2, so |out| < b1*b2; it reduces to SwiGLU as both betas grow."""
import torch

from k3.ops import f32
import torch.nn.functional as F


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    g32, u32 = f32(g), f32(u)
    a = beta1 * torch.tanh(g32 / beta1) * torch.sigmoid(g32)
    b = beta2 * torch.tanh(u32 / beta2)
    return (a * b).to(g.dtype)


def silu_glu(g: torch.Tensor, u: torch.Tensor, beta1: float = 0.0, beta2: float = 0.0) -> torch.Tensor:
    return F.silu(g) * u


def get_glu(name: str):
    if name == "situ":
        return situ_glu
    if name in ("silu", "swiglu"):
        return silu_glu
    raise ValueError(f"unknown hidden_act {name!r}")
