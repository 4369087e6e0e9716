"""`k3 convert` (k3/parallel/convert.py) and the per-rank lazy released-weight loader (k3/parallel/release_load.py).

One 2-rank launch (tests/parallel/convert_cases.py:roundtrip): a DCP checkpoint of the micro model trained one step
under FSDP2 + EP=2 -> released safetensors -> a model-only DCP checkpoint; both results loaded back at 2 ranks with
ep=2. Checked here: the released checkpoint loads with from_pretrained and gives the run's logits; the converted DCP
and the lazily loaded released weights equal the run's; each rank read only its experts and its rows; no conversion
held more than one layer of the source (instrumented by k3.parallel.convert.STATS)."""
import json
import os
import re

import pytest
import torch

from launcher import _load, run_dist

micro_config = _load("tests/parallel/cases.py:micro_config")


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    run = tmp_path_factory.mktemp("convert") / "run"
    res = run_dist("tests/parallel/convert_cases.py:roundtrip", 2, {"run_dir": str(run)})
    return {"run": str(run), "r": res}


def _group_bytes(cfg) -> dict:
    from k3.checkpoint.adapter import model_key_shapes
    from k3.parallel.convert import _group_of
    out: dict = {}
    for k, (shape, _) in model_key_shapes(cfg.replace(dtype="float32")).items():
        g = _group_of(k)
        out[g] = out.get(g, 0) + 4 * int(torch.Size(shape).numel())
    return out


def _same(a: dict, b: dict, what: str):
    assert set(a) == set(b), (what, set(a) ^ set(b))
    bad = [k for k in a if not torch.equal(a[k].float(), b[k].float())]
    assert not bad, f"{what}: differ {bad[:5]}"


def test_dcp_to_release_gives_the_runs_logits(rt):
    from k3.checkpoint import from_pretrained
    from k3.model import K3ForCausalLM
    trained = rt["r"][0]["trained"]
    rel = os.path.join(rt["run"], "release")
    cj = json.load(open(os.path.join(rel, "config.json")))
    assert cj["architectures"] == ["KimiK3ForConditionalGeneration"] and "text_config" in cj
    wm = json.load(open(os.path.join(rel, "model.safetensors.index.json")))["weight_map"]
    assert len(set(wm.values())) > 3                                   # sharded (--max-shard-size 100KB)
    assert all(k.startswith("language_model.") for k in wm)
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight" in wm
    assert not any(k.endswith(("gate_up_proj", "down_proj")) and ".experts." in k and "shared" not in k for k in wm)
    m = from_pretrained(rel, dtype=torch.float32)
    _same(trained, m.state_dict(), "released")
    ref = K3ForCausalLM(micro_config()).eval()
    ref.load_state_dict(trained)
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_conversions_stream_one_layer_at_a_time(rt):
    from k3.checkpoint.adapter import model_key_shapes
    cfg = micro_config()
    groups = _group_bytes(cfg)
    total = sum(groups.values())
    st = rt["r"][0]["to_release_stats"]
    assert st["groups_loaded"] == len(groups)                    # every layer / top tensor read once
    assert st["max_group_bytes"] == max(groups.values()) < total / 3
    biggest = max(4 * torch.Size(s).numel() for s, _ in model_key_shapes(cfg).values())
    # one output shard (+ the tensor that overflows it, + the last one of the previous shard until replaced)
    assert st["peak_live_bytes"] <= 100_000 + 2 * biggest < total / 2
    st = rt["r"][0]["to_dcp_stats"]
    n_released = len(json.load(open(os.path.join(rt["run"], "release", "model.safetensors.index.json")))["weight_map"])
    assert st["tensors_read"] == n_released                      # each released tensor read exactly once
    assert st["peak_live_bytes"] <= biggest                      # one model tensor alive at a time


def test_release_to_dcp_loads_on_a_mesh(rt):
    """The converted DCP checkpoint (written unsharded in one process) loads resharded at 2 ranks, ep=2."""
    _same(rt["r"][0]["trained"], rt["r"][0]["dcp"], "converted dcp")
    d = os.path.join(rt["run"], "dcp")
    assert json.load(open(os.path.join(d, "converted_from.json")))["format"] == "k3-dcp-model-only"
    assert os.path.isfile(os.path.join(d, "config.json"))
    assert "holds model weights only" in rt["r"][0]["resume_refused"]   # with an optimizer: not a resume


def test_lazy_released_load_reads_only_own_experts_and_rows(rt):
    """load_released at 2 ranks, ep=2: rank r reads experts 4r..4r+3 only and half of each dense tensor's rows;
    the loaded model equals the one-process load."""
    _same(rt["r"][0]["trained"], rt["r"][0]["release"], "lazy released load")
    cfg = micro_config()
    E, layers = cfg.num_experts, [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    for r in (0, 1):
        rec = rt["r"][r]["release_record"]
        keys = [k for k, _ in rec]
        assert len(keys) == len(set(keys))                       # nothing read twice
        experts = {int(m.group(1)) for k in keys if (m := re.search(r"\.experts\.(\d+)\.w", k))}
        assert experts == set(range(4 * r, 4 * r + 4))
        n_exp = sum(1 for k in keys if re.search(r"\.experts\.\d+\.w", k))
        assert n_exp == len(layers) * (E // 2) * 3               # w1, w2, w3 of each own expert
        rows = dict(rec)
        emb = rows["language_model.model.embed_tokens.weight"]
        assert emb == (256 * r, 256)                             # FSDP dim-0 half of the [512, d] embedding


def test_cli_convert_bf16_and_model_only_resume_refused(rt, tmp_path, capsys):
    """`k3 convert` registered in the CLI: the default (bf16) released output loads and is close to the run."""
    from k3.checkpoint import from_pretrained
    from k3.cli import main
    ck = os.path.join(rt["run"], "checkpoints", "step-1")
    out = str(tmp_path / "bf16")
    assert main(["convert", ck, out]) == 0
    assert "converted" in capsys.readouterr().out
    m = from_pretrained(out)
    sd = m.state_dict()
    assert sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    for k, v in rt["r"][0]["trained"].items():
        torch.testing.assert_close(sd[k].float(), v, rtol=1e-2, atol=1e-2)
    assert main(["convert", str(tmp_path / "nothing_here"), str(tmp_path / "o")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["convert", out, str(tmp_path / "d"), "--quantize", "mxfp4"]) == 2      # released -> DCP
    assert "--quantize: only for DCP -> released" in capsys.readouterr().err
    assert main(["convert", out, str(tmp_path / "d"), "--dtype", "float32"]) == 0       # auto: released -> DCP
    assert os.path.isfile(os.path.join(tmp_path, "d", ".metadata"))


def test_distributed_trainer_starts_from_released_weights(rt):
    """DistTrainer with init_from = the released directory (2 ranks, ep=2): the model it trains from holds the
    released weights (the run's), not a fresh init."""
    _same(rt["r"][0]["trained"], rt["r"][0]["trainer_init"], "trainer init_from")
