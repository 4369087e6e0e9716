"""`k3 plan`'s memory model vs what a distributed run measures, per rank (issue #30 §7 / §9).

    # CPU, gloo, 2 processes (launches torchrun itself):
    python benchmarks/plan_vs_measured.py --config tiny --nproc 2 --seq-len 256 --rows 2 --steps 3
    python benchmarks/plan_vs_measured.py --config tiny --nproc 2 --ep 2 --seq-len 256 --steps 3
    # GPU (NCCL): small on 2 H200s, bf16 compute over fp32 shards, activation checkpointing
    python benchmarks/plan_vs_measured.py --config small --nproc 2 --device cuda --seq-len 4096 --rows 4 \
        --steps 5 --ep 2 --json runs/plan_vs_measured_small.json

Each rank builds the model on `meta`, applies the real parallelisation (`parallelize_model`: EP, AC, FSDP2),
materialises its shards, and runs `--steps` optimizer steps (sharded Muon + AdamW) on random tokens
(`--rows` x `--seq-len` per rank). Measured, per rank:

* parameters, gradients (after the last backward) and optimizer state: exact, by summing the bytes of the local
  tensors (DTensor shards, EP slices);
* the peak: on CUDA `torch.cuda.max_memory_allocated` (everything the caching allocator handed out: weights,
  gradients, optimizer state, all-gathered units, activations); on CPU the growth of the peak RSS from before the
  model was built (`ru_maxrss`, includes the allocator's and gloo's overheads: an upper bound).

Printed next to `k3.parallel.plan.estimate` for the same mesh (its activation term with the same tokens per rank).
Without torchrun's environment the script relaunches itself under `python -m torch.distributed.run --standalone`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GiB = 1024 ** 3


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help="preset name or config.json [tiny]")
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) [2]")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row [256]")
    p.add_argument("--rows", type=int, default=2, help="rows per data rank per step [2]")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-ac", action="store_true", help="no activation checkpointing")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank [1]")
    p.add_argument("--json", default=None, help="also write the per-rank results here")
    return p.parse_args(argv)


def _relaunch(args) -> int:
    # the flags travel in the environment (torchrun's own parser would claim e.g. --nproc after the script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           os.path.abspath(__file__)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS=str(args.threads), K3_PLAN_VS_MEASURED_ARGS=json.dumps(sys.argv[1:]))
    return subprocess.call(cmd, env=env, cwd=ROOT)


def _nbytes(t) -> int:
    from torch.distributed.tensor import DTensor
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # Linux: KiB


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from k3.config import K3Config
    from k3.parallel import ParallelDims, build_mesh
    from k3.parallel.muon import build_sharded_optimizer
    from k3.parallel.parallelize import build_meta_model, global_mean_loss, materialize, parallelize_model
    from k3.parallel.plan import estimate

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    if cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo")
    cfg = K3Config.load(args.config)
    dims = ParallelDims(dp_replicate=args.dp_replicate, dp_shard=-1, cp=args.cp, ep=args.ep, world_size=world,
                        num_experts=cfg.num_experts)
    rss0 = _rss_bytes()
    pm = build_mesh(dims, dev.type)
    model = build_meta_model(cfg)
    parallelize_model(model, pm, param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32,
                      activation_checkpointing=not args.no_ac)
    materialize(model, dev, seed=0)
    model.train()
    opt = build_sharded_optimizer(model, lr=1e-3)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    T = args.seq_len
    g = torch.Generator().manual_seed(1000 + pm.dp_index())
    grad_bytes, times = 0, []
    for step in range(args.steps):
        t0 = time.time()
        ids = torch.randint(0, cfg.vocab_size, (1, args.rows * T), generator=g)
        cu = torch.arange(0, args.rows * T + 1, T, dtype=torch.int32)
        batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "cu_seqlens": cu}
        if dims.cp_enabled:
            s = model._k3_cp.shard(batch["input_ids"], batch["labels"], batch["cu_seqlens"],
                                   pad_id=cfg.pad_token_id)
            batch = {"input_ids": s.input_ids, "labels": s.labels, "cu_seqlens": s.cu_seqlens}
        batch = {k: v.to(dev) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            out = model(**batch)
        global_mean_loss(out, pm).backward()
        grad_bytes = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.time() - t0)
    meas = {
        "rank": rank,
        "param_bytes": sum(_nbytes(p) for p in model.parameters()),
        "grad_bytes": grad_bytes,
        "optim_bytes": sum(_nbytes(v) for st in opt.state.values() for v in st.values()
                           if torch.is_tensor(v) and v.ndim > 0),
        "peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else _rss_bytes() - rss0,
        "peak_kind": "cuda.max_memory_allocated" if cuda else "peak RSS growth",
        "step_s": sorted(times)[len(times) // 2] if times else None,
    }
    tokens_per_rank = args.rows * T // dims.cp
    est = estimate(cfg, dims, seq_len=args.rows * T, tokens_per_gpu=tokens_per_rank,
                   activation_checkpointing=not args.no_ac, gpu_memory=float("inf"))
    gathered = [None] * world
    dist.all_gather_object(gathered, meas)
    if rank == 0:
        e = {"param_bytes": est.param_bytes, "grad_bytes": est.grad_bytes, "optim_bytes": est.optim_bytes,
             "transient_bytes": est.transient_bytes, "activation_bytes": est.activation_bytes,
             "total_bytes": est.total_bytes}
        print(f"plan vs measured: {args.config}, {dims.describe()}, {args.device}, {tokens_per_rank} tokens per "
              f"rank per step, activation checkpointing {'off' if args.no_ac else 'on'}")
        print(f"{'':>12} {'params':>10} {'grads':>10} {'optim':>10} {'peak':>10}   (MiB)")
        print(f"{'plan r0':>12} " + " ".join(f"{e[k] / 2**20:10.2f}" for k in
                                          ("param_bytes", "grad_bytes", "optim_bytes", "total_bytes")) +
              f"   (+ transient {e['transient_bytes'] / 2**20:.2f}, activations {e['activation_bytes'] / 2**20:.2f})")
        for m in gathered:
            print(f"{'rank ' + str(m['rank']):>12} " + " ".join(f"{m[k] / 2**20:10.2f}" for k in
                  ("param_bytes", "grad_bytes", "optim_bytes", "peak_bytes")) + f"   ({m['peak_kind']})")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "mesh": dims.describe(), "plan_rank0": e, "measured": gathered}, f,
                          indent=2)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    if argv is None and "K3_PLAN_VS_MEASURED_ARGS" in os.environ:
        argv = json.loads(os.environ["K3_PLAN_VS_MEASURED_ARGS"])
    args = parse(argv)
    if "RANK" not in os.environ:
        return _relaunch(args)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
