"""The decode-step entry points of the nn modules (`prepare_decode` / `decode_step`, used by
k3.generation.static.StaticDecoder) equal the modules' own `forward` (fp64); the whole-model step against the cached
decode is tests/generation/test_static_decode.py."""
import ast
import pathlib

import pytest
import torch

from k3.config import K3Config
from k3.nn.mlp import GLUMLP
from k3.nn.moe import LatentMoE, init_moe_
from k3.nn.norm import RMSNorm
from k3.ops.attnres import attnres_mix_decode, attnres_mix_reference


def _cfg(**kw):
    base = dict(hidden_size=32, num_experts=8, num_experts_per_token=2, moe_intermediate_size=12,
                routed_expert_hidden_size=16, num_shared_experts=1)
    base.update(kw)
    return K3Config.from_preset("tiny", **base)


def test_rmsnorm_decode_step_equals_forward():
    torch.manual_seed(0)
    n = RMSNorm(24, 1e-5).double()
    with torch.no_grad():
        n.weight.normal_()
    x = torch.randn(5, 24, dtype=torch.float64)
    assert torch.allclose(n.decode_step(n.prepare_decode(torch.float64), x), n(x), rtol=1e-13, atol=1e-14)


def test_glumlp_decode_step_equals_forward():
    torch.manual_seed(0)
    m = GLUMLP(16, 20).double()
    x = torch.randn(3, 16, dtype=torch.float64)
    st = m.prepare_decode(torch.float64)
    assert torch.allclose(m.decode_step(st, x), m(x), rtol=1e-12, atol=1e-14)
    assert m.prepare_decode(torch.float64, input_proj=False).W_gu is None


@pytest.mark.parametrize("N", [1, 4, 9])          # N * top_k <= experts: gathered experts; else dense bmm
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_latent_moe_decode_step_equals_forward(N, groups):
    torch.manual_seed(N)
    m = LatentMoE(_cfg(num_expert_group=groups[0], topk_group=groups[1])).double()
    init_moe_(m, 0.3)
    with torch.no_grad():
        for p in (m.routed_expert_down_proj.weight, m.routed_expert_up_proj.weight):
            p.normal_(0, 0.3)
        m.gate.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(N, 32, dtype=torch.float64)
    with torch.no_grad():
        ref = m(x)
        out = m.decode_step(m.prepare_decode(torch.float64), x)
    assert torch.allclose(out, ref, rtol=1e-11, atol=1e-13)


def test_attnres_mix_decode_equals_definition():
    torch.manual_seed(0)
    src = [torch.randn(4, 16, dtype=torch.float64) * (i + 1) for i in range(3)]
    w = torch.randn(16, dtype=torch.float64)
    assert torch.allclose(attnres_mix_decode(src, w, 1e-5), attnres_mix_reference(src, w, 1e-5), rtol=1e-12)
    assert attnres_mix_decode(src[:1], w) is src[0]


def test_generation_imports_no_private_names_of_nn_or_model():
    """k3.generation uses the modules' public decode entry points only (no `from k3.nn.x import _y`)."""
    root = pathlib.Path(__file__).resolve().parents[2] / "k3" / "generation"
    bad = []
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and (
                    node.module.startswith("k3.nn") or node.module == "k3.model"):
                bad += [f"{f.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, bad
