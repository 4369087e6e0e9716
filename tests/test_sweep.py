"""`k3 sweep` (k3/sweep/): grid expansion, keys and values refused before any run, a real 2 x 2 micro sweep with
its files, and resuming (finished points are not re-run; a point without a row continues from its checkpoint)."""
import csv
import json
import os

import pytest

from k3 import sweep as sw
from k3.errors import K3ConfigError
from k3.train.trainer import Callback

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------------------- grid / keys

def test_grid_expansion_cartesian_and_typed():
    axes = [sw.parse_set("linear_attn_config.gate_lower_bound=-5,-4,-3"), sw.parse_set("train.lr=1e-3,3e-3"),
            sw.parse_set("hidden_act=silu")]
    pts = sw.expand_grid(axes)
    assert len(pts) == 6
    assert pts[0].values == {"linear_attn_config.gate_lower_bound": -5.0, "train.lr": 1e-3, "hidden_act": "silu"}
    assert [p.values["train.lr"] for p in pts[:2]] == [1e-3, 3e-3]          # the last axis varies fastest
    assert isinstance(pts[0].values["linear_attn_config.gate_lower_bound"], float)
    assert len({p.id for p in pts}) == 6 and len({p.dirname for p in pts}) == 6
    assert sw.expand_grid([]) and sw.expand_grid([])[0].values == {}       # no --set: the base run
    # typed values: ints, bools, JSON lists, ';' when values hold commas, flag names as train keys
    assert sw.parse_set("attn_res_block_size=1,2,4").values == [1, 2, 4]
    assert sw.parse_set("mla_use_output_gate=true,false").values == [True, False]
    assert sw.parse_set("linear_attn_config.full_attn_layers=[4,8];[8]").values == [[4, 8], [8]]
    assert sw.parse_set("linear_attn_config.full_attn_layers=[4,8]").values == [[4, 8]]
    assert sw.parse_set("train.stages=64:0.5,128:0.5;128:1").values == [[[64, 0.5], [128, 0.5]], [[128, 1.0]]]
    ax = sw.parse_set("train.batch_tokens=256,512")
    assert ax.key == "train.tokens_per_step" and ax.values == [256, 512]
    assert sw.parse_set("train.balancer=qb,sign,aux_loss").values == ["qb", "sign", "aux_loss"]
    assert sw.parse_set("model.hidden_size=64").key == "hidden_size"
    assert sw.parse_set("train.data=a.txt;[\"b.txt\", \"c\"]").values == [["a.txt"], ["b.txt", "c"]]
    assert sw.parse_set("train.no_progress=true").values == [False]           # the flag's sense, stored as progress
    assert sw.parse_set("train.progress=false").key == "train.progress"


@pytest.mark.parametrize("text, names", [
    ("hiden_size=64", "hiden_size"),
    ("linear_attn_config.gate_lowr=-5", "gate_lowr"),
    ("linear_attn_config=1", "linear_attn_config"),
    ("hidden_size=sixty", "hidden_size"),
    ("hidden_size=6.5", "hidden_size"),
    ("linear_attn_config.gate_lower_bound=-5,nan", "linear_attn_config.gate_lower_bound"),
    ("mla_use_output_gate=maybe", "mla_use_output_gate"),
    ("train.lr=-1", "train.lr"),
    ("train.lr=fast", "train.lr"),
    ("train.balancer=qb,magic", "train.balancer"),
    ("train.no_such=1", "train.no_such"),
    ("train.seed=1,2", "train.seed"),
    ("train.out=x", "train.out"),
    ("hidden_size=64,64", "hidden_size"),
    ("hidden_size", "hidden_size"),
])
def test_bad_key_or_value_refused_naming_it(text, names):
    with pytest.raises(K3ConfigError, match=names.replace(".", r"\.")):
        sw.parse_set(text)


def test_values_the_validation_rejects_are_refused_before_any_run(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(sw, "run_point", lambda *a: ran.append(a) or {})
    cases = [
        ("linear_attn_config.gate_lower_bound=-5,-11", "linear_attn_config.gate_lower_bound"),  # model validation
        ("hidden_act=situ,gelu", "hidden_act"),
        ("num_experts_per_token=2,64", "num_experts_per_token"),
        ("train.stages=4096:1", "stages"),                                # trainer validation: > batch tokens
    ]
    for text, name in cases:
        s = sw.Sweep(str(tmp_path / "s"), [sw.parse_set(text)], seeds=[0, 1], base={"steps": 2})
        with pytest.raises(K3ConfigError, match=name):
            s.run()
    assert ran == [] and not os.path.exists(tmp_path / "s")
    with pytest.raises(K3ConfigError, match="given twice"):
        sw.expand_grid([sw.parse_set("hidden_size=64"), sw.parse_set("model.hidden_size=32")])
    with pytest.raises(K3ConfigError, match="seeds"):
        sw.Sweep(str(tmp_path / "s"), [], seeds=[])


def test_cli_refuses_before_running(tmp_path, capsys):
    from k3.cli import main
    out = tmp_path / "s"
    assert main(["sweep", "--set", "linear_attn_config.gate_lowr=-5", "--out", str(out)]) == 2
    assert "gate_lowr" in capsys.readouterr().err and not out.exists()
    assert main(["sweep", "--out", str(out), "--gpus", "1"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert main(["sweep", "--out", str(out), "--", "--seed", "3"]) == 2
    assert "--seed" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse names the bad train flag
        main(["sweep", "--out", str(out), "--", "--lr", "-1"])
    assert "--lr" in capsys.readouterr().err and not out.exists()
    assert main(["sweep", "--preset", "tiny", "--set", "attn_res_block_size=1,2", "--seeds", "2", "--steps", "3",
                 "--out", str(out), "--dry-run", "--", "--batch-tokens", "512", "--stages", "128:1"]) == 0
    text = capsys.readouterr().out
    assert "4 run(s)" in text and "seed1" in text and not out.exists()
    # --report-only over a directory with nothing finished: trains nothing, names the 4 missing runs
    assert main(["sweep", "--preset", "tiny", "--set", "attn_res_block_size=1,2", "--seeds", "2", "--steps", "3",
                 "--out", str(out), "--report-only", "--no-plot", "--", "--batch-tokens", "512",
                 "--stages", "128:1"]) == 0
    text = capsys.readouterr().out
    assert "4 run(s) not trained (--report-only)" in text and not (out / "runs").exists()


# ----------------------------------------------------------------------------------------------- a real sweep

@pytest.fixture
def micro_base(micro_corpus, micro_model_overrides):
    return dict(preset="tiny", model_overrides=dict(micro_model_overrides), steps=2, tokens_per_step=128,
                stages=[(64, 1.0)], data=micro_corpus["data"], cache_dir=micro_corpus["cache"], lr=1e-2,
                val_tokens=128, recall_examples=2, recall_pairs=2, eval_every=0, plot=False, device="cpu",
                threads=1)


class CountSteps(Callback):
    """A sweep callback: one per run; its sweep_metrics() become result columns."""
    made = 0

    def __init__(self):
        CountSteps.made += 1
        self.steps = 0

    def on_step_end(self, trainer, record):
        self.steps += 1

    def sweep_metrics(self):
        return {"cb_steps": self.steps}


def test_micro_sweep_two_values_two_seeds_then_resume(tmp_path, micro_base):
    out = str(tmp_path / "sweep")
    axes = [sw.parse_set("linear_attn_config.gate_lower_bound=-5,-3")]
    lines = []
    CountSteps.made = 0
    s = sw.Sweep(out, axes, seeds=[0, 1], base=micro_base, echo=lines.append, callbacks=[CountSteps])
    rows = s.run()
    assert len(rows) == 4 and len(s.ran) == 4 and not s.skipped
    assert all(r["status"] == "completed" for r in rows), rows
    for name in ("results.csv", "results.json", "summary.md", "sweep.json", "loss_curves.png", "final_loss.png"):
        assert os.path.isfile(os.path.join(out, name)), name
    with open(os.path.join(out, "results.csv")) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and CountSteps.made == 4
    assert [r["cb_steps"] for r in table] == ["2"] * 4 and list(table[0])[:2] == [key := "linear_attn_config.gate_lower_bound", "seed"]
    assert sorted(float(r[key]) for r in table) == [-5, -5, -3, -3]
    assert sorted(int(r["seed"]) for r in table) == [0, 0, 1, 1]
    for r in rows:
        for m in ("val_loss", "train_loss", "tokens_per_s", "maxvio", "peak_mem_mb", "wall_s"):
            assert isinstance(r[m], float) and r[m] == r[m], (m, r)
        assert r["steps"] == 2
        run_dir = os.path.join(out, r["run_dir"])
        assert os.path.isfile(os.path.join(run_dir, "metrics.jsonl")) and os.path.isdir(os.path.join(run_dir, "final"))
        with open(os.path.join(run_dir, "config.json")) as f:
            assert json.load(f)["linear_attn_config"]["gate_lower_bound"] == r[key]
    # the values change the result: the seeds and the bound each give other losses
    assert len({round(r["val_loss"], 7) for r in rows}) == 4
    summary = open(os.path.join(out, "summary.md")).read()
    assert "| -5.0 | 2 |" in summary and "| -3.0 | 2 |" in summary and "±" in summary

    # run again: nothing is re-run
    s2 = sw.Sweep(out, axes, seeds=[0, 1], base=micro_base, echo=lines.append)
    rows2 = s2.run()
    assert s2.ran == [] and len(s2.skipped) == 4 and rows2 == json.load(open(os.path.join(out, "results.json")))["rows"]
    # a point whose row is missing (interrupted after its checkpoint) continues from its run directory
    data = json.load(open(os.path.join(out, "results.json")))
    lost = data["rows"].pop(0)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(data, f)
    s3 = sw.Sweep(out, axes, seeds=[0, 1], base=micro_base, echo=lines.append)
    rows3 = s3.run()
    assert len(s3.ran) == 1 and len(s3.skipped) == 3 and len(rows3) == 4
    back = next(r for r in rows3 if r["point"] == lost["point"] and r["seed"] == lost["seed"])
    assert back["resumed"] is True and back["val_loss"] == pytest.approx(lost["val_loss"], rel=1e-6)
    # other run-fixed base settings in the same directory are refused, naming the setting
    with pytest.raises(K3ConfigError, match="lr"):
        sw.Sweep(out, axes, seeds=[0, 1], base=dict(micro_base, lr=3e-2)).run()


def test_keep_prunes_completed_runs_only(tmp_path, micro_base):
    """--keep-outputs final deletes a completed run's checkpoints, none its final model too; metrics and rows stay."""
    axes = [sw.parse_set("linear_attn_config.gate_lower_bound=-5")]
    kept = {}
    for keep in ("all", "final", "none"):
        out = str(tmp_path / keep)
        rows = sw.Sweep(out, axes, base=micro_base, echo=lambda _: None, keep_outputs=keep).run()
        assert rows[0]["status"] == "completed"
        run_dir = os.path.join(out, rows[0]["run_dir"])
        assert os.path.isfile(os.path.join(run_dir, "metrics.jsonl"))
        kept[keep] = tuple(os.path.isdir(os.path.join(run_dir, d)) for d in ("checkpoints", "final"))
    assert kept == {"all": (True, True), "final": (False, True), "none": (False, False)}
    with pytest.raises(K3ConfigError, match="--keep-outputs"):
        sw.Sweep(str(tmp_path / "x"), axes, base=micro_base, keep_outputs="some")


def test_a_point_that_raises_gets_no_row_and_is_retried(tmp_path, micro_base, monkeypatch):
    """One point's crash (here a full disk) is reported and skipped; the other points run; the next run() retries
    it."""
    out = str(tmp_path / "sweep")
    axes = [sw.parse_set("linear_attn_config.gate_lower_bound=-5,-3")]
    real = sw.run_point

    def flaky(cfg, callbacks=()):
        if cfg["model_overrides"]["linear_attn_config.gate_lower_bound"] == -3:
            raise OSError(28, "No space left on device")
        return real(cfg, callbacks)
    monkeypatch.setattr(sw, "run_point", flaky)
    lines = []
    s = sw.Sweep(out, axes, base=micro_base, echo=lines.append)
    rows = s.run()
    assert len(rows) == 1 and rows[0]["linear_attn_config.gate_lower_bound"] == -5 and len(s.errors) == 1
    assert any("No space left on device" in x and "again" in x for x in lines), lines
    # --report-only trains nothing: it names the missing run and rewrites the report from the finished one
    def no_training(cfg, callbacks=()):
        raise AssertionError("report-only trained a point")
    monkeypatch.setattr(sw, "run_point", no_training)
    os.remove(os.path.join(out, "summary.md"))
    lines.clear()
    s_rep = sw.Sweep(out, axes, base=micro_base, echo=lines.append)
    rows_rep = s_rep.run(train=False)
    assert rows_rep == rows and s_rep.ran == [] and not s_rep.errors and len(s_rep.skipped) == 1
    assert [seed for _, seed in s_rep.missing] == [0] and "-3" in s_rep.missing[0][0]
    assert "| -5.0 | 1 |" in open(os.path.join(out, "summary.md")).read() and "report only" in lines[0], lines
    monkeypatch.setattr(sw, "run_point", real)
    s2 = sw.Sweep(out, axes, base=micro_base, echo=lines.append)
    rows2 = s2.run()
    assert len(s2.ran) == 1 and len(s2.skipped) == 1 and not s2.errors
    assert sorted(r["linear_attn_config.gate_lower_bound"] for r in rows2) == [-5, -3]


def test_callbacks_by_name_and_subprocess_needs_names(tmp_path):
    from k3.train.trainer import Callback as CB
    cbs = sw._resolve_callbacks(["k3.train.trainer:Callback", CountSteps, CountSteps()])
    assert [type(c) for c in cbs] == [CB, CountSteps, CountSteps]
    with pytest.raises(K3ConfigError, match="no_such"):
        sw._resolve_callbacks(["k3.train.trainer:no_such"])
    with pytest.raises(K3ConfigError, match="module:attr"):
        sw.Sweep(str(tmp_path), [], subprocess=True, callbacks=[CountSteps])


def test_summary_mean_std():
    rows = [{"point": '{"a": 1}', "label": "a=1", "status": "completed", "val_loss": v} for v in (1.0, 3.0)]
    rows.append({"point": '{"a": 2}', "label": "a=2", "status": "failed", "val_loss": None})
    g = sw.summarize(rows)
    assert g[0]["val_loss"][0] == 2.0 and g[0]["val_loss"][1] == pytest.approx(2 ** 0.5)
    assert g[1]["val_loss"] == (None, None) and g[1]["failed"] == 1
    md = sw.summary_markdown(rows, ["a"])
    assert "| 1 | 2 | 2.0000 ± 1.4142 |" in md and "(+1 failed)" in md


@pytest.mark.slow
def test_subprocess_runs_and_cli(tmp_path, micro_corpus, micro_model_overrides):
    """`k3 sweep --subprocess` end to end through the CLI (the micro model as fixed --set overrides)."""
    import subprocess
    import sys
    out = tmp_path / "sw"
    sets = []
    for k, v in micro_model_overrides.items():
        sets += ["--set", f"{k}={json.dumps(v) if isinstance(v, list) else v}"]
    cmd = [sys.executable, "-m", "k3.cli", "sweep", "--preset", "tiny", *sets, "--set", "train.lr=1e-2,2e-2",
           "--steps", "2", "--out", str(out), "--subprocess", "--", "--batch-tokens", "128", "--stages", "64:1",
           "--val-tokens", "128", "--eval-every", "0", "--data", *micro_corpus["data"], "--threads", "1"]
    env = dict(os.environ, K3_CACHE=micro_corpus["cache"])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rows = json.load(open(out / "results.json"))["rows"]
    assert len(rows) == 2 and {row["train.lr"] for row in rows} == {1e-2, 2e-2}
    assert all(row["status"] == "completed" and row["peak_mem_mb"] > 0 for row in rows)
    assert "| 0.01 |" in r.stdout
