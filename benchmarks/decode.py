"""Decode speed and inference-state memory vs context length: the hybrid KDA/MLA model against an all-MLA control
built from the same preset (every layer MLA: full_attn_layers = all, kda_layers = []).

For each context C in min..max (doubling): fill the cache to C tokens, then time --steps single-token decode steps
(greedy, model(..., cache, logits_to_keep=1) + argmax; median ms/token after --warmup steps). The cache is filled
by a real chunked prefill (--prefill-chunk tokens per forward) up to --real-prefill-max tokens, and beyond that by
*synthetic* state (random MLA latents, random KDA state) because decode cost depends on the cache length only,
not on its content; the JSON/table say which one was used. Weights are random (speed only).

CPU:  python benchmarks/decode.py --preset tiny --max-context 32768 --json decode_cpu.json
CUDA: python benchmarks/decode.py --device cuda --preset small --max-context 1048576 --json decode_h200.json
      (bf16 on CUDA by default; the small all-MLA control needs ~14 GB of latent cache at 1M tokens)
--static: decode with k3.generation.static.StaticDecoder (fused, shape-static step; MLA attention over a window of
context + steps tokens with a length mask; one decoder per context). --cuda-graph: the same, captured as a CUDA
graph and replayed per token (implies --static; CUDA only).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import torch

from k3.config import K3Config
from k3.generation.cache import K3Cache, KDALayerCache, MLALayerCache, cache_memory
from k3.generation.static import StaticDecoder
from k3.model import K3ForCausalLM


def all_mla(cfg: K3Config) -> K3Config:
    lac = dataclasses.replace(cfg.linear_attn_config, full_attn_layers=list(range(1, cfg.num_hidden_layers + 1)),
                              kda_layers=[])
    return cfg.replace(linear_attn_config=lac.to_dict())


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(cfg, device, dtype):
    torch.manual_seed(0)
    with torch.device(device):
        m = K3ForCausalLM(cfg)
    return m.to(dtype).eval()


@torch.inference_mode()
def fill(model, cache: K3Cache, target: int, chunk: int, synthetic: bool, gen: torch.Generator):
    """Grow the (batch-1) cache to `target` tokens."""
    cur = cache.lengths[0]
    n = target - cur
    if n <= 0:
        return
    dev = model.device
    if not synthetic:
        for s in range(cur, target, chunk):
            e = min(target, s + chunk)
            ids = torch.randint(0, model.config.vocab_size, (1, e - s), device=dev, generator=gen)
            model(ids, cache=cache, logits_to_keep=1)
            cache.advance(e - s)
        return
    B = cache.batch_size
    for lc in cache.layers:
        if isinstance(lc, MLALayerCache):
            lc.reserve(target)
            blk = lc.buf[:, cur:target]
            for s in range(0, n, 1 << 16):  # fill in slabs (no [n, 576] fp32 temporary)
                e = min(n, s + (1 << 16))
                blk[:, s:e].normal_(generator=gen)
            lc.lengths = [target] * B
            lc.lengths_t.fill_(target)
        elif isinstance(lc, KDALayerCache) and cur == 0:
            lc.state.normal_(0, 0.05, generator=gen)
            lc.conv.normal_(0, 1.0, generator=gen)
    cache.advance(n)


class Runner:
    """One model + its batch-1 cache; `step()` times one greedy decode step."""

    def __init__(self, name, cfg, device, dtype, max_len, static=False, cuda_graph=False, compile_step=False,
                 batch=1):
        self.name, self.cfg, self.device = name, cfg, device
        self.static, self.cuda_graph, self.dec = static, cuda_graph, None
        self.compile_step = compile_step
        self.model = build(cfg, device, dtype)
        self.batch = batch
        self.cache = K3Cache.for_model(self.model, batch, max_length=max_len)
        self.gen = torch.Generator(device=device).manual_seed(1)
        self.tok = torch.randint(0, cfg.vocab_size, (batch, 1), device=device, generator=self.gen)

    def start(self, n_steps: int) -> None:
        """Before timing a context: a static decoder whose MLA window holds the next n_steps tokens."""
        if self.static:
            self.dec = StaticDecoder(self.model, self.cache, self.batch,
                                     max_length=self.cache.lengths[0] + n_steps + 1,
                                     cuda_graph=self.cuda_graph, compile=self.compile_step)

    @torch.inference_mode()
    def step(self) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        if self.dec is not None:
            logits = self.dec.step(self.tok)
            self.tok = logits.argmax(-1, keepdim=True)
        else:
            logits = self.model(self.tok, cache=self.cache, logits_to_keep=1).logits
            self.tok = logits[:, -1].float().argmax(-1, keepdim=True)
        sync(self.device)
        if self.dec is None:
            self.cache.advance(1)
        return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--min-context", type=int, default=512)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default: 2048 on CPU, 16384 on CUDA")
    ap.add_argument("--real-prefill-max", type=int, default=None,
                    help="fill the cache by real prefill up to this many tokens, synthetic beyond "
                         "(default: max-context on CPU, 131072 on CUDA)")
    ap.add_argument("--models", default="hybrid,all-mla")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--static", action="store_true", help="decode with the fused StaticDecoder step")
    ap.add_argument("--cuda-graph", action="store_true", help="StaticDecoder captured as a CUDA graph (CUDA)")
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences decoded together (each at the full context; > 1 fills the cache synthetically). "
                         "ms_per_token is per step; per_output_token_ms = step / batch")
    ap.add_argument("--contexts", default=None, help="explicit comma list of contexts (instead of min..max doubling)")
    ap.add_argument("--compile-step", action="store_true",
                    help="torch.compile the StaticDecoder step (implies --static; compiles once per context)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.compile_step:
        a.static = True

    device = torch.device(a.device)
    if a.cuda_graph:
        if device.type != "cuda":
            ap.error("--cuda-graph needs --device cuda")
        a.static = True
        a.warmup = max(a.warmup, 3)   # step 1 eager warm-up, step 2 capture + replay, then replays
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    chunk = a.prefill_chunk or (16384 if device.type == "cuda" else 2048)
    real_max = a.real_prefill_max if a.real_prefill_max is not None else \
        (131072 if device.type == "cuda" else a.max_context)
    contexts = []
    c = a.min_context
    while c <= a.max_context:
        contexts.append(c)
        c *= 2
    if a.contexts:
        contexts = sorted(int(x) for x in a.contexts.split(","))

    base = K3Config.from_preset(a.preset)
    cfgs = {"hybrid": base, "all-mla": all_mla(base)}
    names = [n.strip() for n in a.models.split(",") if n.strip()]
    results = {n: [] for n in names}
    extra = (a.warmup + a.steps) * len(contexts)
    # Both models stay resident and their decode steps are interleaved, so load drift on a shared machine hits
    # them alike (for the small preset at 1M on one GPU: ~14 GB + ~4 GB of latent cache).
    if a.batch > 1:
        real_max = 0  # the real prefill path fills one row; batched runs use synthetic cache state
    runners = [Runner(n, cfgs[n], device, dtype, contexts[-1] + extra + 1, a.static, a.cuda_graph, a.compile_step,
                      a.batch) for n in names]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for ctx in contexts:
        fills = {}
        for r in runners:
            target = max(ctx, r.cache.lengths[0])
            synthetic = target > real_max
            t0 = time.perf_counter()
            fill(r.model, r.cache, target, chunk, synthetic, r.gen)
            sync(device)
            fills[r.name] = ("synthetic" if synthetic else "prefill", time.perf_counter() - t0, r.cache.lengths[0])
        for r in runners:
            r.start(a.warmup + a.steps)
        times = {r.name: [] for r in runners}
        for i in range(a.warmup + a.steps):
            for r in runners:
                t = r.step()
                if i >= a.warmup:
                    times[r.name].append(t)
        for r in runners:
            kind, fill_s, L = fills[r.name]
            ms = statistics.median(times[r.name]) * 1e3
            mem = cache_memory(r.cfg, dtype, context=L)
            mem = {k: v * a.batch if k in ("total_bytes", "kda_bytes") else v for k, v in mem.items()}
            row = dict(context=L, ms_per_token=ms, batch=a.batch, per_output_token_ms=ms / a.batch, fill=kind,
                       fill_s=fill_s,
                       cache_bytes=mem["total_bytes"], kda_bytes=mem["kda_bytes"],
                       mla_bytes=L * mem["mla_bytes_per_token"] * a.batch,
                       cache_bytes_allocated=r.cache.memory()["total_bytes"])
            if device.type == "cuda":
                row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
            results[r.name].append(row)
            print(f"  [{r.name}] ctx {L:>8}  {ms:8.2f} ms/step ({ms / a.batch:.2f} per output token)  cache {row['cache_bytes'] / 2**20:9.2f} MiB  "
                  f"({kind} {fill_s:.1f}s)", flush=True)

    print()
    # ms per decode step (one token for each of the batch rows); per output token = step / batch
    hdr = f"{'context':>9} | {'hybrid ms/step':>14} | {'all-MLA ms/step':>15} | {'ratio':>6} | " \
          f"{'hybrid ms/out-tok':>17} | {'all-MLA ms/out-tok':>18} | {'hybrid cache':>14} | {'all-MLA cache':>14} | fill"
    mode = "cuda-graph" if a.cuda_graph else ("static" if a.static else "eager")
    mode += "+compile" if a.compile_step else ""
    print(f"preset {a.preset}, {device.type}, {str(dtype).replace('torch.', '')}, batch {a.batch} (ms per step; per output token = step / batch), {mode}, "
          f"median of {a.steps} decode steps")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for i, ctx in enumerate(contexts):
        h = results.get("hybrid", [None] * len(contexts))[i]
        m = results.get("all-mla", [None] * len(contexts))[i]
        ratio = (m["ms_per_token"] / h["ms_per_token"]) if h and m else float("nan")
        fmt = lambda r, k: f"{r[k]:.2f}" if r else "-"
        mib = lambda r: f"{r['cache_bytes'] / 2**20:.2f} MiB" if r else "-"
        print(f"{ctx:>9} | {fmt(h, 'ms_per_token'):>14} | {fmt(m, 'ms_per_token'):>15} | {ratio:>6.2f} | "
              f"{fmt(h, 'per_output_token_ms'):>17} | {fmt(m, 'per_output_token_ms'):>18} | "
              f"{mib(h):>14} | {mib(m):>14} | {(h or m)['fill']}")
        rows.append(dict(context=ctx, hybrid=h, all_mla=m, all_mla_over_hybrid=ratio))
    if a.json:
        info = dict(preset=a.preset, device=str(device), dtype=str(dtype), steps=a.steps, warmup=a.warmup,
                    mode=mode,
                    prefill_chunk=chunk, real_prefill_max=real_max, torch=torch.__version__,
                    threads=torch.get_num_threads(), platform=platform.platform(),
                    gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    memory_formula={n: cache_memory(cfgs[n], dtype) for n in names}, rows=rows)
        with open(a.json, "w") as f:
            json.dump(info, f, indent=2)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
