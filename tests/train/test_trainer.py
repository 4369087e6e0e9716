"""The training loop (k3.train.trainer / `k3 train`): loss falls, exact resume, atomic checkpoints, curriculum,
NaN handling, Ctrl-C, final model, metrics. A ~0.3M-parameter model on a small slice of the built-in corpus."""
import json
import math
import os

import pytest
import torch

from k3.config import K3Config
from k3.errors import K3ConfigError
from k3.train.trainer import (Callback, Trainer, TrainConfig, TrainingError, find_checkpoints, latest_checkpoint,
                              parse_stages, recall_batch)

@pytest.fixture(scope="module")
def corpus(micro_corpus, micro_model_overrides):
    """The shared micro corpus (tests/conftest.py) and, under "model", the micro model's overrides."""
    return dict(micro_corpus, model=micro_model_overrides)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_cfg(corpus, out, **kw):
    base = dict(out_dir=str(out), preset="tiny", model_overrides=dict(corpus["model"]), steps=8, tokens_per_step=256,
                stages=[(64, 0.5), (128, 0.5)], data=corpus["data"], cache_dir=corpus["cache"], lr=1e-2,
                val_tokens=512, recall_examples=4, recall_pairs=4, progress=False, tensorboard=False,
                samples=False, plot=False, seed=0, device="cpu", eval_every=0)
    base.update(kw)
    return TrainConfig(**base)


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f]


def train_losses(out):
    return [r["loss"] for r in metrics(out) if r["type"] == "train"]


def test_loss_falls_final_loads_and_artifacts(corpus, tmp_path, caplog):
    out = tmp_path / "run"
    trainer = Trainer(make_cfg(corpus, out, steps=14, eval_every=7, samples=True, plot=True, sample_tokens=4,
                          sample_prompts=["The "]))
    s = trainer.train()
    assert s["status"] == "completed"
    assert s["val_loss_after"] < s["val_loss_before"] - 0.5, s
    losses = train_losses(out)
    assert len(losses) == 14 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5
    recs = metrics(out)
    tr = [r for r in recs if r["type"] == "train"]
    for key in ("step", "loss", "lr", "tokens_per_s", "seq_len", "stage", "maxvio"):
        assert key in tr[0], key
    assert [r["step"] for r in tr] == list(range(1, 15))
    ev = [r for r in recs if r["type"] == "eval"]
    assert [r["step"] for r in ev] == [0, 7, 14] and "recall_acc" in ev[0] and "val_loss" in ev[0]
    # final model + tokenizer: from_pretrained gives the trained weights
    from k3.checkpoint import from_pretrained
    from k3.train.data import HFTokenizer
    final = out / "final"
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(final))
    m = from_pretrained(str(final))
    tok = HFTokenizer.from_pretrained(str(final))
    assert tok.vocab_size == 1024
    ids = torch.tensor([tok.encode("The value of the")])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(m(ids).logits, trainer.model(ids).logits)
    assert s["samples"] and s["samples"][0][0] == "The " and "generate failed" not in caplog.text
    assert os.path.isfile(out / "config.json") and os.path.isfile(out / "loss.png")
    assert os.path.isfile(out / "report.md") and os.path.isfile(out / "samples.txt")
    assert K3Config.from_json(str(out / "config.json")).hidden_size == 64


def test_exact_resume(corpus, tmp_path):
    """2N steps straight == N steps, stop, resume, N steps (bitwise on CPU), across a stage switch."""
    a, b = tmp_path / "a", tmp_path / "b"
    Trainer(make_cfg(corpus, a, steps=6)).train()
    s1 = Trainer(make_cfg(corpus, b, steps=6, stop_at=3, eval_every=2)).train()  # evals must not perturb
    assert s1["status"] == "stopped" and find_checkpoints(str(b))[-1][0] == 3
    assert not os.path.exists(b / "final")
    s2 = Trainer(make_cfg(corpus, b, steps=6, resume=True)).train()
    assert s2["status"] == "completed"
    la, lb = train_losses(a), train_losses(b)
    assert len(la) == len(lb) == 6
    assert la == lb, (la, lb)
    # the final weights agree too
    from k3.checkpoint import load_state_dict
    sa, sb = load_state_dict(str(a / "final")), load_state_dict(str(b / "final"))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    st = torch.load(os.path.join(latest_checkpoint(str(b)), "trainer_state.pt"), weights_only=True)
    assert st["step"] == 6 and st["stage"] == 1 and st["seq_len"] == 128
    assert {"optimizer", "scheduler", "balancer", "loader", "rng"} <= set(st)


def test_crash_during_save_keeps_previous_checkpoint(corpus, tmp_path):
    out = tmp_path / "run"
    tr = Trainer(make_cfg(corpus, out, steps=4, save_every=2, keep=1))

    class Boom(Callback):
        def on_save(self, trainer, path):
            def broken(state, p):
                with open(p + ".tmp", "wb") as f:
                    f.write(b"partial")
                raise OSError("disk full")
            trainer._write_state = broken
    tr.callbacks.append(Boom())
    with pytest.raises(OSError, match="disk full"):
        tr.train()  # step 2 saves fine, the save at step 4 crashes half-way
    ck = find_checkpoints(str(out))
    assert [s for s, _ in ck] == [2]
    assert not [n for n in os.listdir(out / "checkpoints") if n.startswith(".")]  # temp dir removed
    from k3.checkpoint import from_pretrained
    from_pretrained(ck[0][1])
    first = train_losses(out)[:2]
    s = Trainer(make_cfg(corpus, out, steps=4, resume=True)).train()
    assert s["status"] == "completed" and train_losses(out)[:2] == first
    assert [r["step"] for r in metrics(out) if r["type"] == "train"] == [1, 2, 3, 4]


def test_curriculum_switches_lengths(corpus, tmp_path):
    out = tmp_path / "run"
    Trainer(make_cfg(corpus, out, steps=6, stages=[(32, 0.34), (64, 0.33), (256, 0.33)], eval_every=0)).train()
    tr = [r for r in metrics(out) if r["type"] == "train"]
    assert [r["seq_len"] for r in tr] == [32, 32, 64, 64, 256, 256]
    assert [r["stage"] for r in tr] == [0, 0, 1, 1, 2, 2]
    assert [r["batch_rows"] for r in tr] == [8, 8, 4, 4, 1, 1]
    assert all(r["tokens"] == 256 for r in tr)
    assert parse_stages("256:0.6,1024:0.3,4096:0.1") == [(256, 0.6), (1024, 0.3), (4096, 0.1)]
    with pytest.raises(K3ConfigError):
        make_cfg(corpus, out, stages=[(512, 1.0)]).validate()


class NaNAt(Callback):
    def __init__(self, steps):
        self.steps = set(steps)

    def on_loss(self, trainer, loss):
        return loss * float("nan") if trainer.step + 1 in self.steps else loss


def test_nan_step_is_skipped_and_repeated_nans_stop(corpus, tmp_path):
    out = tmp_path / "run"
    tr = Trainer(make_cfg(corpus, out, steps=4), callbacks=[NaNAt({2})])
    tr.setup()
    before = {}

    class Snap(Callback):
        def on_step_end(self, trainer, rec):
            before[rec["step"]] = trainer.model.lm_head.weight.detach().clone()
    tr.callbacks.append(Snap())
    s = tr.train()
    assert s["status"] == "completed" and s["skipped_steps"] == 1
    tr_recs = [r for r in metrics(out) if r["type"] == "train"]
    # metrics.jsonl is strict JSON: the skipped step's NaN loss is written as null (the summary keeps NaN)
    assert tr_recs[1]["skipped"] and tr_recs[1]["loss"] is None and tr_recs[1]["grad_norm"] is None
    assert math.isnan(tr.history[1]["loss"])
    with open(out / "metrics.jsonl") as f:
        for line in f:
            json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))
    assert torch.equal(before[1], before[2])  # no update on the skipped step
    assert not torch.equal(before[2], before[3])
    assert all(p.grad is None for p in tr.model.parameters())

    out2 = tmp_path / "run2"
    with pytest.raises(TrainingError, match="NaN/inf for 3 consecutive"):
        Trainer(make_cfg(corpus, out2, steps=8, max_bad_steps=2), callbacks=[NaNAt(range(3, 99))]).train()


class ScaleLossAt(Callback):
    """Multiplies the loss (hence every gradient) by `factor` on the given steps: a finite gradient spike."""
    def __init__(self, steps, factor=1e4):
        self.steps, self.factor = set(steps), factor

    def on_loss(self, trainer, loss):
        return loss * self.factor if trainer.step + 1 in self.steps else loss


def test_grad_spike_is_skipped_with_skip_grad_spikes(corpus, tmp_path, caplog):
    """--skip-grad-spikes F: a step whose gradient norm is over F x the median of the recent updated steps' is
    skipped (no update; its finite loss kept in the record, with the median); without the flag the same step is
    clipped and applied. Before SPIKE_MIN_HISTORY updated steps the rule does not apply."""
    from k3.train.trainer import SPIKE_MIN_HISTORY
    spike = SPIKE_MIN_HISTORY + 2
    snaps = {}

    class Snap(Callback):
        def on_step_end(self, trainer, rec):
            snaps[rec["step"]] = trainer.model.lm_head.weight.detach().clone()
    out = tmp_path / "on"
    with caplog.at_level("WARNING", logger="k3.train"):
        s = Trainer(make_cfg(corpus, out, steps=spike + 2, skip_grad_spikes=10.0),
                    callbacks=[ScaleLossAt({2, spike}), Snap()]).train()
    assert s["status"] == "completed" and s["skipped_steps"] == 1
    recs = {r["step"]: r for r in metrics(out) if r["type"] == "train"}
    assert not recs[2]["skipped"]                            # too early: fewer than SPIKE_MIN_HISTORY norms
    r = recs[spike]
    norms = [recs[i]["grad_norm"] for i in range(1, spike) if i != 2]
    import statistics
    assert r["skipped"] and r["grad_spike_median"] == pytest.approx(statistics.median(norms + [recs[2]["grad_norm"]]))
    assert r["grad_norm"] > 10.0 * r["grad_spike_median"] and math.isfinite(r["loss"])
    assert torch.equal(snaps[spike - 1], snaps[spike]) and not torch.equal(snaps[spike], snaps[spike + 1])
    assert "over 10 x the median" in caplog.text and "--skip-grad-spikes" in caplog.text
    off = tmp_path / "off"
    Trainer(make_cfg(corpus, off, steps=spike), callbacks=[ScaleLossAt({spike})]).train()
    assert not [r for r in metrics(off) if r["type"] == "train"][-1]["skipped"]


def test_grad_spike_rule_resumes_exactly_and_repeated_spikes_stop(corpus, tmp_path):
    """The recent gradient norms are part of the checkpoint: stop before the spike, resume, and the spike is skipped
    as in the straight run (bitwise equal weights); spikes in a row count toward --max-bad-steps."""
    from k3.train.trainer import SPIKE_MIN_HISTORY
    spike, steps = SPIKE_MIN_HISTORY + 2, SPIKE_MIN_HISTORY + 4
    a, b = tmp_path / "a", tmp_path / "b"
    cb = lambda: [ScaleLossAt({spike})]
    Trainer(make_cfg(corpus, a, steps=steps, skip_grad_spikes=10.0), callbacks=cb()).train()
    Trainer(make_cfg(corpus, b, steps=steps, stop_at=spike - 1, skip_grad_spikes=10.0), callbacks=cb()).train()
    st = torch.load(os.path.join(latest_checkpoint(str(b)), "trainer_state.pt"), weights_only=True)
    assert len(st["grad_norm_window"]) == spike - 1
    Trainer(make_cfg(corpus, b, steps=steps, resume=True, skip_grad_spikes=10.0), callbacks=cb()).train()
    ra = [r for r in metrics(a) if r["type"] == "train"]
    rb = [r for r in metrics(b) if r["type"] == "train"]
    assert [r["skipped"] for r in ra] == [r["skipped"] for r in rb] and ra[spike - 1]["skipped"]
    from k3.checkpoint import load_state_dict
    sa, sb = load_state_dict(str(a / "final")), load_state_dict(str(b / "final"))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(TrainingError, match=r"NaN/inf \(or a --skip-grad-spikes spike\) for 2 consecutive"):
        Trainer(make_cfg(corpus, tmp_path / "c", steps=steps, max_bad_steps=1, skip_grad_spikes=10.0),
                callbacks=[ScaleLossAt({spike, spike + 1})]).train()
    for bad in (1.0, 0.5, float("nan"), "10"):
        with pytest.raises(K3ConfigError, match="--skip-grad-spikes"):
            make_cfg(corpus, tmp_path / "d", skip_grad_spikes=bad).validate()


def test_on_step_record_fields_are_logged(corpus, tmp_path):
    """Fields a callback adds in on_step_record reach every train row of metrics.jsonl (and the history);
    on_step_end runs after the row is written."""
    out = tmp_path / "run"

    class Tag(Callback):
        def on_step_record(self, trainer, rec):
            rec["probe"] = 10.0 * rec["step"]

        def on_step_end(self, trainer, rec):
            assert rec["probe"] == 10.0 * trainer.step
    trainer = Trainer(make_cfg(corpus, out, steps=3), callbacks=[Tag()])
    trainer.train()
    tr = [r for r in metrics(out) if r["type"] == "train"]
    assert [r["step"] for r in tr] == [1, 2, 3]
    assert [r.get("probe") for r in tr] == [10.0, 20.0, 30.0]
    assert [r["probe"] for r in trainer.history] == [10.0, 20.0, 30.0]


def test_ctrl_c_saves_and_resumes(corpus, tmp_path, capsys):
    """Ctrl-C (KeyboardInterrupt) after a step or in the middle of one: a checkpoint of the last completed step,
    from which the run continues exactly."""
    ref = tmp_path / "ref"
    Trainer(make_cfg(corpus, ref, steps=4)).train()
    out = tmp_path / "run"

    class CtrlC(Callback):
        def on_step_end(self, trainer, rec):
            if rec["step"] == 2:
                raise KeyboardInterrupt
    s = Trainer(make_cfg(corpus, out, steps=4), callbacks=[CtrlC()]).train()
    assert s["status"] == "interrupted" and "interrupted at step 2" in capsys.readouterr().out
    assert [st for st, _ in find_checkpoints(str(out))] == [2]
    s = Trainer(make_cfg(corpus, out, steps=4, resume=True)).train()
    assert s["status"] == "completed" and s["step"] == 4
    assert train_losses(out) == train_losses(ref)

    class CtrlCMidStep(Callback):  # during the forward/backward of step 3
        def on_loss(self, trainer, loss):
            if trainer.step == 2:
                raise KeyboardInterrupt
            return loss
    out2 = tmp_path / "run2"
    s = Trainer(make_cfg(corpus, out2, steps=4), callbacks=[CtrlCMidStep()]).train()
    assert s["status"] == "interrupted" and [st for st, _ in find_checkpoints(str(out2))] == [2]
    Trainer(make_cfg(corpus, out2, steps=4, resume=True)).train()
    assert train_losses(out2) == train_losses(ref)


def test_cli_end_to_end(corpus, tmp_path, monkeypatch):
    from k3.cli import main
    monkeypatch.setenv("K3_CACHE", corpus["cache"])
    out = tmp_path / "cli"
    cfg = tmp_path / "micro.json"
    K3Config.from_preset("tiny", **corpus["model"]).save_json(str(cfg))
    args = ["train", "--config", str(cfg), "--steps", "2", "--batch-tokens", "128", "--stages", "64:1",
            "--out", str(out), "--data", *corpus["data"], "--no-progress", "--no-tensorboard", "--no-samples",
            "--val-tokens", "128", "--balancer", "sign", "--grad-accum", "2", "--lr", "0.01"]
    assert main(args) == 0
    saved = json.load(open(out / "train_config.json"))
    assert saved["grad_accum"] == 2 and saved["balancer"] == "sign" and saved["steps"] == 2
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--no-progress"]) == 0
    assert [r["step"] for r in metrics(out) if r["type"] == "train"] == [1, 2, 3]
    assert json.load(open(out / "train_config.json"))["grad_accum"] == 2


def test_recall_batch():
    ids, qpos, ans, cands = recall_batch(10, 100, n_examples=3, n_pairs=5)
    assert ids.shape == (3, 20) and qpos.shape == ans.shape == (3, 5)
    for b in range(3):
        keys, vals = ids[b, 0:10:2].tolist(), ids[b, 1:10:2].tolist()
        for q, a in zip(qpos[b].tolist(), ans[b].tolist()):
            assert vals[keys.index(int(ids[b, q]))] == a and ids[b, q + 1] == a
    assert torch.equal(recall_batch(10, 100, 3, 5)[0], ids)


def test_bf16_params_with_fp32_masters(corpus, tmp_path):
    """--param-dtype bf16: bf16 weights, the routing bias fp32, fp32 masters and moments in the optimizer state;
    the loss falls, and a stop + resume reproduces the straight run bitwise (masters included)."""
    a, b = tmp_path / "a", tmp_path / "b"
    t = Trainer(make_cfg(corpus, a, steps=6, param_dtype="bf16"))
    t.train()
    assert t.model.model.embed_tokens.weight.dtype == torch.bfloat16
    biases = [m.e_score_correction_bias for m in t.model.modules() if hasattr(m, "e_score_correction_bias")]
    assert biases and all(x.dtype == torch.float32 for x in biases)
    # the release's storage dtypes (architecture.md §2): A_log, dt_bias, the short convs and KDA's o_norm stay fp32
    from k3.checkpoint import is_fp32_key
    kept = {n: p.dtype for n, p in t.model.named_parameters() if is_fp32_key(n)}
    assert any("A_log" in n for n in kept) and any("conv1d" in n for n in kept) and any("o_norm" in n for n in kept)
    assert all(d == torch.float32 for d in kept.values())
    assert all(p.dtype == torch.bfloat16 for n, p in t.model.named_parameters() if n not in kept)
    Trainer(make_cfg(corpus, b, steps=6, stop_at=3, param_dtype="bf16")).train()
    Trainer(make_cfg(corpus, b, steps=6, resume=True, param_dtype="bf16")).train()
    la, lb = train_losses(a), train_losses(b)
    assert la == lb, (la, lb)
    assert all(math.isfinite(x) for x in la) and la[-1] < la[0], la
    st = torch.load(os.path.join(latest_checkpoint(str(b)), "trainer_state.pt"), weights_only=True)
    masters = [v["master"] for v in st["optimizer"]["state"].values() if "master" in v]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    with pytest.raises(K3ConfigError, match="--param-dtype"):
        make_cfg(corpus, tmp_path / "c", param_dtype="fp16").validate()


def test_param_dtype_auto_is_bf16_on_cuda_only():
    from k3.train.trainer import resolve_param_dtype, TrainConfig
    assert TrainConfig().param_dtype == "auto"
    assert resolve_param_dtype("auto", "cpu") == "fp32"
    assert resolve_param_dtype("auto", torch.device("cuda", 0)) == "bf16"
    assert resolve_param_dtype("fp32", "cuda") == "fp32" and resolve_param_dtype("bf16", "cpu") == "bf16"
    with pytest.raises(K3ConfigError, match="auto, fp32 or bf16"):
        resolve_param_dtype("half", "cpu")
