"""`k3 generate` / `k3 chat` end to end on a tiny random checkpoint with a toy tokenizer."""
import io
import json
import os

import pytest
import torch

from k3.cli import main
from k3.tokenizer import build_toy_tokenizer

from conftest import build, micro_config


def _toy_tokenizer_and_config(root):
    """A toy tokenizer in root/tok and an fp32 micro text config with its vocabulary and special ids."""
    tok = build_toy_tokenizer(str(root / "tok"), num_merges=100)
    return tok, micro_config(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                             pad_token_id=tok.pad_id, dtype="float32")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen_cli")
    tok, cfg = _toy_tokenizer_and_config(root)
    model = build(cfg, torch.float32)
    d = str(root / "ckpt")
    model.save_pretrained(d, tokenizer=tok)
    return d, tok, model


def _run(argv, capsys, monkeypatch, stdin=None):
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _record_chat_messages(monkeypatch) -> list:
    """A list that gets a copy of the messages of every chat turn (a spy on generate's `_chat_ids`)."""
    import sys
    G = sys.modules["k3.generation.generate"]  # (the package attribute `generate` is the function)
    orig, seen = G._chat_ids, []

    def spy(tokenizer, messages, thinking, **kw):
        seen.append([dict(m) for m in messages])
        return orig(tokenizer, messages, thinking, **kw)

    monkeypatch.setattr(G, "_chat_ids", spy)
    return seen


def test_generate_cli_streams(ckpt, capsys, monkeypatch):
    d, tok, model = ckpt
    rc, out, err = _run(["generate", "--ckpt", d, "--prompt", "Hello world", "--max-new-tokens", "8",
                         "--device", "cpu"], capsys, monkeypatch)
    assert rc == 0, err
    from k3.generation import generate
    ids = tok.encode("Hello world")
    ref = generate(model, [ids], 8, tokenizer=tok, return_dict=True)
    assert out == ref.texts[0] + "\n"
    rc, out2, err = _run(["generate", "--ckpt", d, "--prompt", "Hello", "--max-new-tokens", "8", "--temperature",
                          "0.8", "--top-k", "20", "--top-p", "0.9", "--repetition-penalty", "1.1", "--seed", "3",
                          "--stop", "zz", "--device", "cpu"], capsys, monkeypatch)
    assert rc == 0, err


def test_chat_cli_multi_turn(ckpt, capsys, monkeypatch):
    d, tok, model = ckpt
    seen = _record_chat_messages(monkeypatch)
    rc, out, err = _run(["chat", "--ckpt", d, "--max-new-tokens", "5", "--device", "cpu"], capsys, monkeypatch,
                        stdin="hi there\n\nsecond turn\n")
    assert rc == 0, err
    assert out.count("k3> ") == 2
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]
    assert seen[1][0]["content"] == "hi there" and seen[1][2]["content"] == "second turn"


def test_chat_stops_at_end_of_message(ckpt):
    d, tok, model = ckpt
    from k3.generation import chat
    # force the model to emit <|end_of_msg|> first: bias the head towards it
    m = build(model.config, torch.float32)
    with torch.no_grad():
        m.lm_head.weight[tok.eos_id] = m.model.norm.weight * 50
    r = chat(m, tok, [{"role": "user", "content": "hi"}], max_new_tokens=10)
    assert r["finish_reason"] == "stop_token" and r["ids"][-1] == tok.eos_id


def test_cli_errors_are_one_line(ckpt, tmp_path, capsys, monkeypatch):
    d, tok, model = ckpt
    rc, out, err = _run(["generate", "--ckpt", str(tmp_path / "nope"), "--prompt", "x"], capsys, monkeypatch)
    assert rc == 2 and err.startswith("k3: error:") and err.count("\n") == 1
    # corrupt weights
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(d):
        data = open(os.path.join(d, f), "rb").read()
        if f.endswith(".safetensors"):
            data = data[:100]
        (bad / f).write_bytes(data)
    rc, out, err = _run(["generate", "--ckpt", str(bad), "--prompt", "x"], capsys, monkeypatch)
    assert rc == 2 and err.startswith("k3: error:") and err.count("\n") == 1
    # tokenizer of another vocabulary
    other = tmp_path / "other"
    other.mkdir()
    for f in os.listdir(d):
        if f != "tiktoken.model":
            (other / f).write_bytes(open(os.path.join(d, f), "rb").read())
    build_toy_tokenizer(str(tmp_path / "tok2"), num_merges=30)
    (other / "tiktoken.model").write_bytes((tmp_path / "tok2" / "tiktoken.model").read_bytes())
    rc, out, err = _run(["chat", "--ckpt", str(other)], capsys, monkeypatch, stdin="")
    assert rc == 2 and "tokenizer" in err and err.count("\n") == 1
    # no tokenizer at all
    none = tmp_path / "none"
    none.mkdir()
    for f in os.listdir(d):
        if f != "tiktoken.model":
            (none / f).write_bytes(open(os.path.join(d, f), "rb").read())
    rc, out, err = _run(["generate", "--ckpt", str(none), "--prompt", "x"], capsys, monkeypatch)
    assert rc == 2 and err.count("\n") == 1


@pytest.mark.parametrize("cmd", ["generate", "chat"])
@pytest.mark.parametrize("flag,value", [("--max-new-tokens", "-1"), ("--max-new-tokens", "0"),
                                        ("--temperature", "-1"), ("--temperature", "nan"),
                                        ("--temperature", "inf"), ("--top-p", "0"), ("--top-p", "1.5"),
                                        ("--top-k", "-3"), ("--repetition-penalty", "0"),
                                        ("--repetition-penalty", "nan"), ("--prefill-chunk", "0"),
                                        ("--prefill-chunk", "-5")])
def test_bad_flags_are_clear_errors_before_loading(cmd, flag, value, capsys):
    argv = [cmd, "--ckpt", "/nonexistent/ckpt", flag, value] + (["--prompt", "x"] if cmd == "generate" else [])
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"argument {flag}:" in err and flag.lstrip("-").replace("-", "_") in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ images
@pytest.fixture(scope="module")
def mm_ckpt(tmp_path_factory):
    from k3.multimodal import K3ForConditionalGeneration, multimodal_config
    root = tmp_path_factory.mktemp("gen_cli_mm")
    tok, text = _toy_tokenizer_and_config(root)
    cfg = multimodal_config(text, "tiny", media_placeholder_token_id=tok.token_to_id("<|media_pad|>"))
    torch.manual_seed(0)
    model = K3ForConditionalGeneration(cfg).eval()
    d = str(root / "ckpt")
    model.save_pretrained(d, tokenizer=tok)
    from PIL import Image
    img = Image.new("RGB", (40, 30), (200, 30, 30))
    img.paste((20, 200, 40), (0, 0, 20, 15))
    png = str(root / "a.png")
    img.save(png)
    return d, tok, model, png


def test_generate_cli_with_image(mm_ckpt, capsys, monkeypatch):
    d, tok, model, png = mm_ckpt
    rc, out, err = _run(["generate", "--ckpt", d, "--image", png, "--image", png, "--prompt", "What is it?",
                         "--max-new-tokens", "6", "--device", "cpu"], capsys, monkeypatch)
    assert rc == 0, err
    from k3.chat import K3ChatFormat
    from k3.multimodal import generate as mm_generate
    from PIL import Image
    parts = [{"type": "image", "width": 40, "height": 30}] * 2 + [{"type": "text", "text": "What is it?"}]
    ids = K3ChatFormat(tok).render([{"role": "user", "content": parts}], thinking=False)
    ref = mm_generate(model, ids, [Image.open(png)] * 2, 6, tokenizer=tok, return_dict=True)
    assert out == ref.texts[0] + "\n"
    # a multimodal checkpoint still answers text prompts
    rc, out, err = _run(["generate", "--ckpt", d, "--prompt", "Hello", "--max-new-tokens", "3", "--device", "cpu"],
                        capsys, monkeypatch)
    assert rc == 0, err


def test_image_errors_are_one_line(ckpt, mm_ckpt, tmp_path, capsys, monkeypatch):
    d_text = ckpt[0]
    d, tok, model, png = mm_ckpt
    rc, out, err = _run(["generate", "--ckpt", d_text, "--image", png, "--prompt", "x"], capsys, monkeypatch)
    assert rc == 2 and err.count("\n") == 1 and "text-only checkpoint" in err and "--image" in err
    bad = tmp_path / "bad.png"
    bad.write_bytes(open(png, "rb").read()[:40])
    for path, want in ((str(bad), "bad.png"), (str(tmp_path / "missing.png"), "no such file")):
        rc, out, err = _run(["generate", "--ckpt", d, "--image", path, "--prompt", "x"], capsys, monkeypatch)
        assert rc == 2 and err.startswith("k3: error:") and err.count("\n") == 1 and want in err, err


def test_chat_cli_image_command(mm_ckpt, ckpt, capsys, monkeypatch):
    d, tok, model, png = mm_ckpt
    seen = _record_chat_messages(monkeypatch)
    rc, out, err = _run(["chat", "--ckpt", d, "--max-new-tokens", "3", "--device", "cpu"], capsys, monkeypatch,
                        stdin=f"/image {png}\n/image {tmp_path_nope()}\nwhat is this?\nand now?\n")
    assert rc == 0, err
    assert out.count("k3> ") == 2 and "no such file" in err
    first = seen[0][0]["content"]
    assert first[0] == {"type": "image", "width": 40, "height": 30} and first[-1]["text"] == "what is this?"
    assert len(first) == 2 and seen[1][2]["content"] == "and now?"
    # a text-only checkpoint refuses /image with a clear line and goes on
    rc, out, err = _run(["chat", "--ckpt", ckpt[0], "--max-new-tokens", "2", "--device", "cpu"], capsys,
                        monkeypatch, stdin=f"/image {png}\nhi\n")
    assert rc == 0 and "text-only checkpoint" in err and out.count("k3> ") == 1


def tmp_path_nope():
    return "/nonexistent/k3-no-image.png"
