"""Long prefill on one GPU: a batch-1 chunked prefill of a preset (default `small`, bf16, random weights) into a
K3Cache up to --tokens, printing each chunk's time as it goes (so a run cut short still shows the rate), then one
decode step. Also times one-shot (no cache) forwards at --one-shot lengths, each twice (first call includes any
compile/autotune). Usage: python benchmarks/prefill.py --tokens 1048576 --chunk 131072 [--one-shot 65536,131072]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from k3.config import K3Config
from k3.generation.cache import K3Cache
from k3.model import K3ForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--chunk", type=int, default=1 << 17)
    ap.add_argument("--one-shot", default="")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "prefill.json"))
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = K3Config.from_preset(a.preset)
    torch.manual_seed(0)
    with torch.device(dev):
        model = K3ForCausalLM(cfg)
    model = model.to(torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    rows = []

    def log(**kw):
        print(json.dumps(kw), flush=True)
        rows.append(kw)
        json.dump(rows, open(a.json, "w"), indent=1)

    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for T in [int(x) for x in a.one_shot.split(",") if x]:
            ids = torch.randint(0, cfg.vocab_size, (1, T), device=dev)
            for rep in range(2):
                sync()
                t0 = time.perf_counter()
                model(ids, logits_to_keep=1)
                sync()
                dt = time.perf_counter() - t0
                log(what="one_shot", T=T, rep=rep, s=dt, tok_s=T / dt)
        cache = K3Cache.for_model(model, 1, max_length=a.tokens + 8)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t_all = time.perf_counter()
        done = 0
        while done < a.tokens:
            n = min(a.chunk, a.tokens - done)
            ids = torch.randint(0, cfg.vocab_size, (1, n), device=dev)
            sync()
            t0 = time.perf_counter()
            out = model(ids, cache=cache, logits_to_keep=1)
            cache.advance(n)
            sync()
            dt = time.perf_counter() - t0
            done += n
            log(what="chunk", upto=done, n=n, s=dt, tok_s=n / dt, total_s=time.perf_counter() - t_all,
                peak_GiB=torch.cuda.max_memory_allocated() / 2 ** 30 if dev.type == "cuda" else None)
        total = time.perf_counter() - t_all
        tok = out.logits[:, -1].float().argmax(-1, keepdim=True)
        sync()
        t0 = time.perf_counter()
        model(tok, cache=cache, logits_to_keep=1)
        sync()
        log(what="prefill_done", tokens=done, s=total, tok_s=done / total, decode_step_ms=(time.perf_counter() - t0) * 1e3,
            cache_GiB=cache.memory()["total_bytes"] / 2 ** 30,
            peak_GiB=torch.cuda.max_memory_allocated() / 2 ** 30 if dev.type == "cuda" else None)


if __name__ == "__main__":
    main()
