"""The MoE combine / dispatch-backward Triton kernels (k3/ops/moe_triton.py) and the packed SiTU node on CPU through
Triton's interpreter: the kernels against plain torch, and experts_forward with them against its torch path
(output, all gradients). The checks run in one subprocess (TRITON_INTERPRET must be set before triton is imported)
that prints a table; each test below checks its own row."""
import importlib.util
import os

import pytest

from helpers import row
from k3.ops.triton_interp import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_moe_triton_child.py")
KERNEL_CASES = ["gather_sum", "gather_sum unweighted", "gather_dot"]   # relative error vs fp64 torch < 1e-6
CHILD_ROWS = set(KERNEL_CASES) | {"experts_forward triton combine vs torch", "compiled fullgraph vs torch",
                                  "packed SiTU node vs formula", "opcheck"}


@pytest.fixture(scope="module")
def res():
    """The child's table, computed once for the tests below."""
    return run_interpreted(_SCRIPT, timeout=600)


def test_child_table_has_every_case(res):
    assert set(res) == CHILD_ROWS, f"child rows {sorted(res)} != the cases checked here {sorted(CHILD_ROWS)}"


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_matches_torch(res, name):
    assert row(res, name) < 1e-6, f"{name}: relative error {row(res, name):.3g}"


def test_experts_forward_with_triton_combine_matches_torch(res):
    r = row(res, "experts_forward triton combine vs torch")
    assert max(r["errs"].values()) < 1e-5, r["errs"]
    # the triton run: combine fwd, combine bwd (dy: one row each; dw: dots), dispatch bwd
    assert r["kernel_calls"] == ["gather_dot", "gather_sum", "gather_sum", "gather_sum"], r["kernel_calls"]


def test_compiled_fullgraph_matches_torch(res):
    # torch.compile(fullgraph=True), grouped_mm experts
    assert row(res, "compiled fullgraph vs torch") < 1e-5, row(res, "compiled fullgraph vs torch")


def test_packed_situ_node_matches_formula(res):
    # the packed SiTU node (one gradient tensor for the [g | u] projection) against the plain formula
    r = row(res, "packed SiTU node vs formula")
    assert r["used"] == 1 and r["err"] < 1e-5, r


def test_custom_ops_pass_opcheck(res):
    assert row(res, "opcheck") == "ok"
