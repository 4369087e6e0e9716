"""`k3 sft` under torchrun (DistTrainer): the same SFT data as one process -- assistant-only labels, packed with
cu_seqlens -- split over the data-parallel ranks, the same per-step losses, and a resume on another world size.

The reference is `python -m k3.cli sft` on the same checkpoint; each rank runs `k3.cli.main([...])` through the
shared launcher (tests/parallel/launcher.py, tests/parallel/train_cli_cases.py)."""
import json
import os

import pytest

from launcher import run_dist
from test_torchrun_cli import metrics, ranks, single_process

QUIET = ["--no-progress", "--no-tensorboard", "--device", "cpu", "--threads", "1"]


@pytest.fixture(scope="module")
def sft_env(tmp_path_factory, micro_model_overrides):
    """The micro model (tests/conftest.py) + a 768-token BPE with the K3 chat tokens, saved as a checkpoint."""
    import torch
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.rl.sft_data import builtin_sft_set
    from k3.tokenizer import TOY_CORPUS
    from k3.train.data import HFTokenizer, train_tokenizer
    d = tmp_path_factory.mktemp("sft_dist")
    docs = [TOY_CORPUS] * 3 + [json.dumps(c) for c in builtin_sft_set(4)]
    tok = HFTokenizer(train_tokenizer(docs, vocab_size=768))
    cfg = K3Config.from_preset("tiny", **{**micro_model_overrides, "bos_token_id": tok.bos_id,
                                          "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id})
    torch.manual_seed(0)
    K3ForCausalLM(cfg).save_pretrained(str(d / "ckpt"), tokenizer=tok)
    mp = pytest.MonkeyPatch()
    mp.setenv("K3_CACHE", str(d / "cache"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        mp.delenv(k, raising=False)
    yield {"dir": d, "base": ["--ckpt", str(d / "ckpt"), "--tasks", "calculator", "--per-task", "4", "--seq-len",
                              "512", "--batch-tokens", "1024", "--eval-every", "0", "--val-tokens", "512",
                              *QUIET]}
    mp.undo()


def test_sft_dp_shard_2_trains_on_sft_batches_like_one_process_and_resumes(sft_env):
    d, base = sft_env["dir"], sft_env["base"]
    # 2 rows of 512 per step, one per rank (a calculator chat is ~370 tokens, ~90 of them the assistant's); 4 rows
    # per epoch: step 3 starts the second epoch, after the resume
    run = ["sft", *base, "--steps", "3"]
    ref = str(d / "ref")
    single_process([*run, "--out", ref])
    out = str(d / "dp2")
    res = run_dist("tests/parallel/train_cli_cases.py:train_cli_label_counts", 2,
                   {"argv": [*run, "--out", out, "--stop-at", "2", "--dp-shard", "2"]}, timeout=300)
    assert [r["rc"] for r in res] == [0, 0], res[0]["stderr"][-3000:]
    # SFT batches (assistant-only labels: many IGNORE_INDEX positions besides the row padding), every rank drawing
    # the same global batch; the ranks' supervised positions add up to the global count the loss is divided by
    g = res[0]["global_targets"]
    assert len(g) == 2 and res[1]["global_targets"] == g and res[1]["global_ignored"] == res[0]["global_ignored"]
    assert all(0.2 < f < 1.0 for f in res[0]["global_ignored"]), res[0]["global_ignored"]
    assert [a + b for a, b in zip(res[0]["local_targets"], res[1]["local_targets"])] == g
    assert all(n > 0 for r in res for n in r["local_targets"])
    ranks(1, ["sft", "--out", out, "--resume", "--threads", "1", "--no-progress"])   # 2 ranks -> 1
    (tr, ev), (rtr, rev) = metrics(out), metrics(ref)
    assert [r["step"] for r in tr] == [r["step"] for r in rtr] == [1, 2, 3]
    for a, b in zip(tr, rtr):
        for k in ("seq_len", "batch_rows", "tokens", "skipped"):
            assert a[k] == b[k], (k, a, b)
        for k in ("loss", "grad_norm", "lr", "epoch"):
            assert a[k] == pytest.approx(b[k], rel=2e-5), (k, a["step"], a[k], b[k])
    assert [r["step"] for r in ev] == [r["step"] for r in rev] and ev
    for a, b in zip(ev, rev):
        assert a["val_tokens"] == b["val_tokens"]
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=2e-5)
    with open(os.path.join(out, "train_config.json")) as f:
        assert json.load(f)["task"] == "sft"


# ------------------------------------------------------------------ the data resolution itself (no spawn)

def _sft_config(ckpt, out):
    from k3.train.config import TrainConfig
    return TrainConfig(task="sft", init_from=str(ckpt), out_dir=str(out), stages=[(512, 1.0)], tokens_per_step=1024,
                       device="cpu", threads=1, sft_tasks=["calculator"], sft_per_task=2, tensorboard=False)


class _Rank0:
    """What build_run_data reads of a DistTrainer, on a plain Trainer (one rank, no process group)."""
    is_rank0 = True

    def _barrier(self):
        pass


def _rank0_trainer(cfg, data=None):
    from k3.train.trainer import Trainer
    return type("T", (_Rank0, Trainer), {})(cfg, data=data)


def test_build_run_data_resolves_the_sft_data_as_one_process(sft_env, tmp_path):
    from k3.ops.loss import IGNORE_INDEX
    from k3.parallel.setup import build_run_data
    ckpt = sft_env["dir"] / "ckpt"
    t = _rank0_trainer(_sft_config(ckpt, tmp_path / "a"))
    data, _ = build_run_data(t, None, str(ckpt))
    b = data.train.next_batch(512, 2)
    assert float((b["labels"] == IGNORE_INDEX).float().mean()) > 0.5 and int(b["cu_seqlens"][-1]) == 1024
    assert type(data).__name__ == "SFTData"


def test_sft_without_a_tokenizer_is_the_same_error_in_both_trainers(sft_env, tmp_path):
    """A --ckpt without tokenizer.json: one clear K3ConfigError in one process and under torchrun (no crash in the
    SFT loader on a None tokenizer)."""
    import shutil
    from k3.errors import K3ConfigError
    from k3.parallel.setup import build_run_data
    from k3.train.trainer import Trainer
    bare = tmp_path / "bare"
    shutil.copytree(sft_env["dir"] / "ckpt", bare, ignore=shutil.ignore_patterns("tokenizer*"))
    msg = "k3 sft needs a tokenizer: --tokenizer, or --ckpt with a tokenizer.json"
    with pytest.raises(K3ConfigError, match=msg):
        Trainer(_sft_config(bare, tmp_path / "one")).setup()
    assert not (tmp_path / "one").exists()
    t = _rank0_trainer(_sft_config(bare, tmp_path / "dist"))
    with pytest.raises(K3ConfigError, match=msg):
        build_run_data(t, None, t._tokenizer_path(None, str(bare)))
    # an external factory: one process needs the tokenizer too; under torchrun it may bring its own (vision tasks)
    seen = []

    def factory(tok, seq_len, batch_size, seed):
        seen.append(tok)
        raise RuntimeError("stop here")
    with pytest.raises(K3ConfigError, match="an external data source needs a tokenizer"):
        Trainer(_sft_config(bare, tmp_path / "ext"), data=factory).setup()
    with pytest.raises(RuntimeError, match="stop here"):
        build_run_data(_rank0_trainer(_sft_config(bare, tmp_path / "ext2"), data=factory), None, None)
    assert seen == [None]
