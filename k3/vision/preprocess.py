"""Image preprocessing for MoonViT-V2, as the released `KimiK3VisionProcessor` does it (spec §5.1).

Per image: native-resolution resize under the patch budget (PIL bicubic) -> transparency composited onto the
configured background (a chessboard at release, *after* the resize) -> RGB -> zero padding bottom/right to a
multiple of merge x patch (28) -> x/255, (x - mean)/std -> patches [gh*gw, 3, p, p] in row-major (h, w) order,
grid row (1, gh, gw). The LLM sees (gh/2)*(gw/2) tokens per image.

Input modes (what we chose, tested in tests/vision/test_preprocess.py):
- RGB, RGBA, L, LA, P (with or without transparency), 1, CMYK, YCbCr: resized in their own mode by PIL, as the
  release does (PIL resizes P and 1 with nearest neighbour whatever filter is asked), then converted. Images with
  an alpha band or a `transparency` entry (RGBA, LA, PA, P/L with tRNS) are composited onto the configured
  background (release: 8-px chessboard, white 255 / gray 180, white top-left); values are truncated to uint8,
  not rounded. RGB images ignore a `transparency` entry (as the release). With `transparent_bg_config=None`
  the alpha is dropped. Premultiplied modes (RGBa, La) are un-premultiplied to RGBA / LA first.
- 16-bit / 32-bit integer grey (I;16, I;16B, I;16L, I;16N, I): k3's choice, not the release's (PIL would clip
  every value above 255 to white): read as 16-bit grey, clipped to [0, 65535], scaled to 8 bits by v/257 rounded
  half up, then treated as L.
- Anything else (F, LAB, HSV, ...) is refused with `K3ImageError`.
EXIF orientation is not applied (the release does not either): rotate images before calling.
"""
from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch

from k3.vision.config import ImageProcessorConfig, VisionConfig
from k3.vision.errors import K3ImageError

__all__ = ["K3ImageError", "ResizePlan", "resize_plan", "num_image_tokens", "load_image", "preprocess_image",
           "preprocess", "SUPPORTED_MODES"]


_INT16_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
_NATIVE_MODES = ("1", "L", "P", "RGB", "RGBA", "LA", "PA", "CMYK", "YCbCr", "RGBa", "La", "RGBX")
SUPPORTED_MODES = _NATIVE_MODES + _INT16_MODES

ImageInput = Union["PIL.Image.Image", str, os.PathLike, bytes, bytearray, memoryview]  # noqa: F821


def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("k3.vision needs Pillow: pip install pillow") from e
    return Image


def _as_processor_config(config) -> ImageProcessorConfig:
    if config is None:
        return ImageProcessorConfig()
    if isinstance(config, ImageProcessorConfig):
        return config
    if isinstance(config, VisionConfig):
        return ImageProcessorConfig.from_vision_config(config)
    if isinstance(config, dict):
        return ImageProcessorConfig.from_dict(config)
    raise TypeError(f"config: expected ImageProcessorConfig, VisionConfig, a media_proc_cfg dict or None, "
                    f"got {type(config).__name__}")


# ---------------------------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class ResizePlan:
    width: int          # original
    height: int
    new_width: int      # after the resize
    new_height: int
    pad_width: int      # zero columns added on the right / rows at the bottom
    pad_height: int
    grid_h: int         # patches
    grid_w: int
    merge: int          # merge kernel side (2 at release)

    @property
    def num_tokens(self) -> int:
        """Merged tokens the LLM sees: (grid_h / merge) * (grid_w / merge)."""
        return (self.grid_h // self.merge) * (self.grid_w // self.merge)


def resize_plan(width: int, height: int, config=None) -> ResizePlan:
    """The release's native-resolution rule (spec §5.1 step 1 and 3) for an image of `width` x `height` px."""
    cfg = _as_processor_config(config)
    if width < 1 or height < 1:
        raise K3ImageError(f"image of size {width}x{height}: empty image")
    p, side, m = cfg.patch_size, cfg.patch_limit_on_one_side, cfg.merge_kernel_size
    s = min(1.0,
            math.sqrt(cfg.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p))),
            side * p / width,
            side * p / height)
    new_w = min(max(1, int(width * s)), side * p)
    new_h = min(max(1, int(height * s)), side * p)
    f = m * p
    pad_w, pad_h = (f - new_w % f) % f, (f - new_h % f) % f
    return ResizePlan(width, height, new_w, new_h, pad_w, pad_h, (new_h + pad_h) // p, (new_w + pad_w) // p, m)


def num_image_tokens(width: int, height: int, config=None) -> int:
    """How many `<|media_pad|>` positions an image of `width` x `height` px expands to."""
    return resize_plan(width, height, config).num_tokens


# ---------------------------------------------------------------------------------------------------- loading
def load_image(image: ImageInput, config=None):
    """Open `image` (PIL image, path, or encoded bytes), check it, decode it fully; returns a PIL image.

    Raises `K3ImageError` (naming the image) when it is corrupt or truncated, empty, has more than
    `config.max_image_pixels` pixels, or has an unsupported mode.
    """
    Image = _pil()
    cfg = _as_processor_config(config)
    if isinstance(image, Image.Image):
        name, img = f"<PIL {image.mode} {image.size[0]}x{image.size[1]}>", image
        _check_header(img, name, cfg)
        try:
            img.load()
        except Exception as e:
            raise K3ImageError(f"image {name}: cannot decode: {e}") from e
        return img
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        name = f"<{len(data)} bytes>"
        if not data:
            raise K3ImageError(f"image {name}: empty input (no bytes)")
        src = io.BytesIO(data)
    elif isinstance(image, (str, os.PathLike)):
        name = os.fspath(image)
        if not os.path.isfile(name):
            raise K3ImageError(f"image {name!r}: no such file")
        if os.path.getsize(name) == 0:
            raise K3ImageError(f"image {name!r}: empty file")
        src = name
    else:
        raise K3ImageError(f"image of type {type(image).__name__}: expected a PIL image, a path or bytes")
    try:
        fh = Image.open(src)
    except Image.DecompressionBombError as e:
        raise K3ImageError(f"image {name}: too large ({e})") from e
    except Exception as e:  # UnidentifiedImageError, OSError, SyntaxError from broken headers
        raise K3ImageError(f"image {name}: not a readable image ({type(e).__name__}: {e})") from e
    with fh:
        _check_header(fh, name, cfg)
        try:
            fh.load()
        except Exception as e:
            raise K3ImageError(f"image {name}: corrupt or truncated ({type(e).__name__}: {e})") from e
        return fh.copy()


def _check_header(img, name: str, cfg: ImageProcessorConfig) -> None:
    w, h = img.size
    if w < 1 or h < 1:
        raise K3ImageError(f"image {name}: empty image (size {w}x{h})")
    if w * h > cfg.max_image_pixels:
        raise K3ImageError(f"image {name}: too large ({w}x{h} = {w * h} pixels > max_image_pixels="
                           f"{cfg.max_image_pixels})")
    if img.mode not in SUPPORTED_MODES:
        raise K3ImageError(f"image {name}: unsupported mode {img.mode!r}; supported: {list(SUPPORTED_MODES)}")


def _normalise_mode(img):
    """Bring rare modes to one the release path handles (see the module docstring)."""
    Image = _pil()
    if img.mode in _INT16_MODES:
        a = np.asarray(img).astype(np.int64)
        a = np.clip(a, 0, 65535)
        a8 = ((a * 2 + 257) // 514).astype(np.uint8)  # round(v / 257), half up
        return Image.fromarray(a8)
    if img.mode == "RGBa":
        return img.convert("RGBA")
    if img.mode == "La":
        return img.convert("LA")
    if img.mode == "PA":
        return img.convert("RGBA")
    if img.mode == "RGBX":
        return img.convert("RGB")
    return img


# ---------------------------------------------------------------------------------------------------- pixels
def _background(h: int, w: int, bg: dict) -> np.ndarray:
    pattern = bg.get("pattern", "chessboard")
    if pattern == "chessboard":
        sq = bg.get("chessboard_square_size", 8)
        white, gray = bg.get("chessboard_white_value", 255), bg.get("chessboard_gray_value", 180)
        gray_parity = 1 if bg.get("chessboard_square_on_top_left", True) else 0
        parity = (np.arange(h)[:, None] // sq + np.arange(w)[None, :] // sq) % 2
        plane = np.where(parity == gray_parity, gray, white).astype(np.uint8)
        return np.repeat(plane[:, :, None], 3, axis=2)
    return np.full((h, w, 3), {"white": 255, "black": 0, "gray": 128}[pattern], dtype=np.uint8)


def _fill_transparent(img, bg: dict | None):
    """Composite alpha onto the background (float32 blend, truncated to uint8, as the release); returns RGB."""
    Image = _pil()
    if bg is None or img.mode == "RGB":
        return img.convert("RGB")
    if "A" not in img.getbands() and "transparency" not in img.info:
        return img.convert("RGB")
    rgba = np.asarray(img.convert("RGBA"))
    alpha = (rgba[:, :, 3].astype(np.float32) / np.float32(255.0))[:, :, None]
    out = alpha * rgba[:, :, :3] + (np.float32(1.0) - alpha) * _background(rgba.shape[0], rgba.shape[1], bg)
    return Image.fromarray(out.astype(np.uint8), mode="RGB")


def preprocess_image(image: ImageInput, config=None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One image -> (pixel_values [gh*gw, 3, p, p] float32, (1, gh, gw))."""
    Image = _pil()
    cfg = _as_processor_config(config)
    img = _normalise_mode(load_image(image, cfg))
    plan = resize_plan(img.size[0], img.size[1], cfg)
    bg, stage = cfg.transparent_bg_config, cfg.transparent_bg_fill_stage
    if stage == "before_resize":
        img = _fill_transparent(img, bg)
    if (plan.new_width, plan.new_height) != img.size:
        img = img.resize((plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC)
    img = _fill_transparent(img, bg)  # after_resize (a no-op conversion when already filled before)
    arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
    arr = np.pad(arr, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)), mode="constant", constant_values=0)
    x = (arr / 255.0).astype(np.float32)
    x -= np.asarray(cfg.image_mean, dtype=np.float64)
    x *= 1.0 / np.asarray(cfg.image_std, dtype=np.float64)
    p = cfg.patch_size
    gh, gw = plan.grid_h, plan.grid_w
    x_LCPP = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    return torch.from_numpy(np.ascontiguousarray(x_LCPP)), (1, gh, gw)


def preprocess(images: Union[ImageInput, Sequence[ImageInput]], config=None, *, return_sizes: bool = False):
    """Images of one prompt (or batch) -> (pixel_values [L, 3, p, p] float32, grid_thw [n_images, 3] int64).

    `images`: one image or a sequence of them (PIL images, paths, encoded bytes), in prompt order; their patches
    are concatenated in that order. `config`: an `ImageProcessorConfig`, a `media_proc_cfg` /
    `preprocessor_config.json` dict, a `VisionConfig` (release preprocessing with its patch/merge sizes) or None
    (the release). With `return_sizes=True` a third item lists each image's original (width, height), which the
    chat prompt prints (`image {W}x{H}`).
    """
    cfg = _as_processor_config(config)
    if isinstance(images, (str, os.PathLike, bytes, bytearray, memoryview)) or hasattr(images, "getbands"):
        images = [images]
    images = list(images)
    p = cfg.patch_size
    pixels, grids, sizes = [torch.zeros(0, 3, p, p)], [], []
    for i, im in enumerate(images):
        try:
            img = load_image(im, cfg)
            pv, thw = preprocess_image(img, cfg)
        except K3ImageError as e:
            raise K3ImageError(f"images[{i}]: {e}") from e
        pixels.append(pv)
        grids.append(thw)
        sizes.append(tuple(img.size))
    out = torch.cat(pixels, 0), torch.tensor(grids, dtype=torch.int64).view(-1, 3)
    return (*out, sizes) if return_sizes else out
