"""Load test of `k3 serve` on loopback: requests/s, time to first token and per-token latency at several numbers
of concurrent streams.

    python benchmarks/serve_load.py                       # tiny preset, random init, toy tokenizer, on CPU
    python benchmarks/serve_load.py --ckpt DIR --concurrency 1 8 32 --max-tokens 64

Without --ckpt a random-init `tiny` model (vocab resized to a toy BPE tokenizer's, 612 ids) is saved in a temp
dir. The server runs as a subprocess (`python -m k3.cli serve ... --max-batch max(concurrency)`) on a free
127.0.0.1 port; this process drives it with C concurrent streaming clients (httpx), each sending
/v1/completions requests (stream, greedy, fixed prompt length, exactly max_tokens: ignore_eos) back to back until the level's
request count or time budget is spent. Only 127.0.0.1 is ever contacted.

Per request: TTFT = send -> first non-empty text chunk; TPOT (per-token latency) = (last chunk - first chunk) /
(completion_tokens - 1), completion_tokens from the usage chunk. Reported: p50/p99 over requests, requests/s and
generated tokens/s over the level's wall time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def make_tiny_checkpoint(root: str) -> str:
    import torch
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.tokenizer import build_toy_tokenizer
    tok = build_toy_tokenizer(os.path.join(root, "tok"), num_merges=100)
    cfg = K3Config.from_preset("tiny", vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                               pad_token_id=tok.pad_id, dtype="float32")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    d = os.path.join(root, "k3-tiny")
    model.save_pretrained(d, tokenizer=tok)
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(client, model, prompt, max_tokens):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    t_first = t_last = None
    n = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                n = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices", []):
                if ch.get("text"):
                    now = time.perf_counter()
                    t_first = t_first or now
                    t_last = now
    t_end = time.perf_counter()
    return dict(ttft=(t_first or t_end) - t0, tpot=((t_last - t_first) / (n - 1)) if n and n > 1 and t_first else
                None, tokens=n or 0, latency=t_end - t0)


async def level(base, model, prompts, conc, n_requests, max_tokens, time_limit):
    import httpx
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    results, errors = [], []
    counter = iter(range(n_requests))
    t_stop = time.perf_counter() + time_limit
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        async def worker():
            for i in counter:
                if time.perf_counter() > t_stop:
                    return
                try:
                    results.append(await one_request(client, model, prompts[i % len(prompts)], max_tokens))
                except Exception as e:  # reported, not fatal
                    errors.append(str(e))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
    tt = [r["ttft"] * 1e3 for r in results]
    tp = [r["tpot"] * 1e3 for r in results if r["tpot"] is not None]
    toks = sum(r["tokens"] for r in results)
    return dict(concurrency=conc, requests=len(results), errors=len(errors), wall_s=wall,
                req_per_s=len(results) / wall, tok_per_s=toks / wall, tokens=toks,
                ttft_p50_ms=pct(tt, 50), ttft_p99_ms=pct(tt, 99), tpot_p50_ms=pct(tp, 50), tpot_p99_ms=pct(tp, 99),
                first_error=errors[0] if errors else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=None, help="checkpoint dir (default: a random-init tiny one in a temp dir)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default max(16, 2 x C))")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="approximate prompt length")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=90.0, help="seconds per level before no new requests")
    ap.add_argument("--server-threads", type=int, default=1, help="torch threads of the server process")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="k3-serve-load-")
    ckpt = a.ckpt or make_tiny_checkpoint(tmp)
    from k3.tokenizer import load_tokenizer
    tok = load_tokenizer(ckpt)
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while hello world tokens model numbers".split()
    prompts = []
    for _ in range(64):   # distinct prompts of about --prompt-tokens tokens
        text = ""
        while len(tok.encode(text)) < a.prompt_tokens:
            text += rng.choice(words) + " "
        prompts.append(text)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    name = os.path.basename(os.path.normpath(ckpt))
    cmd = [sys.executable, "-m", "k3.cli", "serve", "--ckpt", ckpt, "--host", "127.0.0.1", "--port", str(port),
           "--max-batch", str(max(a.concurrency)), "--max-queue", "256", "--threads", str(a.server_threads),
           "--prefill-chunk", str(a.prefill_chunk), "--log-level", "warning", "--device", "cpu",
           "--max-context", str(a.prompt_tokens + a.max_tokens + 64)]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.server_threads))
    log = open(os.path.join(tmp, "server.log"), "w")
    from k3.serve.client import stop_server, wait_ready
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        import httpx
        try:
            wait_ready(base, proc, timeout=120)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; see {log.name}") from None
        asyncio.run(level(base, name, prompts, 2, 4, a.max_tokens, 60))          # warm-up
        for c in a.concurrency:
            n = a.requests or max(16, 2 * c)
            r = asyncio.run(level(base, name, prompts, c, n, a.max_tokens, a.time_limit))
            rows.append(r)
            print(f"C={c:3d}: {r['requests']} req in {r['wall_s']:.1f}s  {r['req_per_s']:.2f} req/s  "
                  f"{r['tok_per_s']:.0f} tok/s  TTFT p50 {r['ttft_p50_ms']:.0f} p99 {r['ttft_p99_ms']:.0f} ms  "
                  f"TPOT p50 {r['tpot_p50_ms']:.1f} p99 {r['tpot_p99_ms']:.1f} ms  errors {r['errors']}",
                  flush=True)
        health = httpx.get(base + "/health").json()
    finally:
        stop_server(proc)
    print()
    print("| streams | requests | req/s | gen tok/s | TTFT p50 ms | TTFT p99 ms | per-token p50 ms | per-token p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests']} | {r['req_per_s']:.2f} | {r['tok_per_s']:.0f} | "
              f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} |")
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=f"{platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} CPUs", python=platform.python_version(), cmd=" ".join(sys.argv),
                prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens, server_threads=a.server_threads,
                server_stats=health)
    print(json.dumps(meta))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, levels=rows), f, indent=2)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
