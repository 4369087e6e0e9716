"""A micro K3 model with every new Triton path of the training step forced on (short conv, MoE combine and
dispatch backward, packed SiTU node) against its torch paths, on CPU through Triton's interpreter: loss and all
gradients, packed documents including an empty one."""
import importlib.util
import os

import pytest

from k3.ops.triton_interp import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def test_model_with_triton_paths_matches_torch_paths():
    res = run_interpreted(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_model_triton_child.py"),
                          timeout=600)
    # every kernel ran: 3 KDA layers x 3 convs, 3 MoE layers (gather_sum: combine fwd, its dy, dispatch bwd)
    assert res["calls"] == {"conv1d_fwd": 9, "conv1d_bwd": 9, "situ_fwd": 3, "situ_bwd": 3, "gather_sum": 9,
                            "gather_dot": 3}, res["calls"]
    assert res["same_params"] and res["n_grads"] > 100
    assert res["loss"] < 1e-6 and res["worst_grad"] < 1e-3, res   # fp32; SiTU's tanh formula differs in rounding
