"""CUDA fast path of `causal_attention` (dispatch op "attention", backend "flash"): no dense T x T masks.

Cases:
- one sequence per batch row, Tq == Tk: torch SDPA with is_causal=True (flash kernel on Hopper);
- queries after a cached prefix (q_offset > 0): SDPA with the lower-right causal bias (flash/efficient kernels,
  no materialised mask); a single query needs no mask at all;
- packed documents (cu_seqlens): torch's varlen flash attention (`torch.nn.attention.varlen.varlen_attn`,
  causal inside each document) when this torch has it, else flex_attention with a document-causal BlockMask.
Notable: MLA has a value head dim (v_head_dim) smaller than the query/key head dim (nope + rope). Flash kernels
want one head dim, so V is zero-padded up to it and the output sliced (`PAD_V`; the padded columns produce
zeros). The dense SDPA paths do not pad by default (`PAD_V = False`): unpadded, SDPA picks the memory-efficient
kernel, which measured faster on the H200 with torch 2.11 (B4 T8K H96 Dqk192 Dv128 fwd+bwd 63.0 vs 95.8 ms padded
for flash; benchmarks/RESULTS.md). The varlen kernel always gets the padded V (it needs one head dim).
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Optional

import torch
import torch.nn.functional as F

log = logging.getLogger("k3")

PAD_V = False         # dense paths: zero-pad V to the q/k head dim for the flash kernel (slower on H200, torch 2.11)
VARLEN = "auto"        # "auto" (varlen_attn if present, else flex), "varlen", "flex"


@functools.lru_cache(maxsize=1)
def available() -> bool:
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=1)
def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:      # torch >= 2.11: causal = window (-1, 0)
        return functools.partial(varlen_attn, window_size=(-1, 0))
    if "is_causal" in params:        # torch 2.10
        return functools.partial(varlen_attn, is_causal=True)
    return None


def _pad_v(v: torch.Tensor, D: int, force: bool = False) -> torch.Tensor:
    E = v.shape[-1]
    return F.pad(v, (0, D - E)) if ((PAD_V or force) and E < D) else v


def _dense_causal(q, k, v, scale, q_offset):
    """q [B,Tq,H,D], k [B,Tk,H,D], v [B,Tk,H,E] -> [B,Tq,H,E]; query i sits at position q_offset + i."""
    B, Tq, H, D = q.shape
    E = v.shape[-1]
    Tk_vis = min(k.shape[1], q_offset + Tq)        # keys after the last query are never visible
    k, v = k[:, :Tk_vis], v[:, :Tk_vis]
    v = _pad_v(v, D)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if Tq == Tk_vis:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    elif Tq == 1:
        o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    else:
        from torch.nn.attention.bias import causal_lower_right
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(Tq, Tk_vis), scale=scale)
    return o.transpose(1, 2)[..., :E]


_MAXLEN_CACHE: dict = {}


def _max_len(cu_seqlens: torch.Tensor) -> int:
    """Longest document; cached on the tensor identity so the layers of one step share one host sync."""
    key = (id(cu_seqlens), cu_seqlens.data_ptr(), cu_seqlens.numel())
    hit = _MAXLEN_CACHE.get(key)
    if hit is not None and hit[0] is cu_seqlens:
        return hit[1]
    m = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    _MAXLEN_CACHE.clear()
    _MAXLEN_CACHE[key] = (cu_seqlens, m)
    return m


def _varlen(q, k, v, scale, cu_seqlens):
    fn = _varlen_fn()
    _, T, H, D = q.shape
    E = v.shape[-1]
    cu = cu_seqlens.to(q.device, torch.int32)
    m = _max_len(cu_seqlens)
    o = fn(q[0], k[0], _pad_v(v[0], D, force=True).contiguous(), cu, cu, m, m, scale=scale)
    return o[..., :E].unsqueeze(0)


@functools.lru_cache(maxsize=1)
def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    return torch.compile(flex_attention, dynamic=False), create_block_mask


_MASK_CACHE: dict = {}


def _flex_varlen(q, k, v, scale, cu_seqlens):
    flex, create_block_mask = _flex()
    _, T, H, D = q.shape
    key = (T, tuple(cu_seqlens.tolist()))
    bm = _MASK_CACHE.get(key)
    if bm is None:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(q.device, torch.long)
        doc = torch.repeat_interleave(torch.arange(lens.numel(), device=q.device), lens)

        def doc_causal(b, h, qi, kv):
            return (qi >= kv) & (doc[qi] == doc[kv])
        bm = create_block_mask(doc_causal, None, None, T, T, device=q.device)
        _MASK_CACHE.clear()
        _MASK_CACHE[key] = bm
    o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, scale=scale)
    return o.transpose(1, 2)


def flash_causal_attention(q_BTHD, k_BTHD, v_BTHE, scale: float, cu_seqlens: Optional[torch.Tensor] = None,
                           q_offset: int = 0) -> torch.Tensor:
    """Same semantics as k3.ops.attention.causal_attention's output (without max_logit)."""
    if cu_seqlens is None:
        return _dense_causal(q_BTHD, k_BTHD, v_BTHE, scale, q_offset)
    half = q_BTHD.dtype in (torch.bfloat16, torch.float16)
    use_varlen = VARLEN == "varlen" or (VARLEN == "auto" and half and _varlen_fn() is not None)
    if use_varlen:
        return _varlen(q_BTHD, k_BTHD, v_BTHE, scale, cu_seqlens)
    return _flex_varlen(q_BTHD, k_BTHD, v_BTHE, scale, cu_seqlens)
