"""`k3 serve` as a command: a subprocess on a free loopback port, answering the openai client."""
import os
import socket
import subprocess
import sys

import openai
import pytest

from k3.cli import build_parser
from k3.serve.client import wait_ready


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
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
