"""MXFP4 routed experts kept packed in memory, dequantised inside the expert matmul (issue #29 item 2)."""
import pytest
import torch

from k3.checkpoint import from_pretrained, save_pretrained
from k3.checkpoint.io import iter_checkpoint_tensors
from k3.nn.moe import LatentMoE, PackedMXFP4Experts, StackedExperts, pack_experts_

from .released_fixture import quantization_config, released_tensors, text_config, write_released

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mx_ckpt(tmp_path_factory):
    c = text_config(routed_expert_hidden_size=64, moe_intermediate_size=32, num_experts=8,
                    num_experts_per_token=2, quantization_config=quantization_config())
    t = released_tensors(c, mxfp4=True, seed=3)
    return c, t, write_released(str(tmp_path_factory.mktemp("mx") / "ck"), c, t)


def _moes(model):
    return [m for m in model.modules() if isinstance(m, LatentMoE)]


def test_packed_load_keeps_bytes_and_matches_dequantised_model(mx_ckpt):
    c, t, path = mx_ckpt
    dense = from_pretrained(path)
    packed = from_pretrained(path, packed_experts=True)
    moes = _moes(packed)
    assert moes and all(isinstance(m.experts, PackedMXFP4Experts) for m in moes)
    assert not any(isinstance(m, StackedExperts) for m in packed.modules())
    # the checkpoint's bytes, untouched
    i = next(i for i, layer in enumerate(packed.model.layers) if hasattr(layer, "block_sparse_moe"))
    ex = packed.model.layers[i].block_sparse_moe.experts
    pre = f"language_model.model.layers.{i}.block_sparse_moe.experts."
    M = c["moe_intermediate_size"]
    assert torch.equal(ex.gate_up_packed[5, :M], t[pre + "5.w1.weight_packed"])
    assert torch.equal(ex.gate_up_scale[5, M:], t[pre + "5.w3.weight_scale"])
    assert torch.equal(ex.down_packed[2], t[pre + "2.w2.weight_packed"])
    # 4.25 bits per routed-expert weight
    E, l = c["num_experts"], c["routed_expert_hidden_size"]
    nbytes = sum(b.numel() * b.element_size() for b in ex.buffers())
    assert nbytes * 8 == pytest.approx(4.25 * E * 3 * M * l)
    gu, dn = ex.dense()
    ref = dense.model.layers[i].block_sparse_moe.experts
    assert torch.equal(gu, ref.gate_up_proj) and torch.equal(dn, ref.down_proj)
    ids = torch.randint(0, c["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = dense(ids).logits, packed(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_packed_decode_step_matches_forward(mx_ckpt):
    c, t, path = mx_ckpt
    packed = from_pretrained(path, packed_experts=True)
    moe = _moes(packed)[0]
    x = torch.randn(3, c["hidden_size"], generator=torch.Generator().manual_seed(2))
    st = moe.prepare_decode(torch.float32)
    assert st.gate_up is None
    with torch.no_grad():
        torch.testing.assert_close(moe.decode_step(st, x), moe(x.unsqueeze(0))[0], rtol=1e-5, atol=1e-5)


def test_packed_model_saves_the_same_mxfp4_bytes_and_dense_weights(mx_ckpt, tmp_path):
    c, t, path = mx_ckpt
    packed = from_pretrained(path, packed_experts=True)
    out = save_pretrained(packed, str(tmp_path / "re"), quantize_experts=True)
    got = {k: v for k, v, _ in iter_checkpoint_tensors(out)}
    assert set(got) == set(t)
    for k, v in t.items():
        if ".experts." in k:
            assert torch.equal(got[k], v), k
    dense_out = save_pretrained(packed, str(tmp_path / "dense"))
    ref = from_pretrained(path)
    back = from_pretrained(dense_out)
    for (k, a), (_, b) in zip(sorted(ref.state_dict().items()), sorted(back.state_dict().items())):
        assert torch.equal(a, b), k


def test_pack_experts_of_a_dense_model():
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    cfg = K3Config.from_dict(text_config(routed_expert_hidden_size=32, moe_intermediate_size=64))
    torch.manual_seed(0)
    m = K3ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 7))
    pack_experts_(m)
    # the packed model computes with the MXFP4-rounded weights: compare against those, dense
    ref = K3ForCausalLM(cfg).eval()
    sd = {k: v for k, v in m.state_dict().items() if "experts" not in k or "shared" in k}
    ref.load_state_dict(sd, strict=False)
    for mm, rr in zip(_moes(m), _moes(ref)):
        gu, dn = mm.experts.dense()
        rr.experts.gate_up_proj.data.copy_(gu)
        rr.experts.down_proj.data.copy_(dn)
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_mxfp4_decode_into_a_buffer():
    from k3.checkpoint.mxfp4 import mxfp4_decode
    from .released_fixture import mxfp4_reference_decode
    g = torch.Generator().manual_seed(1)
    p = torch.randint(0, 256, (3, 40, 48), generator=g, dtype=torch.uint8)
    s = torch.randint(100, 140, (3, 40, 3), generator=g, dtype=torch.uint8)
    ref = torch.stack([mxfp4_reference_decode(p[i], s[i]) for i in range(3)])
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        buf = torch.full((3, 40, 96), 7.0, dtype=dt)
        assert mxfp4_decode(p, s, dt, out=buf) is buf
        assert torch.equal(buf, ref.to(dt)) and torch.equal(mxfp4_decode(p, s, dt), ref.to(dt))
    with pytest.raises(ValueError, match="out must be"):
        mxfp4_decode(p, s, torch.float32, out=torch.empty(3, 40, 95))
