"""Image preprocessing (spec §5.1): sizes, padding, token counts, pixel layout, modes, errors."""
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from k3.errors import K3ConfigError, K3Error
from k3.vision import ImageProcessorConfig, K3ImageError, num_image_tokens, preprocess, resize_plan


def plan_by_hand(W, H, p=14, m=2, limit=65536, side=512):
    """The release rule, written out independently of k3.vision.preprocess."""
    s = min(1.0, math.sqrt(limit / (max(1, W // p) * max(1, H // p))), side * p / W, side * p / H)
    w2 = min(max(1, int(W * s)), side * p)
    h2 = min(max(1, int(H * s)), side * p)
    wp = w2 + (-w2) % (m * p)
    hp = h2 + (-h2) % (m * p)
    return w2, h2, hp // p, wp // p, (hp // (m * p)) * (wp // (m * p))


@pytest.mark.parametrize("W,H,expect", [
    ((1), 1, (1, 1, 2, 2, 1)),
    (13, 1000, (13, 1000, 72, 2, 36)),
    (1000, 13, (1000, 13, 2, 72, 36)),
    (224, 224, (224, 224, 16, 16, 64)),
    (4000, 3000, (4000, 3000, 216, 286, 15444)),     # spec example
    (3600, 3600, (3585, 3585, 258, 258, 16641)),     # budget bounds the scale, not the padded count (66,564 patches)
    (20000, 20000, (3585, 3585, 258, 258, 16641)),   # huge -> patch budget
    (10000, 20, (7168, 14, 2, 512, 256)),            # one-side limit (512 patches)
    (100000, 3, (7167, 1, 2, 512, 256)),             # int(100000 * (7168 / 100000)) = 7167 in floats
], ids=lambda v: str(v))
def test_resize_plan_known_sizes(W, H, expect):
    plan = resize_plan(W, H)
    got = (plan.new_width, plan.new_height, plan.grid_h, plan.grid_w, plan.num_tokens)
    assert got == expect == plan_by_hand(W, H)
    assert num_image_tokens(W, H) == expect[-1]


def test_resize_plan_many_sizes_against_formula():
    rng = np.random.default_rng(0)
    for W, H in rng.integers(1, 30000, size=(300, 2)).tolist() + [[7168, 7168], [7169, 1], [28, 28], [29, 27]]:
        plan = resize_plan(W, H)
        assert (plan.new_width, plan.new_height, plan.grid_h, plan.grid_w, plan.num_tokens) == plan_by_hand(W, H)
        assert plan.grid_h <= 512 and plan.grid_w <= 512 and plan.grid_h % 2 == 0 and plan.grid_w % 2 == 0
        assert 0 <= plan.pad_width < 28 and 0 <= plan.pad_height < 28
        assert (plan.new_width + plan.pad_width) % 28 == 0 and (plan.new_height + plan.pad_height) % 28 == 0


def test_pixels_layout_padding_and_normalisation():
    # 30 x 20 (W x H): no resize; padded to 56 x 28 -> grid (2, 4); each patch's content checked by hand.
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, size=(20, 30, 3), dtype=np.uint8)
    pv, grid = preprocess(Image.fromarray(arr))
    assert grid.tolist() == [[1, 2, 4]] and grid.dtype == torch.int64
    assert pv.shape == (8, 3, 14, 14) and pv.dtype == torch.float32
    padded = np.zeros((28, 56, 3), dtype=np.uint8)
    padded[:20, :30] = arr
    for r in range(2):
        for c in range(4):
            patch = padded[14 * r:14 * r + 14, 14 * c:14 * c + 14].transpose(2, 0, 1)  # (C, 14, 14)
            want = torch.from_numpy(((patch / 255.0).astype(np.float32) - 0.5) / 0.5)
            torch.testing.assert_close(pv[r * 4 + c], want, rtol=0, atol=1e-6)
    assert (pv[7] == -1).all()  # bottom-right patch is all padding


def test_several_images_concatenate_in_order():
    ims = [Image.new("RGB", (13, 100), (200, 10, 3)), Image.new("RGB", (1, 1), (9, 9, 9)),
           Image.new("RGB", (300, 41), (0, 255, 7))]
    pv, grid = preprocess(ims)
    parts = [preprocess(im) for im in ims]
    assert torch.equal(pv, torch.cat([p[0] for p in parts]))
    assert torch.equal(grid, torch.cat([p[1] for p in parts]))
    assert grid[:, 0].tolist() == [1, 1, 1]
    assert pv.shape[0] == int((grid[:, 1] * grid[:, 2]).sum())
    assert preprocess(ims, return_sizes=True)[2] == [(13, 100), (1, 1), (300, 41)]
    e_pv, e_grid = preprocess([])
    assert e_pv.shape == (0, 3, 14, 14) and e_grid.shape == (0, 3)


def test_inputs_path_bytes_pil_agree(tmp_path):
    im = Image.fromarray(np.random.default_rng(2).integers(0, 256, (33, 47, 3), dtype=np.uint8))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    path = tmp_path / "x.png"
    path.write_bytes(buf.getvalue())
    a = preprocess(im)[0]
    assert torch.equal(a, preprocess(buf.getvalue())[0])
    assert torch.equal(a, preprocess(str(path))[0])
    assert torch.equal(a, preprocess(path)[0])


def small_budget():
    return ImageProcessorConfig(in_patch_limit=16)  # forces a resize on small test images


def test_resize_is_pil_bicubic():
    arr = np.random.default_rng(3).integers(0, 256, (90, 120, 3), dtype=np.uint8)
    cfg = small_budget()
    plan = resize_plan(120, 90, cfg)
    assert (plan.new_width, plan.new_height) == (69, 51)  # s = sqrt(16 / (8 * 6))
    want = np.asarray(Image.fromarray(arr).resize((69, 51), Image.Resampling.BICUBIC))
    pv, grid = preprocess(Image.fromarray(arr), cfg)
    gh, gw = grid[0, 1:].tolist()
    img = ((pv.view(gh, gw, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(gh * 14, gw * 14, 3) + 1) / 2 * 255)
    assert np.array_equal(img.round().to(torch.uint8).numpy()[:51, :69], want)


@pytest.mark.parametrize("cfg", [None, "small"], ids=["native", "resized"])
def test_grey_equals_replicated_rgb(cfg):
    cfg = small_budget() if cfg else None
    g = np.random.default_rng(4).integers(0, 256, (50, 70), dtype=np.uint8)
    rgb = np.repeat(g[:, :, None], 3, axis=2)
    assert torch.equal(preprocess(Image.fromarray(g), cfg)[0], preprocess(Image.fromarray(rgb), cfg)[0])


def unpatchify(pv, grid):
    gh, gw = grid[0, 1:].tolist()
    x = pv.view(gh, gw, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(gh * 14, gw * 14, 3)
    return ((x + 1) / 2 * 255).round().to(torch.int64).numpy()


def chessboard(h, w):
    yy, xx = np.mgrid[:h, :w]
    return np.where(((yy // 8) + (xx // 8)) % 2 == 1, 180, 255)


def test_rgba_composited_on_chessboard_truncating():
    h, w = 20, 30
    rgba = np.zeros((h, w, 4), dtype=np.uint8)
    rgba[..., :3] = np.random.default_rng(5).integers(0, 256, (h, w, 3))
    rgba[..., 3] = np.random.default_rng(6).integers(0, 256, (h, w))
    rgba[0, :, 3] = 0      # fully transparent row: shows the board
    rgba[1, :, 3] = 255    # opaque row: shows the colour
    out = unpatchify(*preprocess(Image.fromarray(rgba, "RGBA")))[:h, :w]
    a = rgba[..., 3:].astype(np.float32) / np.float32(255)
    bg = chessboard(h, w)[..., None].astype(np.uint8)
    want = (a * rgba[..., :3] + (np.float32(1) - a) * bg).astype(np.uint8)   # truncation, not rounding
    assert np.array_equal(out, want)
    assert out[0, 0].tolist() == [255] * 3 and out[0, 8].tolist() == [180] * 3 and out[0, 16].tolist() == [255] * 3
    assert np.array_equal(out[1], rgba[1, :, :3])


def test_la_equals_rgba_and_bg_off_drops_alpha():
    la = np.random.default_rng(7).integers(0, 256, (20, 30, 2), dtype=np.uint8)
    rgba = np.concatenate([np.repeat(la[..., :1], 3, axis=2), la[..., 1:]], axis=2)
    a = preprocess(Image.fromarray(la, "LA"))[0]
    assert torch.equal(a, preprocess(Image.fromarray(rgba, "RGBA"))[0])
    off = ImageProcessorConfig(transparent_bg_config=None)
    assert torch.equal(preprocess(Image.fromarray(rgba, "RGBA"), off)[0],
                       preprocess(Image.fromarray(np.ascontiguousarray(rgba[..., :3])), off)[0])


def test_palette_with_and_without_transparency():
    idx = np.random.default_rng(8).integers(0, 4, (20, 30), dtype=np.uint8)
    im = Image.fromarray(idx, "P")
    im.putpalette([10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120] + [0] * (256 * 3 - 12))
    opaque = preprocess(im)[0]
    assert torch.equal(opaque, preprocess(im.convert("RGB"))[0])
    im.info["transparency"] = 2
    out = unpatchify(*preprocess(im))[:20, :30]
    board = chessboard(20, 30)
    assert (out[idx == 2] == board[idx == 2][:, None]).all()
    assert np.array_equal(out[idx != 2], np.asarray(im.convert("RGB"))[idx != 2])


def test_cmyk_and_16bit():
    cmyk = Image.fromarray(np.random.default_rng(9).integers(0, 256, (20, 30, 4), dtype=np.uint8), "CMYK")
    assert torch.equal(preprocess(cmyk)[0], preprocess(cmyk.convert("RGB"))[0])
    v = np.array([[0, 128, 129, 257, 385, 386, 65535, 40000]], dtype=np.uint16)
    out = unpatchify(*preprocess(Image.fromarray(v)))[0, :8, 0]
    assert out.tolist() == [int(math.floor(x / 257 + 0.5)) for x in v[0].tolist()] == [0, 0, 1, 1, 1, 2, 255, 156]
    i32 = Image.fromarray(np.array([[-5, 70000, 257]], dtype=np.int32))
    assert i32.mode == "I"
    assert unpatchify(*preprocess(i32))[0, :3, 0].tolist() == [0, 255, 1]


def png_bytes(w=20, h=20):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("bad,needle", [
    (b"not an image at all", "not a readable image"),
    (b"", "empty input"),
    (png_bytes(200, 200)[:200], "corrupt or truncated"),
    (Image.new("RGB", (0, 0)), "empty image"),
    (Image.new("F", (4, 4)), "unsupported mode 'F'"),
    (12345, "expected a PIL image"),
    ("/no/such/file.png", "no such file"),
], ids=["garbage", "no-bytes", "truncated", "0x0", "mode-F", "int", "missing-path"])
def test_errors(bad, needle):
    with pytest.raises(K3ImageError, match=needle) as ei:
        preprocess([Image.new("RGB", (5, 5)), bad])
    assert "images[1]" in str(ei.value)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, K3Error)


def test_too_large_refused_before_decoding():
    cfg = ImageProcessorConfig(max_image_pixels=399)
    with pytest.raises(K3ImageError, match="too large .*20x20 = 400 pixels"):
        preprocess(png_bytes(20, 20), cfg)
    assert preprocess(png_bytes(19, 21), cfg)[1].tolist() == [[1, 2, 2]]


def test_processor_config_from_released_dict_and_errors():
    released = {"media_proc_cfg": {
        "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 65536, "patch_limit_on_one_side": 512,
        "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "in_patch_limit_each_frame": 16384, "sample_fps": 8.0, "temporal_merge_kernel_size": 4,
        "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                                  "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
                                  "chessboard_gray_value": 180},
        "transparent_bg_fill_stage": "after_resize", "something_new": 1}}
    cfg = ImageProcessorConfig.from_dict(released)
    assert cfg == ImageProcessorConfig(extra={"something_new": 1})
    assert cfg.to_dict() == released["media_proc_cfg"]
    assert ImageProcessorConfig.from_dict({"merge_kernel_size": [2, 2]}).merge_kernel_size == 2
    with pytest.raises(K3ConfigError, match="fixed_output_tokens"):
        ImageProcessorConfig(fixed_output_tokens=256)
    with pytest.raises(K3ConfigError, match="image_std"):
        ImageProcessorConfig(image_std=[0.5, 0, 0.5])
    with pytest.raises(K3ConfigError, match="patch_size"):
        ImageProcessorConfig.from_dict({"patch_size": 0})
    with pytest.raises(K3ConfigError, match="transparent_bg_fill_stage"):
        ImageProcessorConfig(transparent_bg_fill_stage="never")


def test_palette_resized_nearest_then_composited():
    """PIL resizes P images with nearest neighbour whatever filter is asked (so does the release)."""
    idx = np.random.default_rng(10).integers(0, 4, (90, 120), dtype=np.uint8)
    im = Image.fromarray(idx, "P")
    im.putpalette([10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120] + [0] * (256 * 3 - 12))
    im.info["transparency"] = 2
    cfg = small_budget()
    plan = resize_plan(120, 90, cfg)
    small = np.asarray(im.resize((plan.new_width, plan.new_height), Image.Resampling.NEAREST))
    rgb = np.asarray(im.convert("RGB").resize((plan.new_width, plan.new_height), Image.Resampling.NEAREST))
    out = unpatchify(*preprocess(im, cfg))[:plan.new_height, :plan.new_width]
    board = chessboard(plan.new_height, plan.new_width)
    assert (out[small == 2] == board[small == 2][:, None]).all()
    assert np.array_equal(out[small != 2], rgb[small != 2])
