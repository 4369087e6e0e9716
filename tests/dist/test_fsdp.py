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
    bad = []
    for k in a:
        try:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol)
        except AssertionError:
            bad.append(f"{k}: max abs diff {float((a[k] - b[k]).abs().max()):.3g}")
    assert not bad, f"{what}: {len(bad)} tensors differ:\n" + "\n".join(bad)


def test_fsdp2_two_ranks_equal_one_process():
    r = run_dist(f"{CASES}:train_steps", 2, dict(ep=1, steps=1, clip=1e9))[0]
    assert r["loss"][0] == pytest.approx(r["ref_loss"][0], rel=1e-5, abs=1e-6)
    assert r["norm"][0] == pytest.approx(r["ref_norm"][0], rel=1e-4)
    _close_dicts(r["grads"], r["ref_grads"], 1e-6, 1e-4, "grad")


def test_ep2_and_dp_x_ep_equal_one_process():
    """EP=2 over 2 ranks (experts split, no expert FSDP), then --dp-shard 4 --ep 2 (experts split over 2 and
    FSDP-sharded over 2) with sharded Muon: losses, gradients and the updated parameters of 2 steps."""
    r = run_dist(f"{CASES}:train_steps", 2, dict(ep=2, steps=1, clip=1e9))[0]
    assert r["loss"][0] == pytest.approx(r["ref_loss"][0], rel=1e-5, abs=1e-6)
    assert r["norm"][0] == pytest.approx(r["ref_norm"][0], rel=1e-4)
    _close_dicts(r["grads"], r["ref_grads"], 1e-6, 1e-4, "grad")


def test_dp4_ep2_sharded_muon_and_dcp_resume_on_other_meshes(tmp_path):
    """4 ranks, --dp-shard 4 --ep 2: experts split over 2 ranks and FSDP-sharded over the other 2; 2 steps of
    sharded per-head Muon + AdamW (on DTensors) = 2 single-process steps. A DCP checkpoint written after step 1
    resumes at 2 ranks (ep=2, then no expert FSDP) and at 1 rank, and their step 2 equals the uninterrupted
    run (AdamW's embedding / lm_head within 5e-5: fp32 reduction order, amplified by Adam's 1/sqrt(v))."""
    ck = str(tmp_path / "ckpt")
    r = run_dist(f"{CASES}:train_steps", 4, dict(ep=2, steps=2, opt="muon", clip=1e9, save=ck, save_after=0))[0]
    for a, b in zip(r["loss"], r["ref_loss"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    _close_dicts(r["grads"], r["ref_grads"], 1e-6, 1e-4, "grad")
    # AdamW (embedding, lm_head) within 5e-5 = 0.25% of one lr step; Muon matrices within 1e-6
    _close_dicts(r["params"], r["ref_params"], 5e-5, 1e-4, "param")
    assert sorted(os.listdir(ck)) == ["step-1"]
    for world, ep in ((2, 2), (1, 1)):
        q = run_dist(f"{CASES}:train_steps", world, dict(ep=ep, steps=2, start=1, opt="muon", clip=1e9, load=ck))[0]
        assert q["extra"] == {"step": 1, "data": {"epoch": 0, "offset": 4}}
        for a, b in zip(q["loss"], r["loss"][1:]):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
        _close_dicts(q["params"], r["params"], 5e-5, 1e-4, f"resumed at {world} ranks: param")
