"""Block Attention Residual mixing (architecture.md §3.3): a per-token softmax over depth sources, all in fp32.

    k_s = V_s / sqrt(mean(V_s^2) + eps);  logit_s = <k_s, w>  (w = gamma * q);  out = sum_s softmax(logit)_s V_s

`attnres_mix` is the fast path: it never materialises the normalised keys (logit_s = rsqrt_s * <V_s, w>) and
streams sources one at a time; `attnres_mix_reference` is the definition, written out. Both fp32 throughout.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from k3.ops import dispatch, f32, fp32_math

# eps of the mix's un-weighted RMS normalisation of the sources (architecture.md §3.3: 1e-5, a constant of the mix, not the
# config's rms_norm_eps)
ATTNRES_EPS = 1e-5


def mix_query(gamma: torch.Tensor, proj_1d: torch.Tensor) -> torch.Tensor:
    """The mix's pseudo-query w = gamma * q in fp32 (gamma = `*_res_norm.weight` [d], q = `*_res_proj.weight`
    [1, d])."""
    return f32(gamma) * f32(proj_1d[0])


def _fla_available() -> bool:
    from k3.ops import attnres_triton
    return attnres_triton.fla_available()


# "torch": the eager code below (any device); "fla": flash-linear-attention's fused kernels (k3.ops.attnres_triton);
# "compile": the eager code under torch.compile (`mix_compile`, CUDA machines without fla)
dispatch.register("attnres", "torch", lambda: True, priority=0)
dispatch.register("attnres", "fla", _fla_available, priority=10)
dispatch.register("attnres", "compile", lambda: torch.cuda.is_available(), priority=5)


def attnres_mix_reference(sources: Sequence[torch.Tensor], w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    with fp32_math(w):
        return _reference(sources, w, eps)


def _reference(sources, w, eps):
    V_SNd = torch.stack([f32(s) for s in sources], 0)
    k_SNd = V_SNd / torch.sqrt(V_SNd.pow(2).mean(-1, keepdim=True) + eps)
    logit_SN = (k_SNd * f32(w)).sum(-1)
    alpha_SN = torch.softmax(logit_SN, dim=0)
    return (alpha_SN.unsqueeze(-1) * V_SNd).sum(0).to(sources[0].dtype)


def attnres_mix(sources: Sequence[torch.Tensor], w: torch.Tensor, eps: float = 1e-5,
                backend: Optional[str] = None) -> torch.Tensor:
    if len(sources) == 0:
        raise ValueError("attnres_mix needs at least one source")
    if len(sources) == 1:  # softmax over one source is 1: the mix is the source itself
        return sources[0]
    if sources[0].device.type == "cuda":
        name = dispatch.resolve("attnres", backend, "cuda")
        if name != "torch" and _uniform(sources) and sources[0].dtype != torch.float64:
            if name == "fla":
                from k3.ops import attnres_triton
                return attnres_triton.mix_fla(sources, w, eps)
            return mix_compile(sources, w, eps)
    return mix_eager(sources, w, eps)


def _uniform(sources: Sequence[torch.Tensor]) -> bool:
    """The fused CUDA paths need every source in one dtype, shape and device (the model's are)."""
    s0 = sources[0]
    return all(s.dtype == s0.dtype and s.shape == s0.shape and s.device == s0.device for s in sources)


def mix_eager(sources: Sequence[torch.Tensor], w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """The eager fp32 mix, streaming the sources one at a time (fixed summation order); fp32 under autocast too.
    Also what the "compile" CUDA backend compiles."""
    with fp32_math(w):
        return _mix_streamed(sources, w, eps)


def _mix_streamed(sources, w, eps):
    w32 = f32(w)
    logits = []
    for s in sources:
        s32 = f32(s)
        logits.append(torch.rsqrt(s32.pow(2).mean(-1) + eps) * (s32 @ w32))
    alpha_SN = torch.softmax(torch.stack(logits, 0), dim=0)
    out = alpha_SN[0].unsqueeze(-1) * f32(sources[0])
    for i in range(1, len(sources)):  # fixed summation order
        out = out + alpha_SN[i].unsqueeze(-1) * f32(sources[i])
    return out.to(sources[0].dtype)


@functools.lru_cache(maxsize=1)
def _compiled_mix():
    return torch.compile(mix_eager, dynamic=False)


def mix_compile(sources: Sequence[torch.Tensor], w: torch.Tensor, eps: float) -> torch.Tensor:
    """The "compile" CUDA backend: `mix_eager` under torch.compile (Inductor fuses it into a few kernels)."""
    if torch.compiler.is_compiling():  # already inside a compiled region: let the outer graph fuse it
        return mix_eager(sources, w, eps)
    return _compiled_mix()(list(sources), w, eps)


def attnres_mix_decode(sources: Sequence[torch.Tensor], w32: torch.Tensor, eps: float = ATTNRES_EPS) -> torch.Tensor:
    """The mix for [N, d] sources as one stacked softmax over depth, fp32 (the decode step, k3.generation.static:
    few tokens, few kernels, shape-static). Same math as `attnres_mix`; w32 the fp32 pseudo-query."""
    if len(sources) == 1:
        return sources[0]
    V = f32(torch.stack(sources, 0))                                            # [S, N, d]
    logit = torch.rsqrt(V.pow(2).mean(-1) + eps) * (V @ w32)                    # [S, N]
    a = torch.softmax(logit, 0)
    return (a.unsqueeze(-1) * V).sum(0).to(sources[0].dtype)
