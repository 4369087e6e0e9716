"""Every bad mesh is a K3ConfigError naming the field, raised before any process group or model work."""
import pytest

from k3.errors import K3ConfigError
from k3.parallel.mesh import ParallelDims


def test_dp_shard_fills_the_world_and_derived_sizes():
    d = ParallelDims(dp_shard=-1, ep=2, world_size=4, num_experts=8)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.ep) == (1, 4, 1, 2)
    assert d.efsdp == 2 and d.data_ranks == 4 and d.dp_shard_cp == 4
    d = ParallelDims(dp_replicate=2, dp_shard=-1, cp=2, ep=4, world_size=16, num_experts=896)
    assert d.dp_shard == 4 and d.dp_shard_cp == 8 and d.efsdp == 2
    assert "ep=4" in d.describe()


@pytest.mark.parametrize("kw, field, text", [
    (dict(dp_shard=3, world_size=4), "world_size", "3 * 1 = 3 != world size 4"),
    (dict(dp_replicate=2, dp_shard=4, world_size=4), "world_size", "!= world size 4"),
    (dict(dp_replicate=3, world_size=4), "dp_shard", "-1 (fill the world)"),
    (dict(ep=3, world_size=4), "ep", "must divide dp_shard * cp"),
    (dict(ep=4, world_size=4, num_experts=6), "ep", "num_experts = 6 is not divisible by ep = 4"),
    (dict(ep=2, world_size=2, num_experts=0), "ep", "needs a model with routed experts"),
    (dict(dp_replicate=2, ep=4, world_size=4), "ep", "must divide dp_shard * cp = 2 * 1 = 2"),
    (dict(dp_replicate=0, world_size=4), "dp_replicate", ">= 1"),
    (dict(cp=-1, world_size=4), "cp", ">= 1"),
    (dict(ep=0, world_size=4), "ep", ">= 1"),
    (dict(dp_shard=0, world_size=4), "dp_shard", ">= 1 or -1"),
    (dict(world_size=0), "world_size", ">= 1"),
    (dict(dp_shard=2.0, world_size=2), "dp_shard", "must be an int"),
])
def test_bad_meshes(kw, field, text):
    with pytest.raises(K3ConfigError) as e:
        ParallelDims(**kw)
    msg = str(e.value)
    assert f"parallel dims: {field}:" in msg and text in msg, msg


def test_check_model_against_config():
    from k3.config import K3Config
    cfg = K3Config.from_preset("kimi-k3")
    ParallelDims(dp_shard=-1, ep=8, world_size=64).check_model(cfg)     # 896 experts / 8
    with pytest.raises(K3ConfigError, match="num_experts = 896 is not divisible by ep = 5"):
        ParallelDims(dp_shard=-1, ep=5, world_size=10).check_model(cfg)
