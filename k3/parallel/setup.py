"""What `DistTrainer` builds before its first step (k3.parallel.training): the run's data (rank 0
first), and the model on the device mesh -- built on `meta`, parallelised, materialised and initialised or loaded
per rank. A multimodal config (`k3.multimodal.is_multimodal_config`: the `--task vision-synth` / `image-text`
runs) builds `K3ForConditionalGeneration` with `k3.parallel.vision` (tower blocks and projector as FSDP units, the
tower run on every rank)."""
from __future__ import annotations

import time
from typing import Optional

import torch

from k3.errors import K3ConfigError

__all__ = ["EXACT_INIT_MAX_PARAMS", "build_run_data", "build_parallel_model", "refuse_cp_unsupported"]

# models up to this size are initialised as one full CPU copy per rank (then sharded): the same weights as the
# single-process run, whatever the mesh
EXACT_INIT_MAX_PARAMS = 2_000_000_000


def build_run_data(trainer, mcfg, tok_path: Optional[str]):
    """The run's data, resolved as in one process (`Trainer._resolved_data_factory`): an external source as
    `Trainer(data=...)` takes, the SFT data of `k3 sft` (`task == "sft"`, assistant-only labels), or
    `k3.train.data.build_data`. The SFT source needs a tokenizer (--tokenizer / the checkpoint's tokenizer.json:
    `Trainer._factory_tokenizer`'s K3ConfigError, raised on every rank before any work); an external factory gets
    None without one and brings its own (the vision tasks, k3.parallel.vision_train). Rank 0 first (it trains /
    tokenizes into the cache), then the others read the cache. Returns (data, seconds)."""
    from k3.train.data import build_data
    cfg = trainer.cfg
    first_seq = trainer._stage_seq_len(0)
    rows = cfg.tokens_per_step // first_seq
    t0 = time.time()
    factory = trainer._resolved_data_factory()
    tok = None
    if factory is not None:   # on every rank: a missing tokenizer stops them all alike
        tok = trainer._factory_tokenizer(tok_path, optional=factory is trainer._data_factory)
    data = None
    for turn in (True, False):
        if trainer.is_rank0 == turn:
            if factory is not None:
                data = factory(tok, first_seq, rows, cfg.seed)
            else:
                data = build_data(cfg.data, vocab_size=mcfg.vocab_size, seq_len=first_seq, batch_size=rows,
                                  seed=cfg.seed, tokenizer_path=tok_path, cache=cfg.cache_dir,
                                  split_sections=cfg.split_sections)
        trainer._barrier()
    return data, time.time() - t0


def refuse_cp_unsupported(dims, mcfg) -> None:
    """Context parallelism splits each sequence over ranks; two model parts cannot run on such slices: the vision
    tower (images) and multi-token prediction (its shifted inputs and targets would stop at each slice's end)."""
    if not dims.cp_enabled:
        return
    from k3.multimodal import is_multimodal_config
    if is_multimodal_config(mcfg):
        raise K3ConfigError(f"--cp {dims.cp}: context parallelism is not supported with images (a multimodal "
                            f"model); use --cp 1 and data parallelism (--dp-shard / --dp-replicate)")
    n_mtp = int(getattr(mcfg, "num_nextn_predict_layers", 0) or 0)
    if n_mtp > 0:
        raise K3ConfigError(f"--cp {dims.cp}: multi-token prediction (num_nextn_predict_layers={n_mtp}) is not "
                            f"supported with context parallelism (each rank's slice would lose the next slice's "
                            f"tokens at its end); use --cp 1, or num_nextn_predict_layers=0")


def build_parallel_model(trainer, mcfg, pmesh, *, fresh: bool, init: Optional[str]):
    """The model on `pmesh` (`parallelize_model`: EP -> CP -> AC -> compile -> FSDP2; multimodal:
    `parallelize_multimodal`), materialised on `trainer.device`. `fresh` (no checkpoint to resume): up to
    `EXACT_INIT_MAX_PARAMS` parameters initialised as the single-process run does (a CPU copy per rank from the
    same seed, each keeping its shards), a larger one shard by shard; `init`: loaded per rank from that released
    / DCP checkpoint. Returns the model (train mode, MLA max-logit tracking on); sets `trainer.param_dtype`,
    `trainer.compile_mode`, `trainer.num_params`."""
    from k3.multimodal import is_multimodal_config
    from k3.parallel.parallelize import build_meta_model, load_full_state_dict, materialize, parallelize_model
    from k3.parallel.release_load import load_init
    from k3.train.config import resolve_compile, resolve_param_dtype
    cfg, device = trainer.cfg, trainer.device
    multimodal = is_multimodal_config(mcfg)
    refuse_cp_unsupported(trainer.dims, mcfg)   # also for a model config read from --init / a resumed run
    trainer.param_dtype = resolve_param_dtype(cfg.param_dtype, device)
    trainer.compile_mode = resolve_compile(cfg.compile, device)
    if trainer.compile_mode == "model":
        trainer.compile_mode = "layers"      # FSDP units are layers: compile per layer
    if multimodal:
        from k3.parallel.vision import build_meta_multimodal, parallelize_multimodal
        model, parallelize = build_meta_multimodal(mcfg), parallelize_multimodal
    else:
        model, parallelize = build_meta_model(mcfg), parallelize_model
    trainer.num_params = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if hasattr(m, "track_max_logit"):
            m.track_max_logit = True
    # --param-dtype bf16: FSDP computes in bf16 over fp32 shards (the fp32 master is the shard itself); fp32:
    # fp32 shards, bf16 autocast on CUDA as in one process (Trainer._autocast)
    mp_dtype = torch.bfloat16 if trainer.param_dtype == "bf16" else (
        torch.float32 if device.type == "cuda" else None)
    parallelize(model, pmesh, param_dtype=mp_dtype, reduce_dtype=torch.float32,
                activation_checkpointing=cfg.activation_checkpointing, compile=trainer.compile_mode)
    exact = fresh and init is None and trainer.num_params <= EXACT_INIT_MAX_PARAMS
    materialize(model, device, seed=cfg.seed, init=fresh and init is None and not exact)
    if init is not None:   # each rank reads only its shards / experts (k3.parallel.release_load)
        load_init(model, init)
    if exact:   # the single-process init (same seed, same RNG stream), each rank keeping its shards
        if multimodal:
            from k3.multimodal import K3ForConditionalGeneration as cls
        else:
            from k3.model import K3ForCausalLM as cls
        with torch.device("cpu"):
            full = cls(mcfg)
        full.float()
        load_full_state_dict(model, full.state_dict())
        del full
    model.train()
    return model
