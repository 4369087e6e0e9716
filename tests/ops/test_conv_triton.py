"""The Triton causal short-conv kernels (k3/ops/conv_triton.py) against the fp64 token-loop definition and the
torch path, forward and both gradients, on CPU through Triton's interpreter (a subprocess: TRITON_INTERPRET must be
set before triton is imported)."""
import importlib.util
import os

import pytest

from helpers import row
from k3.ops.triton_interp import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_conv_triton_child.py")


@pytest.fixture(scope="module")
def res():
    """The child's table, computed once for the tests below (each checks its own row); the kernel cases' backward at
    three of its launch options (the child's BWD_OPTIONS["default"])."""
    return run_interpreted(_SCRIPT, timeout=600, env_set={"K3_TEST_LAUNCH_OPTIONS": "default"})


@pytest.fixture(scope="module")
def res_all_options():
    """The same with the backward at every launch option of the child (slow tests)."""
    return run_interpreted(_SCRIPT, timeout=900, env_set={"K3_TEST_LAUNCH_OPTIONS": "all"})


# case id: bound of its worst relative error (forward y, backward dx and dw) against fp64. The kernel cases run the
# backward at three launch options incl. a rolling one, five under `pytest -m slow` (the autotuner picks among them on
# a GPU); fp32: T not a
# multiple of the 64-token span, C not a multiple of the channel block, silu and no activation; varlen: documents of
# 1, 0 (empty), 70, 5 and 80 tokens packed in one row (no tap crosses a document start)
KERNEL_CASES = {
    "fp32 silu B2 T150 C200": 2e-5,
    "fp32 no-act B2 T150 C200": 2e-5,
    "fp32 varlen docs 1,0,70,5,80": 2e-5,
    "bf16 silu B2 T100 C256": 2e-2,
    "compiled fullgraph vs torch": 2e-5,    # torch.compile(fullgraph=True) of the dispatch call, vs its torch path
}
CHILD_ROWS = set(KERNEL_CASES) | {"varlen without resets", "dispatch triton vs torch", "kernel size 3", "opcheck"}


def test_child_table_has_every_case(res):
    assert set(res) == CHILD_ROWS, f"child rows {sorted(res)} != the cases checked here {sorted(CHILD_ROWS)}"


def _check_kernel_case(res, name):
    errs = row(res, name)
    worst = max(errs, key=errs.get)
    assert errs[worst] < KERNEL_CASES[name], f"{name}: {worst} relative error {errs[worst]:.3g} >= " \
        f"{KERNEL_CASES[name]:g} (all: {errs})"


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_conv_triton_matches_reference(res, name):
    _check_kernel_case(res, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", KERNEL_CASES)
def test_conv_triton_matches_reference_all_launch_options(res_all_options, name):
    _check_kernel_case(res_all_options, name)


def test_conv_triton_varlen_check_can_fail(res):
    # the same packed row without resets differs: the varlen case above can fail
    assert row(res, "varlen without resets")["y"] > 1e-2


def test_conv_triton_dispatch_takes_the_kernels(res):
    # causal_conv1d(backend="triton") took the kernels (custom ops) and matches its torch path
    r = row(res, "dispatch triton vs torch")
    assert r["took_triton"], r
    assert max(r["errs"].values()) < 2e-5, r["errs"]


def test_conv_triton_custom_ops_pass_opcheck(res):
    assert row(res, "opcheck") == "ok"


def test_conv_triton_kernel_size_3_takes_torch_path(res):
    # kernel size 3: the torch path, and the kernel refuses by name
    r = row(res, "kernel size 3")
    assert r["took_torch"] and "kernel size 4 only" in r["bwd_error"], r


def test_conv_bwd_config_kinds(monkeypatch):
    from k3.ops import conv_triton as ct
    tiles, roll = ct.bwd_configs("tiles"), ct.bwd_configs("roll")
    assert tiles and roll and all(c[0] > 1 for c in tiles) and all(c[0] == 1 for c in roll)
    assert sorted(tiles + roll) == sorted(ct.bwd_configs("auto")) == sorted(ct.BWD_CONFIGS)
    assert ct.bwd_configs() == ct.bwd_configs(" Auto ") == ct.BWD_CONFIGS
    with pytest.raises(ValueError, match="kind must be one of.*'fast'"):
        ct.bwd_configs("fast")
