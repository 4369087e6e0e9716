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
        # rank 0's parameter shards, gradient shards (after the backward) and Muon / AdamW state, to the byte
        assert (measured["param"], measured["grad"], measured["optim"]) == \
            (est.param_bytes, est.grad_bytes, est.optim_bytes), key


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


def test_cp_divides_the_activation_estimate_and_shards_like_dp():
    cfg = _cfg()
    S = 4096
    one = estimate(cfg, ParallelDims(dp_shard=-1, world_size=2, num_experts=8), seq_len=S)
    cp2 = estimate(cfg, ParallelDims(dp_shard=-1, cp=2, world_size=2, num_experts=8), seq_len=S)
    assert (one.tokens_per_rank, cp2.tokens_per_rank) == (S, S // 2)
    assert cp2.param_bytes == one.param_bytes and cp2.optim_bytes == one.optim_bytes   # FSDP over dp_shard x cp
    gathered = 2 * 2 * S * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert cp2.activation_bytes - gathered < 0.55 * one.activation_bytes
    assert cp2.mesh() == "dp_shard=1 cp=2"
    dims = ParallelDims(dp_shard=-1, cp=2, ep=2, world_size=4, num_experts=8)
    assert verify_with_fake_pg(cfg, dims) == estimate(cfg, dims, seq_len=64).local_elements


def test_plan_cp_candidates():
    cfg = _cfg()
    assert {c.cp for c in plan(cfg, gpus=4, seq_len=8192).candidates} == {1}          # short: no CP
    long = plan(cfg, gpus=4, seq_len=65536).candidates
    assert {c.cp for c in long} == {1, 2, 4}
    assert all(c.tokens_per_rank == 65536 // c.cp for c in long)
    assert {c.cp for c in plan(cfg, gpus=4, seq_len=64, cp=2).candidates} == {2}    # --cp given
    with pytest.raises(K3ConfigError, match="--cp 3 must be >= 1 and divide"):
        plan(cfg, gpus=4, cp=3)


def test_plan_cli_cp_json(capsys, tmp_path):
    import json
    from k3.cli import main
    p = str(tmp_path / "micro.json")
    _cfg().save_json(p)
    assert main(["plan", "--config", p, "--gpus", "4", "--seq-len", "65536", "--cp", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["cp"] == 2 and all(c["cp"] == 2 and c["tokens_per_rank"] == 32768 for c in d["candidates"])
    assert "--cp 2" in d["recommended_flags"] and "cp=2" in d["recommended_mesh"]


@pytest.mark.slow
def test_plan_vs_measured_script(tmp_path):
    """benchmarks/plan_vs_measured.py at 2 gloo ranks (it launches torchrun itself): rank 0's measured parameter /
    gradient / optimizer bytes = the plan's, and the peak is reported."""
    import json
    import os
    import subprocess
    import sys
    from launcher import ROOT
    cfg = str(tmp_path / "micro.json")
    _cfg().save_json(cfg)
    out = str(tmp_path / "pvm.json")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plan_vs_measured.py"), "--config", cfg,
                        "--nproc", "2", "--ep", "2", "--seq-len", "32", "--rows", "2", "--steps", "1", "--json", out],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "plan vs measured" in r.stdout and "rank 1" in r.stdout
    d = json.load(open(out))
    m0 = d["measured"][0]
    for k in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert m0[k] == d["plan_rank0"][k], k
    assert m0["peak_bytes"] > 0
