"""GLU feed-forward (dense layer 0 and the shared experts): down(act(gate(x), up(x)))."""
from typing import Optional

import torch
from torch import nn

from k3.ops.activations import get_glu


def cat_weights(*linears: nn.Linear) -> torch.Tensor:
    """The weights of several bias-free Linear layers on the same input as one [d_in, sum(d_out)] matrix (x @ W
    runs them as one GEMM), detached."""
    return torch.cat([m.weight.detach() for m in linears], 0).t().contiguous()


class GLUDecodeState:
    """Fused weights for `GLUMLP.decode_step`: W_gu [d, 2I] (None when the caller fuses gate/up into its own input
    projection), W_d [I, d], I."""
    __slots__ = ("W_gu", "W_d", "I")

    def __init__(self, W_gu: Optional[torch.Tensor], W_d: torch.Tensor, I: int):
        self.W_gu, self.W_d, self.I = W_gu, W_d, I


class GLUMLP(nn.Module):
    def __init__(self, dim: int, inter: int, act: str = "situ", beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)
        self._glu, self.beta1, self.beta2 = get_glu(act), beta1, beta2

    def forward(self, x):
        return self.down_proj(self._glu(self.gate_proj(x), self.up_proj(x), self.beta1, self.beta2))

    # ------------------------------------------------------------------ decode step (k3.generation.static)
    def prepare_decode(self, dtype: torch.dtype, input_proj: bool = True) -> GLUDecodeState:
        """Fused weights: gate and up as one [d, 2I] matrix (unless `input_proj` is False: the caller projects,
        e.g. LatentMoE fuses the shared experts' gate/up with its latent down-projection), down transposed."""
        return GLUDecodeState(cat_weights(self.gate_proj, self.up_proj) if input_proj else None,
                              self.down_proj.weight.detach().t().contiguous(), self.gate_proj.weight.shape[0])

    def decode_step(self, st: GLUDecodeState, x_Nd: torch.Tensor) -> torch.Tensor:
        """forward(x) for x [N, d] with the fused weights: one GEMM for gate + up, one for down."""
        return self.decode_from_gate_up(st, x_Nd @ st.W_gu)

    def decode_from_gate_up(self, st: GLUDecodeState, gu_N2I: torch.Tensor) -> torch.Tensor:
        """The rest of the layer from the packed [gate | up] projections [N, 2I]."""
        g, u = gu_N2I.split(st.I, -1)
        return self._glu(g, u, self.beta1, self.beta2) @ st.W_d
