"""k3.parallel.plan: the shard sizes of its memory model = the real parallelisation over torch's fake process group,
and its parameter / optimizer bytes = what a gloo run measures."""
import pytest

from k3.config import K3Config
from k3.errors import K3ConfigError
from k3.parallel.mesh import ParallelDims
from k3.parallel.plan import estimate, plan, verify_with_fake_pg


def _cfg():
    from launcher import _load
    return _load("tests/parallel/cases.py:micro_config")()


@pytest.mark.parametrize("kw", [dict(world_size=3), dict(world_size=4, ep=2), dict(world_size=8, ep=4),
                                dict(world_size=8, dp_replicate=2, ep=2)])
def test_local_elements_match_fake_pg_parallelisation(kw):
    cfg = _cfg()
    dims = ParallelDims(dp_shard=-1, num_experts=cfg.num_experts, **kw)
    assert verify_with_fake_pg(cfg, dims) == estimate(cfg, dims, seq_len=64).local_elements


def test_bytes_match_a_gloo_run(two_rank_results):
    cfg = _cfg()
    for key, ep in (("fsdp", 1), ("ep2", 2)):
        measured = two_rank_results[0][key]["bytes"]
        est = estimate(cfg, ParallelDims(dp_shard=-1, ep=ep, world_size=2, num_experts=8), seq_len=64)
        assert measured["param"] == est.param_bytes
        # optimizer state: the estimate also counts layer 0's never-used AttnRes query (no gradient, no state)
        assert est.optim_bytes * 0.97 <= measured["optim"] <= est.optim_bytes


def test_plan_kimi_k3():
    cfg = K3Config.from_preset("kimi-k3")
    rep = plan(cfg, gpus=512, gpu_memory=141e9, seq_len=8192)
    from k3.parallel.parallelize import build_meta_model
    assert rep.total_params == build_meta_model(cfg).num_parameters() > 2.7e12
    assert rep.recommended is not None and rep.recommended.fits
    assert all(c.ep == 1 or cfg.num_experts % c.ep == 0 for c in rep.candidates)
    assert not plan(cfg, gpus=64).recommended          # 2.78T params do not train on 64 GPUs
    assert "recommended on 512 GPUs" in rep.table()
    with pytest.raises(K3ConfigError):
        plan(cfg, gpus=0)
