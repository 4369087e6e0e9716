"""One bad request harms no one (issue 28.1/28.2), scheduler level: degenerate sampling parameters are safe, an
error while serving one request fails that request alone with a generic message, and a scheduler loop that
cannot continue fails every waiting and running request at once and reports why."""
import queue
import time

import pytest

from k3.generation import generate
from k3.generation.sampling import SamplingParams
from k3.serve.scheduler import INTERNAL_ERROR, MAX_STEP_FAILURES, GenRequest, Scheduler

DEGENERATE = [
    dict(do_sample=True, temperature=1e-300),
    dict(do_sample=True, temperature=0.8, top_p=1e-300),
    dict(do_sample=True, temperature=0.8, repetition_penalty=1e-300),
    dict(do_sample=True, temperature=0.8, repetition_penalty=1e300),
    dict(do_sample=False, repetition_penalty=1e-300),
    dict(do_sample=True, temperature=2.0, top_k=1 << 30, top_p=1.0, repetition_penalty=100.0),
]


def _submit(sched, req):
    q = queue.Queue()
    req.sink = q.put
    sched.submit(req)
    return q


def _drain(q, timeout=60):
    text = []
    while True:
        ev = q.get(timeout=timeout)
        if ev[0] == "text":
            text.append(ev[1])
        else:
            return "".join(text), ev


def _normal(tok, words, n=6):
    p = tok.encode(words)
    return p, GenRequest(prompt=p, max_tokens=n, sink=None, stop_ids=frozenset(tok.stop_ids))


def test_degenerate_sampling_is_safe_beside_normal_requests(loaded):
    model, tok = loaded
    sched = Scheduler(model, tok, max_batch=4, max_queue=16, max_context=128, prefill_chunk=16)
    sched.start()
    try:
        normal = [_normal(tok, w) for w in ("Hello world", "the quick brown fox", "one two three four")]
        qs = [(p, r, _submit(sched, r)) for p, r in normal]
        bad = []
        for i, kw in enumerate(DEGENERATE):
            r = GenRequest(prompt=tok.encode("hostile"), max_tokens=5, sink=None, params=SamplingParams(**kw),
                           seed=i, stop_ids=frozenset())
            bad.append((r, _submit(sched, r)))
        for p, r, q in qs:
            text, ev = _drain(q)
            ref = generate(model, [p], r.max_tokens, tokenizer=tok, return_dict=True)
            assert ev[0] == "done" and r.generated == ref.new_tokens[0] and text == ref.texts[0]
        for r, q in bad:                      # safe: each finishes normally, within the vocabulary
            _, ev = _drain(q)
            assert ev[0] == "done" and ev[1] == "length", (r.params, ev)
            assert all(0 <= t < model.config.vocab_size for t in r.generated)
        # tiny temperatures act as greedy
        assert bad[0][0].generated == generate(model, [tok.encode("hostile")], 5, stop_token_ids=[])[0, -5:].tolist()
        assert sched.snapshot()["errors"] == 0 and sched.alive
    finally:
        sched.stop()


def test_a_failing_request_fails_alone_with_a_generic_message(loaded, caplog):
    model, tok = loaded
    sched = Scheduler(model, tok, max_batch=4, max_queue=16, max_context=128)
    orig = sched._pick

    def pick(r, logits):
        if r.id == "evil":
            raise RuntimeError("secret internal detail")
        return orig(r, logits)

    sched._pick = pick
    normal = [_normal(tok, w) for w in ("Hello world", "lazy dog jumps")]
    evil = GenRequest(prompt=tok.encode("x y"), max_tokens=6, sink=None, id="evil",
                      params=SamplingParams(do_sample=True, temperature=0.7))
    qs = [(p, r, _submit(sched, r)) for p, r in normal[:1]]
    qe = _submit(sched, evil)
    qs += [(p, r, _submit(sched, r)) for p, r in normal[1:]]
    sched.start()
    try:
        _, ev = _drain(qe)
        assert ev == ("error", INTERNAL_ERROR) and "secret" not in ev[1]
        for p, r, q in qs:
            text, ev = _drain(q)
            ref = generate(model, [p], r.max_tokens, tokenizer=tok, return_dict=True)
            assert ev[0] == "done" and r.generated == ref.new_tokens[0] and text == ref.texts[0]
        assert "secret internal detail" in caplog.text       # the detail is logged server-side
        snap = sched.snapshot()
        assert snap["errors"] == 1 and snap["active"] == 0 and sched.alive
        # the freed slot serves the next request normally
        p, r = _normal(tok, "Hello world")
        assert _drain(_submit(sched, r))[1][0] == "done"
    finally:
        sched.stop()


def test_a_failing_admission_fails_alone(loaded):
    model, tok = loaded
    sched = Scheduler(model, tok, max_batch=2, max_queue=8, max_context=128)
    bad = GenRequest(prompt=[10 ** 9], max_tokens=3, sink=None,            # out-of-range id: admission fails
                     params=SamplingParams(repetition_penalty=1.3))
    p, ok = _normal(tok, "Hello world")
    qb, qo = _submit(sched, bad), _submit(sched, ok)
    sched.start()
    try:
        assert _drain(qb)[1] == ("error", INTERNAL_ERROR)
        assert _drain(qo)[1][0] == "done" and sched.alive
    finally:
        sched.stop()


@pytest.mark.parametrize("where", ["step", "loop"])
def test_a_broken_loop_fails_everyone_at_once_and_reports(loaded, where):
    model, tok = loaded
    reasons = []
    sched = Scheduler(model, tok, max_batch=2, max_queue=8, max_context=128, on_fatal=reasons.append)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise MemoryError("device lost")

    if where == "step":
        sched._step = broken           # every step fails: after MAX_STEP_FAILURES the loop gives up
    else:
        sched._admit = broken          # an error outside any request: the loop cannot continue
    reqs = [_normal(tok, "Hello world", n=50)[1] for _ in range(5)]   # 2 running + 3 waiting
    qs = [_submit(sched, r) for r in reqs]
    t = time.time()
    sched.start()
    evs = [_drain(q, timeout=10)[1] for q in qs]
    assert time.time() - t < 10
    assert all(ev[0] == "error" for ev in evs), evs
    sched._thread.join(5)
    assert not sched.alive and sched.fatal and "device lost" in sched.fatal
    assert reasons == [sched.fatal]
    assert len(calls) == (MAX_STEP_FAILURES if where == "step" else 1)
    snap = sched.snapshot()
    assert not snap["scheduler_alive"] and snap["active"] == 0 and snap["queued"] == 0
    with pytest.raises(RuntimeError):
        sched.submit(_normal(tok, "late")[1])
    sched.stop()


def test_one_failed_step_is_survived(loaded):
    model, tok = loaded
    sched = Scheduler(model, tok, max_batch=2, max_queue=8, max_context=128)
    orig, n = sched._step, []

    def flaky():
        n.append(1)
        if len(n) == 2:
            raise RuntimeError("transient")
        return orig()

    sched._step = flaky
    r1 = _normal(tok, "Hello world", n=20)[1]
    q1 = _submit(sched, r1)
    sched.start()
    try:
        assert _drain(q1)[1] == ("error", INTERNAL_ERROR)       # it was running when the step failed
        p, r2 = _normal(tok, "Hello world")
        assert _drain(_submit(sched, r2))[1][0] == "done" and sched.alive and sched.fatal is None
    finally:
        sched.stop()
