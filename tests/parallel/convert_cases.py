"""What tests/parallel/test_convert.py runs on every rank (through launcher.run_dist)."""
from __future__ import annotations

import os

import torch.distributed as dist

from cases import batch, micro_config, reference_model, rows_of_rank, sharded_model  # noqa: E402


def train_and_save(run_dir: str, ep: int = 2) -> dict:
    """One step of the micro model (FSDP2 + EP) with sharded Muon, a DCP checkpoint in RUN/checkpoints/step-1, the
    run's config.json and a tokenizer beside it (as `k3 train` writes them). Rank 0 returns the full weights."""
    from k3.parallel.checkpoint import save_checkpoint
    from k3.parallel.muon import build_sharded_optimizer
    from k3.parallel.parallelize import full_state_dict, global_mean_loss
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = micro_config()
    model, pm = sharded_model(cfg, reference_model(cfg).state_dict(), ep=ep)
    opt = build_sharded_optimizer(model, lr=0.02)
    ids, labels = batch(11, 4, 12, cfg.vocab_size)
    global_mean_loss(model(rows_of_rank(ids, rank, world), labels=rows_of_rank(labels, rank, world)), pm).backward()
    opt.step()
    path = save_checkpoint(os.path.join(run_dir, "checkpoints"), 1, model, opt, extra={"step": 1})
    if rank == 0:
        from k3.tokenizer import build_toy_tokenizer
        cfg.save_json(os.path.join(run_dir, "config.json"))
        build_toy_tokenizer(path, num_merges=0)          # 256 bytes + 256 specials = the micro vocab
    full = full_state_dict(model)
    dist.barrier()
    return {k: v.clone() for k, v in full.items()} if rank == 0 else {}


def load_both(dcp_dir: str, release_dir: str, ep: int = 2) -> dict:
    """The converted DCP checkpoint through load_init, and the released checkpoint through the lazy per-rank
    loader (recording which released keys / rows this rank read), each into a fresh sharded model."""
    from k3.parallel.parallelize import build_meta_model, full_state_dict, materialize, parallelize_model
    from k3.parallel import ParallelDims, build_mesh
    from k3.parallel.release_load import load_init, load_released
    cfg = micro_config()
    out = {}
    for what, path in (("dcp", dcp_dir), ("release", release_dir)):
        dims = ParallelDims(dp_shard=-1, ep=ep, world_size=dist.get_world_size(), num_experts=cfg.num_experts)
        model = build_meta_model(cfg)
        parallelize_model(model, build_mesh(dims, "cpu"))
        materialize(model, "cpu", init=False)
        rec: list = []
        if what == "dcp":
            load_init(model, path)
        else:
            load_released(model, path, record=rec)
        out[what] = full_state_dict(model)
        out[what + "_record"] = rec
    return out


def roundtrip(run_dir: str, ep: int = 2) -> dict:
    """One launch for test_convert: train_and_save; rank 0 converts DCP -> released -> DCP (no process group
    used by the conversions) while the other ranks wait; then every rank loads both results (load_both)."""
    from k3.parallel.convert import STATS, dcp_to_release, release_to_dcp
    trained = train_and_save(run_dir, ep=ep)
    rel, dcp2 = os.path.join(run_dir, "release"), os.path.join(run_dir, "dcp")
    out = {"trained": trained}
    if dist.get_rank() == 0:
        dcp_to_release(run_dir, rel, dtype="float32", max_shard_size="100KB")
        out["to_release_stats"] = dict(vars(STATS))
        release_to_dcp(rel, dcp2)
        out["to_dcp_stats"] = dict(vars(STATS))
    dist.barrier()
    out.update(load_both(dcp2, rel, ep=ep))
    out["resume_refused"] = resume_model_only_refused(dcp2)
    out["trainer_init"] = trainer_init(run_dir, rel, ep=ep)
    if dist.get_rank() != 0:
        for k in ("dcp", "release", "trainer_init"):
            out.pop(k)
    return out


def resume_model_only_refused(dcp_dir: str) -> str:
    from k3.errors import CheckpointError
    from k3.parallel.checkpoint import load_checkpoint
    from k3.parallel.muon import build_sharded_optimizer
    cfg = micro_config()
    model, _ = sharded_model(cfg, reference_model(cfg).state_dict())
    try:
        load_checkpoint(dcp_dir, model, build_sharded_optimizer(model, lr=0.02))
    except CheckpointError as e:
        return str(e)
    return "loaded"


def trainer_init(run_dir: str, init: str, ep: int = 2) -> dict:
    """`k3 train` under torchrun starting from `init` (TrainConfig.init_from): DistTrainer.setup() only; its
    model's full weights (every rank read its own shards of the released files)."""
    from k3.parallel.parallelize import full_state_dict
    from k3.parallel.training import MeshFlags, make_trainer
    from k3.train.config import TrainConfig
    corpus = os.path.join(run_dir, "corpus.txt")
    if dist.get_rank() == 0:
        with open(os.path.join(os.path.dirname(__file__), "cases.py")) as f:
            open(corpus, "w").write(f.read())
    dist.barrier()
    cfg = TrainConfig(out_dir=os.path.join(run_dir, "from_init"), data=[corpus], init_from=init,
                      cache_dir=os.path.join(run_dir, "cache"), steps=1, tokens_per_step=128, stages=[(32, 1.0)], device="cpu", progress=False,
                      tensorboard=False, samples=False, eval_every=0, threads=1)
    tr = make_trainer(cfg, MeshFlags(ep=ep))
    try:
        tr.setup()
        return full_state_dict(tr.model)
    finally:
        tr.close()
