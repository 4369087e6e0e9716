"""Causal softmax attention for Gated MLA (NoPE): q,k [B,T,H,Dk], v [B,T,H,Dv]; packed documents via cu_seqlens.

Paths: `sdpa` (torch scaled_dot_product_attention; on CUDA it picks flash/efficient kernels, on CPU the fused
math kernel) with query tiling so the mask is at most [tile, T]; `reference` (explicit fp32 softmax). Both never
let a query see a later key or another document. `max_logit` (per-head max pre-softmax logit, scale included) is
computed on request for QK-clip.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from k3.ops import dispatch, f32

_Q_TILE = 2048
# Packed documents on CPU: query tiles of this many tokens, each against the keys from the start of the document
# holding its first query (never the whole packed row: 8 rows of 256 packed into 2048 tokens need ~1/8 the work).
_DOC_TILE = 128


def _cuda_available() -> bool:
    from k3.ops import attention_cuda
    return attention_cuda.available()


# "sdpa": the tiled path below (any device). "flash": k3.ops.attention_cuda (CUDA only, no dense masks).
dispatch.register("attention", "sdpa", lambda: True, priority=0)
dispatch.register("attention", "flash", _cuda_available, priority=10)


def _doc_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens)


def _mask(q0: int, q1: int, Tk: int, doc: Optional[torch.Tensor], device, offset: int = 0,
          k0: int = 0) -> torch.Tensor:
    """[q1-q0, Tk-k0] bool: query q0+i (at position q0+i+offset) may see key k0+j."""
    qi = torch.arange(q0, q1, device=device).unsqueeze(1) + offset
    kj = torch.arange(k0, Tk, device=device).unsqueeze(0)
    m = kj <= qi
    if doc is not None:
        m = m & (doc[q0:q1].unsqueeze(1) == doc[k0:Tk].unsqueeze(0))
    return m


def _doc_tiles(cu_seqlens: torch.Tensor, T: int, tile: int) -> list:
    """(q0, q1, k0) query tiles of <= `tile` tokens; k0 = start of the document that holds query q0. Keys before
    k0 belong to earlier documents and are never visible to any query of the tile."""
    import bisect
    cu = [int(c) for c in cu_seqlens.tolist()]
    out, q0 = [], 0
    while q0 < T:
        q1 = min(T, q0 + tile)
        out.append((q0, q1, cu[bisect.bisect_right(cu, q0) - 1]))
        q0 = q1
    return out


def attention_reference(q, k, v, scale: float, cu_seqlens=None):
    B, T, H, _ = q.shape
    s = torch.einsum("bthd,bshd->bhts", q.double(), k.double()) * scale
    doc = _doc_ids(cu_seqlens, T) if cu_seqlens is not None else None
    m = _mask(0, T, T, doc, q.device)
    s = s.masked_fill(~m, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), v.double()).to(v.dtype)


@torch.no_grad()
def _max_logit_tiles(q, k, scale: float, tiles: list, doc: Optional[torch.Tensor], q_offset: int) -> torch.Tensor:
    """Per-head max logit [H] (fp32, or fp64 for fp64 inputs) of q, k [B, H, T, D] over the visible pairs of
    the query tiles `tiles` ((q0, q1, k0) as in causal_attention); -inf for a head with no visible pair."""
    H, Tk = q.shape[1], k.shape[2]
    ml = torch.full((H,), float("-inf"), device=q.device, dtype=f32(q).dtype)
    for q0, q1, k0 in tiles:
        kmax = min(Tk, q1 + q_offset)
        s = torch.einsum("bhtd,bhsd->bhts", f32(q[:, :, q0:q1]), f32(k[:, :, k0:kmax])) * scale
        s = s.masked_fill(~_mask(q0, q1, kmax, doc, q.device, q_offset, k0), float("-inf"))
        ml = torch.maximum(ml, s.amax(dim=(0, 2, 3)))
    return ml


def attention_max_logit(q_BTHD, k_BTHD, scale: float, cu_seqlens: Optional[torch.Tensor] = None,
                        q_offset: int = 0) -> torch.Tensor:
    """The max logit `causal_attention(..., return_max_logit=True)` returns for the same arguments (same tiles,
    same ops), without the attention itself: for callers that need it over a subset of the queries (context
    parallelism leaves out its padding). No query: all -inf."""
    H, Tq, Tk = q_BTHD.shape[2], q_BTHD.shape[1], k_BTHD.shape[1]
    if cu_seqlens is not None and (q_BTHD.shape[0] != 1 or q_offset):
        raise ValueError("attention_max_logit: cu_seqlens needs batch size 1 and no q_offset")
    if Tq == 0:
        return torch.full((H,), float("-inf"), device=q_BTHD.device, dtype=f32(q_BTHD).dtype)
    doc = _doc_ids(cu_seqlens, Tk) if cu_seqlens is not None else None
    q, k = q_BTHD.transpose(1, 2), k_BTHD.transpose(1, 2)
    if doc is not None and q.device.type == "cpu":
        tiles = _doc_tiles(cu_seqlens, Tq, _DOC_TILE)
    else:
        tiles = [(q0, min(Tq, q0 + _Q_TILE), 0) for q0 in range(0, Tq, _Q_TILE)]
    return _max_logit_tiles(q, k, scale, tiles, doc, q_offset)


def causal_attention(q_BTHD, k_BTHD, v_BTHE, scale: float, cu_seqlens: Optional[torch.Tensor] = None,
                     return_max_logit: bool = False, q_offset: int = 0, backend: Optional[str] = None):
    """Causal attention. With q_offset>0 the queries are the last Tq positions of a length-Tk context
    (chunked prefill against a cache: keys [0, Tk), query i sits at position q_offset + i)."""
    B, Tq, H, D = q_BTHD.shape
    Tk = k_BTHD.shape[1]
    if cu_seqlens is not None and (B != 1 or q_offset):
        raise ValueError("causal_attention: cu_seqlens needs batch size 1 and no q_offset")
    fast = q_BTHD.device.type == "cuda" and dispatch.resolve("attention", backend, "cuda") == "flash"
    doc = _doc_ids(cu_seqlens, Tk) if cu_seqlens is not None and not (fast and not return_max_logit) else None
    low = q_BTHD.device.type == "cpu" and q_BTHD.dtype in (torch.bfloat16, torch.float16)
    q = q_BTHD.transpose(1, 2)
    k = k_BTHD.transpose(1, 2)
    v = v_BTHE.transpose(1, 2)
    if low:  # fp32 softmax on CPU (CUDA kernels accumulate in fp32 themselves)
        q, k, v = q.float(), k.float(), v.float()
    # (q0, q1, k0): query tiles and the first key each can see
    if doc is not None and q.device.type == "cpu":
        tiles = _doc_tiles(cu_seqlens, Tq, _DOC_TILE)
    else:
        tiles = [(q0, min(Tq, q0 + _Q_TILE), 0) for q0 in range(0, Tq, _Q_TILE)]
    max_logit = _max_logit_tiles(q, k, scale, tiles, doc, q_offset) if return_max_logit else None
    if fast:
        from k3.ops.attention_cuda import flash_causal_attention
        o = flash_causal_attention(q_BTHD, k_BTHD, v_BTHE.to(q_BTHD.dtype), scale, cu_seqlens, q_offset)
        return o.to(v_BTHE.dtype), max_logit
    if doc is None and Tq == Tk and q_offset == 0 and Tq <= _Q_TILE:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        outs = []
        for q0, q1, k0 in tiles:
            kmax = min(Tk, q1 + q_offset)  # keys after the last query of the tile are never visible
            m = _mask(q0, q1, kmax, doc, q.device, q_offset, k0)
            outs.append(F.scaled_dot_product_attention(q[:, :, q0:q1], k[:, :, k0:kmax], v[:, :, k0:kmax],
                                                       attn_mask=m, scale=scale))
        o = torch.cat(outs, 2)
    return o.transpose(1, 2).to(v_BTHE.dtype), max_logit
