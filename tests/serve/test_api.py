"""`k3 serve` over HTTP with the official openai client: chat, completions, streaming, models, usage; the error
format of bad input; API key; 429 on a full queue; a disconnected client frees its slot."""
import json
import time

import httpx
import openai
import pytest

from k3.generation import generate

from .conftest import start_server


def client(server, key="unused", **kw):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def ref_completion(loaded, prompt_ids, n, **kw):
    model, tok = loaded
    return generate(model, [prompt_ids], n, tokenizer=tok, return_dict=True, **kw)


def chat_ref(loaded, messages, n):
    """What the server answers for a chat: generate to <|end_of_msg|>; the reply text is the ordinary text up
    to the first special token (the response block's <|close|>)."""
    from k3.chat import K3ChatFormat
    model, tok = loaded
    ids = K3ChatFormat(tok).render(messages, thinking=False, add_generation_prompt=True)
    out = generate(model, [ids], n, stop_token_ids=[tok.eos_id], return_dict=True)
    new = out.new_tokens[0]
    k = next((j for j, t in enumerate(new) if tok.is_special(t)), len(new))
    return len(ids), new, tok.decode(new[:k])


def test_models_and_health(server):
    c = client(server)
    models = c.models.list().data
    assert [m.id for m in models] == ["k3-test"]
    assert c.models.retrieve("k3-test").id == "k3-test"
    h = httpx.get(server.base + "/health").json()
    assert h["status"] == "ok" and h["scheduler_alive"] and h["max_batch"] == 16


def test_completion_matches_generate(server, loaded):
    model, tok = loaded
    c = client(server)
    r = c.completions.create(model="k3-test", prompt="Hello world", max_tokens=10, temperature=0)
    ids = tok.encode("Hello world")
    ref = ref_completion(loaded, ids, 10)
    assert r.choices[0].text == ref.texts[0]
    assert r.choices[0].finish_reason == ("length" if ref.finish_reasons[0] == "length" else "stop")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.new_tokens[0])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # token-id prompt, streamed, with usage
    chunks = list(c.completions.create(model="k3-test", prompt=ids, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.texts[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.new_tokens[0])
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    # seeded sampling is reproducible and equals k3.generate with the same seed
    kw = dict(model="k3-test", prompt="The quick brown fox", max_tokens=8, temperature=0.8, top_p=0.9, seed=7)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    ref = ref_completion(loaded, tok.encode("The quick brown fox"), 8, do_sample=True, temperature=0.8, top_p=0.9,
                         seed=7)
    assert a.choices[0].text == b.choices[0].text == ref.texts[0]


def test_chat_and_stream(server, loaded):
    c = client(server)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there, world."}]
    n_prompt, new, text = chat_ref(loaded, msgs, 12)
    r = c.chat.completions.create(model="k3-test", messages=msgs, max_tokens=12, temperature=0)
    m = r.choices[0].message
    assert m.role == "assistant" and m.content == text
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == len(new)
    assert r.choices[0].finish_reason in ("stop", "length")
    stream = c.chat.completions.create(model="k3-test", messages=msgs, max_completion_tokens=12, temperature=0,
                                       stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(ch.usage is None for ch in chunks)
    # raw SSE framing: data: lines, ending in [DONE]
    with httpx.stream("POST", server.base + "/v1/chat/completions", timeout=30,
                      json={"model": "k3-test", "messages": msgs, "max_tokens": 3, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in resp.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_stop_strings(server, loaded):
    model, tok = loaded
    ids = tok.encode("Numbers like 1, 12, 123")
    full = ref_completion(loaded, ids, 12, stop_token_ids=[]).texts[0]
    stop = full[4:6]
    assert len(stop) == 2
    cut = full.find(stop)
    r = client(server).completions.create(model="k3-test", prompt=ids, max_tokens=12, temperature=0,
                                          stop=["zzzz", stop])
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    chunks = client(server).completions.create(model="k3-test", prompt=ids, max_tokens=12, temperature=0,
                                               stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks) == full[:cut]


BAD = [  # (path, body: dict | bytes, status, param, code)
    ("/v1/chat/completions", b'{"model": "k3-test", "messages": [', 400, None, "invalid_json"),
    ("/v1/chat/completions", b'\xff\xfe{"model": 1}', 400, None, "invalid_utf8"),
    ("/v1/chat/completions", b"", 400, None, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, None, "invalid_type"),
    ("/v1/chat/completions", b'{"model": "k3-test", "messages": [{"role": "user", "content": "x"}], '
                             b'"temperature": NaN}', 400, None, "invalid_json"),
    ("/v1/chat/completions", b'{"model": "k3-test", "messages": [{"role": "user", "content": "x"}], '
                             b'"temperature": 1e400}', 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", b'{"model": "k3-test", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages[0].content", "invalid_utf8"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "model",
     "missing_required_parameter"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 404, "model",
     "model_not_found"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": []}, 400, "messages", "empty_array"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": "hi"}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"content": "x"}]}, 400, "messages[0].role",
     "missing_required_parameter"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", "invalid_value"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content", "invalid_type"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}],
                              "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}],
                              "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 10 ** 30}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 100000}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": True}, 400, "max_tokens", "invalid_type"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400,
     "n", "unsupported_value"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}],
                              "stream": "yes"}, 400, "stream", "invalid_type"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}],
                              "stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}],
                              "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}],
                              "bogus": 1}, 400, "bogus", "unknown_parameter"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools", "unsupported_parameter"),
    ("/v1/chat/completions", {"model": "k3-test", "messages": [{"role": "user", "content": "word " * 400}]}, 400,
     "messages", "context_length_exceeded"),
    ("/v1/completions", {"model": "k3-test", "prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos",
     "invalid_type"),
    ("/v1/completions", {"model": "k3-test", "prompt": ""}, 400, "prompt", "empty_prompt"),
    ("/v1/completions", {"model": "k3-test", "prompt": [1, 99999]}, 400, "prompt[1]", "invalid_value"),
    ("/v1/completions", {"model": "k3-test", "prompt": ["a", "b"]}, 400, "prompt", "unsupported_value"),
    ("/v1/completions", {"model": "k3-test", "prompt": {"text": "a"}}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"model": "k3-test", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"model": "k3-test", "prompt": "x", "seed": 2 ** 70}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"model": "k3-test", "prompt": "x", "echo": True}, 400, "echo", "unsupported_parameter"),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD, ids=[f"{i}-{b[4]}" for i, b in enumerate(BAD)])
def test_bad_input_is_4xx_in_openai_format(server, path, body, status, param, code):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.base + path, content=data, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code, err
    if param:
        assert param.split("[")[0].split(".")[0] in err["message"]


def test_routes_and_methods_in_openai_format(server):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405),
                                 ("GET", "/v1/models/other", 404)):
        r = httpx.request(method, server.base + path)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model="k3-test", messages=[])
    assert e.value.body["param"] == "messages"


def test_api_key(loaded):
    s = start_server(loaded, api_key="sekret", default_max_tokens=2)
    try:
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").models.list()
        assert httpx.get(s.base + "/v1/models").status_code == 401
        r = httpx.post(s.base + "/v1/completions", json={"model": "k3-test", "prompt": "x"},
                       headers={"Authorization": "Basic sekret"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.base + "/health").status_code == 200        # probes need no key
        c = client(s, "sekret")
        assert c.models.list().data[0].id == "k3-test"
        assert c.completions.create(model="k3-test", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        s.close()


def _wait(pred, timeout=20):
    t = time.time()
    while not pred():
        if time.time() - t > timeout:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def test_full_queue_is_429_and_disconnect_frees_slot(loaded):
    s = start_server(loaded, max_batch=1, max_queue=1, max_context=4096)
    health = lambda: httpx.get(s.base + "/health").json()  # noqa: E731
    long = {"model": "k3-test", "prompt": "Hello", "max_tokens": 4000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.Client(base_url=s.base, timeout=30) as h1, httpx.Client(base_url=s.base, timeout=30) as h2:
            with h1.stream("POST", "/v1/completions", json=long) as r1:
                assert r1.status_code == 200
                it = r1.iter_lines()
                next(it)                                   # first token arrived: the one slot is busy
                with h2.stream("POST", "/v1/completions", json=long) as r2:   # waits in the queue
                    _wait(lambda: health()["queued"] == 1)
                    with pytest.raises(openai.RateLimitError) as e:
                        client(s).completions.create(model="k3-test", prompt="x", max_tokens=1)
                    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
                    assert r2.status_code == 200
                # r2 closed while queued, r1 closed mid-stream: both free their place
            _wait(lambda: health()["active"] == 0 and health()["queued"] == 0)
        assert health()["cancelled"] == 2
        # a non-streaming client that times out (disconnects) also frees the slot
        try:
            r = httpx.post(s.base + "/v1/completions", timeout=0.5,
                           json={"model": "k3-test", "prompt": "Hello", "max_tokens": 4000, "temperature": 0,
                                 "ignore_eos": True})
            raise AssertionError(f"expected a timeout, got {r.status_code} {r.text[:300]} {health()}")
        except httpx.ReadTimeout:
            pass
        _wait(lambda: health()["active"] == 0)
        assert health()["cancelled"] == 3
        r = client(s).completions.create(model="k3-test", prompt="Hello", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    finally:
        s.close()
