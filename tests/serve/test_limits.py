"""Bounded work per request and a server that never dies silently (issue 28.2/28.3/28.9), over HTTP: body limit
while reading, read and request timeouts, room checked before tokenising, stop-string limits, the default
max_tokens, /health after the scheduler stops, run_server's exit code, and a final event for open streams on
shutdown."""
import json
import socket
import threading
import time

import httpx
import pytest

from k3.serve.protocol import MAX_STOP_CHARS

from .conftest import start_server


def _raw(port, head: bytes, body: bytes = b"", wait=5.0) -> bytes:
    """Send raw bytes, return what the server answers (until it closes or `wait` passes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(head + body)
        out = b""
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                out += b
                if b"\r\n\r\n" in out and b"}}" in out:
                    break
        except socket.timeout:
            pass
    return out


def test_body_limit_applies_while_reading(server):
    n = 5 * 1024 * 1024
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {n}\r\n\r\n").encode()
    t = time.time()
    out = _raw(server.port, head, b"{" + b" " * 1000)          # 1 KB of a 5 MB body: refused without the rest
    assert out.startswith(b"HTTP/1.1 413") and b"request_too_large" in out, out[:300]
    assert time.time() - t < 5

    def chunks():                                              # chunked, no Content-Length: counted as it arrives
        yield b'{"model": "k3-test", "prompt": "'
        for _ in range(80):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(server.base + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_slow_body_is_408(loaded):
    s = start_server(loaded, read_timeout=0.5)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        t = time.time()
        out = _raw(s.port, head, b'{"model"', wait=10)
        assert out.startswith(b"HTTP/1.1 408") and b"request_timeout" in out, out[:300]
        assert time.time() - t < 5
    finally:
        s.close()


def test_room_is_checked_before_tokenising_and_waits_time_out(loaded):
    s = start_server(loaded, max_batch=1, max_queue=0, request_timeout=0.5)
    eng = s.engine
    calls = []
    orig = eng.tokenize
    eng.tokenize = lambda p: (calls.append(1), orig(p))[1]
    try:
        eng.scheduler.pause()                       # nothing runs: the one place stays taken
        body = {"model": "k3-test", "prompt": "Hello", "max_tokens": 5}
        r = httpx.post(s.base + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"    # non-streaming wait timed out
        assert len(calls) == 1
        box = []
        t = threading.Thread(target=lambda: box.append(httpx.post(s.base + "/v1/completions", json=body,
                                                                  timeout=10)))
        eng.cfg.request_timeout = 5.0
        t.start()
        deadline = time.time() + 5
        while eng.scheduler.snapshot()["requests"] < 2:        # the second one is in (queued)
            assert time.time() < deadline
            time.sleep(0.01)
        r = httpx.post(s.base + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 429 and len(calls) == 2            # refused before tokenising
        eng.scheduler.resume()
        t.join(10)
        assert box[0].status_code == 200
    finally:
        s.close()


@pytest.mark.parametrize("stop,param", [(["a", "b", "c", "d", "e"], "stop"),
                                        (["x" * (MAX_STOP_CHARS + 1)], "stop[0]"),
                                        ("y" * (MAX_STOP_CHARS + 1), "stop")])
def test_stop_string_limits(server, stop, param):
    r = httpx.post(server.base + "/v1/completions", json={"model": "k3-test", "prompt": "Hi", "stop": stop})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_default_max_tokens_is_capped(loaded):
    from k3.cli import build_parser
    from k3.serve import ServeConfig
    assert ServeConfig().default_max_tokens == 256
    assert build_parser().parse_args(["serve", "--ckpt", "x"]).default_max_tokens == 256
    s = start_server(loaded, max_context=1024, default_max_tokens=20)
    try:
        r = httpx.post(s.base + "/v1/chat/completions", timeout=60,
                       json={"model": "k3-test", "messages": [{"role": "user", "content": "Hi"}],
                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
    finally:
        s.close()


def test_dead_scheduler_health_503_errors_and_exit_code(loaded):
    s = start_server(loaded, max_batch=2, max_queue=4)
    try:
        sched = s.engine.scheduler

        def broken():
            raise MemoryError("device lost")
        sched._admit = broken
        sched.pause()
        box = []
        body = {"model": "k3-test", "prompt": "Hello", "max_tokens": 50, "stream": True}
        t = threading.Thread(target=lambda: box.append(httpx.post(s.base + "/v1/completions", json=body,
                                                                  timeout=20)))
        t.start()
        while sched.snapshot()["queued"] == 0:
            time.sleep(0.01)
        sched.resume()                                       # the loop breaks with a request waiting
        t.join(20)
        text = box[0].text
        assert '"generation_failed"' in text and text.rstrip().endswith("data: [DONE]")
        assert "device lost" not in text
        s.thread.join(20)                                    # the server stops itself ...
        assert not s.thread.is_alive() and s.rc == 1         # ... and run_server reports failure
        assert sched.fatal and not sched.alive
        # /health of a server whose scheduler died (the app answers 503 while it is still up)
        from fastapi.testclient import TestClient
        h = TestClient(s.app).get("/health")
        assert h.status_code == 503 and h.json()["status"] == "unavailable" and h.json()["fatal"]
    finally:
        s.close()


def test_shutdown_sends_a_final_event_to_open_streams(loaded):
    s = start_server(loaded, max_batch=1, max_queue=4)
    lines, done = [], threading.Event()

    def stream():
        body = {"model": "k3-test", "prompt": "Hello", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", s.base + "/v1/completions", json=body, timeout=20) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
        done.set()

    s.engine.scheduler.pause()                 # the stream stays open, waiting
    t = threading.Thread(target=stream)
    t.start()
    while s.engine.scheduler.snapshot()["queued"] == 0:
        time.sleep(0.01)
    s.server.should_exit = True                # what Ctrl-C / SIGTERM do
    assert done.wait(15)
    t.join(5)
    s.thread.join(10)
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: "):])
    assert err["error"]["message"] == "server shutting down"
    assert s.rc == 0


def test_connection_limit(loaded):
    s = start_server(loaded, max_batch=1, max_queue=4, max_connections=1)
    try:
        s.engine.scheduler.pause()
        opened, status = threading.Event(), []

        def hold():
            body = {"model": "k3-test", "prompt": "Hello", "max_tokens": 3, "stream": True}
            with httpx.stream("POST", s.base + "/v1/completions", json=body, timeout=20) as r:
                status.append(r.status_code)
                opened.set()
                r.read()

        t = threading.Thread(target=hold)
        t.start()
        assert opened.wait(10) and status == [200]
        r = httpx.get(s.base + "/v1/models", timeout=10)        # one connection more than allowed
        assert r.status_code == 503
        s.engine.scheduler.resume()
        t.join(20)
        deadline = time.time() + 10                              # the closed connection is let go: served again
        while httpx.get(s.base + "/v1/models", timeout=10).status_code != 200:
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        s.close()
