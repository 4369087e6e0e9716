"""A server under hostile traffic (issue 28): normal requests are in flight while hostile ones (degenerate
sampling, huge / slow / broken bodies, too many or too long stop strings, wrong types, non-finite numbers, a
failing request) are sent beside them. Every normal request completes with exactly what it gives alone; every
hostile one gets a clean 4xx or its own answer / error; the server stays healthy."""
import json
import random
import socket
import threading

import httpx

from k3.generation import generate

from .conftest import start_server

WORDS = "the quick brown fox jumps over the lazy dog hello world model tokens café 你好".split()
HUGE = 5 * 1024 * 1024


def _normal_requests(tok):
    rng = random.Random(7)
    out = []
    for i in range(10):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 20)))
        body = {"model": "k3-test", "max_tokens": rng.randint(4, 12), "temperature": 0, "stream": i % 2 == 1}
        if i % 3 == 2:
            body.update(temperature=0.9, top_p=0.9, seed=i)
        if i % 4 == 3:
            body.update(messages=[{"role": "user", "content": prompt}])
            out.append(("/v1/chat/completions", body))
        else:
            body.update(prompt=prompt, ignore_eos=True)
            out.append(("/v1/completions", body))
    return out


def _expected(loaded, path, body):
    """What the request gives alone: the k3.generate reference (the tests of test_api/test_scheduler check that
    the server matches it)."""
    from k3.chat import K3ChatFormat
    model, tok = loaded
    kw = dict(do_sample=True, temperature=body["temperature"], top_p=body["top_p"], seed=body["seed"]) \
        if body["temperature"] > 0 else {}
    if path.endswith("chat/completions"):
        ids = K3ChatFormat(tok).render(body["messages"], thinking=False, add_generation_prompt=True)
        out = generate(model, [ids], body["max_tokens"], stop_token_ids=[tok.eos_id], return_dict=True, **kw)
        new = out.new_tokens[0]
        k = next((j for j, t in enumerate(new) if tok.is_special(t)), len(new))
        return tok.decode(new[:k]), len(new)
    ids = tok.encode(body["prompt"])
    out = generate(model, [ids], body["max_tokens"], tokenizer=tok, stop_token_ids=[], return_dict=True, **kw)
    return out.texts[0], len(out.new_tokens[0])


def _answer(r, path, stream):
    """(text, completion tokens) of a 200 answer, streamed or not."""
    chat = path.endswith("chat/completions")
    if not stream:
        j = r.json()
        c = j["choices"][0]
        return (c["message"]["content"] if chat else c["text"]), j["usage"]["completion_tokens"]
    text, usage = [], None
    lines = [ln for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    for ln in lines[:-1]:
        ev = json.loads(ln[6:])
        assert "error" not in ev, ev
        if ev.get("usage"):
            usage = ev["usage"]["completion_tokens"]
        for ch in ev["choices"]:
            text.append((ch["delta"].get("content") or "") if chat else ch["text"])
    return "".join(text), usage


def _hostile():
    m = {"model": "k3-test"}
    msgs = [{"role": "user", "content": "hi"}]
    js = lambda **kw: json.dumps({**m, **kw}).encode()      # noqa: E731
    ok_or_4xx = (200, 400)
    return [   # (path, raw body, allowed statuses, expected error param or None)
        ("/v1/completions", js(prompt="x", temperature=1e-300, max_tokens=6), (200,), None),
        ("/v1/completions", js(prompt="x", top_p=1e-300, temperature=1.0, max_tokens=6), (200,), None),
        ("/v1/completions", js(prompt="x", repetition_penalty=1e-300, temperature=0.8, max_tokens=6), ok_or_4xx,
         None),
        ("/v1/chat/completions", js(messages=msgs, repetition_penalty=100, temperature=2, top_k=1 << 30,
                                    max_tokens=6, stream=True), (200,), None),
        ("/v1/completions", js(prompt="x", repetition_penalty=1e-300, max_tokens=6, stream=True), ok_or_4xx, None),
        ("/v1/completions", b'{"model": "k3-test", "prompt": "x", "temperature": 1e400}', (400,), "temperature"),
        ("/v1/completions", b'{"model": "k3-test", "prompt": "x", "top_p": NaN}', (400,), None),
        ("/v1/completions", b'{"model": "k3-test", "prompt": "' + b"a" * HUGE + b'"}', (413,), None),
        ("/v1/completions", js(prompt="x", stop=["a", "b", "c", "d", "e"]), (400,), "stop"),
        ("/v1/completions", js(prompt="x", stop=["s" * 5000]), (400,), "stop[0]"),
        ("/v1/chat/completions", js(messages=msgs, stop="z" * 100000), (400,), "stop"),
        ("/v1/completions", b'{"model": "k3-test", "prompt": ', (400,), None),
        ("/v1/completions", b"\xff\xfe\x00garbage", (400,), None),
        ("/v1/completions", b"[" * 100000 + b"]" * 100000, (400,), None),
        ("/v1/completions", js(prompt="x", temperature="hot"), (400,), "temperature"),
        ("/v1/completions", js(prompt="x", max_tokens=1.5), (400,), "max_tokens"),
        ("/v1/completions", js(prompt="x", max_tokens=10 ** 12), (400,), "max_tokens"),
        ("/v1/completions", js(prompt={"a": 1}), (400,), "prompt"),
        ("/v1/completions", js(prompt=[10 ** 12]), (400,), "prompt[0]"),
        ("/v1/chat/completions", js(messages="hi"), (400,), "messages"),
        ("/v1/chat/completions", js(messages=msgs, seed=2 ** 70), (400,), "seed"),
        ("/v1/chat/completions", js(messages=msgs, frobnicate=1), (400,), "frobnicate"),
        ("/v1/completions", js(prompt="x", stream_options={"include_usage": "yes"}, stream=True), (400,), None),
    ]


def _slow_body(port):
    """Send half a body and stall: the server answers 408 after its read timeout, holding nothing else up."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        out = b""
        while b"\r\n\r\n" not in out:
            b = s.recv(4096)
            if not b:
                break
            out += b
    return out


def test_hostile_requests_beside_normal_traffic(loaded):
    s = start_server(loaded, max_batch=4, max_queue=64, max_context=256, read_timeout=2.0)
    eng = s.engine
    orig_pick = eng.scheduler._pick

    def pick(r, logits):                   # one request whose generation fails inside the scheduler
        if r.prompt == failing_prompt:
            raise RuntimeError("internal detail that must not leak")
        return orig_pick(r, logits)

    model, tok = loaded
    failing_prompt = tok.encode("this one breaks")
    eng.scheduler._pick = pick
    normal = _normal_requests(tok)
    expected = [_expected(loaded, p, b) for p, b in normal]
    hostile = _hostile()
    results, errors = {}, []
    start = threading.Barrier(len(normal) + len(hostile) + 2)

    def run(key, fn):
        try:
            start.wait(30)
            results[key] = fn()
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append((key, repr(e)))

    def post(path, content, timeout=120):
        return httpx.post(s.base + path, content=content, timeout=timeout,
                          headers={"Content-Type": "application/json"})

    threads = [threading.Thread(target=run, args=(("n", i), lambda p=p, b=b: post(p, json.dumps(b))))
               for i, (p, b) in enumerate(normal)]
    threads += [threading.Thread(target=run, args=(("h", i), lambda p=p, raw=raw: post(p, raw)))
                for i, (p, raw, _, _) in enumerate(hostile)]
    threads.append(threading.Thread(target=run, args=(("slow", 0), lambda: _slow_body(s.port))))
    threads.append(threading.Thread(target=run, args=(("fail", 0), lambda: post(
        "/v1/completions", json.dumps({"model": "k3-test", "prompt": "this one breaks", "max_tokens": 5,
                                       "temperature": 0.5})))))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors, errors
        for i, (path, body) in enumerate(normal):                  # every normal request completed exactly
            r = results[("n", i)]
            assert r.status_code == 200, (i, r.text[:300])
            text, n = _answer(r, path, body["stream"])
            assert (text, n if n is not None else expected[i][1]) == expected[i], (i, body)
        for i, (path, raw, statuses, param) in enumerate(hostile):  # every hostile one: clean 4xx or its answer
            r = results[("h", i)]
            assert r.status_code in statuses, (i, raw[:120], r.status_code, r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, err
                if param is not None:
                    assert err["param"] == param, (i, err)
            elif b'"stream": true' in raw:
                _answer(r, path, True)
            else:
                assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert results[("slow", 0)].startswith(b"HTTP/1.1 408")
        r = results[("fail", 0)]                                    # its own error, generic, no internals
        assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"
        assert "internal detail" not in r.text
        h = httpx.get(s.base + "/health").json()
        assert h["status"] == "ok" and h["errors"] == 1 and h["active"] == 0 and h["queued"] == 0
    finally:
        s.close()
