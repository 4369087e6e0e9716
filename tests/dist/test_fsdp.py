"""FSDP2 (+EP) on gloo processes vs one process on the concatenated batch (fp32)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from launcher import run_dist  # noqa: E402

CASES = "tests/dist/cases.py"


def _close_dicts(a, b, atol, rtol, what):
    a = {k: v for k, v in a.items() if v is not None}
    b = {k: v for k, v in b.items() if v is not None}
    assert set(a) == set(b), f"{what}: keys differ {set(a) ^ set(b)}"
    for k in a:
        assert a[k] is not None and b[k] is not None, f"{what}: {k} missing on one side"
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m: f"{what} {k}: {m}")


def test_fsdp2_two_ranks_equal_one_process():
    r = run_dist(f"{CASES}:train_steps", 2, dict(ep=1, steps=1, clip=1e9))[0]
    assert r["loss"][0] == pytest.approx(r["ref_loss"][0], rel=1e-5, abs=1e-6)
    assert r["norm"][0] == pytest.approx(r["ref_norm"][0], rel=1e-4)
    _close_dicts(r["grads"], r["ref_grads"], 1e-6, 1e-4, "grad")
