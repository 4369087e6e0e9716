"""KDA decay gate: raw gate input f -> per-channel log-decay g (fp32, or fp64 for fp64 inputs).

Notable: K3 uses the bounded "safe" gate g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)) in (lb, 0), lb = -5,
which is what lets the chunked kernel form intra-chunk decays with plain matmuls. `lower_bound=None` gives the
Kimi-Linear / fla default unbounded gate -exp(A_log[h]) * softplus(f + dt_bias).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _gate_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def check_gate_params(f: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                      f_name: str = "f") -> None:
    """Raise ValueError naming the argument when A_log / dt_bias do not fit f [..., H, K]."""
    if not isinstance(A_log, torch.Tensor):
        raise ValueError("A_log: a tensor [H] is required for the KDA gate")
    if not isinstance(dt_bias, torch.Tensor):
        raise ValueError("dt_bias: a tensor [H*K] is required for the KDA gate")
    if f.dim() < 2:
        raise ValueError(f"{f_name}: expected [..., H, K], got shape {tuple(f.shape)}")
    H, K = f.shape[-2], f.shape[-1]
    if A_log.numel() != H:
        raise ValueError(f"A_log: expected {H} entries (one per head), got shape {tuple(A_log.shape)}; "
                         f"the released checkpoint zero-pads A_log to 128 entries: slice [:H] when loading")
    if dt_bias.numel() != H * K:
        raise ValueError(f"dt_bias: expected H*K = {H * K} entries, got shape {tuple(dt_bias.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating tensor, got {t.dtype}")
        if t.device != f.device:
            raise ValueError(f"{name}: on {t.device}, but {f_name} is on {f.device}")


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: Optional[float] = -5.0) -> torch.Tensor:
    """g[..., h, c] = lower_bound * sigmoid(exp(A_log[h]) * (f[..., h, c] + dt_bias[h*K + c])).

    f [..., H, K] any float dtype; A_log [H]; dt_bias [H*K]. Math and result in fp32 (fp64 if any input is fp64).
    lower_bound=None: unbounded gate -exp(A_log[h]) * softplus(f + dt_bias).
    """
    check_gate_params(f, A_log, dt_bias)
    H, K = f.shape[-2], f.shape[-1]
    dt = _gate_dtype(f, A_log, dt_bias)
    x_HK = f.to(dt) + dt_bias.to(dt).reshape(H, K)
    a_H1 = A_log.to(dt).reshape(H, 1).exp()
    if lower_bound is None:
        return -a_H1 * F.softplus(x_HK)
    return float(lower_bound) * torch.sigmoid(a_H1 * x_HK)
