"""`k3 train --task vision-synth | image-text`: the multimodal model through the train CLI (a few steps), its
checkpoint loads back, and bad data is a clear one-line error."""
import base64
import io
import json
import os

import pytest

from k3.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _few_evals(monkeypatch):
    monkeypatch.setattr("k3.vision.train.CLI_EVAL_N", 3)


def test_train_vision_synth_cli(tmp_path, capsys):
    out = str(tmp_path / "run")
    rc = main(["train", "--task", "vision-synth", "--steps", "2", "--batch-tokens", "256", "--out", out])
    assert rc == 0
    res = json.load(open(os.path.join(out, "vision_result.json")))
    assert res["steps"] == 2 and res["after"]["n"] == 3 and 0 <= res["after"]["accuracy"] <= 1
    from k3.multimodal import K3ForConditionalGeneration
    m = K3ForConditionalGeneration.from_pretrained(os.path.join(out, "final"))
    assert m.vision_tower is not None
    assert os.path.isfile(os.path.join(out, "final", "tiktoken.model"))
    # a second run into the same --out needs --overwrite
    rc = main(["train", "--task", "vision-synth", "--steps", "1", "--out", out])
    err = capsys.readouterr().err
    assert rc == 2 and "--overwrite" in err


def _pairs(tmp_path, n=10):
    from PIL import Image
    lines = []
    for i in range(n):
        img = Image.new("RGB", (56, 56), (200, 20 * i, 30))
        if i % 2:
            p = tmp_path / f"im{i}.png"
            img.save(p)
            src = p.name
        else:
            buf = io.BytesIO()
            img.save(buf, "PNG")
            src = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        rec = {"image": src, "text": f"a red image number {i}"} if i % 3 else \
            {"image": src, "messages": [{"role": "user", "content": "what is it?"},
                                        {"role": "assistant", "content": "red"}]}
        lines.append(json.dumps(rec))
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(lines) + "\n")
    return str(f)


def test_train_image_text_jsonl(tmp_path):
    data = _pairs(tmp_path)
    out = str(tmp_path / "run")
    rc = main(["train", "--task", "image-text", "--data", data, "--steps", "2", "--batch-tokens", "256",
               "--out", out])
    assert rc == 0
    res = json.load(open(os.path.join(out, "vision_result.json")))
    assert res["steps"] == 2 and res["after"]["val_loss"] > 0


@pytest.mark.parametrize("line,want", [('{"text": "x"}', '"image"'), ('{"image": "a.png"}', '"text"'),
                                       ("not json", "not JSON"),
                                       ('{"image": "missing.png", "text": "x"}', "no such file")])
def test_image_text_bad_records(tmp_path, capsys, line, want):
    f = tmp_path / "bad.jsonl"
    f.write_text(line + "\n")
    rc = main(["train", "--task", "image-text", "--data", str(f), "--steps", "1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and want in err and err.count("\n") == 1, err
