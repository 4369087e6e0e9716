"""GLU feed-forward (dense layer 0 and the shared experts): down(act(gate(x), up(x)))."""
from torch import nn

from k3.ops.activations import get_glu


class GLUMLP(nn.Module):
    def __init__(self, dim: int, inter: int, act: str = "situ", beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)
        self._glu, self.beta1, self.beta2 = get_glu(act), beta1, beta2

    def forward(self, x):
        return self.down_proj(self._glu(self.gate_proj(x), self.up_proj(x), self.beta1, self.beta2))
