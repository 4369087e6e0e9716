"""MXFP4 (compressed-tensors ``mxfp4-pack-quantized``) decode / encode — architecture.md §4.3.

Layout of one weight ``W [out, in]``:

* ``weight_packed`` ``uint8 [out, in/2]``: byte ``i`` of 32-column group ``j`` holds element ``32j+2i`` in its
  **low** nibble and ``32j+2i+1`` in its **high** nibble (i.e. plain little-endian nibble packing of consecutive
  columns).
* nibble → E2M1 value: codes 0–7 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}; codes 8–15 are the negatives (bit 3 = sign).
* ``weight_scale`` ``uint8 [out, in/32]``, E8M0: multiplier ``2**(s - 127)``. (``s = 255`` is NaN per the OCP MX
  spec; it never occurs in a valid checkpoint and decodes to NaN.)

Both functions accept any number of leading dimensions (e.g. stacked experts ``[E, out, in/2]``).
"""
from __future__ import annotations

import torch

__all__ = ["mxfp4_decode", "mxfp4_encode", "E2M1_VALUES", "GROUP_SIZE"]

GROUP_SIZE = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# 256-entry table: byte -> (value of low nibble, value of high nibble)
_BYTE_LUT = torch.tensor([[E2M1_VALUES[b & 0xF], E2M1_VALUES[b >> 4]] for b in range(256)], dtype=torch.float32)
# Midpoints between consecutive non-negative grid values, and which ties round *up* (to the even code).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)
_CHUNK = 1 << 22  # elements per decode chunk (bounds the int64 index temporaries)


def _scale_multiplier(scale_u8: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> exact fp32 ``2**(s-127)`` by building the fp32 bit pattern (s=0 -> subnormal 2**-127)."""
    s = scale_u8.to(torch.int32)
    bits = s << 23
    bits = torch.where(s == 0, torch.full_like(bits, 1 << 22), bits)
    bits = torch.where(s == 255, torch.full_like(bits, 0x7FC00000), bits)  # NaN
    return bits.view(torch.float32)


def mxfp4_decode(packed_u8: torch.Tensor, scale_u8: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                 out: torch.Tensor = None) -> torch.Tensor:
    """``packed [..., out, in/2]`` + ``scale [..., out, in/32]`` (uint8) -> ``W [..., out, in]`` in ``dtype``.

    The product is formed exactly in fp32 (E2M1 values have 2 significant bits, the scale is a power of two), so
    decoding to bf16/fp32 is exact. ``out`` (optional, contiguous, ``W``'s shape and dtype): written in place, so
    a caller decoding repeatedly (packed expert matmuls) reuses one buffer instead of faulting in fresh pages.
    """
    if packed_u8.dtype != torch.uint8 or scale_u8.dtype != torch.uint8:
        raise ValueError(f"mxfp4_decode expects uint8 tensors, got packed {packed_u8.dtype}, scale {scale_u8.dtype}")
    half = packed_u8.shape[-1]
    n_in = half * 2
    if n_in % GROUP_SIZE:
        raise ValueError(f"packed last dim {half} * 2 = {n_in} is not a multiple of {GROUP_SIZE}")
    groups = n_in // GROUP_SIZE
    if tuple(scale_u8.shape) != tuple(packed_u8.shape[:-1]) + (groups,):
        raise ValueError(f"scale shape {tuple(scale_u8.shape)} does not match packed shape {tuple(packed_u8.shape)}: "
                         f"expected {tuple(packed_u8.shape[:-1]) + (groups,)}")
    lead = tuple(packed_u8.shape[:-1])
    device = packed_u8.device
    if out is not None:
        if tuple(out.shape) != lead + (n_in,) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"mxfp4_decode: out must be a contiguous {dtype} tensor of shape {lead + (n_in,)}, "
                             f"got {out.dtype} {tuple(out.shape)}")
    # fp32 and bf16 hold every product exactly (2 significant bits times a power of two, bf16 has fp32's
    # exponent range): decode straight into them; other dtypes go through fp32
    cdt = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    lut = _lut(device, cdt)
    p2 = packed_u8.reshape(-1, half)
    s2 = scale_u8.reshape(-1, groups)
    rows = p2.shape[0]
    if out is None:
        out = torch.empty(lead + (n_in,), dtype=dtype, device=device)
    o2 = out.view(rows, n_in)
    step = max(1, _CHUNK // max(n_in, 1))
    for r0 in range(0, rows, step):  # loop over row chunks only (memory bound), never over elements
        p = p2[r0:r0 + step]
        r = p.shape[0]
        ids = p.reshape(-1).to(torch.int32)
        # (low, high) nibble values -> consecutive columns: a 1-D gather from the 256-entry byte table whose
        # entries hold both values bit-cast into one int64 (fp32 pair) / int32 (bf16 pair) -- ~10x faster than
        # gathering 2-wide rows -- written in place (no temporaries beyond the int32 ids); then the per-group
        # scale, in place
        tgt = o2[r0:r0 + r] if cdt == dtype else torch.empty(r, n_in, dtype=cdt, device=device)
        torch.index_select(lut, 0, ids, out=tgt.view(-1).view(lut.dtype))
        tgt.view(r, groups, GROUP_SIZE).mul_(_scale_multiplier(s2[r0:r0 + r]).to(cdt).unsqueeze(-1))
        if tgt is not o2[r0:r0 + r] and cdt != dtype:
            o2[r0:r0 + r].copy_(tgt)
    return out


_LUTS: dict = {}


def _lut(device, dtype) -> torch.Tensor:
    """The byte table for ``dtype`` (fp32 / bf16) as 256 integers, each the bit pattern of the (low, high)
    nibble values side by side (int64 for fp32, int32 for bf16)."""
    key = (str(device), dtype)
    t = _LUTS.get(key)
    if t is None:
        pair = _BYTE_LUT.to(dtype=dtype).contiguous()  # [256, 2]
        t = _LUTS[key] = pair.view(torch.int64 if dtype == torch.float32 else torch.int32).reshape(256).to(device)
    return t


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``W [..., out, in]`` (``in`` a multiple of 32) to ``(packed uint8 [..., out, in/2],
    scale uint8 [..., out, in/32])``.

    Per 32-group the scale is the smallest power of two ``2**e`` with ``max|w| / 2**e <= 6`` (clamped to the E8M0
    range ``s = e+127`` in 0..254; all-zero groups get ``s = 127``); elements are rounded to the nearest E2M1 value,
    ties to the even code. Values already on the grid (with a canonical scale) round-trip bit-exactly; the sign
    of ``-0.0`` is kept.
    """
    if not w.is_floating_point():
        raise ValueError(f"mxfp4_encode expects a floating tensor, got {w.dtype}")
    n_in = w.shape[-1]
    if n_in % GROUP_SIZE:
        raise ValueError(f"last dim {n_in} of shape {tuple(w.shape)} is not a multiple of {GROUP_SIZE}")
    x = w.detach().to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"mxfp4_encode: tensor of shape {tuple(w.shape)} contains NaN or Inf")
    lead = tuple(x.shape[:-1])
    g = x.reshape(lead + (n_in // GROUP_SIZE, GROUP_SIZE))
    amax = g.abs().amax(dim=-1).to(torch.float64)
    # e = ceil(log2(amax / 6)) computed exactly with frexp: amax/6 = m * 2**ex, m in [0.5, 1)
    m, ex = torch.frexp(amax / 6.0)
    e = torch.where(m == 0.5, ex - 1, ex)
    e = torch.where(amax == 0, torch.zeros_like(e), e)
    s = (e + 127).clamp(0, 254)
    mult = _scale_multiplier(s.to(torch.uint8))
    y = (g / mult.unsqueeze(-1)).abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for b in _MIDPOINTS:  # number of midpoints strictly below y (7 vectorised compares)
        code += y > b
    for t in _TIES_UP:  # exact ties at these midpoints round up, to the even code
        code += y == t
    code = code.clamp_(max=7)
    code = code + torch.signbit(g).to(torch.uint8) * 8
    code = code.reshape(lead + (n_in // 2, 2))
    packed = code[..., 0] | (code[..., 1] << 4)
    return packed.contiguous(), s.to(torch.uint8).contiguous()
