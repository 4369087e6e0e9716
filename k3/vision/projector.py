"""`patchmergerv2` projector (spec §5.4) and the tower + projector pair with the released top-level names.

    merged [N, kh*kw*D] -> proj.0 Linear(4D -> 4D) -> GELU (exact erf) -> proj.2 Linear(4D -> text_hidden)
      -> post_norm RMSNorm(text_hidden, eps=projector_ln_eps) -> [N, text_hidden]
No pre-norm (unlike K2.5 / Kimi-VL).
"""
from __future__ import annotations

import torch
from torch import nn

from k3.vision.config import VisionConfig
from k3.vision.tower import MoonViT, VisionRMSNorm, merge_sd2_tpool

__all__ = ["PatchMergerV2", "VisionModel", "encode_images"]


class PatchMergerV2(nn.Module):
    """`mm_projector.proj.{0,2}.weight`, `mm_projector.post_norm.weight`."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d_in = cfg.projector_in_features
        self.proj = nn.Sequential(nn.Linear(d_in, d_in, bias=cfg.linear_bias), nn.GELU(),
                                  nn.Linear(d_in, cfg.text_hidden_size, bias=cfg.linear_bias))
        self.post_norm = VisionRMSNorm(cfg.text_hidden_size, eps=cfg.projector_ln_eps)

    def forward(self, merged_ND: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged_ND))


def encode_images(vision_tower: MoonViT, mm_projector: PatchMergerV2, pixel_values: torch.Tensor,
                  grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """pixel_values [L, 3, p, p] + grid_thw [n, 3] -> (embeddings [sum_i N_i, text_hidden] in the tower dtype,
    [N_1, ..., N_n] tokens per image, in image order)."""
    hidden_LD = vision_tower(pixel_values, grid_thw)
    merged, counts = merge_sd2_tpool(hidden_LD, grid_thw, vision_tower.config.merge_kernel_size)
    return mm_projector(merged), counts


class VisionModel(nn.Module):
    """`vision_tower` + `mm_projector` with the released names, so `state_dict()` keys equal the checkpoint's
    (`vision_tower.patch_embed.proj.weight`, ..., `mm_projector.post_norm.weight`)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.vision_tower = MoonViT(cfg)
        self.mm_projector = PatchMergerV2(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        return encode_images(self.vision_tower, self.mm_projector, pixel_values, grid_thw)
