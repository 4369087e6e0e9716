"""CPU benchmark: forward+backward tokens/s of a preset (default `tiny`), and chunk_kda vs recurrent_kda at T=2048.

    python benchmarks/cpu_model.py [--preset tiny] [--seq-len 1024] [--steps 5] [--json out.json]

Prints medians and the chunk/recurrent ratio measured in the same run (CPU timings are noisy: compare ratios).
"""
import argparse
import json
import platform
import time

import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.ops.kda import chunk_kda, recurrent_kda

from _common import median_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--kda-T", type=int, default=2048)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    res = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine()}
    cfg = K3Config.from_preset(a.preset)
    model = K3ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len))

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids.roll(-1, 1)).loss.backward()

    step()  # warm-up
    t = median_s(step, a.steps)
    res["model"] = dict(preset=a.preset, tokens=a.batch * a.seq_len, fwd_bwd_s=t, tokens_per_s=a.batch * a.seq_len / t)
    with torch.no_grad():
        tf = median_s(lambda: model(ids), a.steps)
    res["model"]["fwd_tokens_per_s"] = a.batch * a.seq_len / tf

    H, K, T = 4, 64, a.kda_T
    q, k, v = (torch.randn(1, T, H, K) for _ in range(3))
    g = -5 * torch.rand(1, T, H, K)
    beta = torch.rand(1, T, H)
    q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    chunk_kda(q, k, v, g, beta)
    tc = median_s(lambda: chunk_kda(q, k, v, g, beta), 3)
    tr = median_s(lambda: recurrent_kda(q, k, v, g, beta), 3)
    res["kda"] = dict(T=T, H=H, K=K, chunk_s=tc, recurrent_s=tr, speedup=tr / tc)
    print(f"{'what':<36}{'value':>14}")
    print(f"{a.preset + ' fwd+bwd tokens/s':<36}{res['model']['tokens_per_s']:>14.0f}")
    print(f"{a.preset + ' fwd tokens/s':<36}{res['model']['fwd_tokens_per_s']:>14.0f}")
    print(f"{'chunk_kda T=%d (ms)' % T:<36}{tc * 1e3:>14.1f}")
    print(f"{'recurrent_kda T=%d (ms)' % T:<36}{tr * 1e3:>14.1f}")
    print(f"{'chunk speedup over recurrent':<36}{tr / tc:>14.1f}x")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
