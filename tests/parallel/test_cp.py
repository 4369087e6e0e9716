"""Context parallelism on gloo processes (one 4-rank launch) = one process on the whole packed sequence (fp32):
KDA alone (short-conv halo + state passing), MLA alone (latent all-gather), and the whole micro model, at cp = 2
and 3, with documents starting / ending inside slices, one spanning three slices, slices shorter than the conv
halo, lengths not divisible by cp (padded) or the chunk size; cp x dp x ep with activation checkpointing."""
import pytest
import torch

from launcher import run_dist  # noqa: E402  (tests/parallel/conftest.py puts this folder on sys.path)

C3 = [0, 5, 35, 37]        # cp=3, L=13 (+2 pad): doc [5, 35) spans all three slices, starts/ends inside one
C2 = [0, 9, 30, 37]        # cp=2, L=19 (+1 pad): doc [9, 30) crosses the boundary
LAYERS = {
    3: [[dict(kind="kda", T=37, cu=C3), dict(kind="mla", T=37, cu=C3),
         dict(kind="kda", T=5, cu=[0, 5])]],                     # L=2 < kernel-1: the halo spans two ranks
    2: [[dict(kind="kda", T=37, cu=C2)],                         # dp group 0 (ranks 0, 1)
        [dict(kind="mla", T=37, cu=C2), dict(kind="kda", T=16, cu=[0, 3, 8, 16])]],   # dp group 1 (ranks 2, 3)
}
MODELS = [dict(cp=3, seqs=[(37, C3)], sub=True),
          dict(cp=2, seqs=[(37, C2), (15, [0, 4, 15])], ep=2, ac=True, fsdp=True)]


@pytest.fixture(scope="module")
def cp_results():
    res = run_dist("tests/parallel/_cp_cases.py:suite", 4, {"layers": LAYERS, "models": MODELS, "balance": True})
    return {"layers": [x for r in res for x in r["layers"] if x is not None],
            "models": [x for r in res for x in r["models"] if x is not None],
            "balance": [r["balance"] for r in res]}


def _check_layer(r):
    assert r["out"] <= 1e-5 * r["scale"], r["case"]
    assert r["gx"] <= 1e-5 * r["gscale"], r["case"]
    assert r["grads"] and max(r["grads"].values()) <= 2e-6 * r["gscale"], (r["case"], r["grads"])


@pytest.mark.parametrize("kind", ["kda", "mla"])
@pytest.mark.parametrize("cp", [2, 3])
def test_layer_under_cp_equals_one_process(cp_results, kind, cp):
    """Outputs, input gradients and every parameter gradient (summed over the cp ranks) of one KDA / MLA layer."""
    rs = [r for r in cp_results["layers"] if r["case"].startswith(kind) and r["case"].endswith(f"cp={cp}")]
    assert rs, f"no {kind} cp={cp} result"
    for r in rs:
        _check_layer(r)
    assert any(any(r["cont"]) for r in rs)      # some slice really continued a document


def test_all_layer_cases_ran(cp_results):
    assert len(cp_results["layers"]) == 6
    tiny = [r for r in cp_results["layers"] if "T=5 " in r["case"]]
    assert tiny and tiny[0]["cont"] == [False, True, True]


@pytest.mark.parametrize("i", [0, 1], ids=["cp3", "fsdp2_cp2xdp2xep2_ac"])
def test_whole_model_under_cp_equals_one_process(cp_results, i):
    """The whole micro model (KDA, MLA, AttnRes, MoE, loss over the global token count): the summed loss, the
    final hidden states of the first sequence and every gradient (routed experts gathered over ep). The second
    runs FSDP2 over the dp_shard x cp ranks with EP=2 folded into them and activation checkpointing (the
    recompute re-runs the CP collectives inside the backward)."""
    r = cp_results["models"][i]
    assert r["case"].startswith(f"model cp={MODELS[i]['cp']}")
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6, abs=1e-6), r["case"]
    assert r["h"] <= 1e-5, r["case"]
    bad = {k: v for k, v in r["grads"].items() if v > 1e-5 * r["gscale"]}
    assert r["grads"] and not bad, (r["case"], bad)


@pytest.mark.usefixtures("one_torch_thread")   # the in-process reference: tiny ops, one thread is much faster
def test_balancer_statistics_reduce_over_dp_and_cp(cp_results):
    """QB and the sign rule after one step on 2 sequences x 2 slices (4 ranks) = one process on the whole
    sequences: the statistics of every slice reach the (identical) bias of every rank."""
    from launcher import _load
    ref = _load("tests/parallel/_cp_cases.py:balance_case")(distributed=False)   # no process group here
    res = cp_results["balance"]
    for name, r in ref.items():
        assert r and res[0][name].keys() == r.keys()
        for k in r:
            torch.testing.assert_close(res[0][name][k], r[k], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name} {k}: {m}")
            for other in res[1:]:
                torch.testing.assert_close(other[name][k], res[0][name][k], atol=0, rtol=0)
        assert max(float(v.abs().max()) for v in r.values()) > 0, f"{name}: the bias did not move"
