"""Balancers under 2 ranks (FSDP2 + EP=2) see the global batch: the bias after a step equals one process on the
concatenated batch (k3/balance.py reduces its statistics over the default process group)."""
import pytest
import torch


@pytest.mark.usefixtures("one_torch_thread")   # the in-process reference: tiny ops, one thread is much faster
def test_balancer_bias_two_ranks_equals_one_process(two_rank_results):
    from launcher import _load
    ref = _load("tests/parallel/cases.py:balancer_bias")(distributed=False)   # no process group in this process
    res = [r["balance"] for r in two_rank_results]
    for name, r in ref.items():
        got = res[0][name]
        assert got.keys() == r.keys() and r
        for k in r:
            torch.testing.assert_close(got[k], r[k], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name} {k}: {m}")
            torch.testing.assert_close(res[1][name][k], got[k], atol=0, rtol=0)   # the same bias on every rank
        assert max(float(v.abs().max()) for v in r.values()) > 0, f"{name}: the bias did not move"

