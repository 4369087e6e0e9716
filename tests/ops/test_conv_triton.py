"""The Triton causal short-conv kernels (k3/ops/conv_triton.py) against the fp64 token-loop definition and the
torch path, forward and both gradients, on CPU through Triton's interpreter (a subprocess: TRITON_INTERPRET must be
set before triton is imported)."""
import importlib.util
import os

import pytest

from k3.ops.triton_interp import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_conv_triton_child.py")


@pytest.fixture(scope="module")
def res():
    return run_interpreted(_SCRIPT, timeout=600)


def test_conv_triton_fwd_bwd_match_fp64(res):
    # fp32: T not a multiple of the 64-token span, C not a multiple of the channel block, silu and none; the
    # backward at five launch options incl. two rolling ones (the autotuner picks among them on a GPU)
    for name, errs in res["dense"].items():
        assert max(errs.values()) < 2e-5, (name, errs)


def test_conv_triton_varlen_resets_at_documents(res):
    # documents of 1, 0 (empty), 70, 5 and 80 tokens packed in one row: no tap crosses a document start
    for name, errs in res["varlen"].items():
        assert max(errs.values()) < 2e-5, (name, errs)
    assert res["varlen_would_leak"] > 1e-2   # the same packed row without resets differs: the check can fail


def test_conv_triton_bf16_and_dispatch(res):
    assert max(res["bf16"].values()) < 2e-2, res["bf16"]
    # causal_conv1d(backend="triton") took the kernels (custom ops) and matches its torch path
    assert res["dispatch_took_triton"] and max(res["dispatch"].values()) < 2e-5, res
    assert res["opcheck"] == "ok"
    assert max(res["compiled"].values()) < 2e-5, res["compiled"]   # torch.compile(fullgraph=True) of the same call
    # kernel size 3: the torch path, and the kernel refuses by name
    assert res["k3_took_torch"] and "kernel size 4 only" in res["k3_bwd_error"], res


def test_conv_bwd_config_kinds(monkeypatch):
    from k3.ops import conv_triton as ct
    tiles, roll = ct.bwd_configs("tiles"), ct.bwd_configs("roll")
    assert tiles and roll and all(c[0] > 1 for c in tiles) and all(c[0] == 1 for c in roll)
    assert sorted(tiles + roll) == sorted(ct.bwd_configs("auto")) == sorted(ct.BWD_CONFIGS)
    monkeypatch.setenv("K3_CONV_BWD", "roll")
    assert ct.bwd_configs() == roll
    monkeypatch.setenv("K3_CONV_BWD", "fast")
    with pytest.raises(ValueError, match="K3_CONV_BWD"):
        ct.bwd_configs()
