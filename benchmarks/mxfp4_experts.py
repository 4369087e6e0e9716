"""MXFP4 routed experts: kept packed in memory (dequantised inside the expert matmul) vs dequantised on load.

Writes one random model as an MXFP4 checkpoint (released layout), then loads it in a fresh process per mode
(`from_pretrained(dir)` = dequantise on load, `from_pretrained(dir, packed_experts=True)` = packed) and reports:
peak RSS after load and after the forwards (VmHWM, the process's high-water mark; the import-only baseline is
subtracted), the bytes of the routed-expert weights in memory, and the median ms per forward for a prefill of
--tokens tokens and a 1-token step (no cache: the forward of one token), for the whole model and for one
LatentMoE layer alone (the only part that differs between the modes).

CPU:  python benchmarks/mxfp4_experts.py --json mxfp4_cpu.json            (small config, ~1 min)
CUDA: python benchmarks/mxfp4_experts.py --device cuda --preset small --dtype bfloat16 --json mxfp4_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SMALL = dict(hidden_size=512, num_hidden_layers=4, vocab_size=4096, bos_token_id=3840, eos_token_id=3842,
             pad_token_id=4095, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4,
             q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             num_experts=64, num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=256,
             routed_expert_hidden_size=256, attn_res_block_size=2, dtype="float32",
             **{"linear_attn_config.num_heads": 4, "linear_attn_config.head_dim": 64,
                "linear_attn_config.full_attn_layers": [4], "linear_attn_config.kda_layers": [1, 2, 3]})


def _rss_mb() -> float:
    """Peak resident set of this process (VmHWM; ru_maxrss would carry the parent's peak across fork+exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, warmup: int, iters: int, device) -> float:
    """Median ms (rounded to 3 decimals) of `iters` no-grad calls of fn() after `warmup` untimed ones, synced."""
    times = []
    with torch.no_grad():
        for i in range(warmup + iters):
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 3)


def child(a) -> dict:
    from k3.checkpoint import from_pretrained
    from k3.nn.moe import LatentMoE, PackedMXFP4Experts
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    base = _rss_mb()
    t0 = time.perf_counter()
    model = from_pretrained(a.ckpt, device=device, dtype=a.dtype, packed_experts=(a.child == "packed"))
    load_s = time.perf_counter() - t0
    after_load = _rss_mb()
    expert_bytes = 0
    for m in model.modules():
        if isinstance(m, LatentMoE):
            ts = m.experts.buffers() if isinstance(m.experts, PackedMXFP4Experts) else m.experts.parameters()
            expert_bytes += sum(t.numel() * t.element_size() for t in ts)
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    res = {}
    for name, T in (("prefill", a.tokens), ("one_token", 1)):
        ids = torch.randint(0, V, (1, T), generator=g).to(device)
        res[f"{name}_ms"] = _median_ms(lambda: model(ids), a.warmup, a.iters, device)
    # one LatentMoE layer alone (the part that differs), same input in both modes
    moe = next(m for m in model.modules() if isinstance(m, LatentMoE))
    d = model.config.hidden_size
    for name, T in (("moe_layer_prefill", a.tokens), ("moe_layer_one_token", 1)):
        x = torch.randn(1, T, d, generator=g).to(device=device, dtype=model.dtype)
        res[f"{name}_ms"] = _median_ms(lambda: moe(x), a.warmup, 3 * a.iters, device)
    out = {"mode": a.child, "load_s": round(load_s, 3), "baseline_rss_mb": round(base, 1),
           "peak_rss_after_load_mb": round(after_load - base, 1), "peak_rss_total_mb": round(_rss_mb() - base, 1),
           "expert_weight_mb": round(expert_bytes / 2**20, 2), **res}
    if device.type == "cuda":
        out["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="a k3 preset instead of the built-in small config")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--child", choices=("dequant", "packed"), help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)))
        return 0
    from k3.checkpoint import save_pretrained
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    cfg = K3Config.from_preset(a.preset) if a.preset else K3Config.from_preset("tiny", **SMALL)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = K3ForCausalLM(cfg)
        ckpt = save_pretrained(model, os.path.join(tmp, "ckpt"), quantize_experts=True)
        n_routed = sum(m.experts.gate_up_proj.numel() + m.experts.down_proj.numel()
                       for m in model.modules() if hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj"))
        del model
        rows = []
        for mode in ("dequant", "packed"):
            cmd = [sys.executable, __file__, "--child", mode, "--ckpt", ckpt, "--device", a.device,
                   "--dtype", a.dtype, "--tokens", str(a.tokens), "--iters", str(a.iters), "--warmup",
                   str(a.warmup), "--threads", str(a.threads)]
            r = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    d, pk = rows
    summary = {"config": a.preset or "built-in small (d 512, 4 layers, 64 experts of 256x256, top-4)",
               "routed_expert_params": n_routed, "device": a.device, "dtype": a.dtype, "threads": a.threads,
               "tokens": a.tokens, "torch": torch.__version__, "machine": platform.machine(),
               "bits_per_expert_param_packed": round(pk["expert_weight_mb"] * 2**20 * 8 / n_routed, 3),
               "results": rows}
    print(f"{'mode':8} {'load s':>7} {'RSS load MB':>12} {'RSS peak MB':>12} {'experts MB':>11} "
          f"{'prefill ms':>11} {'1-tok ms':>9} {'MoE pre ms':>11} {'MoE 1 ms':>9}")
    for r in rows:
        print(f"{r['mode']:8} {r['load_s']:7.2f} {r['peak_rss_after_load_mb']:12.1f} {r['peak_rss_total_mb']:12.1f} "
              f"{r['expert_weight_mb']:11.2f} {r['prefill_ms']:11.2f} {r['one_token_ms']:9.2f} "
              f"{r['moe_layer_prefill_ms']:11.2f} {r['moe_layer_one_token_ms']:9.2f}")
    print(f"packed routed experts: {summary['bits_per_expert_param_packed']} bits/param")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
