"""The MoE combine / dispatch-backward Triton kernels (k3/ops/moe_triton.py) and the packed SiTU node on CPU through
Triton's interpreter: the kernels against plain torch, and experts_forward with them against its torch path
(output, all gradients)."""
import importlib.util
import os

import pytest

from k3.ops.triton_interp import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def test_moe_triton_combine_matches_torch():
    res = run_interpreted(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_moe_triton_child.py"),
                          timeout=600)
    for name in ("gather_sum", "gather_sum_now", "gather_dot"):
        assert res[name] < 1e-6, (name, res[name])
    assert max(res["experts"].values()) < 1e-5, res["experts"]
    # the triton run: combine fwd, combine bwd (dy: one row each; dw: dots), dispatch bwd
    assert res["kernel_calls"] == ["gather_dot", "gather_sum", "gather_sum", "gather_sum"], res["kernel_calls"]
    assert res["opcheck"] == "ok"
    assert res["compiled"] < 1e-5, res["compiled"]  # torch.compile(fullgraph=True), grouped_mm experts
    # the packed SiTU node (one gradient tensor for the [g | u] projection) against the plain formula
    assert res["packed_used"] == 1 and res["packed"] < 1e-5, (res["packed_used"], res["packed"])
