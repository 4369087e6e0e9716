"""MXFP4-packed routed experts on CUDA: the Triton grouped GEMM (k3/ops/mxfp4_triton.py) against the fp64 formula and
packed_experts_forward's Triton path against its torch path (decode-then-GEMM), in bf16. Skipped without CUDA.

Errors are relative Frobenius norms; bf16 outputs land around 1e-3. Run with -s to see them."""
import pytest
import torch

from helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
BF = torch.bfloat16


def report(name, **errs):
    print(f"[gpu-mxfp4] {name}: " + ", ".join(f"{k}={v:.2e}" for k, v in errs.items()), flush=True)


def _random_packed(E, out, inp, g):
    """Random codes and scales around 2**-4 (realistic weight magnitudes)."""
    p = torch.randint(0, 256, (E, out, inp // 2), generator=g, dtype=torch.uint8)
    s = torch.randint(119, 125, (E, out, inp // 32), generator=g, dtype=torch.uint8)
    return p.to(DEV), s.to(DEV)


@pytest.mark.parametrize("counts", [[0, 1, 37, 0, 300, 5, 128, 0], [3] * 8, [0] * 7 + [1]],
                         ids=["mixed", "few rows", "one row"])
def test_mxfp4_grouped_matmul_vs_fp64(counts):
    from k3.checkpoint.mxfp4 import mxfp4_decode
    from k3.ops.mxfp4_triton import mxfp4_grouped_matmul
    g = torch.Generator().manual_seed(0)
    E, OUT, IN = len(counts), 384, 544          # 544 = 17 groups: not a multiple of any BK
    p, s = _random_packed(E, OUT, IN, g)
    x = torch.randn(sum(counts), IN, generator=g).to(DEV, BF)
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    y = mxfp4_grouped_matmul(x, offs, p, s)
    W = mxfp4_decode(p, s, torch.float64)
    ref, r = [], 0
    for e, c in enumerate(counts):
        ref.append(x[r:r + c].double() @ W[e].T)
        r += c
    err = rel_err(y, torch.cat(ref), finite=True)
    report(f"grouped matmul {counts}", err=err)
    assert err < 4e-3


def test_packed_experts_forward_triton_vs_torch():
    from k3.ops.activations import situ_glu
    from k3.ops.moe import packed_experts_forward, route
    g = torch.Generator().manual_seed(1)
    E, l, M, N, k = 64, 512, 256, 1000, 8
    gp, gs = _random_packed(E, 2 * M, l, g)
    dp, ds = _random_packed(E, l, M, g)
    x = torch.randn(N, l, generator=g).to(DEV, BF)
    idx, w, _ = route(x, torch.randn(E, l, generator=g).to(DEV, BF), None, k)
    idx = torch.where(idx < 3, idx + 3, idx)   # experts 0-2 without tokens
    with torch.no_grad():
        out = {b: packed_experts_forward(x, idx, w, gp, gs, dp, ds, situ_glu, backend=b) for b in ("torch", "triton")}
        auto = packed_experts_forward(x, idx, w, gp, gs, dp, ds, situ_glu)
    err = rel_err(out["triton"], out["torch"], finite=True)
    report("packed_experts_forward triton vs torch", err=err)
    assert err < 1e-2
    assert torch.equal(auto, out["triton"])  # the CUDA default for bf16 activations (timed: benchmarks/mxfp4_gpu.py)
