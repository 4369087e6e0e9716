"""Context-parallel padding (cp not dividing the sequence) never reaches the MoE router: it counts in no balancer
statistic. No processes: the slice of a rank is set by hand (k3.parallel.context.plan_slices), the MoE forward of
apply_context_parallel needs no collective."""
import pytest
import torch

from launcher import _load


def _moe_and_cp(T, size, rank):
    import copy
    from k3.model import K3ForCausalLM
    from k3.parallel.context import ContextParallel, apply_context_parallel, plan_slices
    cfg = _load("tests/parallel/cases.py:micro_config")()
    torch.manual_seed(0)
    ref = K3ForCausalLM(cfg).model.layers[1].block_sparse_moe
    moe = copy.deepcopy(ref)
    cp = ContextParallel()                      # no process group: only the slice bookkeeping is used
    apply_context_parallel(moe, cp)
    cp.current = plan_slices(T, None, size, rank)
    return cfg, ref, moe, cp


@pytest.mark.parametrize("name", ["qb", "qb_hist", "sign", "aux_loss"])
@pytest.mark.parametrize("T, size, rank, real", [(5, 2, 1, 2), (4, 3, 2, 0), (6, 2, 1, 3)])
def test_pad_rows_skip_the_router_and_the_balancer(name, T, size, rank, real):
    from k3.balance import make_balancer
    cfg, ref, moe, cp = _moe_and_cp(T, size, rank)
    L = cp.current.slice_len
    x = torch.randn(1, L, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    bal = make_balancer(name).attach(moe)
    moe.train()
    y = moe(x)
    assert y.shape == x.shape
    loads = [r.load_E for r in bal.routers]
    seen = sum(int(l.sum()) for l in loads if l is not None)
    assert seen == real * cfg.num_experts_per_token            # only the real tokens were routed
    if real:
        torch.testing.assert_close(y[:, :real], ref(x[:, :real]))
    assert torch.count_nonzero(y[:, real:]) == 0
    y.sum().backward()                                           # the graph is whole (also with 0 real rows)


def test_cp_refuses_mtp_before_any_work(tmp_path, monkeypatch):
    # MTP shifts inputs and targets within the sequence: under CP each rank's slice would lose the next slice's
    # tokens at its end, so `--cp` with MTP blocks is refused before the process group starts (as images are)
    from k3.errors import K3ConfigError
    from k3.parallel.training import MeshFlags, make_trainer
    from k3.train.config import TrainConfig
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "cp_mtp"
    cfg = TrainConfig(out_dir=str(out), steps=1, model_overrides={"num_nextn_predict_layers": 1})
    with pytest.raises(K3ConfigError, match=r"--cp 2: multi-token prediction \(num_nextn_predict_layers=1\)"):
        make_trainer(cfg, MeshFlags(cp=2))
    assert not out.exists()
    # the same model without CP passes the check
    from k3.config import K3Config
    from k3.parallel.mesh import ParallelDims
    from k3.parallel.setup import refuse_cp_unsupported
    mtp_model = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=1)
    refuse_cp_unsupported(ParallelDims(dp_shard=2, world_size=2), mtp_model)
    with pytest.raises(K3ConfigError, match="multi-token prediction"):
        refuse_cp_unsupported(ParallelDims(dp_shard=1, cp=2, world_size=2), mtp_model)
