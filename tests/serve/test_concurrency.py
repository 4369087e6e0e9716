"""Many concurrent streams through the batching scheduler: every one completes with exactly what k3.generate
gives for its prompt alone (greedy, and seeded sampling with per-request parameters)."""
import asyncio
import random

import openai

from k3.generation import generate

N_STREAMS = 24          # server max_batch is 16: 16 decode together, the rest queue and take freed slots
WORDS = ("the quick brown fox jumps over the lazy dog hello world model tokens assistant user system numbers "
         "like café naïve 你好 世界").split()


def _requests():
    rng = random.Random(1234)
    out = []
    for i in range(N_STREAMS):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        kw = dict(max_tokens=rng.randint(4, 14))
        if i % 4 == 3:
            kw.update(temperature=rng.choice([0.7, 1.0, 1.3]), top_p=rng.choice([0.8, 1.0]), seed=i)
        else:
            kw.update(temperature=0)
        out.append((prompt, kw))
    return out


async def _stream_all(base, sched, reqs):
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)

    async def one(prompt, kw):
        text, finish, usage = [], None, None
        stream = await client.completions.create(model="k3-test", prompt=prompt, stream=True,
                                                 stream_options={"include_usage": True}, **kw)
        async for ch in stream:
            if ch.choices:
                text.append(ch.choices[0].text)
                finish = ch.choices[0].finish_reason or finish
            if ch.usage:
                usage = ch.usage
        return "".join(text), finish, usage

    async def release():
        # the scheduler is paused until every request is queued: 16 start together, 8 take freed slots later
        while sched.snapshot()["queued"] < len(reqs):
            await asyncio.sleep(0.01)
        sched.resume()

    sched.pause()
    try:
        out = await asyncio.gather(release(), *(one(p, kw) for p, kw in reqs))
        return out[1:]
    finally:
        sched.resume()
        await client.close()


def test_concurrent_streams_are_independent_and_exact(server, loaded):
    model, tok = loaded
    reqs = _requests()
    results = asyncio.run(_stream_all(server.base, server.engine.scheduler, reqs))
    snap = server.engine.scheduler.snapshot()
    assert snap["active"] == 0 and snap["queued"] == 0
    assert snap["peak_active"] == 16            # the streams really shared the batch
    for (prompt, kw), (text, finish, usage) in zip(reqs, results):
        ids = tok.encode(prompt)
        gkw = {}
        if kw["temperature"] > 0:
            gkw = dict(do_sample=True, temperature=kw["temperature"], top_p=kw["top_p"], seed=kw["seed"])
        ref = generate(model, [ids], kw["max_tokens"], tokenizer=tok, return_dict=True, **gkw)
        assert text == ref.texts[0], (prompt, kw)
        assert finish == ("length" if ref.finish_reasons[0] == "length" else "stop")
        assert usage.prompt_tokens == len(ids) and usage.completion_tokens == len(ref.new_tokens[0])
