"""Configs of the MoonViT-V2 vision tower (`vision_config`) and of its image preprocessor (`media_proc_cfg`).

Field names are the released keys, so both map 1:1 to `config.json["vision_config"]` and to
`preprocessor_config.json["media_proc_cfg"]`; keys these classes do not model go to `extra` and come back out of
`to_dict()`, so a load -> save round trip loses nothing.

The references hard-code the two GELU variants (tanh in the tower MLP, exact erf in the projector) and ignore
`activation_func` / `projector_hidden_act`; so do we (the keys are kept for the round trip).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from k3.errors import K3ConfigError

__all__ = ["VisionConfig", "ImageProcessorConfig", "VISION_PRESETS"]


def _from_dict(cls, d: dict, where: str):
    if not isinstance(d, dict):
        raise K3ConfigError(f"{where}: expected a dict, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    kw = {k: copy.deepcopy(v) for k, v in d.items() if k in names}
    return cls(**kw, extra={k: copy.deepcopy(v) for k, v in d.items() if k not in names})


def _to_dict(obj, skip=()) -> dict:
    d = {f.name: copy.deepcopy(getattr(obj, f.name)) for f in dataclasses.fields(obj)
         if f.name != "extra" and f.name not in skip}
    d.update(copy.deepcopy(obj.extra))
    return d


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class VisionConfig:
    """`vision_config` of the release (MoonViT-V2 tower + patchmergerv2 projector). Defaults = the release."""

    patch_size: int = 14
    vt_hidden_size: int = 1024
    vt_num_hidden_layers: int = 27
    vt_num_attention_heads: int = 12
    qkv_hidden_size: int = 1536
    vt_intermediate_size: int = 4096
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    merge_kernel_size: list = field(default_factory=lambda: [2, 2])
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    norm_type: str = "rmsnorm"
    mlp_type: str = "mlp2"
    activation_func: str = "gelu_pytorch_tanh"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    text_hidden_size: int = 7168
    _attn_implementation: str = "flash_attention_2"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.merge_kernel_size, tuple):
            self.merge_kernel_size = list(self.merge_kernel_size)
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merge_area(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def projector_in_features(self) -> int:
        """Width of one merged token = the projector's input and hidden width (4096 at release)."""
        return self.mm_hidden_size * self.merge_area

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def bad(key, msg):
            raise K3ConfigError(f"vision_config.{key}: {msg} (got {getattr(self, key)!r})")

        for key in ("patch_size", "vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads",
                    "qkv_hidden_size", "vt_intermediate_size", "init_pos_emb_height", "init_pos_emb_width",
                    "init_pos_emb_time", "mm_hidden_size", "text_hidden_size"):
            v = getattr(self, key)
            if not _is_int(v) or v <= 0:
                bad(key, "must be a positive integer")
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            bad("qkv_hidden_size", f"must be divisible by vt_num_attention_heads={self.vt_num_attention_heads}")
        if self.head_dim % 4:
            bad("qkv_hidden_size", f"head dim {self.head_dim} must be a multiple of 4 (2-D RoPE: row and column "
                "frequencies on alternating complex pairs)")
        mk = self.merge_kernel_size
        if not (isinstance(mk, list) and len(mk) == 2 and all(_is_int(m) and m > 0 for m in mk)):
            bad("merge_kernel_size", "must be two positive integers [kh, kw]")
        if self.mm_hidden_size != self.vt_hidden_size:
            bad("mm_hidden_size", f"must equal vt_hidden_size={self.vt_hidden_size} (the projector reads the "
                "tower output)")
        for key, allowed in (("pos_emb_type", ("divided_fixed",)), ("pos_emb_interpolation_mode", ("bilinear",)),
                             ("merge_type", ("sd2_tpool",)), ("mm_projector_type", ("patchmergerv2",)),
                             ("norm_type", ("rmsnorm",)), ("mlp_type", ("mlp2",))):
            if getattr(self, key) not in allowed:
                bad(key, f"unsupported; supported: {list(allowed)}")
        for key in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
            if not isinstance(getattr(self, key), bool):
                bad(key, "must be a boolean")
        eps = self.projector_ln_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1):
            bad("projector_ln_eps", "must be a number in (0, 1)")

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        """From a `vision_config` dict, or from a whole container `config.json` dict that holds one."""
        if isinstance(d, dict) and "vision_config" in d and isinstance(d["vision_config"], dict):
            d = d["vision_config"]
        try:
            return _from_dict(cls, d, "vision_config")
        except TypeError as e:  # wrong-typed extra etc.
            raise K3ConfigError(f"vision_config: {e}") from None

    def to_dict(self) -> dict:
        return _to_dict(self)

    @classmethod
    def preset(cls, name: str) -> "VisionConfig":
        if name not in VISION_PRESETS:
            raise K3ConfigError(f"vision preset {name!r}: unknown; known: {sorted(VISION_PRESETS)}")
        return cls.from_dict(VISION_PRESETS[name])


_BG_DEFAULT = {
    "pattern": "chessboard",
    "chessboard_square_size": 8,
    "chessboard_square_on_top_left": True,
    "chessboard_white_value": 255,
    "chessboard_gray_value": 180,
}


@dataclass
class ImageProcessorConfig:
    """`media_proc_cfg` of the release's `preprocessor_config.json` (image part). Defaults = the release.

    `max_image_pixels` is k3-only (not in the release): images with more pixels (W*H, read from the header before
    decoding) are refused with `K3ImageError`. Default = Pillow's own decompression-bomb error threshold.
    """

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: Optional[int] = None
    image_mean: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    in_patch_limit_each_frame: int = 16384
    sample_fps: float = 8.0
    temporal_merge_kernel_size: int = 4
    transparent_bg_config: Optional[dict] = field(default_factory=lambda: dict(_BG_DEFAULT))
    transparent_bg_fill_stage: str = "after_resize"
    max_image_pixels: int = 178_956_970
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.validate()

    @property
    def pad_multiple(self) -> int:
        """Resized images are padded bottom/right to a multiple of this (merge x patch = 28 at release)."""
        return self.merge_kernel_size * self.patch_size

    def validate(self) -> None:
        def bad(key, msg):
            raise K3ConfigError(f"media_proc_cfg.{key}: {msg} (got {getattr(self, key)!r})")

        for key in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                    "max_image_pixels"):
            v = getattr(self, key)
            if not _is_int(v) or v <= 0:
                bad(key, "must be a positive integer")
        if self.fixed_output_tokens is not None:
            bad("fixed_output_tokens", "only null (native resolution, as released) is supported")
        for key in ("image_mean", "image_std"):
            v = getattr(self, key)
            if not (isinstance(v, (list, tuple)) and len(v) == 3
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
                bad(key, "must be three numbers (R, G, B)")
        if any(s == 0 for s in self.image_std):
            bad("image_std", "must be non-zero")
        if self.transparent_bg_fill_stage not in ("before_resize", "after_resize"):
            bad("transparent_bg_fill_stage", "must be 'before_resize' or 'after_resize'")
        bg = self.transparent_bg_config
        if bg is not None:
            if not isinstance(bg, dict):
                bad("transparent_bg_config", "must be a dict or null")
            pattern = bg.get("pattern", "chessboard")
            if pattern not in ("chessboard", "white", "black", "gray"):
                bad("transparent_bg_config", f"pattern {pattern!r} unsupported; supported: chessboard, white, "
                    "black, gray")
            if pattern == "chessboard":
                for k in ("chessboard_square_size", "chessboard_white_value", "chessboard_gray_value"):
                    v = bg.get(k, _BG_DEFAULT[k])
                    if not _is_int(v) or v < 0 or v > 255 or (k == "chessboard_square_size" and v == 0):
                        bad("transparent_bg_config", f"{k} must be an integer in [1, 255]")

    @classmethod
    def from_dict(cls, d: dict) -> "ImageProcessorConfig":
        """From a `media_proc_cfg` dict or a whole `preprocessor_config.json` dict that holds one."""
        if isinstance(d, dict) and isinstance(d.get("media_proc_cfg"), dict):
            d = d["media_proc_cfg"]
        if isinstance(d, dict) and isinstance(d.get("merge_kernel_size"), (list, tuple)):
            mk = list(d["merge_kernel_size"])
            if len(mk) != 2 or mk[0] != mk[1]:
                raise K3ConfigError(f"media_proc_cfg.merge_kernel_size: must be one integer or a square pair "
                                    f"(got {mk!r})")
            d = dict(d, merge_kernel_size=mk[0])
        try:
            return _from_dict(cls, d, "media_proc_cfg")
        except TypeError as e:
            raise K3ConfigError(f"media_proc_cfg: {e}") from None

    def to_dict(self) -> dict:
        d = _to_dict(self, skip=("max_image_pixels",))
        if self.max_image_pixels != 178_956_970:
            d["max_image_pixels"] = self.max_image_pixels
        return d

    @classmethod
    def from_vision_config(cls, vc: VisionConfig, **overrides) -> "ImageProcessorConfig":
        """Release preprocessing defaults with the tower's patch and merge sizes."""
        kh, kw = vc.merge_kernel_size
        if kh != kw:
            raise K3ConfigError(f"vision_config.merge_kernel_size: the preprocessor needs a square merge "
                                f"(got {vc.merge_kernel_size!r})")
        return cls(**{"patch_size": vc.patch_size, "merge_kernel_size": kh, **overrides})


VISION_PRESETS = {
    "kimi-k3": VisionConfig().to_dict(),
    # a debug tower: 2 blocks, width 64, 2 heads (head dim 32), projecting into the tiny text model (256)
    "tiny": dict(VisionConfig().to_dict(), vt_hidden_size=64, vt_num_hidden_layers=2, vt_num_attention_heads=2,
                 qkv_hidden_size=64, vt_intermediate_size=128, mm_hidden_size=64, text_hidden_size=256),
}
