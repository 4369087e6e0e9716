"""The continuous-batching scheduler without HTTP: staggered arrivals, rows still prefilling between decoding
rows, slot reuse and cancellation; every output equals k3.generate on the same prompt alone."""
import queue
import random
import time

from k3.generation import generate
from k3.generation.sampling import SamplingParams
from k3.serve.scheduler import GenRequest, QueueFull, Scheduler


def _collect(sched, req, timeout=60):
    q = queue.Queue()
    req.sink = q.put
    sched.submit(req)
    return q


def _drain(q, timeout=60):
    text, t = [], time.time()
    while True:
        ev = q.get(timeout=max(0.1, timeout - (time.time() - t)))
        if ev[0] == "text":
            text.append(ev[1])
        elif ev[0] == "done":
            return "".join(text), ev
        else:
            raise AssertionError(ev)


def test_staggered_requests_match_generate(loaded):
    model, tok = loaded
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog hello world tokens model".split()
    prompts = [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))) for _ in range(10)]
    # chunk 16: long prompts stay in prefill for several steps while neighbours decode
    sched = Scheduler(model, tok, max_batch=4, max_queue=16, max_context=256, prefill_chunk=16)
    sched.start()
    try:
        qs = []
        for i, p in enumerate(prompts):
            sampled = i % 3 == 2
            params = SamplingParams(do_sample=True, temperature=0.9, top_p=0.9) if sampled else SamplingParams()
            req = GenRequest(prompt=p, max_tokens=6 + i % 5, sink=None, params=params, seed=100 + i,
                             stop_ids=frozenset(tok.stop_ids))
            qs.append((p, req, _collect(sched, req)))
            time.sleep(rng.random() * 0.01)
        for i, (p, req, q) in enumerate(qs):
            text, ev = _drain(q)
            kw = dict(do_sample=True, temperature=0.9, top_p=0.9, seed=100 + i) if i % 3 == 2 else {}
            ref = generate(model, [p], req.max_tokens, tokenizer=tok, return_dict=True, **kw)
            assert req.generated == ref.new_tokens[0], i
            assert text == ref.texts[0]
            assert ev[1] == {"stop_token": "stop", "length": "length"}[ref.finish_reasons[0]]
            assert ev[2:] == (len(p), len(ref.new_tokens[0]))
        snap = sched.snapshot()
        assert snap["active"] == 0 and snap["queued"] == 0 and snap["completed"] == len(prompts)
    finally:
        sched.stop()


def test_queue_full_and_cancel(loaded):
    model, tok = loaded
    sched = Scheduler(model, tok, max_batch=1, max_queue=1, max_context=512)
    p = tok.encode("Hello world")
    a = GenRequest(prompt=p, max_tokens=400, sink=None, stop_ids=frozenset())
    b = GenRequest(prompt=p, max_tokens=400, sink=None, stop_ids=frozenset())
    qa, qb = _collect(sched, a), _collect(sched, b)      # not started yet: both wait
    try:
        _collect(sched, GenRequest(prompt=p, max_tokens=4, sink=None))
        raise AssertionError("expected QueueFull")
    except QueueFull:
        pass
    sched.start()
    try:
        b.cancel.set()                                      # cancelled while queued
        assert _drain(qb)[1][1] == "cancelled"
        while not a.generated:
            time.sleep(0.005)
        a.cancel.set()                                      # cancelled while running: the slot is freed
        sched.wake()
        assert _drain(qa)[1][1] == "cancelled" and len(a.generated) < 400
        c = GenRequest(prompt=p, max_tokens=3, sink=None, stop_ids=frozenset())
        text, ev = _drain(_collect(sched, c))
        assert ev[1] == "length" and c.generated == generate(model, [p], 3, stop_token_ids=[])[0, len(p):].tolist()
    finally:
        sched.stop()


def test_stop_strings_are_cut_and_held_back(loaded):
    model, tok = loaded
    p = tok.encode("Numbers like 1, 12, 123")
    ref = generate(model, [p], 12, tokenizer=tok, return_dict=True, stop_token_ids=[])
    full = ref.texts[0]
    target = full[3:5] if len(full) >= 5 else full[-1:]
    sched = Scheduler(model, tok, max_batch=2, max_context=128)
    sched.start()
    try:
        req = GenRequest(prompt=p, max_tokens=12, sink=None, stop_strings=[target])
        q = _collect(sched, req)
        chunks = []
        while True:
            ev = q.get(timeout=30)
            if ev[0] != "text":
                break
            chunks.append(ev[1])
        assert ev[1] == "stop" and "".join(chunks) == full[:full.find(target)]
    finally:
        sched.stop()


def test_free_row_inside_a_decoding_run(loaded):
    """Row 1 finishes first: rows 0 and 2 keep decoding in one forward with row 1 fed a dummy token."""
    model, tok = loaded
    prompts = [tok.encode(t) for t in ("Hello there, world.", "The quick brown fox", "def encode(text):")]
    sched = Scheduler(model, tok, max_batch=3, max_context=128)
    seen_dummy = []
    orig = sched._runs

    def runs():
        r = orig()
        seen_dummy.extend(i for lo, hi in r for i in range(lo, hi + 1) if sched.slots[i] is None)
        return r

    sched._runs = runs
    reqs = [GenRequest(prompt=p, max_tokens=n, sink=None, stop_ids=frozenset()) for p, n in zip(prompts, (14, 2, 14))]
    qs = [_collect(sched, r) for r in reqs]                 # queued before the thread starts: admitted together
    sched.start()
    try:
        for p, r, q in zip(prompts, reqs, qs):
            _drain(q)
            assert r.generated == generate(model, [p], r.max_tokens, stop_token_ids=[])[0, len(p):].tolist()
        assert 1 in seen_dummy
    finally:
        sched.stop()


def _serve_all(sched, qs):
    """Start the scheduler, wait for every queued request to finish, stop it."""
    sched.start()
    try:
        for q in qs:
            _drain(q)
    finally:
        sched.stop()


def _count_forwards(model):
    calls = []
    orig = model.forward

    def fwd(*a, **kw):
        ids = kw.get("input_ids", a[0] if a else None)
        calls.append((tuple(ids.shape), kw.get("cu_seqlens") is not None))
        return orig(*a, **kw)

    model.forward = fwd
    return calls, lambda: model.__dict__.pop("forward", None)


def test_ragged_prompts_arriving_together_are_prefilled_in_one_packed_forward(loaded):
    """Prompts of different lengths (1 .. 37 tokens: both the short-input recurrent/absorbed paths and the chunked
    ones) queued together: their prefill is ONE packed forward (cu_seqlens over their cache rows), and every
    output, greedy and seeded, equals k3.generate on that prompt alone."""
    model, tok = loaded
    texts = ["Hi", "The quick brown fox jumps over the lazy dog and then some more words follow here",
             "def encode(text):", "hello world " * 6, "x", "Numbers like 1, 12, 123 and 1234"]
    prompts = [tok.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == len(prompts) and max(len(p) for p in prompts) > 16
    sched = Scheduler(model, tok, max_batch=8, max_context=256, prefill_chunk=4096)
    reqs = []
    for i, p in enumerate(prompts):
        sampled = i % 3 == 1
        params = SamplingParams(do_sample=True, temperature=0.9, top_p=0.9) if sampled else SamplingParams()
        reqs.append(GenRequest(prompt=p, max_tokens=8, sink=None, params=params, seed=7 + i, stop_ids=frozenset()))
    qs = [_collect(sched, r) for r in reqs]                 # queued before the thread starts: admitted together
    calls, restore = _count_forwards(model)
    try:
        _serve_all(sched, qs)
    finally:
        restore()
    prefills = [c for c in calls if c[0][0] == 1 and c[0][1] > 1 or c[1]]
    assert prefills == [((1, sum(map(len, prompts))), True)], calls[:3]
    assert sched.stats["prefill_forwards"] == 1 and sched.stats["packed_prefills"] == 1
    for i, (p, r) in enumerate(zip(prompts, reqs)):
        kw = dict(do_sample=True, temperature=0.9, top_p=0.9, seed=7 + i) if i % 3 == 1 else {}
        assert r.generated == generate(model, [p], 8, stop_token_ids=[], **kw)[0, len(p):].tolist(), i


def test_packed_prefill_chunks_continue_rows_exactly(loaded):
    """A small prefill budget: prompts are split into chunks, several in flight at once, each packed forward
    mixing first chunks with continuations of earlier ones (per-row KDA/conv/MLA state carried across)."""
    model, tok = loaded
    rng = random.Random(1)
    words = "the quick brown fox jumps over lazy dog hello world tokens model".split()
    prompts = [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))) for _ in range(6)]
    sched = Scheduler(model, tok, max_batch=6, max_context=256, prefill_chunk=11)
    reqs = [GenRequest(prompt=p, max_tokens=5, sink=None, stop_ids=frozenset()) for p in prompts]
    qs = [_collect(sched, r) for r in reqs]
    _serve_all(sched, qs)
    assert sched.stats["packed_prefills"] >= 2
    for p, r in zip(prompts, reqs):
        assert r.generated == generate(model, [p], 5, stop_token_ids=[])[0, len(p):].tolist()
