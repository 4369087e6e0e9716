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
