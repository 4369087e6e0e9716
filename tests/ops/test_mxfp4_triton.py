"""The MXFP4 grouped-GEMM Triton kernel (k3/ops/mxfp4_triton.py: packed expert weights dequantised in registers) on
CPU through Triton's interpreter: against the MXFP4 format written out in fp64 (a 16-value E2M1 table and 2**(s-127)),
per expert, with experts of 0 rows, odd row counts, tile-edge widths and the E8M0 edge scales 0, 1, 253, 254 (and 255 =
NaN); every GPU launch option; and packed_experts_forward through the kernel against its torch path. The checks run
in one subprocess (TRITON_INTERPRET must be set before triton is imported, ~20 s) that prints a table; each test
below checks its own row. Plus an ahead-of-time sm_90 compile of the launch options (no spills, tensor-core MMA)."""
import importlib.util
import os

import pytest
import torch

from helpers import row
from k3.ops.triton_interp import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mxfp4_triton_child.py")
CONFIG_ROWS = ["config 64x128x64 w4 s3", "config 128x128x64 w8 s3", "config 64x64x128 w4 s3",
               "config 16x64x128 w4 s3", "config 16x128x64 w4 s4"]
# case: bound of its relative error against the fp64 formula. fp32: IEEE dots, fp32 accumulation; bf16 out: one
# bf16 rounding of each output (the decoded weights and the products are exact)
KERNEL_CASES = {"kernel fp32": 1e-6, "kernel fp32 every expert with rows": 1e-6, **{c: 1e-6 for c in CONFIG_ROWS},
                "kernel bf16": 4e-3, "kernel bf16 in, fp32 out": 1e-6}
CHILD_ROWS = set(KERNEL_CASES) | {"scale 255 is NaN", "swapped nibbles differ",
                                  "packed_experts_forward triton vs torch", "opcheck"}


@pytest.fixture(scope="module")
def res():
    """The child's table, computed once for the tests below."""
    return run_interpreted(_SCRIPT, timeout=600)


def test_child_table_has_every_case(res):
    assert set(res) == CHILD_ROWS, f"child rows {sorted(res)} != the cases checked here {sorted(CHILD_ROWS)}"


def test_configs_listed_here_are_the_kernels():
    from k3.ops import mxfp4_triton as mt
    assert ["config {}x{}x{} w{} s{}".format(*c) for c in mt.CONFIGS] == CONFIG_ROWS


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_matches_fp64_formula(res, name):
    err = row(res, name)
    assert err < KERNEL_CASES[name], f"{name}: relative error {err:.3g} >= {KERNEL_CASES[name]:g}"


def test_scale_255_is_nan_exactly_where_used(res):
    # one weight row's group with E8M0 255: NaN in that output column for that expert's 17 rows, nowhere else
    r = row(res, "scale 255 is NaN")
    assert r == {"exact": True, "n_nan": 17}, r


def test_formula_check_can_fail(res):
    # the same weights read with the nibbles swapped differ by O(1): the layout is checked, not only the values
    assert row(res, "swapped nibbles differ") > 0.5


def test_packed_experts_forward_triton_matches_torch(res):
    r = row(res, "packed_experts_forward triton vs torch")
    assert r["kernel_calls"] == 2, r          # gate_up and down, through torch.ops.k3.mxfp4_grouped_mm
    assert r["err"] < 1e-5, r
    # auto: torch on CPU (unchanged CPU behaviour, even with the interpreter on), the kernel on CUDA
    assert r["cpu_auto"] == "torch" and r["auto_equals_torch"] and r["cuda_auto"] == "triton", r


def test_custom_op_passes_opcheck(res):
    assert row(res, "opcheck") == "ok"


def test_bad_shapes_name_the_problem():
    from k3.ops.mxfp4_triton import mxfp4_grouped_matmul
    x = torch.zeros(4, 64)
    offs = torch.tensor([4, 4], dtype=torch.int32)
    p, s = torch.zeros(2, 8, 32, dtype=torch.uint8), torch.zeros(2, 8, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"packed \(2, 8, 16\).*\[E, out, 32\]"):
        mxfp4_grouped_matmul(x, offs, p[:, :, :16], s)
    with pytest.raises(ValueError, match=r"offs must be \[E\] = \[2\]"):
        mxfp4_grouped_matmul(x, offs[:1], p, s)
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4_grouped_matmul(x, offs, p.to(torch.int8), s)
    with pytest.raises(ValueError, match="dtype must be one of"):
        mxfp4_grouped_matmul(x.double(), offs, p, s)


_TYPES = dict(x="*bf16", offs="*i32", wp="*u8", ws="*u8", y="*bf16", E="i32", OUT="i32", IN="i32", sxa="i32",
              swe="i32", swo="i32", sse="i32", sso="i32", sya="i32", ROWS_BUCKET="i32")


def _sm90(cfg):
    from k3.ops import mxfp4_triton as mt
    from k3.ops.triton_sm90 import SMEM_LIMIT, compile_sm90, stats
    bm, bn, bk, nw, ns = cfg
    # strides and widths multiples of 16 (the JIT specializes them so at K3's widths: 3584 / 3072 inputs), 1024 =
    # next_pow2(896 experts)
    ck = compile_sm90(mt._mxfp4_gmm_kernel, dict(EP=1024, BM=bm, BN=bn, BK=bk, IEEE=False), _TYPES, num_warps=nw,
                      num_stages=ns, divisible=("sxa", "swe", "swo", "sse", "sso", "sya", "IN", "OUT"))
    st = stats(ck, nw)
    mma = sum(v for k, v in st["ops"].items() if k in ("HGMMA", "HMMA"))
    assert st["stack_B"] == 0 and st["smem_B"] <= SMEM_LIMIT and mma > 0, \
        f"{cfg}: regs {st['regs']}, spill stack {st['stack_B']} B, smem {st['smem_B']} B, MMA instructions {mma}"


def test_sm90_compiles_first_config():
    from k3.ops import mxfp4_triton as mt
    _sm90(mt.CONFIGS[0])


@pytest.mark.slow
@pytest.mark.parametrize("i", range(1, 5))
def test_sm90_compiles_every_config(i):
    from k3.ops import mxfp4_triton as mt
    _sm90(mt.CONFIGS[i])
