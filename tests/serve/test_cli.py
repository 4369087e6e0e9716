"""`k3 serve` as a command: a subprocess on a free loopback port, answering the openai client."""
import os
import socket
import subprocess
import sys

import openai
import pytest

from k3.cli import build_parser
from k3.serve.client import stop_server, wait_ready


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_parser_defaults_and_checks():
    a = build_parser().parse_args(["serve", "--ckpt", "x"])
    assert (a.host, a.port, a.api_key, a.max_batch, a.max_queue, a.max_context) == ("127.0.0.1", 8000, None, 8, 64,
                                                                                   None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--ckpt", "x", "--max-batch", "0"])


def test_k3_serve_subprocess(ckpt):
    d, _ = ckpt
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("K3_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "k3.cli", "serve", "--ckpt", d, "--port", str(port),
                             "--api-key", "k", "--max-batch", "2", "--max-context", "64", "--threads", "1",
                             "--log-level", "warning", "--device", "cpu"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(base, proc, timeout=60)
        except RuntimeError as e:
            pytest.fail(f"{e}\n{proc.stdout.read() if proc.poll() is not None else ''}")
        c = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=30)
        assert c.models.list().data[0].id == os.path.basename(d)
        r = c.chat.completions.create(model=os.path.basename(d), messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError) as e:       # prompt over --max-context
            c.completions.create(model=os.path.basename(d), prompt="word " * 100, max_tokens=1)
        assert e.value.body["code"] == "context_length_exceeded"
    finally:
        stop_server(proc)


@pytest.mark.parametrize("argv,flag", [(["--port", "99999"], "--port"), (["--port", "0"], "--port"),
                                       (["--threads", "-2"], "--threads"), (["--max-queue", "-1"], "--max-queue"),
                                       (["--default-max-tokens", "-1"], "--default-max-tokens"),
                                       (["--read-timeout", "nan"], "--read-timeout"),
                                       (["--request-timeout", "inf"], "--request-timeout"),
                                       (["--max-connections", "0"], "--max-connections")])
def test_bad_serve_flags_are_clear_errors_before_loading(argv, flag, capsys, monkeypatch):
    from k3.cli import main
    loads = []
    monkeypatch.setattr("k3.generation.cli.load_for_inference", lambda *a, **k: loads.append(a))
    with pytest.raises(SystemExit) as e:
        main(["serve", "--ckpt", "/nonexistent"] + argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}:" in err and "Traceback" not in err and not loads


def test_missing_serving_dependency_is_a_one_line_hint(capsys, monkeypatch):
    import importlib.util
    from k3.cli import main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    rc = main(["serve", "--ckpt", "/nonexistent"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("k3: error: k3 serve needs uvicorn") and err.count("\n") == 1
    assert "pip install" in err


def test_serving_dependencies_install_with_the_package():
    import pathlib
    import re
    try:
        import tomllib
    except ModuleNotFoundError:          # Python 3.10
        tomllib = None
    text = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    if tomllib is not None:
        deps = tomllib.loads(text)["project"]["dependencies"]
    else:
        deps = re.findall(r'"([^"]+)"', text.split("dependencies = [", 1)[1].split("]", 1)[0])
    names = {re.split(r"[<>=!~\[ ;]", d, 1)[0].lower() for d in deps}
    assert {"fastapi", "uvicorn"} <= names
