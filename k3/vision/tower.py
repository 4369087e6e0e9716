"""MoonViT-V2, the K3 vision tower (spec §5.2-5.3), with the released parameter names.

    pixel_values [L, 3, p, p] (images packed, patches row-major per image), grid_thw [n, 3]
      -> patch_embed.proj (Conv2d p x p, stride p) + patch_embed.pos_emb (64x64 table, bilinear to each grid)
      -> encoder.blocks.i: x += wo(attn(rope(wqkv(norm0(x))))); x += mlp.fc1(gelu_tanh(mlp.fc0(norm1(x))))
      -> encoder.final_layernorm -> hidden [L, D]
    merge_sd2_tpool(hidden, grid_thw) -> [sum_i (h_i/2)(w_i/2), 4D]: 2x2 windows concatenated, mean over time.

Notes that matter for matching the release:
- Vision RMSNorms use eps = finfo(compute dtype).eps (2^-7 in bf16, 1.19e-7 in fp32): the release builds
  `nn.RMSNorm(dim)` with eps=None (spec §5.2). It is taken from the activation dtype at run time, never hard-coded.
- Pixels are cast to the tower dtype before the patch conv; q and k are rotated in fp32 and cast back.
- 2-D RoPE: head dim viewed as complex pairs of adjacent elements (2m, 2m+1); pair 2i turns by col*f_i and pair
  2i+1 by row*f_i, f_i = 10000^(-4i/head_dim).
- Attention is bidirectional within each image only (no L x L mask is built). `MoonViT.attn_impl`:
  "sdpa" = one SDPA call per image; "varlen" = one flash varlen call over the packed images
  (`torch.nn.attention.varlen.varlen_attn` with the images' cu_seqlens; CUDA, fp16/bf16, head_dim <= 256 and a
  multiple of 8: the release's `flash_attention_2` path); "auto" (default) = varlen where it can run and the pack
  holds many small images (>= 4 images of <= 1,024 patches on average), else sdpa: on the H200 at the released width
  varlen is 1.26x faster for 8 images of 256² but 1.2-1.4x slower for single images and at 1024² / 2048²
  (benchmarks/RESULTS.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from k3.errors import K3ConfigError
from k3.vision.config import VisionConfig
from k3.vision.errors import K3ImageError

__all__ = ["VisionRMSNorm", "MoonViT", "packed_attention", "varlen_supported", "ATTN_IMPLS", "rope_2d_angles",
           "apply_rope_2d", "time_embedding", "merge_sd2_tpool", "check_grid", "cu_seqlens_from_grid",
           "image_token_counts"]


class VisionRMSNorm(nn.Module):
    """RMSNorm whose eps, when None, is finfo(input dtype).eps (the release's `nn.RMSNorm(dim)` behaviour per
    spec §5.2). Statistics and scaling by torch's `F.rms_norm`."""

    def __init__(self, dim: int, eps: Optional[float] = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={'finfo(dtype).eps' if self.eps is None else self.eps}"


# ---------------------------------------------------------------------------------------------------- grid helpers
def check_grid(grid_thw: torch.Tensor, n_patches: int, merge=(2, 2)) -> list[tuple[int, int, int]]:
    """Validate grid_thw [n, 3] against n_patches rows of pixel_values; returns the rows as Python ints."""
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise K3ImageError(f"grid_thw: expected an int tensor of shape [n_images, 3], got "
                           f"{getattr(grid_thw, 'shape', type(grid_thw).__name__)}")
    rows = [tuple(int(v) for v in r) for r in grid_thw.tolist()]
    for i, (t, h, w) in enumerate(rows):
        if t < 1 or h < 1 or w < 1:
            raise K3ImageError(f"grid_thw[{i}] = {(t, h, w)}: every entry must be >= 1")
        if h % merge[0] or w % merge[1]:
            raise K3ImageError(f"grid_thw[{i}] = {(t, h, w)}: h and w must be multiples of the merge kernel "
                               f"{list(merge)}")
    total = sum(t * h * w for t, h, w in rows)
    if total != n_patches:
        raise K3ImageError(f"pixel_values has {n_patches} patches but grid_thw describes {total}")
    return rows


def image_token_counts(grid_thw: torch.Tensor, merge=(2, 2)) -> list[int]:
    """Merged tokens per image, (h/kh)*(w/kw) for each grid row (time is pooled): the number of `<|media_pad|>`
    positions each image's placeholder expands to."""
    rows = check_grid(grid_thw, int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum()), merge)
    return [(h // merge[0]) * (w // merge[1]) for _, h, w in rows]


def cu_seqlens_from_grid(rows) -> list[int]:
    cu = [0]
    for t, h, w in rows:
        cu.append(cu[-1] + t * h * w)
    return cu


# ---------------------------------------------------------------------------------------------------- positions
def rope_2d_angles(t: int, h: int, w: int, head_dim: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """Rotation angles [t*h*w, head_dim/2] (fp32) for patches in (t, row, col) row-major order.

    Angle of complex pair 2i = col * f_i, of pair 2i+1 = row * f_i, f_i = theta^(-4i/head_dim), i < head_dim/4.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 4, device=device, dtype=torch.float32)[: head_dim // 4]
                             / head_dim))
    rows = torch.arange(h, device=device, dtype=torch.float32)[:, None].expand(h, w)
    cols = torch.arange(w, device=device, dtype=torch.float32)[None, :].expand(h, w)
    ang = torch.stack([cols[..., None] * freqs, rows[..., None] * freqs], dim=-1)  # [h, w, hd/4, 2]
    return ang.reshape(h * w, head_dim // 2).repeat(t, 1)


def apply_rope_2d(x_LHD: torch.Tensor, cos_LP: torch.Tensor, sin_LP: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2m, 2m+1) of x [L, H, D] by the angles behind cos/sin [L, D/2]; math in fp32,
    result in x's dtype."""
    x32 = x_LHD.float()
    e, o = x32[..., 0::2], x32[..., 1::2]
    c, s = cos_LP[:, None, :], sin_LP[:, None, :]
    return torch.stack([e * c - o * s, e * s + o * c], dim=-1).flatten(-2).to(x_LHD.dtype)


def time_embedding(t: int, dim: int, device=None) -> torch.Tensor:
    """Fixed 1-D sin-cos table [t, dim]: sin half then cos half, w_i = 10000^(-i/(dim/2))."""
    half = dim // 2
    omega = 1.0 / (10000.0 ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    ang = torch.arange(t, device=device, dtype=torch.float32)[:, None] * omega
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class PosEmb(nn.Module):
    """`patch_embed.pos_emb`: a learned [H0, W0, D] table, bilinearly resampled (align_corners=False) to each
    image's grid; for t > 1 frames the 2-D table repeats per frame plus a fixed sin-cos time embedding."""

    def __init__(self, height: int, width: int, dim: int, max_time: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        self.max_time = max_time
        bound = 0.02 * 3 ** 0.5  # std 0.02; uniform, as normal_ is slow to set up on the meta device
        nn.init.uniform_(self.weight, -bound, bound)

    def table(self, t: int, h: int, w: int) -> torch.Tensor:
        """[t*h*w, D] in fp32."""
        if t > self.max_time:
            raise K3ImageError(f"grid t={t}: more frames than init_pos_emb_time={self.max_time}")
        w32 = self.weight.float()
        if (h, w) != tuple(self.weight.shape[:2]):
            w32 = F.interpolate(w32.permute(2, 0, 1)[None], size=(h, w), mode="bilinear",
                                align_corners=False)[0].permute(1, 2, 0)
        pos_LD = w32.reshape(h * w, -1)
        if t > 1:
            pos_LD = (pos_LD[None] + time_embedding(t, pos_LD.shape[-1], pos_LD.device)[:, None]).reshape(
                t * h * w, -1)
        return pos_LD


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=cfg.patch_embed_proj_bias)
        self.pos_emb = PosEmb(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.vt_hidden_size,
                              cfg.init_pos_emb_time)

    def forward(self, pixel_values: torch.Tensor, rows) -> torch.Tensor:
        w = self.proj.weight
        x_LD = self.proj(pixel_values.to(device=w.device, dtype=w.dtype)).flatten(1)
        pos_LD = torch.cat([self.pos_emb.table(t, h, ww) for t, h, ww in rows], 0)
        return x_LD + pos_LD.to(x_LD.dtype)


ATTN_IMPLS = ("auto", "sdpa", "varlen")
VARLEN_MIN_IMAGES = 4              # "auto" takes the varlen kernel for packs of at least this many images
VARLEN_MAX_MEAN_PATCHES = 1024     # ... of at most this many patches on average (module docstring)


def _varlen_op():
    """torch's flash varlen attention (CUDA only; raises NotImplementedError on CPU tensors)."""
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn


def varlen_supported(q_LHD: torch.Tensor) -> bool:
    """Whether the flash varlen kernel can take these queries: CUDA, fp16/bf16, head_dim <= 256 and % 8 == 0."""
    if not (q_LHD.is_cuda and q_LHD.dtype in (torch.float16, torch.bfloat16)):
        return False
    d = q_LHD.shape[-1]
    if d > 256 or d % 8:
        return False
    try:
        _varlen_op()
    except ImportError:
        return False
    return True


def packed_attention(q_LHD: torch.Tensor, k_LHD: torch.Tensor, v_LHD: torch.Tensor, cu_seqlens: list[int],
                     scale: float, impl: str = "auto", cu_tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bidirectional attention within each packed image ([L, H, D] in, [L, H, D] out); images are the
    segments [cu_seqlens[i], cu_seqlens[i+1]). `impl`: see the module docstring; `cu_tensor`: cu_seqlens as an
    int32 tensor on q's device (built here when None; the tower builds it once per forward)."""
    if impl not in ATTN_IMPLS:
        raise K3ConfigError(f"vision attn_impl {impl!r}: expected one of {ATTN_IMPLS}")
    n_img = len(cu_seqlens) - 1
    many_small = n_img >= VARLEN_MIN_IMAGES and cu_seqlens[-1] <= VARLEN_MAX_MEAN_PATCHES * n_img
    if impl == "varlen" or (impl == "auto" and many_small and varlen_supported(q_LHD)):
        cu = cu_tensor if cu_tensor is not None else torch.tensor(cu_seqlens, dtype=torch.int32,
                                                                   device=q_LHD.device)
        m = max(e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]))
        q_LHD, k_LHD, v_LHD = (z.contiguous() for z in (q_LHD, k_LHD, v_LHD))   # v is a strided view of qkv
        return _varlen_op()(q_LHD, k_LHD, v_LHD, cu, cu, m, m, scale=scale)
    out = []
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # one SDPA call per image
        qi, ki, vi = (z[s:e].transpose(0, 1)[None] for z in (q_LHD, k_LHD, v_LHD))
        out.append(F.scaled_dot_product_attention(qi, ki, vi, scale=scale)[0].transpose(0, 1))
    return torch.cat(out, 0) if len(out) > 1 else out[0]


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=bias)
        self.fc1 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, q = cfg.vt_hidden_size, cfg.qkv_hidden_size
        self.num_heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = VisionRMSNorm(d)
        self.wqkv = nn.Linear(d, 3 * q, bias=cfg.attn_bias)
        self.wo = nn.Linear(q, d, bias=cfg.attn_bias)
        self.norm1 = VisionRMSNorm(d)
        self.mlp = VisionMLP(d, cfg.vt_intermediate_size, cfg.linear_bias)

    def attention(self, x_LD, cos_LP, sin_LP, cu_seqlens: list[int], impl: str = "auto",
                  cu_tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
        L = x_LD.shape[0]
        qkv = self.wqkv(x_LD).view(L, 3, self.num_heads, self.head_dim)
        q_LHD = apply_rope_2d(qkv[:, 0], cos_LP, sin_LP)
        k_LHD = apply_rope_2d(qkv[:, 1], cos_LP, sin_LP)
        v_LHD = qkv[:, 2]
        o_LHD = packed_attention(q_LHD, k_LHD, v_LHD, cu_seqlens, self.head_dim ** -0.5, impl, cu_tensor)
        return self.wo(o_LHD.reshape(L, -1))

    def forward(self, x_LD, cos_LP, sin_LP, cu_seqlens, impl: str = "auto", cu_tensor=None):
        x_LD = x_LD + self.attention(self.norm0(x_LD), cos_LP, sin_LP, cu_seqlens, impl, cu_tensor)
        return x_LD + self.mlp(self.norm1(x_LD))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = VisionRMSNorm(cfg.vt_hidden_size)


class MoonViT(nn.Module):
    """The tower: `patch_embed.*`, `encoder.blocks.{i}.*`, `encoder.final_layernorm.weight` (released names under
    the `vision_tower.` prefix)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoder(cfg)
        self.attn_impl = "auto"   # "auto" | "sdpa" | "varlen" (packed_attention)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [L, 3, p, p], grid_thw [n, 3] -> final-normed hidden states [L, D] (tower dtype)."""
        cfg = self.config
        p = cfg.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise K3ImageError(f"pixel_values: expected shape [L, 3, {p}, {p}], got {tuple(pixel_values.shape)}")
        rows = check_grid(grid_thw, pixel_values.shape[0], cfg.merge_kernel_size)
        cu = cu_seqlens_from_grid(rows)
        x_LD = self.patch_embed(pixel_values, rows)
        ang_LP = torch.cat([rope_2d_angles(t, h, w, cfg.head_dim, device=x_LD.device) for t, h, w in rows], 0)
        cos_LP, sin_LP = ang_LP.cos(), ang_LP.sin()
        impl = self.attn_impl
        if impl not in ATTN_IMPLS:
            raise K3ConfigError(f"MoonViT.attn_impl {impl!r}: expected one of {ATTN_IMPLS}")
        cu_t = None
        if impl == "varlen" or (impl == "auto" and x_LD.is_cuda):   # built once, not per block
            cu_t = torch.tensor(cu, dtype=torch.int32, device=x_LD.device)
        for blk in self.encoder.blocks:
            x_LD = blk(x_LD, cos_LP, sin_LP, cu, impl, cu_t)
        return self.encoder.final_layernorm(x_LD)


def merge_sd2_tpool(hidden_LD: torch.Tensor, grid_thw: torch.Tensor, kernel=(2, 2)) -> tuple[torch.Tensor, list]:
    """sd2_tpool: per image, view [t, h/kh, kh, w/kw, kw, D] -> [t, h/kh, w/kw, kh, kw, D] -> mean over t ->
    [(h/kh)(w/kw), kh*kw*D], windows concatenated in (0,0),(0,1),(1,0),(1,1) order, tokens row-major.

    Returns (merged [sum of merged tokens, kh*kw*D], per-image token counts)."""
    kh, kw = kernel
    rows = check_grid(grid_thw, hidden_LD.shape[0], kernel)
    D = hidden_LD.shape[-1]
    out, counts, s = [], [], 0
    for t, h, w in rows:
        x = hidden_LD[s:s + t * h * w].view(t, h // kh, kh, w // kw, kw, D).permute(0, 1, 3, 2, 4, 5)
        x = x[0] if t == 1 else x.mean(0)
        out.append(x.reshape((h // kh) * (w // kw), kh * kw * D))
        counts.append((h // kh) * (w // kw))
        s += t * h * w
    return torch.cat(out, 0), counts
