"""The "fla" CUDA backend of AttnRes mixing (dispatch op "attnres"): one fused pass over the depth sources, fp32 math.

flash-linear-attention's Triton `fused_attnres` (forward and backward kernels). Our mix softmax_s(<V_s / rms(V_s), w>)
is fla's with query = w, rms_weight = 1, scale = 1; it reads each source once (and once more in backward) and writes
the mix once, so it runs near the copy bandwidth. It needs every source in one dtype and shape (the model's are);
otherwise k3.ops.attnres runs its eager path. The other CUDA backend, "compile" (the eager formula under
torch.compile), lives beside the formula in k3.ops.attnres. This module imports nothing from k3.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Sequence

import torch


@functools.lru_cache(maxsize=1)
def _fla_attnres():
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.ops.attnres import fused_attnres
    except Exception:
        return None
    return fused_attnres


def fla_available() -> bool:
    return torch.cuda.is_available() and _fla_attnres() is not None


_ONES: dict = {}


def _ones(d: int, device) -> torch.Tensor:
    key = (d, str(device))
    t = _ONES.get(key)
    if t is None:
        t = _ONES[key] = torch.ones(d, device=device, dtype=torch.float32)
    return t


@torch.compiler.disable
def mix_fla(sources: Sequence[torch.Tensor], w: torch.Tensor, eps: float) -> torch.Tensor:
    fused = _fla_attnres()
    d = sources[0].shape[-1]
    return fused(w.float(), list(sources), _ones(d, w.device), rms_eps=eps, scale=1.0)
