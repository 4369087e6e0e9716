"""Fuzzed request bodies (hypothesis, bounded): never a 5xx, errors always in OpenAI's format, and the server
keeps answering afterwards."""
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.filterwarnings("ignore")

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=False),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), c, max_size=4)),
                           max_leaves=12)

DELETE = object()
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "developer", "tool", "bot"]), json_values),
     "content": st.one_of(st.text(max_size=40), json_values,
                          st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                          "text": st.one_of(st.text(max_size=20), scalars)}),
                                   max_size=3))},
    optional={"name": st.one_of(st.text(max_size=8), scalars)})
# each field: mostly valid values, some invalid ones, or the field removed
FIELDS = {
    "model": st.one_of(st.just("k3-test"), st.just(DELETE), json_values),
    "messages": st.one_of(st.lists(message, max_size=3), json_values, st.just(DELETE)),
    "prompt": st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 700), max_size=10), json_values,
                        st.just(DELETE)),
    "max_tokens": st.one_of(st.integers(1, 8), st.integers(-3, 0), st.integers(150, 2 ** 80), json_values,
                            st.just(DELETE)),
    "max_completion_tokens": st.one_of(st.integers(-2, 8), st.integers(2 ** 31, 2 ** 80), scalars),
    "temperature": st.one_of(st.floats(0, 2), st.floats(-1, 3), json_values),
    "top_p": st.one_of(st.floats(0, 1), st.floats(-0.5, 1.5), scalars),
    "top_k": st.one_of(st.integers(-2, 50), scalars),
    "repetition_penalty": st.one_of(st.floats(0.5, 2), st.floats(-1, 3), scalars),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=6), json_values),
    "seed": st.one_of(st.integers(-2 ** 70, 2 ** 70), scalars),
    "n": st.one_of(st.integers(-1, 3), scalars),
    "stream": st.one_of(st.booleans(), scalars),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "user": scalars, "presence_penalty": scalars, "frequency_penalty": scalars, "logprobs": scalars,
    "echo": scalars, "logit_bias": json_values, "ignore_eos": scalars, "tools": json_values, "unknown_field": scalars,
}


@st.composite
def mutated(draw, chat: bool):
    """A valid request with 0-3 fields replaced by fuzzed values or removed."""
    if chat:
        body = {"model": "k3-test", "messages": [{"role": "user", "content": draw(st.text(max_size=30))}]}
    else:
        body = {"model": "k3-test", "prompt": draw(st.text(min_size=1, max_size=30))}
    body["max_tokens"] = draw(st.integers(1, 6))
    other = {"prompt", "echo"} if chat else {"messages", "max_completion_tokens", "tools"}
    keys = sorted(k for k in FIELDS if k not in other)
    for k in draw(st.lists(st.sampled_from(keys), max_size=3, unique=True)):
        v = draw(FIELDS[k])
        if v is DELETE:
            body.pop(k, None)
        else:
            body[k] = v
    return json.dumps(body).encode()


def bodies(chat: bool):
    return st.one_of(
        mutated(chat), mutated(chat), mutated(chat),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")),
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_fuzzed_bodies_never_5xx(server, path):
    with httpx.Client(base_url=server.base, timeout=60) as h:
        @settings(max_examples=50, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(body=bodies(path.endswith("/chat/completions")))
        def run(body):
            r = h.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code < 500, (body, r.status_code, r.text)
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
            elif r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.rstrip().endswith("data: [DONE]")
            else:
                assert r.json()["usage"]["completion_tokens"] >= 1

        run()
        assert h.get("/health").json()["status"] == "ok"
        ok = h.post("/v1/completions", json={"model": "k3-test", "prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert server.engine.scheduler.snapshot()["errors"] == 0
