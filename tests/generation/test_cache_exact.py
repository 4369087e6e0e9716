"""Exactness of incremental decoding with the hybrid cache (fp64 / fp32 on CPU)."""
import pytest
import torch

from k3.config import K3Config
from k3.generation import K3Cache, cache_memory
from k3.generation.cache import KDALayerCache, MLALayerCache

from conftest import build, micro_config


def _decode_logits(model, ids, n_prefill, **cache_kw):
    cache = K3Cache.for_model(model, ids.shape[0], **cache_kw)
    outs = [model(ids[:, :n_prefill], cache=cache).logits]
    for t in range(n_prefill, ids.shape[1]):
        outs.append(model(ids[:, t:t + 1], cache=cache).logits)
    return torch.cat(outs, 1), cache


def _check_decode_equals_forward(model, seed, shape, n_prefill, tol):
    torch.manual_seed(seed)
    ids = torch.randint(0, 512, shape)
    full = model(ids).logits
    inc, _ = _decode_logits(model, ids, n_prefill)
    assert (inc - full).abs().max() < tol


def test_cached_decode_equals_full_forward_fp64(model64):
    _check_decode_equals_forward(model64, 1, (2, 40), 9, 1e-10)


def test_cached_decode_equals_full_forward_fp32(model32):
    _check_decode_equals_forward(model32, 2, (1, 33), 5, 1e-5)


@pytest.mark.parametrize("mla_mode,kda_mode", [("auto", "auto"), ("expanded", "chunk"), ("absorbed", "recurrent")])
def test_chunked_prefill_equals_one_shot(model64, mla_mode, kda_mode):
    torch.manual_seed(3)
    ids = torch.randint(0, 512, (2, 37))
    one = K3Cache.for_model(model64, 2, block_size=16)
    ref = model64(ids, cache=one).logits
    many = K3Cache.for_model(model64, 2, block_size=16, mla_mode=mla_mode, kda_mode=kda_mode)
    outs = [model64(ids[:, s:s + 10], cache=many).logits for s in range(0, 37, 10)]
    assert (torch.cat(outs, 1) - ref).abs().max() < 1e-10
    for a, b in zip(one.layers, many.layers):
        if isinstance(a, KDALayerCache):
            assert (a.state - b.state).abs().max() < 1e-10
            assert (a.conv - b.conv).abs().max() < 1e-12
        else:
            assert a.lengths == b.lengths == [37, 37]
            assert (a.buf[:, :37] - b.buf[:, :37]).abs().max() < 1e-12
    # and decoding on from either cache agrees
    nxt = torch.randint(0, 512, (2, 1))
    assert (model64(nxt, cache=one).logits - model64(nxt, cache=many).logits).abs().max() < 1e-10


def test_absorbed_equals_expanded_mla_fp32(model32):
    torch.manual_seed(4)
    ids = torch.randint(0, 512, (2, 24))
    res = {}
    for mode in ("absorbed", "expanded"):
        cache = K3Cache.for_model(model32, 2, mla_mode="expanded")
        model32(ids[:, :20], cache=cache)
        for lc in cache.layers:
            lc.mla_mode = mode
        res[mode] = torch.cat([model32(ids[:, t:t + 1], cache=cache).logits for t in range(20, 24)], 1)
    assert (res["absorbed"] - res["expanded"]).abs().max() < 1e-5
    # layer level, several query tokens at once (chunk against a cache)
    attn = next(l.self_attn for l in model32.model.layers if l.layer_type == "mla")
    x = torch.randn(2, 5, 64)
    q = attn.project_q(x)
    c, kpe = attn.project_latent(torch.randn(2, 12, 64))
    starts = torch.tensor([7, 7])
    k, v = attn.expand_kv(c, kpe)
    from k3.ops.attention import causal_attention
    o_exp, _ = causal_attention(q, k, v, attn.softmax_scale, q_offset=7)
    o_abs = attn.absorbed_attention(q, c, kpe, starts)
    assert (o_abs - o_exp).abs().max() < 1e-5


def test_ragged_rows_equal_separate(model64):
    """Rows of different lengths in one cache (prefilled row by row, decoded together) = each alone."""
    torch.manual_seed(5)
    lens = [3, 11, 7]
    prompts = [torch.randint(0, 512, (1, n)) for n in lens]
    cont = torch.randint(0, 512, (3, 6))
    cache = K3Cache.for_model(model64, 3, block_size=4)
    for i, p in enumerate(prompts):
        model64(p, cache=cache.rows(i))
    steps = [model64(cont[:, j:j + 1], cache=cache).logits[:, 0] for j in range(6)]
    got = torch.stack(steps, 1)  # [3, 6, V]
    for i, p in enumerate(prompts):
        ref = model64(torch.cat([p, cont[i:i + 1]], 1)).logits[0, lens[i]:]
        assert (got[i] - ref).abs().max() < 1e-10
    # several tokens at once on ragged rows (expanded, masked) also agree
    more = torch.randint(0, 512, (3, 20))
    got2 = model64(more, cache=cache).logits
    for i, p in enumerate(prompts):
        ref = model64(torch.cat([p, cont[i:i + 1], more[i:i + 1]], 1)).logits[0, -20:]
        assert (got2[i] - ref).abs().max() < 1e-10


def test_mla_cache_grows_by_blocks():
    lc = MLALayerCache(2, 4, 2, torch.float32, "cpu", block_size=8, capacity=1)
    assert lc.capacity == 8
    for t in range(9):
        lc.update(torch.randn(2, 1, 4), torch.randn(2, 1, 2))
    assert lc.capacity % 8 == 0 and lc.capacity >= 9 and lc.lengths == [9, 9]


def test_long_prefill_beyond_training_length():
    cfg = micro_config(max_position_embeddings=16)
    m = build(cfg)
    ids = torch.randint(0, 512, (1, 48))
    full = m(ids).logits
    inc, _ = _decode_logits(m, ids, 40)
    assert (inc - full).abs().max() < 1e-10


def test_cache_memory_matches_tensors(model32):
    cfg = model32.config
    mem = cache_memory(cfg, torch.float32)
    cache = K3Cache.for_model(model32, 1, max_length=64, block_size=64)
    real = cache.memory()
    assert real["kda_bytes"] == mem["kda_bytes"]
    assert real["mla_bytes_allocated"] == 64 * mem["mla_bytes_per_token"]
    model32(torch.randint(0, 512, (1, 10)), cache=cache)
    assert cache.memory()["mla_bytes_used"] == 10 * mem["mla_bytes_per_token"]
    kda = [l for l in cache.layers if isinstance(l, KDALayerCache)]
    st = sum(l.state.numel() * l.state.element_size() for l in kda)
    assert st == mem["kda_state_bytes"]


def test_cache_memory_kimi_k3_table():
    cfg = K3Config.from_preset("kimi-k3")
    mem = cache_memory(cfg, torch.bfloat16)
    assert mem["kda_layers"] == 69 and mem["mla_layers"] == 24
    assert mem["kda_state_bytes_per_layer"] == 6_291_456
    assert mem["mla_bytes_per_token"] == 24 * 576 * 2 == 27_648
    assert mem["kda_conv_bytes_per_layer"] == 3 * 12288 * 3 * 2
    assert cache_memory(cfg, "bfloat16", context=1 << 20)["total_bytes"] == \
        69 * (6_291_456 + 221_184) + 27_648 * (1 << 20)
