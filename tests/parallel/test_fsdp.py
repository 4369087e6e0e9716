"""FSDP2 (+EP) on gloo processes vs one process on the concatenated batch (fp32)."""
import os

import pytest
import torch

from launcher import run_dist  # noqa: E402  (tests/parallel/conftest.py puts this folder on sys.path)

CASES = "tests/parallel/cases.py"


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


def _check_run(r, what):
    assert len(r["loss"]) == len(r["ref_loss"]) > 0
    for a, b in zip(r["loss"], r["ref_loss"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), what
    for a, b in zip(r["norm"], r["ref_norm"]):
        assert a == pytest.approx(b, rel=1e-4), what
    _close_dicts(r["grads"], r["ref_grads"], 1e-6, 1e-4, f"{what} grad")
    # Muon matrices within 1e-6; AdamW (embedding, lm_head) within 5e-5 = 0.25% of one lr step (fp32 reduction
    # order amplified by Adam's 1/sqrt(v) on tiny gradients)
    _close_dicts(r["params"], r["ref_params"], 5e-5, 1e-4, f"{what} param")


def test_fsdp2_two_ranks_equal_one_process(two_rank_results):
    """FSDP2 over 2 ranks, each on half the rows: global-count loss, global grad norm, gradients, and the
    parameters after 2 steps of sharded per-head Muon + AdamW = one process on the whole batch (fp32)."""
    _check_run(two_rank_results[0]["fsdp"], "fsdp2")


def test_ep2_equal_local_moe(two_rank_results):
    """EP=2 (each rank holds 4 of 8 experts; tokens exchanged by all-to-all in the latent width; with activation
    checkpointing): the same losses, gradients (experts included) and updated parameters as the local MoE in one
    process."""
    _check_run(two_rank_results[0]["ep2"], "ep2")


def test_hsdp_replicas_equal_one_process(two_rank_results):
    """dp_replicate=2, dp_shard=1: gradients all-reduced across replicas (sum), Muon on Replicate placements."""
    _check_run(two_rank_results[0]["hsdp"], "hsdp")


def test_dp4_ep2_sharded_muon_and_dcp_resume_on_other_meshes(tmp_path):
    """4 ranks, --dp-shard 4 --ep 2: experts split over 2 ranks and FSDP-sharded over the other 2; 2 steps of
    sharded per-head Muon + AdamW (on DTensors) = 2 single-process steps. A DCP checkpoint written after step 1
    resumes at 2 ranks (ep=2, then no expert FSDP) and at 1 rank, and their step 2 equals the uninterrupted
    run (AdamW's embedding / lm_head within 5e-5: fp32 reduction order, amplified by Adam's 1/sqrt(v))."""
    ck = str(tmp_path / "ckpt")
    r = run_dist(f"{CASES}:train_steps", 4, dict(ep=2, steps=2, opt="muon", clip=1e9, save=ck, save_after=0))[0]
    _check_run(r, "dp4 x ep2")
    assert sorted(os.listdir(ck)) == ["step-1"]
    for world, ep in ((2, 2), (1, 1)):
        q = run_dist(f"{CASES}:train_steps", world, dict(ep=ep, steps=2, start=1, opt="muon", clip=1e9, load=ck))[0]
        assert q["extra"] == {"step": 1, "data": {"epoch": 0, "offset": 4}}
        for a, b in zip(q["loss"], r["loss"][1:]):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
        _close_dicts(q["params"], r["params"], 5e-5, 1e-4, f"resumed at {world} ranks: param")


def test_sharded_qk_clip_equals_one_process(two_rank_results):
    """Per-head max logits reduced over ranks, MLA q_b / kv_b rows scaled on their shards = qk_clip on one
    process seeing the whole batch."""
    r = two_rank_results[0]["qk_clip"]
    assert r["n"] == r["n_ref"] > 0
    _close_dicts(r["dist"], r["ref"], 1e-7, 1e-6, "qk-clipped param")


def test_async_dcp_save_is_the_state_at_save_time(two_rank_results):
    """dcp.async_save: not published until wait(); what loads is the model and Muon momenta at save time, though
    the weights changed while the write was in flight (EP=2, so the global expert view round-trips too)."""
    r = two_rank_results[0]["async_save"]
    assert r["was_tmp"] and r["extra"] == {"step": 1}
    _close_dicts(r["loaded"], r["saved"], 0, 0, "async-saved param")
    assert r["mom"] and r["mom"].keys() == r["mom2"].keys()
    _close_dicts(r["mom2"], r["mom"], 0, 0, "async-saved momentum")
