"""`k3 sft` and `k3 rl` end to end on a tiny saved checkpoint: metrics rows (strict JSON), checkpoints, exact
resume, safety hooks in the loop, clear errors for bad flags."""
import json
import os

import pytest

from k3.cli import main

TIMING = ("rollout_tokens_per_s", "train_tokens_per_s", "rollout_s", "train_s", "tokens_per_s", "step_time",
          "eval_time", "seconds")


def _strict(line):
    def bad(c):
        raise ValueError(f"non-strict JSON constant {c}")
    return json.loads(line, parse_constant=bad)


def _rows(path):
    with open(path) as f:
        return [_strict(ln) for ln in f if ln.strip()]


def _no_timing(row):
    return {k: v for k, v in row.items() if k not in TIMING}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, make_tiny_model):
    """A tiny model + a 768-token BPE (tokenizer.json) with the K3 chat tokens, saved as a checkpoint."""
    from k3.rl.sft_data import builtin_sft_set
    from k3.tokenizer import TOY_CORPUS
    from k3.train.data import HFTokenizer, train_tokenizer
    d = str(tmp_path_factory.mktemp("rl_cli") / "ckpt")
    docs = [TOY_CORPUS] * 3 + [json.dumps(c) for c in builtin_sft_set(4)]
    tok = HFTokenizer(train_tokenizer(docs, vocab_size=768))
    make_tiny_model(tok.vocab_size, tok.eos_id, tok.pad_id, tok.bos_id).save_pretrained(d, tokenizer=tok)
    return d


SFT = ["--per-task", "3", "--seq-len", "512", "--batch-tokens", "1024", "--threads", "1", "--no-progress",
       "--no-tensorboard", "--val-tokens", "512", "--eval-every", "0"]
RL = ["--env", "calculator", "--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "6",
      "--max-turns", "2", "--threads", "1", "--lr", "1e-3", "--no-plot"]


def test_sft_runs_and_resumes_exactly(tiny_ckpt, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["sft", "--ckpt", tiny_ckpt, "--out", a, "--steps", "3", *SFT]) == 0
    rows = [r for r in _rows(os.path.join(a, "metrics.jsonl")) if r["type"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows)
    assert os.path.isfile(os.path.join(a, "final", "tokenizer.json"))
    with open(os.path.join(a, "train_config.json")) as f:
        tc = json.load(f)
    assert tc["task"] == "sft" and tc["init_from"] == tiny_ckpt
    # interrupted after step 2, resumed: step 3 equals the uninterrupted run's
    assert main(["sft", "--ckpt", tiny_ckpt, "--out", b, "--steps", "3", "--stop-at", "2", *SFT]) == 0
    assert main(["sft", "--out", b, "--steps", "3", "--resume", "--threads", "1", "--no-progress"]) == 0
    rb = [r for r in _rows(os.path.join(b, "metrics.jsonl")) if r["type"] == "train"]
    assert [r["step"] for r in rb] == [1, 2, 3]
    assert _no_timing(rb[2]) == _no_timing(rows[2])


def test_sft_loss_is_on_assistant_tokens_only(tiny_ckpt):
    from k3.rl.sft_data import IGNORE_INDEX, build_sft_data
    from k3.tokenizer import load_tokenizer
    tok = load_tokenizer(tiny_ckpt)
    data = build_sft_data(tok, 512, 2, data=None, n_per_task=2, tasks=["calculator"])
    b = data.train.next_batch(512, 2)
    ids, lab = b["input_ids"][0].tolist(), b["labels"][0].tolist()
    tgt = [t for t in lab if t != IGNORE_INDEX]
    assert 0 < len(tgt) < len(ids) / 3
    text = tok.decode(tgt)
    assert "calculator" in text and "What is" not in text and "precise assistant" not in text


def test_rl_runs_metrics_and_exact_resume(tiny_ckpt, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["rl", "--ckpt", tiny_ckpt, "--out", a, "--steps", "2", "--eval-prompts", "2", *RL]) == 0
    rows = _rows(os.path.join(a, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert {"step", "reward_mean", "reward_std", "kl", "entropy", "clip_frac", "rollout_tokens_per_s",
                "train_tokens_per_s"} <= set(r)
        assert r["trajectories"] == 4 and r["ratio_min"] == 1.0 == r["ratio_max"]   # first epoch on-policy
    audit = _rows(os.path.join(a, "audit.jsonl"))
    assert len(audit) == 8 and {x["step"] for x in audit} == {1, 2} and "prompt" in audit[0]
    ev = _rows(os.path.join(a, "eval.jsonl"))
    assert [e["when"] for e in ev] == ["start", "end"]
    assert os.path.isdir(os.path.join(a, "final")) and os.path.isdir(os.path.join(a, "checkpoints", "step-00000002"))
    # stop after step 1 (checkpoint), resume: step 2 is the same row as in the uninterrupted run
    assert main(["rl", "--ckpt", tiny_ckpt, "--out", b, "--steps", "2", "--stop-at", "1", *RL]) == 0
    assert not os.path.exists(os.path.join(b, "final"))
    assert main(["rl", "--out", b, "--resume", "--threads", "1"]) == 0
    rb = _rows(os.path.join(b, "metrics.jsonl"))
    assert [r["step"] for r in rb] == [1, 2]
    assert _no_timing(rb[1]) == _no_timing(rows[1])
    assert _no_timing(rb[0]) == _no_timing(rows[0])


def test_rl_filter_and_review_in_the_loop(tiny_ckpt, tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"name": "anything", "type": "regex", "pattern": "(?s).|^$"}]))
    run = str(tmp_path / "r")
    assert main(["rl", "--ckpt", tiny_ckpt, "--out", run, "--steps", "1", "--filter-rules", str(rules),
                 "--review-every", "1", "--review-timeout", "0", *RL]) == 0
    row = _rows(os.path.join(run, "metrics.jsonl"))[0]
    assert row["filtered"] == 4 and row["reward_mean"] == 0.0
    assert row["review"] == "rejected" and "grad_norm" not in row       # a rejected batch is not trained on
    audit = _rows(os.path.join(run, "audit.jsonl"))
    assert all(x["filter"]["blocked"] and x["filter"]["rules"] == ["anything"] for x in audit)
    assert os.path.isfile(os.path.join(run, "review", "step-1.jsonl"))


def test_rl_skip_uniform_groups(tiny_ckpt, tmp_path):
    """--skip-uniform-groups: groups whose rewards are all equal (here all 0: an untrained model) are not trained
    on -- no optimizer step -- while the row still reports every rollout; the summary carries the eval's
    standard errors and the paired before/after difference."""
    from k3.rl.trainer import RLConfig, RLRunner
    run = str(tmp_path / "u")
    s = RLRunner(RLConfig(ckpt=tiny_ckpt, env="calculator", out_dir=run, steps=1, group_size=2, prompts_per_step=2,
                          max_new_tokens_per_turn=6, max_turns=2, threads=1, lr=1e-3, plot=False,
                          skip_uniform_groups=True, eval_prompts=2)).run()
    row = _rows(os.path.join(run, "metrics.jsonl"))[0]
    assert row["reward_mean"] == 0.0 and row["trajectories"] == 4
    assert row["groups_trained"] == 0 and "grad_norm" not in row and row["train_s"] == 0.0
    assert s["eval_prompts"] == 2 and s["eval_delta"] == 0.0 and s["eval_stderr_start"] == 0.0
    with open(os.path.join(run, "rl_config.json")) as f:
        assert json.load(f)["skip_uniform_groups"] is True


def test_rl_lr_warmup():
    from k3.errors import K3ConfigError
    from k3.rl.trainer import RLConfig, RLRunner
    r = RLRunner(RLConfig(lr=1e-3, warmup_steps=4))
    assert [r.lr_at(s) for s in (1, 2, 4, 9)] == [2.5e-4, 5e-4, 1e-3, 1e-3]
    assert RLRunner(RLConfig(lr=1e-3)).lr_at(1) == 1e-3
    with pytest.raises(K3ConfigError, match="--warmup-steps"):
        RLConfig(ckpt="x", warmup_steps=-1).validate()
    with pytest.raises(K3ConfigError, match="--train-dtype"):
        RLConfig(ckpt="x", train_dtype="fp16").validate()


@pytest.mark.parametrize("argv, msg", [
    (["rl", "--group-size", "0"], "--group-size"),
    (["rl", "--lr", "nan"], "--lr"),
    (["rl", "--tis-cap", "-1"], "--tis-cap"),
    (["rl", "--clip-low", "2"], "--clip-low"),
    (["rl", "--review-every", "x"], "--review-every"),
    (["rl", "--train-dtype", "fp16"], "--train-dtype"),
    (["sft", "--steps", "0"], "--steps"),
    (["sft", "--seq-len", "1"], "--seq-len"),
])
def test_bad_flags_are_argparse_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_bad_settings_are_named(tiny_ckpt, tmp_path, capsys):
    out = str(tmp_path / "x")
    cases = [(["rl", "--out", out, "--env", "calculator"], "--ckpt is required"),
             (["rl", "--ckpt", tiny_ckpt, "--out", out, "--env", "nope"], "--env 'nope'"),
             (["rl", "--ckpt", str(tmp_path), "--out", out], "--ckpt"),
             (["rl", "--ckpt", tiny_ckpt, "--out", out, "--filter-rules", str(tmp_path / "none.json")],
              "--filter-rules"),
             (["sft", "--out", out], "--ckpt is required"),
             (["sft", "--ckpt", tiny_ckpt, "--out", out, "--data", str(tmp_path / "none.jsonl")], "--data"),
             (["sft", "--ckpt", tiny_ckpt, "--out", out, "--tasks", "nope"], "--tasks")]
    for argv, msg in cases:
        assert main(argv) == 2, argv
        assert msg in capsys.readouterr().err, argv
    assert not os.path.exists(out)


def test_rl_resume_refuses_changed_settings(tiny_ckpt, tmp_path, capsys):
    run = str(tmp_path / "r")
    assert main(["rl", "--ckpt", tiny_ckpt, "--out", run, "--steps", "1", *RL]) == 0
    assert main(["rl", "--out", run, "--resume", "--lr", "0.5"]) == 2
    assert "--lr" in capsys.readouterr().err
    assert main(["rl", "--ckpt", tiny_ckpt, "--out", run, "--steps", "1", *RL]) == 2      # holds a run
    assert "--resume" in capsys.readouterr().err


def test_rl_train_params_and_sampled_eval(tiny_ckpt, tmp_path):
    """--train-params REGEX: only the matching parameters change (the others are frozen); --eval-samples: the
    sampled eval uses fixed sampler seeds (an untrained start and end give the same per-prompt rewards), so the
    paired difference is exactly 0 when nothing was trained."""
    import torch
    from k3.checkpoint import from_pretrained
    from k3.rl.trainer import RLConfig, RLRunner
    run = str(tmp_path / "p")
    s = RLRunner(RLConfig(ckpt=tiny_ckpt, env="calculator", out_dir=run, steps=1, group_size=2, prompts_per_step=2,
                          max_new_tokens_per_turn=6, max_turns=2, threads=1, lr=1e-2, plot=False,
                          train_params=r"^lm_head\.", eval_prompts=2, eval_samples=2,
                          skip_uniform_groups=True)).run()
    assert s["eval_samples"] == 2 and s["eval_sampled_delta"] == 0.0        # nothing trained: same samples
    assert s["eval_sampled_start"] == s["eval_sampled_end"]
    with open(os.path.join(run, "eval.jsonl")) as f:
        ev = [json.loads(ln) for ln in f]
    assert [e["samples"] for e in ev] == [2, 2] and all("sampled_reward_mean" in e for e in ev)
    # with every group kept (advantage 0 but an optimizer step), only lm_head may move
    run2 = str(tmp_path / "q")
    RLRunner(RLConfig(ckpt=tiny_ckpt, env="calculator", out_dir=run2, steps=1, group_size=2, prompts_per_step=2,
                      max_new_tokens_per_turn=6, max_turns=2, threads=1, lr=1e-2, plot=False, weight_decay=0.5,
                      train_params=r"^lm_head\.")).run()
    a = dict(from_pretrained(tiny_ckpt, dtype=torch.float32).named_parameters())
    b = dict(from_pretrained(os.path.join(run2, "final"), dtype=torch.float32).named_parameters())
    changed = {n for n in a if not torch.equal(a[n], b[n])}
    assert changed == {"lm_head.weight"}


def test_rl_train_params_errors(tiny_ckpt, tmp_path, capsys):
    from k3.errors import K3ConfigError
    from k3.rl.trainer import RLConfig, RLRunner
    with pytest.raises(K3ConfigError, match="--train-params"):
        RLConfig(ckpt=tiny_ckpt, train_params="(").validate()
    with pytest.raises(K3ConfigError, match="--train-params 'nothing_matches' matches no parameter"):
        RLRunner(RLConfig(ckpt=tiny_ckpt, out_dir=str(tmp_path / "e"), train_params="nothing_matches",
                          threads=1)).setup()
    assert main(["rl", "--ckpt", tiny_ckpt, "--out", str(tmp_path / "f"), "--train-params", "nothing"]) == 2
    assert "--train-params" in capsys.readouterr().err


def test_param_groups_first_match_and_errors(make_tiny_model):
    """param_groups: each parameter goes to the group of the first regex that matches its name, the rest to the
    default group at --lr; every group carries its base LR; a regex that matches nothing is refused."""
    from k3.errors import K3ConfigError
    from k3.rl.trainer import RLConfig, param_groups
    m = make_tiny_model(64, 1, 0, 2)
    params = list(m.parameters())
    gs = param_groups(m, params, 1e-5, {r"^model\.norm\.": 0.1, r"norm": 1e-3})
    names = {id(p): n for n, p in m.named_parameters()}
    by = {g["group_name"]: {names[id(p)] for p in g["params"]} for g in gs}
    assert by[r"^model\.norm\."] == {"model.norm.weight"}
    assert by["norm"] and all("norm" in n and n != "model.norm.weight" for n in by["norm"])
    assert by["default"] == {n for n, _ in m.named_parameters()} - by["norm"] - by[r"^model\.norm\."]
    assert [(g["lr"], g["base_lr"]) for g in gs] == [(0.1, 0.1), (1e-3, 1e-3), (1e-5, 1e-5)]
    assert sum(len(g["params"]) for g in gs) == len(params)
    with pytest.raises(K3ConfigError, match="--param-lr 'nothing' matches no trained parameter"):
        param_groups(m, params, 1e-5, {"nothing": 0.1})
    with pytest.raises(K3ConfigError, match="--param-lr"):
        RLConfig(ckpt=None, param_lrs={"x": -1.0}).validate()


def test_rl_param_lr_moves_only_its_group(tiny_ckpt, tmp_path, capsys):
    """--param-lr REGEX=LR: the matching parameters step at that LR (warm-up scaling it like --lr), the rest at
    --lr: with --lr 1e-30 and weight decay, only lm_head (LR 1e-2) changes; the metrics row's lr is --lr's."""
    import torch
    from k3.checkpoint import from_pretrained
    run = str(tmp_path / "g")
    assert main(["rl", "--ckpt", tiny_ckpt, "--out", run, "--steps", "2", "--group-size", "2",
                 "--prompts-per-step", "2", "--max-new-tokens", "6", "--max-turns", "2", "--threads", "1",
                 "--lr", "1e-30", "--param-lr", r"^lm_head\.=1e-2", "--weight-decay", "0.5", "--warmup-steps", "2",
                 "--no-plot"]) == 0
    with open(os.path.join(run, "rl_config.json")) as f:
        assert json.load(f)["param_lrs"] == {r"^lm_head\.": 1e-2}
    rows = _rows(os.path.join(run, "metrics.jsonl"))
    assert [r["lr"] for r in rows] == [0.5e-30, 1e-30]
    a = dict(from_pretrained(tiny_ckpt, dtype=torch.float32).named_parameters())
    b = dict(from_pretrained(os.path.join(run, "final"), dtype=torch.float32).named_parameters())
    assert {n for n in a if not torch.equal(a[n], b[n])} == {"lm_head.weight"}
    # lm_head decayed by (1 - 0.5e-2 * 0.5) then (1 - 1e-2 * 0.5): warm-up scales the group's LR too
    torch.testing.assert_close(b["lm_head.weight"], a["lm_head.weight"] * (1 - 0.25e-2) * (1 - 0.5e-2))
    # stopped after step 1 and resumed: the restored optimizer keeps each group's LR (step 2 decays lm_head the
    # same); a different --param-lr on --resume is refused
    args = ["rl", "--ckpt", tiny_ckpt, "--steps", "2", "--group-size", "2", "--prompts-per-step", "2",
            "--max-new-tokens", "6", "--max-turns", "2", "--threads", "1", "--lr", "1e-30", "--param-lr",
            r"^lm_head\.=1e-2", "--weight-decay", "0.5", "--warmup-steps", "2", "--no-plot"]
    r2 = str(tmp_path / "g2")
    assert main([*args, "--out", r2, "--stop-at", "1"]) == 0
    capsys.readouterr()
    assert main(["rl", "--out", r2, "--resume", "--param-lr", r"^lm_head\.=1e-3"]) == 2
    assert "--param-lr" in capsys.readouterr().err
    assert main(["rl", "--out", r2, "--resume", "--threads", "1"]) == 0
    c = dict(from_pretrained(os.path.join(r2, "final"), dtype=torch.float32).named_parameters())
    assert all(torch.equal(b[n], c[n]) for n in b)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["rl", "--ckpt", tiny_ckpt, "--out", str(tmp_path / "h"), "--param-lr", "x=-1"])
    assert "--param-lr: 'x=-1': must be > 0" in capsys.readouterr().err
    assert main(["rl", "--ckpt", tiny_ckpt, "--out", str(tmp_path / "h"), "--param-lr", "nothing=0.1"]) == 2
    assert "--param-lr 'nothing' matches no trained parameter" in capsys.readouterr().err


def test_rl_train_dtype(tiny_ckpt, tmp_path):
    """--train-dtype bf16 runs the training forwards under autocast (here on CPU) with fp32 weights; auto is fp32 on
    CPU; the choice is stored and a resume with another one is refused."""
    import torch
    from k3.errors import K3ConfigError
    from k3.rl.trainer import RLConfig, RLRunner, resume_rl_config
    run = str(tmp_path / "d")
    r = RLRunner(RLConfig(ckpt=tiny_ckpt, env="calculator", out_dir=run, steps=1, group_size=2, prompts_per_step=1,
                          max_new_tokens_per_turn=4, max_turns=1, threads=1, plot=False, train_dtype="bf16"))
    r.run()
    assert r.autocast_dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in r.model.parameters())
    row = _rows(os.path.join(run, "metrics.jsonl"))[0]
    assert row["groups_trained"] == 1 and row["ratio_min"] == 1.0 == row["ratio_max"]
    with pytest.raises(K3ConfigError, match="--train-dtype"):
        resume_rl_config(run, {"train_dtype": "fp32"})
    # a run stored before --train-dtype existed ran fp32: its resume stays fp32 (also on CUDA, where auto is bf16)
    cpath = os.path.join(run, "rl_config.json")
    with open(cpath) as f:
        stored = json.load(f)
    stored.pop("train_dtype")
    with open(cpath, "w") as f:
        json.dump(stored, f)
    assert resume_rl_config(run).train_dtype == "fp32"
    with pytest.raises(K3ConfigError, match="--train-dtype 'bf16' differs from the run's 'fp32'"):
        resume_rl_config(run, {"train_dtype": "bf16"})
    auto = RLRunner(RLConfig(ckpt=tiny_ckpt, out_dir=str(tmp_path / "e"), steps=1, threads=1, plot=False)).setup()
    assert auto.autocast_dtype is None                                      # auto on CPU: fp32


@pytest.mark.parametrize("env, opts", [("kv-lookup", ["--env-option", "num_lines=8", "--env-option", "hops=2"]),
                                       ("multi-tool", [])])
def test_rl_cli_on_the_other_builtin_envs(tiny_ckpt, tmp_path, env, opts):
    """`k3 rl --env kv-lookup / multi-tool` end to end from the CLI: a step, its metrics row and audited
    trajectories of that environment (the calculator runs above)."""
    run = str(tmp_path / env)
    argv = ["rl", "--ckpt", tiny_ckpt, "--out", run, "--steps", "1", *RL, "--env", env, *opts]
    assert main(argv) == 0
    row = _rows(os.path.join(run, "metrics.jsonl"))[0]
    assert row["step"] == 1 and row["trajectories"] == 4 and row["generated_tokens"] > 0
    audit = _rows(os.path.join(run, "audit.jsonl"))
    assert len(audit) == 4 and {a["env"] for a in audit} == {env}
    assert os.path.isdir(os.path.join(run, "final"))
