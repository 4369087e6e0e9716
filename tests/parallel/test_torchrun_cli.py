"""`k3 train` under torchrun (k3/parallel/training.py) and `k3 plan`, through the real CLI entry point.

Each rank runs `k3.cli.main([...])` with torchrun's RANK / WORLD_SIZE / LOCAL_RANK (tests/parallel/launcher.py), on a
micro model and a small corpus; the single-process reference is `python -m k3.cli train` with the same flags. The
same losses (train loss and gradient norm per step, validation loss) up to fp32 reduction order; a run stopped on
one mesh resumes on another and continues exactly; every bad mesh is refused before any work."""
import json
import os
import subprocess
import sys

import pytest

from launcher import ROOT, run_dist

WORKER = "tests/parallel/train_cli_cases.py:train_cli"
QUIET = ["--no-progress", "--no-tensorboard", "--no-samples", "--device", "cpu", "--threads", "1"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """micro config + corpus + a tokenizer cache shared by every run (K3_CACHE, inherited by the ranks)."""
    from launcher import _load
    d = tmp_path_factory.mktemp("train_cli")
    cfg = _load("tests/parallel/cases.py:micro_config")(vocab_size=1024, pad_token_id=1023)
    cfg.save_json(str(d / "micro.json"))
    (d / "corpus.txt").write_text(fixed_corpus())
    mp = pytest.MonkeyPatch()
    mp.setenv("K3_CACHE", str(d / "cache"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        mp.delenv(k, raising=False)
    yield {"dir": d, "base": ["--config", str(d / "micro.json"), "--data", str(d / "corpus.txt"), "--split-sections",
                              "--batch-tokens", "256", "--eval-every", "0", "--val-tokens", "128", *QUIET]}
    mp.undo()


def fixed_corpus(sections: int = 250, seed: int = 0) -> str:
    """A deterministic prose-like corpus (~60 KB, blank-line sections). Fixed on purpose: a corpus read from the
    repository's own source files changed whenever those files were edited, and with it every run these tests
    compare."""
    import random
    rng = random.Random(seed)
    words = ("the rank shard mesh expert token layer state sequence slice gradient optimizer checkpoint step "
             "batch loss model weight tensor process group device memory context parallel data sum mean norm "
             "update resume save load split gather reduce scatter row column head query key value latent "
             "document boundary offset chunk kernel window block router bias load balance").split()
    out = []
    for _ in range(sections):
        lines = []
        for _ in range(rng.randint(2, 6)):
            s = " ".join(rng.choice(words) for _ in range(rng.randint(5, 14)))
            lines.append(s[0].upper() + s[1:] + rng.choice((".", ".", "!", "?", ":")))
        out.append("\n".join(lines))
    return "\n\n".join(out)


def single_process(argv):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "k3.cli", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def ranks(n, argv):
    res = run_dist(WORKER, n, {"argv": list(argv)}, timeout=300)
    assert [r["rc"] for r in res] == [0] * n, res[0]["stderr"][-3000:]
    return res


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return ([r for r in recs if r["type"] == "train"], [r for r in recs if r["type"] == "eval"])


def assert_same_run(out, ref, rtol=2e-5):
    (tr, ev), (rtr, rev) = metrics(out), metrics(ref)
    assert [r["step"] for r in tr] == [r["step"] for r in rtr]
    for a, b in zip(tr, rtr):
        for k in ("seq_len", "batch_rows", "tokens", "stage", "skipped"):
            assert a[k] == b[k], (k, a, b)
        for k in ("loss", "grad_norm", "lr", "max_logit"):
            assert a[k] == pytest.approx(b[k], rel=rtol), (k, a["step"], a[k], b[k])
    assert [r["step"] for r in ev] == [r["step"] for r in rev]
    for a, b in zip(ev, rev):
        assert a["val_tokens"] == b["val_tokens"]
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=rtol)


def distcp_files(ckpt):
    return sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))


def test_dp_shard_2_matches_one_process_and_resumes_on_one_rank(env):
    d, base = env["dir"], env["base"]
    run = base + ["--steps", "3", "--stages", "64", "--grad-accum", "2",   # 2 micro-batches of 2 rows
                  "--skip-grad-spikes", "10"]                               # its window goes through DCP
    single_process(["train", *run, "--out", str(d / "ref")])
    out = str(d / "dp2")
    ranks(2, ["train", *run, "--out", out, "--dp-shard", "2", "--stop-at", "2"])
    ck = os.path.join(out, "checkpoints")
    assert os.listdir(ck) == ["step-2"] and len(distcp_files(os.path.join(ck, "step-2"))) == 2
    import torch
    extra = torch.load(os.path.join(ck, "step-2", "extra.pt"), weights_only=True)
    ref_norms = [r["grad_norm"] for r in metrics(str(d / "ref"))[0][:2]]   # the global norms one process sees
    assert extra["grad_norm_window"] == pytest.approx(ref_norms, rel=2e-5)
    ranks(1, ["train", "--out", out, "--resume", "--threads", "1"])       # another world size: 2 -> 1
    assert sorted(os.listdir(ck)) == ["step-2", "step-3"] and len(distcp_files(os.path.join(ck, "step-3"))) == 1
    assert_same_run(out, str(d / "ref"))
    from k3.checkpoint import from_pretrained   # final/ in the single-process layout, the same weights
    a, b = from_pretrained(os.path.join(out, "final")), from_pretrained(str(d / "ref" / "final"))
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        # AdamW's embedding / lm_head within 5e-5, as in test_fsdp.py (fp32 reduction order amplified by Adam's
        # 1/sqrt(v) on a rare token's tiny gradient); the Muon matrices within 1e-5
        adamw = n in ("model.embed_tokens.weight", "lm_head.weight")
        torch.testing.assert_close(p, q, rtol=1e-4, atol=5e-5 if adamw else 1e-5, msg=n)


def test_mtp_losses_logged_and_equal_to_one_process(env):
    """An MTP block (num_nextn_predict_layers=1) at --dp-shard 2: the step records carry main_loss, mtp_loss and
    mtp_losses, the evaluations val_mtp_loss, all equal to one process's. The reference runs --grad-accum 2 (its
    micro-batches are the ranks' rows): each depth's loss is weighted by the next-token counts per micro-batch /
    rank, so the runs agree exactly when the two split the rows alike."""
    from launcher import _load
    d, base = env["dir"], env["base"]
    cfg = _load("tests/parallel/cases.py:micro_config")(vocab_size=1024, pad_token_id=1023,
                                                          num_nextn_predict_layers=1)
    cfg.save_json(str(d / "micro_mtp.json"))
    run = base + ["--config", str(d / "micro_mtp.json"), "--steps", "2", "--stages", "64"]
    single_process(["train", *run, "--grad-accum", "2", "--out", str(d / "ref_mtp")])
    out = str(d / "mtp2")
    ranks(2, ["train", *run, "--out", out, "--dp-shard", "2"])
    (tr, ev), (rtr, rev) = metrics(out), metrics(str(d / "ref_mtp"))
    assert [r["step"] for r in tr] == [r["step"] for r in rtr] == [1, 2] and len(ev) == len(rev) == 2
    for a, b in zip(tr, rtr):   # (not max_logit: with --grad-accum the single process keeps the last micro-batch's)
        assert len(a["mtp_losses"]) == 1 and a["mtp_loss"] == pytest.approx(a["mtp_losses"][0])
        for k in ("loss", "grad_norm", "main_loss", "mtp_loss"):
            assert a[k] == pytest.approx(b[k], rel=2e-5), (k, a, b)
        assert a["mtp_losses"] == pytest.approx(b["mtp_losses"], rel=2e-5)
        assert a["loss"] > a["main_loss"]   # the objective adds lambda * the MTP loss
    for a, b in zip(ev, rev):
        assert a["val_tokens"] == b["val_tokens"]
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=2e-5)
        # the validation rows are one forward in one process, one per rank here: each forward's depth loss is
        # weighted by its next-token count (k3.train.probes.evaluate), not the depth's own, hence a looser match
        assert a["val_mtp_loss"] == pytest.approx(b["val_mtp_loss"], rel=1e-4)


@pytest.mark.slow
def test_cp_2_over_a_stage_switch_resumes_on_a_dp_mesh(env):
    """--cp 2 for both stages (32 then 64 tokens per row, 256 tokens per step), stopped at the switch and resumed
    at --dp-shard 2 (no CP): the single-process run's numbers."""
    d, base = env["dir"], env["base"]
    run = base + ["--steps", "4", "--stages", "32:0.5,64:0.5"]
    single_process(["train", *run, "--out", str(d / "ref_st")])
    out = str(d / "cp2")
    ranks(2, ["train", *run, "--out", out, "--cp", "2", "--stop-at", "2"])
    ranks(2, ["train", "--out", out, "--resume", "--threads", "1", "--dp-shard", "2"])
    assert_same_run(out, str(d / "ref_st"))


@pytest.mark.slow
def test_dp_shard_4_ep_2_matches_one_process(env):
    d, base = env["dir"], env["base"]
    run = base + ["--steps", "2", "--stages", "64"]
    single_process(["train", *run, "--out", str(d / "ref4")])
    ranks(4, ["train", *run, "--out", str(d / "ep2"), "--dp-shard", "4", "--ep", "2"])
    assert_same_run(str(d / "ep2"), str(d / "ref4"))


# ------------------------------------------------------------------------------------------ bad meshes (no spawn)

@pytest.mark.parametrize("world, flags, msg", [
    (4, ["--dp-shard", "3"], r"dp_replicate \* dp_shard \* cp = 1 \* 3 \* 1 = 3 != world size 4"),
    (2, ["--dp-replicate", "2", "--dp-shard", "2"], r"= 4 != world size 2"),
    (4, ["--cp", "3"], r"--dp-shard: -1 \(fill the world\) needs dp_replicate \* cp = 3 to divide"),
    (4, ["--ep", "3"], r"--ep: expert parallelism is folded .* ep=3 must divide dp_shard \* cp"),
    (6, ["--ep", "3"], r"--ep: num_experts = 8 is not divisible by ep = 3"),
    (3, [], r"--batch-tokens 256 at stage seq_len 64 gives 4 rows per step, .* 3 data-parallel ranks"),
    (2, ["--grad-accum", "4"], r"--grad-accum 4 micro-batches x 2 data-parallel ranks"),
])
def test_bad_mesh_is_refused_before_any_work(env, monkeypatch, capsys, world, flags, msg):
    import re
    from k3.cli import main
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    out = env["dir"] / f"bad-{world}-{'-'.join(flags)}"
    assert main(["train", *env["base"], "--steps", "2", "--stages", "64", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert re.search(msg, err), err
    assert not out.exists()          # nothing written, no process group started
    import torch.distributed as dist
    assert not dist.is_initialized()


def test_mesh_flags_need_torchrun_and_a_whole_environment(env, monkeypatch, capsys):
    from k3.cli import main
    out = str(env["dir"] / "nope")
    argv = ["train", *env["base"], "--steps", "2", "--stages", "64", "--out", out]
    assert main(argv + ["--dp-shard", "2"]) == 2
    assert "--dp-shard 2: mesh flags need several processes; launch with torchrun" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    assert main(argv) == 2
    assert "RANK and WORLD_SIZE must both be set" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(argv) == 2
    assert "RANK=1 is not below WORLD_SIZE=1" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "x")
    assert main(argv) == 2
    assert "WORLD_SIZE must be an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv + ["--ep", "0"])
    assert "--ep: must be >= 1" in capsys.readouterr().err
    assert not os.path.exists(out)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    ck = os.path.join(out, "checkpoints", "step-2")          # a run written under torchrun (DCP checkpoints)
    os.makedirs(ck)
    open(os.path.join(ck, ".metadata"), "wb").close()
    assert main(["train", "--out", out, "--resume"]) == 2
    assert "continue it under torchrun, on any number of processes" in capsys.readouterr().err
    assert os.path.exists(os.path.join(ck, ".metadata"))


# ------------------------------------------------------------------------------------------------ k3 plan

def test_plan_kimi_k3_recommends_a_mesh_json(capsys):
    from k3.cli import main
    assert main(["plan", "--config", "kimi-k3", "--gpus", "512", "--gpu-memory", "141GB", "--seq-len", "8192",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["gpus"] == 512 and d["gpu_memory"] == 141e9 and d["total_params"] > 2.7e12
    rec = d["recommended"]
    assert rec["fits"] and rec["total_bytes"] <= 141e9 and d["recommended_mesh"].startswith("dp_")
    assert 384 % rec["ep"] == 0 and rec["dp_replicate"] * rec["dp_shard"] == 512
    assert d["recommended_flags"].startswith(("--dp-shard", "--dp-replicate"))
    assert any(not c["fits"] for c in d["candidates"]) and all("mesh" in c for c in d["candidates"])


def test_plan_text_fits_and_does_not_fit(env, capsys):
    from k3.cli import main
    cfg = str(env["dir"] / "micro.json")
    assert main(["plan", "--config", cfg, "--gpus", "4", "--gpu-memory", "80GiB", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "recommended on 4 GPUs of 80 GiB: dp_shard=4" in out and "torchrun" in out and "--dp-shard 4" in out
    assert main(["plan", "--config", cfg, "--gpus", "2", "--gpu-memory", "1MB", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "none fits" in out and "does not fit" in out
    with pytest.raises(SystemExit):
        main(["plan", "--gpus", "8", "--gpu-memory", "lots"])
    assert "expected a size such as 141GB" in capsys.readouterr().err


@pytest.mark.slow
def test_real_torchrun_launch(env):
    """`python -m torch.distributed.run --standalone --nproc-per-node 2 -m k3.cli train --dp-shard 2`: torchrun's
    own rendezvous and env:// process group (the tests above pre-initialise the group through the launcher)."""
    d, base = env["dir"], env["base"]
    run = base + ["--steps", "2", "--stages", "64"]
    single_process(["train", *run, "--out", str(d / "ref_tr")])
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        e.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "k3.cli", "train", *run, "--out", str(d / "torchrun"), "--dp-shard", "2"],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("k3 train: completed") == 1          # rank 0 alone prints the summary
    assert_same_run(str(d / "torchrun"), str(d / "ref_tr"))


@pytest.mark.slow
def test_ctrl_c_on_one_rank_stops_every_rank_at_the_same_step(env):
    d, base = env["dir"], env["base"]
    run = base + ["--steps", "3", "--stages", "64"]
    single_process(["train", *run, "--out", str(d / "ref_c")])
    out = str(d / "ctrl_c")
    res = run_dist("tests/parallel/train_cli_cases.py:train_cli_ctrl_c", 2,
                   {"argv": ["train", *run, "--out", out, "--dp-shard", "2"], "signal_rank": 1, "after_step": 1},
                   timeout=300)
    assert [r["rc"] for r in res] == [130, 130], res[0]["stderr"][-3000:]
    assert os.listdir(os.path.join(out, "checkpoints")) == ["step-1"]    # agreed on before step 2 began
    ranks(2, ["train", "--out", out, "--resume", "--threads", "1"])
    assert_same_run(out, str(d / "ref_c"))


def test_a_failing_rank_leaves_its_message_for_torchrun(tmp_path, monkeypatch, capsys):
    """torchrun's failure summary prints the rank's TORCHELASTIC_ERROR_FILE (else `error_file: <N/A>` and no
    message): k3.cli.main writes it for the error that ends the command."""
    from k3.cli import main
    err = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(err))
    assert main(["train", "--preset", "no_such_preset", "--out", str(tmp_path / "run")]) == 2
    assert "unknown preset 'no_such_preset'" in capsys.readouterr().err
    msg = json.loads(err.read_text())["message"]
    assert msg["message"].startswith("K3ConfigError: unknown preset 'no_such_preset'")
    assert "Traceback" in msg["extraInfo"]["py_callstack"]
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    err.unlink()
    assert main(["train", "--preset", "no_such_preset", "--out", str(tmp_path / "run")]) == 2
    assert not err.exists()                                    # outside torchrun nothing is written
