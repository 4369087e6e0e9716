"""RMSNorm as the K3 text model uses it (architecture.md §2): statistics in fp32, cast back to the input dtype, *then* scale."""
import torch

from k3.ops import f32
from torch import nn


def rms_scale(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, unweighted, in x's dtype (one fused kernel on CUDA)."""
    return torch.rms_norm(x32, (x32.shape[-1],), eps=eps)


class NormDecodeState:
    """The weight in the activation dtype and eps, for `RMSNorm.decode_step`."""
    __slots__ = ("w", "eps")

    def __init__(self, w: torch.Tensor, eps: float):
        self.w, self.eps = w, eps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = f32(x)
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return y * self.weight.to(x.dtype)

    def prepare_decode(self, dtype: torch.dtype) -> NormDecodeState:
        return NormDecodeState(self.weight.detach().to(dtype), self.eps)

    def decode_step(self, st: NormDecodeState, x: torch.Tensor) -> torch.Tensor:
        """forward(x) with the weight pre-cast (fp32 statistics as one fused rms_norm kernel)."""
        return rms_scale(f32(x), st.eps).to(x.dtype) * st.w

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
