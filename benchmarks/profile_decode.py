"""Profile single-token decode steps of a preset (where does a decode step's time go?).

    python benchmarks/profile_decode.py --device cuda --preset small --context 512 --steps 3
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from k3.config import K3Config
from k3.generation.cache import K3Cache
from k3.model import K3ForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="tiny")
ap.add_argument("--device", default="cpu")
ap.add_argument("--context", type=int, default=512)
ap.add_argument("--steps", type=int, default=3)
a = ap.parse_args()
dev = torch.device(a.device)
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
cfg = K3Config.from_preset(a.preset)
with dev:
    model = K3ForCausalLM(cfg).to(dtype).eval()
cache = K3Cache.for_model(model, 1)
ids = torch.randint(0, cfg.vocab_size, (1, a.context), device=dev)
with torch.no_grad():
    model(ids, cache=cache, logits_to_keep=1)
    tok = torch.randint(0, cfg.vocab_size, (1, 1), device=dev)
    for _ in range(3):
        model(tok, cache=cache, logits_to_keep=1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t = time.time()
        for _ in range(a.steps):
            model(tok, cache=cache, logits_to_keep=1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"{(time.time() - t) / a.steps * 1e3:.2f} ms/step")
key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
