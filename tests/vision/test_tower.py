"""MoonViT-V2 tower, sd2_tpool merge and patchmergerv2 projector (spec §5.2-5.4) against explicit loops."""
import math

import pytest
import torch
import torch.nn.functional as F

from k3.errors import K3ConfigError
from k3.vision import (K3ImageError, MoonViT, VisionConfig, VisionModel, VisionRMSNorm, image_token_counts,
                       merge_sd2_tpool, num_image_tokens, preprocess)
from k3.vision.tower import PosEmb, apply_rope_2d, rope_2d_angles, time_embedding

RELEASED_VISION_CONFIG = {
    "_attn_implementation": "flash_attention_2", "activation_func": "gelu_pytorch_tanh", "attn_bias": False,
    "init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64, "linear_bias": False,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mlp_type": "mlp2", "mm_hidden_size": 1024,
    "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm", "patch_embed_proj_bias": False, "patch_size": 14,
    "pos_emb_interpolation_mode": "bilinear", "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-05, "qkv_hidden_size": 1536, "text_hidden_size": 7168, "vt_hidden_size": 1024,
    "vt_intermediate_size": 4096, "vt_num_attention_heads": 12, "vt_num_hidden_layers": 27,
}


# ------------------------------------------------------------------------------------------------ config
def test_config_round_trip_and_container():
    cfg = VisionConfig.from_dict(RELEASED_VISION_CONFIG)
    assert cfg == VisionConfig()
    assert cfg.to_dict() == RELEASED_VISION_CONFIG
    assert VisionConfig.from_dict({"vision_config": RELEASED_VISION_CONFIG, "model_type": "kimi_k3"}) == cfg
    odd = dict(RELEASED_VISION_CONFIG, model_type="moonvit3d")
    assert VisionConfig.from_dict(odd).to_dict() == odd  # unknown keys survive
    assert cfg.head_dim == 128 and cfg.projector_in_features == 4096


@pytest.mark.parametrize("key,val,needle", [
    ("vt_num_attention_heads", 7, "qkv_hidden_size"),
    ("qkv_hidden_size", 12 * 6, "qkv_hidden_size: head dim 6 must be a multiple of 4"),
    ("merge_type", "avg", "merge_type"),
    ("mm_projector_type", "patchmerger", "mm_projector_type"),
    ("mm_hidden_size", 512, "mm_hidden_size"),
    ("merge_kernel_size", [2], "merge_kernel_size"),
    ("patch_size", 0, "patch_size"),
    ("projector_ln_eps", 0, "projector_ln_eps"),
    ("pos_emb_interpolation_mode", "bicubic", "pos_emb_interpolation_mode"),
])
def test_config_errors_name_the_field(key, val, needle):
    with pytest.raises(K3ConfigError, match=f"vision_config.{needle}"):
        VisionConfig.from_dict(dict(RELEASED_VISION_CONFIG, **{key: val}))
    with pytest.raises(K3ConfigError, match="unknown"):
        VisionConfig.preset("huge")


# ------------------------------------------------------------------------------------------------ names
def released_vision_keys():
    keys = {"vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
            "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
            "vision_tower.encoder.final_layernorm.weight": (1024,),
            "mm_projector.proj.0.weight": (4096, 4096), "mm_projector.proj.2.weight": (7168, 4096),
            "mm_projector.post_norm.weight": (7168,)}
    for i in range(27):
        b = f"vision_tower.encoder.blocks.{i}."
        keys.update({b + "norm0.weight": (1024,), b + "norm1.weight": (1024,), b + "wqkv.weight": (4608, 1024),
                     b + "wo.weight": (1024, 1536), b + "mlp.fc0.weight": (4096, 1024),
                     b + "mlp.fc1.weight": (1024, 4096)})
    return keys


def test_state_dict_matches_released_names_shapes_and_counts():
    with torch.device("meta"):
        vm = VisionModel(VisionConfig())
    sd = vm.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == released_vision_keys()
    assert len(sd) == 168
    assert sum(p.numel() for p in vm.vision_tower.parameters()) == 401_214_464
    assert sum(p.numel() for p in vm.mm_projector.parameters()) == 46_144_512


# ------------------------------------------------------------------------------------------------ pieces
def test_rope_against_explicit_loop():
    t, h, w, H, D = 2, 3, 5, 2, 16
    x = torch.randn(t * h * w, H, D, dtype=torch.float64)
    ang = rope_2d_angles(t, h, w, D)
    got = apply_rope_2d(x.float(), ang.cos(), ang.sin()).double()
    xs, want = x.tolist(), [[[0.0] * D for _ in range(H)] for _ in range(t * h * w)]
    for n in range(t * h * w):
        row, col = (n % (h * w)) // w, n % w
        for head in range(H):
            for m in range(D // 2):
                f = 10000.0 ** (-4 * (m // 2) / D)
                theta = (col if m % 2 == 0 else row) * f
                z = complex(xs[n][head][2 * m], xs[n][head][2 * m + 1]) * complex(math.cos(theta), math.sin(theta))
                want[n][head][2 * m], want[n][head][2 * m + 1] = z.real, z.imag
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def test_rope_rotates_in_fp32_and_returns_input_dtype():
    x = torch.randn(6, 2, 8).bfloat16()
    ang = rope_2d_angles(1, 2, 3, 8)
    got = apply_rope_2d(x, ang.cos(), ang.sin())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, apply_rope_2d(x.float(), ang.cos(), ang.sin()).bfloat16())


def test_merge_against_explicit_loop():
    D = 3
    grids = torch.tensor([[1, 4, 6], [1, 2, 2], [2, 2, 4]])
    L = int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum())
    x = torch.randn(L, D)
    merged, counts = merge_sd2_tpool(x, grids)
    want, s = [], 0
    for t, h, w in grids.tolist():
        for a in range(h // 2):
            for b in range(w // 2):
                win = []
                for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):
                    frames = [x[s + f * h * w + (2 * a + dy) * w + 2 * b + dx] for f in range(t)]
                    win.append(torch.stack(frames).mean(0))
                want.append(torch.cat(win))
        s += t * h * w
    assert counts == [6, 1, 2]
    torch.testing.assert_close(merged, torch.stack(want))


def test_pos_table_identity_at_native_grid_and_bilinear_elsewhere():
    pe = PosEmb(64, 64, 8, 4)
    assert torch.equal(pe.table(1, 64, 64), pe.weight.reshape(64 * 64, 8))
    small = PosEmb(4, 6, 2, 4)
    h, w = 3, 5
    got = small.table(1, h, w).view(h, w, 2)

    def src(i, n_out, n_in):  # align_corners=False source coordinate, clamped
        c = min(max((i + 0.5) * n_in / n_out - 0.5, 0.0), n_in - 1)
        i0 = int(math.floor(c))
        return i0, min(i0 + 1, n_in - 1), c - i0

    W = small.weight.detach()
    for i in range(h):
        y0, y1, fy = src(i, h, 4)
        for j in range(w):
            x0, x1, fx = src(j, w, 6)
            want = ((1 - fy) * ((1 - fx) * W[y0, x0] + fx * W[y0, x1]) + fy * ((1 - fx) * W[y1, x0] + fx * W[y1, x1]))
            torch.testing.assert_close(got[i, j], want, rtol=1e-5, atol=1e-6)


def test_time_embedding_for_video_frames():
    te = time_embedding(3, 8)
    for k in range(3):
        for i in range(4):
            om = 10000.0 ** (-i / 4)
            assert te[k, i].item() == pytest.approx(math.sin(k * om), abs=1e-6)
            assert te[k, 4 + i].item() == pytest.approx(math.cos(k * om), abs=1e-6)
    pe = PosEmb(64, 64, 8, 4)
    t2 = pe.table(2, 4, 4).view(2, 16, 8)
    torch.testing.assert_close(t2[1] - t2[0], (te[1] - te[0]).expand(16, 8))
    with pytest.raises(K3ImageError, match="init_pos_emb_time"):
        pe.table(5, 2, 2)


def test_rmsnorm_eps_follows_compute_dtype():
    n = VisionRMSNorm(4)
    x = torch.full((1, 4), 0.05)
    for dt in (torch.float32, torch.bfloat16):
        y = n.to(dt)(x.to(dt)).float()
        x32 = x.to(dt).float()
        want = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + torch.finfo(dt).eps)
        torch.testing.assert_close(y, want.to(dt).float(), rtol=1e-2 if dt == torch.bfloat16 else 1e-6, atol=0)
    assert n.to(torch.bfloat16)(x.bfloat16()).float()[0, 0].item() == pytest.approx(0.4927, abs=4e-3)  # 2^-7
    vm = VisionModel(VisionConfig.preset("tiny"))
    assert vm.mm_projector.post_norm.eps == 1e-5 and vm.vision_tower.encoder.final_layernorm.eps is None


# ------------------------------------------------------------------------------------------------ whole tower
def image_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    grids = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 4]])
    L = int((grids[:, 1] * grids[:, 2]).sum())
    return torch.randn(L, 3, 14, 14, generator=g), grids


def test_packed_equals_one_image_at_a_time():
    torch.manual_seed(0)
    vm = VisionModel(VisionConfig.preset("tiny")).eval()
    pv, grids = image_batch()
    with torch.no_grad():
        emb, counts = vm(pv, grids)
        assert emb.shape == (sum(counts), 256) and counts == [6, 1, 6]
        hidden = vm.vision_tower(pv, grids)
        s, e0 = 0, 0
        for (t, h, w), n in zip(grids.tolist(), counts):
            one = torch.tensor([[t, h, w]])
            torch.testing.assert_close(vm.vision_tower(pv[s:s + h * w], one), hidden[s:s + h * w],
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vm(pv[s:s + h * w], one)[0], emb[e0:e0 + n], rtol=1e-5, atol=1e-5)
            s, e0 = s + h * w, e0 + n


def test_tower_against_hand_written_forward():
    """The whole tower once more in plain ops (dense per-image softmax, explicit norms)."""
    torch.manual_seed(1)
    cfg = VisionConfig.preset("tiny")
    vm = VisionModel(cfg).double().eval()
    pv, grids = image_batch(1)
    with torch.no_grad():
        got, _ = vm(pv.double(), grids)
        tw, pj = vm.vision_tower, vm.mm_projector
        eps = torch.finfo(torch.float64).eps

        def rms(x, wgt, e):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e) * wgt

        outs, s = [], 0
        for t, h, w in grids.tolist():
            n = h * w
            x = pv[s:s + n].double().flatten(1) @ tw.patch_embed.proj.weight.flatten(1).T
            pos = F.interpolate(tw.patch_embed.pos_emb.weight.permute(2, 0, 1)[None], size=(h, w), mode="bilinear",
                                align_corners=False)[0].permute(1, 2, 0).reshape(n, -1)
            x = x + pos
            ang = rope_2d_angles(1, h, w, cfg.head_dim).double()
            rot = torch.polar(torch.ones_like(ang), ang)
            for blk in tw.encoder.blocks:
                qkv = (rms(x, blk.norm0.weight, eps) @ blk.wqkv.weight.T).view(n, 3, cfg.vt_num_attention_heads, -1)
                nh = cfg.vt_num_attention_heads
                q, k = (torch.view_as_real(torch.view_as_complex(qkv[:, j].reshape(n, nh, -1, 2).contiguous())
                                           * rot[:, None]).reshape(n, nh, -1) for j in (0, 1))
                v = qkv[:, 2]
                p = torch.softmax(torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(cfg.head_dim), -1)
                x = x + torch.einsum("hnm,mhd->nhd", p, v).reshape(n, -1) @ blk.wo.weight.T
                y = rms(x, blk.norm1.weight, eps) @ blk.mlp.fc0.weight.T
                x = x + F.gelu(y, approximate="tanh") @ blk.mlp.fc1.weight.T
            x = rms(x, tw.encoder.final_layernorm.weight, eps)
            win = ((0, 0), (0, 1), (1, 0), (1, 1))
            m = torch.stack([torch.cat([x[(2 * a + dy) * w + 2 * b + dx] for dy, dx in win])
                             for a in range(h // 2) for b in range(w // 2)])
            z = F.gelu(m @ pj.proj[0].weight.T) @ pj.proj[2].weight.T
            outs.append(rms(z, pj.post_norm.weight, 1e-5))
            s += n
    # q/k are rotated in fp32 by design (spec §5.2), so even a float64 run agrees only to ~1e-7
    torch.testing.assert_close(got, torch.cat(outs), rtol=1e-5, atol=1e-6)


def test_dtype_flow_bf16_tower_fp32_pixels():
    torch.manual_seed(2)
    vm = VisionModel(VisionConfig.preset("tiny")).to(torch.bfloat16).eval()
    pv, grids = image_batch(2)
    with torch.no_grad():
        emb, _ = vm(pv, grids)            # fp32 pixels are cast to the tower dtype
        ref, _ = vm(pv.bfloat16(), grids)
    assert emb.dtype == torch.bfloat16 and torch.equal(emb, ref) and torch.isfinite(emb).all()


def test_end_to_end_token_counts_match_preprocessing():
    from PIL import Image
    sizes = [(1, 1), (13, 100), (100, 13), (57, 29)]
    pv, grid = preprocess([Image.new("RGB", s, (120, 30, 200)) for s in sizes])
    vm = VisionModel(VisionConfig.preset("tiny")).eval()
    with torch.no_grad():
        emb, counts = vm(pv, grid)
    assert counts == [num_image_tokens(w, h) for w, h in sizes] and emb.shape[0] == sum(counts)
    assert image_token_counts(grid) == counts


def test_tower_input_errors():
    tw = MoonViT(VisionConfig.preset("tiny"))
    pv, grids = image_batch()
    with pytest.raises(K3ImageError, match="describes"):
        tw(pv[:-1], grids)
    with pytest.raises(K3ImageError, match="multiples of the merge"):
        tw(torch.zeros(3, 3, 14, 14), torch.tensor([[1, 1, 3]]))
    with pytest.raises(K3ImageError, match=r"\[L, 3, 14, 14\]"):
        tw(torch.zeros(4, 3, 16, 16), torch.tensor([[1, 2, 2]]))
    with pytest.raises(K3ImageError, match="grid_thw"):
        tw(pv, grids[:, :2])


# ------------------------------------------------------------------------------------------------ varlen path
def _reference_varlen(calls):
    """A CPU stand-in for torch's flash varlen op with its calling convention ([T, H, D] packed, int32
    cu_seqlens, max lengths): a dense block-diagonal mask over the whole pack (an independent formulation)."""
    def op(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None):
        calls.append(dict(cu_q=cu_q.clone(), cu_k=cu_k.clone(), max_q=max_q, max_k=max_k, scale=scale,
                          shape=tuple(q.shape)))
        seg = torch.repeat_interleave(torch.arange(len(cu_q) - 1), (cu_q[1:] - cu_q[:-1]).long())
        mask = seg[:, None] == seg[None, :]
        s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", p, v.float()).to(q.dtype)
    return op


def test_varlen_path_equals_per_image_sdpa(monkeypatch):
    """attn_impl="varlen" (one call over the packed images with cu_seqlens) = the per-image SDPA path; the op gets
    int32 cu_seqlens on the tower's device, the longest image as max_q = max_k and the 1/sqrt(head_dim) scale."""
    import k3.vision.tower as tower
    calls = []
    monkeypatch.setattr(tower, "_varlen_op", lambda: _reference_varlen(calls))
    cfg = VisionConfig.preset("tiny")
    torch.manual_seed(0)
    m = MoonViT(cfg).eval()
    grid = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 4]])
    pv = torch.randn(int(grid.prod(1).sum()), 3, 14, 14)
    m.attn_impl = "sdpa"
    ref = m(pv, grid)
    m.attn_impl = "varlen"
    out = m(pv, grid)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert len(calls) == cfg.vt_num_hidden_layers
    c = calls[0]
    assert c["cu_q"].dtype == torch.int32 and c["cu_q"].tolist() == [0, 24, 28, 52] and c["max_q"] == c["max_k"] == 24
    assert c["scale"] == pytest.approx(cfg.head_dim ** -0.5) and c["shape"] == (52, cfg.vt_num_attention_heads,
                                                                                cfg.head_dim)


def test_attn_impl_auto_is_sdpa_on_cpu_and_bad_names_fail():
    from k3.vision.tower import packed_attention, varlen_supported
    q = torch.randn(10, 2, 16)
    assert not varlen_supported(q) and not varlen_supported(q.bfloat16())
    cu = [0, 4, 10]
    out = packed_attention(q, q, q, cu, 0.25, "auto")
    for s, e in zip(cu[:-1], cu[1:]):
        qi = q[s:e].transpose(0, 1)
        exp = F.scaled_dot_product_attention(qi, qi, qi, scale=0.25).transpose(0, 1)
        torch.testing.assert_close(out[s:e], exp)
    with pytest.raises(K3ConfigError, match="attn_impl"):
        packed_attention(q, q, q, cu, 0.25, "flash")
    m = MoonViT(VisionConfig.preset("tiny"))
    m.attn_impl = "xformers"
    with pytest.raises(K3ConfigError, match="attn_impl"):
        m(torch.randn(4, 3, 14, 14), torch.tensor([[1, 2, 2]]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash varlen attention needs CUDA")
def test_varlen_equals_sdpa_on_cuda_bf16():
    cfg = VisionConfig.preset("tiny")
    torch.manual_seed(0)
    m = MoonViT(cfg).cuda().to(torch.bfloat16).eval()
    grid = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 4]])
    pv = torch.randn(int(grid.prod(1).sum()), 3, 14, 14, device="cuda")
    with torch.inference_mode():
        m.attn_impl = "sdpa"
        ref = m(pv, grid).float()
        m.attn_impl = "varlen"
        out = m(pv, grid).float()
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


def test_attn_impl_auto_takes_varlen_for_many_small_images_only(monkeypatch):
    """"auto" (where varlen can run) takes the varlen kernel for >= 4 images of <= 1,024 patches on average (where
    it measured faster on the H200), per-image SDPA otherwise; both give the same attention."""
    import k3.vision.tower as tower
    calls = []
    monkeypatch.setattr(tower, "_varlen_op", lambda: _reference_varlen(calls))
    monkeypatch.setattr(tower, "varlen_supported", lambda q: True)
    torch.manual_seed(0)
    for cu, want in (([0, 5, 9, 16, 20], 1), ([0, 5, 9, 16], 0), ([0, 1500, 2000, 3000, 5000], 0),
                     ([0, 1000, 2000, 3000, 4096], 1), ([0, 1000, 2000, 3000, 4097], 0)):
        calls.clear()
        L = cu[-1]
        q, k, v = (torch.randn(L, 1, 8) for _ in range(3))
        out = tower.packed_attention(q, k, v, cu, 0.3, "auto")
        assert len(calls) == want, (cu, len(calls))
        if L <= 100:
            torch.testing.assert_close(out, tower.packed_attention(q, k, v, cu, 0.3, "sdpa"), atol=1e-5, rtol=1e-5)
