"""`k3 train --task vision-synth` under torchrun (k3.parallel.vision_train -> DistTrainer with the multimodal model,
k3.parallel.vision): 2 gloo ranks give one rank's losses (train loss, gradient norm, validation loss), also on a
step where only one rank's rows hold images (the other runs the tower on a blank image: no deadlock), and with an
MTP block (main_loss / mtp_loss / mtp_losses, val_mtp_loss); --cp 2 with images is refused.

The rank function lives in this file (run_dist loads it in each child by path); it parses the real `k3 train`
arguments and calls `run_train_dist`, what `k3 train --task vision-synth` runs under torchrun."""
import json
import os

import pytest

from launcher import run_dist  # noqa: E402  (tests/parallel/conftest.py puts this folder on sys.path)

HERE = "tests/parallel/test_vision_train.py"
# 4 rows of 64 placeholder-level tokens per step (84 px images: 9 image tokens each, one example per row)
BASE = ["train", "--task", "vision-synth", "--steps", "2", "--batch-tokens", "256", "--stages", "64",
        "--eval-every", "0", "--val-tokens", "128", "--no-progress", "--no-tensorboard", "--device", "cpu",
        "--threads", "1", "--save-every", "0"]


def vision_train(argv: list, text_only_rows_at_step: int = 0) -> dict:
    """`k3 train <argv>` for a vision task on this rank. `text_only_rows_at_step` N > 0: step N's batch loses the
    images of its second half of rows (their placeholders become ordinary tokens), so at 2 ranks rank 1 has none."""
    from k3.cli import build_parser
    from k3.train.cli import build_train_config
    from k3.parallel import vision_train as vt
    if text_only_rows_at_step:
        nb = vt._Split.next_batch
        calls = {"n": 0}

        def next_batch(self, seq, rows):
            b = nb(self, seq, rows)
            if self.split == "train":
                calls["n"] += 1
                if calls["n"] == text_only_rows_at_step:
                    b = drop_images_after(b, (rows // 2) * seq)
            return b
        vt._Split.next_batch = next_batch
    from k3.parallel.training import DistTrainer
    seen, lb = [], DistTrainer._local_batch

    def local_batch(self, b, seq, allow_uneven=False):   # how many images this rank's rows held, per call
        loc = lb(self, b, seq, allow_uneven)
        seen.append((allow_uneven, 0 if loc["grid_thw"] is None else len(loc["grid_thw"])))
        return loc
    DistTrainer._local_batch = local_batch
    args = build_parser().parse_args(list(argv))
    return {"rc": vt.run_train_dist(args, build_train_config), "images": seen}


def drop_images_after(b: dict, pos: int) -> dict:
    """The batch with the images whose placeholders sit at or after `pos` removed (placeholders -> token 5)."""
    from k3.parallel.batching import slice_images
    ids = b["input_ids"].clone()
    pid = _placeholder(b)
    pv, grid = slice_images(ids, 0, pos, b["pixel_values"], b["grid_thw"], pid)
    tail = ids[0, pos:]
    tail[tail == pid] = 5
    return dict(b, input_ids=ids, pixel_values=pv, grid_thw=grid)


def _placeholder(b):
    from k3.vision.train import synth_tokenizer
    import tempfile
    return synth_tokenizer(tempfile.mkdtemp()).token_to_id("<|media_pad|>")


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if r["type"] == "train"], [r for r in recs if r["type"] == "eval"]


def assert_same(out, ref, keys=("loss", "grad_norm", "lr"), eval_keys=("val_loss",), rtol=2e-5):
    (tr, ev), (rtr, rev) = metrics(out), metrics(ref)
    assert [r["step"] for r in tr] == [r["step"] for r in rtr] and len(tr) == 2
    for a, b in zip(tr, rtr):
        assert not a["skipped"] and a["batch_rows"] == b["batch_rows"] == 4
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=rtol), (k, a["step"], a[k], b[k])
    assert len(ev) == len(rev) == 2
    for a, b in zip(ev, rev):
        assert a["val_tokens"] == b["val_tokens"] > 0
        for k in eval_keys:
            assert a[k] == pytest.approx(b[k], rel=rtol), (k, a[k], b[k])


def test_vision_synth_2_ranks_match_one_with_a_step_where_one_rank_has_no_image(tmp_path):
    run = BASE + ["--seed", "0"]
    ref, out = str(tmp_path / "ref"), str(tmp_path / "dp2")
    kw = {"text_only_rows_at_step": 2}
    (one,) = run_dist(f"{HERE}:vision_train", 1, {"argv": run + ["--out", ref], **kw}, timeout=300)
    two = run_dist(f"{HERE}:vision_train", 2, {"argv": run + ["--out", out, "--dp-shard", "2"], **kw}, timeout=300)
    assert [r["rc"] for r in (one, *two)] == [0, 0, 0]
    train_images = [[n for uneven, n in r["images"] if not uneven] for r in (one, *two)]
    assert train_images == [[4, 2], [2, 2], [2, 0]]   # step 2: rank 1's rows lost their images
    assert_same(out, ref)
    assert os.path.isfile(os.path.join(out, "final", "config.json"))


def test_vision_synth_refuses_cp_before_any_work(tmp_path, monkeypatch):
    from k3.cli import build_parser
    from k3.errors import K3ConfigError
    from k3.parallel.vision_train import run_train_dist
    from k3.train.cli import build_train_config
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "cp"
    with pytest.raises(K3ConfigError, match="--cp 2: context parallelism is not supported with images"):
        run_train_dist(build_parser().parse_args(BASE + ["--out", str(out), "--cp", "2"]), build_train_config)
    assert not out.exists()
