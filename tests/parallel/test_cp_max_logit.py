"""QK-clip's max logit under context parallelism ignores the padding (cp not dividing the sequence): each MLA
layer's per-head max logit, reduced over the cp ranks, equals one process's on the unpadded sequence, even with
a pad token whose own q.k is larger than every real logit (so a leak would show and clip heads)."""
import pytest
import torch

from launcher import run_dist


@pytest.fixture(scope="module")
def cp2_max_logit():
    return run_dist("tests/parallel/_cp_cases.py:max_logit_case", 2, {"T": 37, "cu": (0, 9, 30, 37)})


def test_cp_max_logit_excludes_padding(cp2_max_logit):
    r = cp2_max_logit[0]
    assert r["pad_rows"] == 1
    assert r["margin"] > 1e-3, r            # the pad token's own logit beats every real one: a leak would show
    assert len(r["ref"]) == len(r["cp"]) >= 1
    for S_ref, S_cp in zip(r["ref"], r["cp"]):
        torch.testing.assert_close(S_cp, S_ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{r['case']}: {m}")
    assert r["n_ref"] == 0 and r["n_cp"] == 0, r       # tau above every real logit: nothing to clip
    for other in cp2_max_logit[1:]:
        for a, b in zip(other["cp"], r["cp"]):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
