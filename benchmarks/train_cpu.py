"""Training throughput: tokens/s of full optimizer steps (forward + backward + MuonAdamW + QK-clip + balancer).

    python benchmarks/train_cpu.py                          # tiny on CPU, seq 256/1024, 2048 tokens per step
    python benchmarks/train_cpu.py --threads 1 2 --seq-lens 256 1024 2048
    python benchmarks/train_cpu.py --device cuda --preset small --tokens 65536 --seq-lens 4096   # H200: bf16 + MFU

Random token ids (no data pipeline in the timing), packed as the trainer packs them (k3.train.data.PackedLoader):
each step is one [1, rows*seq] row with `cu_seqlens` marking row starts and random document boundaries (mean
document ~`--doc-len` tokens); `--no-packed` gives plain [rows, seq] batches instead. Each configuration runs
`--warmup` steps, then `--steps` timed steps; `cpu s` is the process CPU time of a step (steadier than wall time
on a shared machine when running 1 thread). MFU uses a FLOP count of 6 x active non-embedding params per token (forward+backward matmuls, incl. the
lm_head) + attention / KDA terms per token:
    MLA (causal): 6 * 0.5*T * H * (qk_head_dim + v_head_dim)   per layer   (QK^T and PV, fwd+bwd, causal half)
    KDA (chunked, chunk C=64): 6 * H * (C * (2K + V) + 2 K V)    per layer   (intra-chunk attention + state I/O)
(KDA: V = K = head_dim; intra-chunk QK^T and AV, plus state read/update), against `--peak-tflops` (default 685).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from k3.config import K3Config


def active_params(cfg: K3Config) -> dict:
    """Parameters used per token: total and non-embedding (lm_head counted as compute, embeddings not)."""
    from k3.model import K3ForCausalLM
    with torch.device("meta"):
        m = K3ForCausalLM(cfg)
    total = emb = 0
    routed_total = routed_active = 0
    for name, p in m.named_parameters():
        n = p.numel()
        total += n
        if "embed_tokens" in name:
            emb += n
        if ".experts." in name:
            routed_total += n
            routed_active += n * cfg.num_experts_per_token // max(cfg.num_experts, 1)
    active = total - routed_total + routed_active
    return {"total": total, "active": active, "active_compute": active - emb}


def flops_per_token(cfg: K3Config, seq_len: int) -> float:
    f = 6.0 * active_params(cfg)["active_compute"]
    H, dq, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    Hk, K = cfg.lac.num_heads, cfg.lac.head_dim
    C = 64
    for t in cfg.layer_types:
        if t == "mla":
            f += 6.0 * 0.5 * seq_len * H * (dq + dv)
        else:
            f += 6.0 * Hk * (C * (2 * K + K) + 2 * K * K)
    return f


def packed_batch(rows: int, seq_len: int, vocab: int, doc_len: int, g: torch.Generator) -> dict:
    """One trainer-style packed batch: input_ids/labels [1, rows*seq_len] and cu_seqlens (row and document starts)."""
    import numpy as np
    from k3.train.data import _finish_batch
    rng = np.random.default_rng(int(torch.randint(0, 2 ** 31, (1,), generator=g)))
    ids, starts = [], []
    for _ in range(rows):
        st, pos = [], 0
        while True:
            pos += int(rng.integers(max(1, doc_len // 4), 2 * doc_len))
            if pos >= seq_len:
                break
            st.append(pos)
        ids.append(rng.integers(0, vocab, seq_len))
        starts.append(st)
    return _finish_batch(ids, starts, seq_len)


def bench_one(cfg: K3Config, seq_len: int, tokens: int, steps: int, warmup: int, device: torch.device,
              balancer: str, ckpt: bool, packed: bool = True, doc_len: int = 300) -> dict:
    from k3.model import K3ForCausalLM
    from k3.train.optim import build_optimizer, qk_clip
    torch.manual_seed(0)
    with torch.device(device):
        model = K3ForCausalLM(cfg)
    model.float().train()
    if ckpt:
        model.set_gradient_checkpointing(True)
    for m in model.modules():
        if hasattr(m, "track_max_logit"):
            m.track_max_logit = True
    opt = build_optimizer(model, lr=1e-3)
    bal = None
    if cfg.num_experts and balancer != "none":
        try:
            from k3.balance import make_balancer
            bal = make_balancer(balancer).attach(model)
        except ImportError:
            pass
    rows = max(1, tokens // seq_len)
    vocab = min(cfg.vocab_size - 256, cfg.vocab_size)
    g = torch.Generator().manual_seed(0)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    times, fb_times, cpu_times = [], [], []
    for i in range(warmup + steps):
        if packed:
            batch = {k: v.to(device) for k, v in packed_batch(rows, seq_len, vocab, doc_len, g).items()}
        else:
            ids = torch.randint(0, vocab, (rows, seq_len), generator=g).to(device)
            batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        with amp:
            out = model(**batch)
        out.loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        qk_clip(model)
        if bal is not None:
            bal.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t2, c2 = time.perf_counter(), time.process_time()
        if i >= warmup:
            times.append(t2 - t0)
            fb_times.append(t1 - t0)
            cpu_times.append(c2 - c0)
    step = sorted(times)[len(times) // 2]
    fb = sorted(fb_times)[len(fb_times) // 2]
    ntok = rows * seq_len
    res = {"seq_len": seq_len, "rows": rows, "tokens": ntok, "step_s": step, "fwd_bwd_s": fb, "opt_s": step - fb,
           "tokens_per_s": ntok / step, "cpu_s": sorted(cpu_times)[len(cpu_times) // 2], "packed": packed}
    if device.type == "cuda":
        res["tflops"] = flops_per_token(cfg, seq_len) * ntok / step / 1e12
        res["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per optimizer step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, nargs="+", default=None, help="CPU thread counts to try")
    p.add_argument("--balancer", default="qb")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True,
                   help="trainer-style packed rows with cu_seqlens (default) or plain [rows, seq] batches")
    p.add_argument("--doc-len", type=int, default=300, help="mean document length of the packed batches")
    p.add_argument("--peak-tflops", type=float, default=685.0)
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    cfg = K3Config.load(a.preset)
    device = torch.device(a.device)
    ap = active_params(cfg)
    print(f"# {a.preset}: {ap['total'] / 1e6:.1f}M params, {ap['active'] / 1e6:.1f}M active/token; device {device}"
          + (" (bf16 autocast)" if device.type == "cuda" else " (fp32)"), flush=True)
    threads = a.threads if (a.threads and device.type == "cpu") else [torch.get_num_threads()]
    rows = []
    hdr = f"{'threads':>7} {'seq':>6} {'rows':>5} {'step s':>8} {'fwd+bwd s':>9} {'opt s':>7} {'tok/s':>9} {'cpu s':>7}"
    if device.type == "cuda":
        hdr += f" {'TFLOP/s':>8} {'MFU':>6} {'mem GB':>7}"
    print(hdr, flush=True)
    for nt in threads:
        torch.set_num_threads(nt)
        for T in a.seq_lens:
            r = bench_one(cfg, T, max(a.tokens, T), a.steps, a.warmup, device, a.balancer,
                          a.activation_checkpointing, a.packed, a.doc_len)
            r["threads"] = nt
            line = (f"{nt:>7} {T:>6} {r['rows']:>5} {r['step_s']:>8.2f} {r['fwd_bwd_s']:>9.2f} {r['opt_s']:>7.2f} "
                    f"{r['tokens_per_s']:>9.0f} {r['cpu_s']:>7.2f}")
            if "tflops" in r:
                r["mfu"] = r["tflops"] / a.peak_tflops
                line += f" {r['tflops']:>8.1f} {100 * r['mfu']:>5.1f}% {r['peak_mem_gb']:>7.1f}"
            print(line, flush=True)
            rows.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"preset": a.preset, "device": str(device), "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
