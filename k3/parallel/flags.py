"""The mesh flags of `k3 train` under torchrun (--dp-replicate, --dp-shard, --cp, --ep) and what is checked from
them before any work: the mesh itself (`ParallelDims`, its errors naming the flags) and the batch shape
(`check_batch_shape`). Used by k3.parallel.training.make_trainer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from k3.errors import K3ConfigError
from k3.parallel.mesh import ParallelDims

__all__ = ["MeshFlags", "mesh_dims", "check_batch_shape"]

_FLAGS = {"dp_replicate": "--dp-replicate", "dp_shard": "--dp-shard", "cp": "--cp", "ep": "--ep",
          "world_size": "torchrun's WORLD_SIZE (--nproc-per-node x --nnodes)"}


@dataclass
class MeshFlags:
    """The mesh flags of `k3 train` (None: not given)."""
    dp_replicate: Optional[int] = None
    dp_shard: Optional[int] = None
    cp: Optional[int] = None
    ep: Optional[int] = None

    def given(self) -> bool:
        return any(v is not None for v in (self.dp_replicate, self.dp_shard, self.cp, self.ep))

    def describe(self) -> str:
        return " ".join(f"{_FLAGS[k]} {v}" for k, v in vars(self).items() if v is not None)


def mesh_dims(flags: MeshFlags, world: int, num_experts: int) -> ParallelDims:
    try:
        return ParallelDims(dp_replicate=flags.dp_replicate or 1,
                            dp_shard=flags.dp_shard if flags.dp_shard is not None else -1,
                            cp=flags.cp or 1, ep=flags.ep or 1, world_size=world,
                            num_experts=num_experts)
    except K3ConfigError as e:
        msg = str(e)
        for k, f in _FLAGS.items():
            msg = msg.replace(f"parallel dims: {k}:", f"{f}:", 1)
        raise K3ConfigError(f"k3 train mesh ({flags.describe() or 'defaults'}, world size {world}): {msg}") from None


def check_batch_shape(cfg, dims: ParallelDims) -> None:
    """Every stage's rows per step split into --grad-accum micro-batches of whole rows per data-parallel rank, and
    each cp group's sequence (its rows x seq_len) has at least cp tokens. Raises K3ConfigError naming the flags."""
    from k3.train.config import parse_stages
    dp = dims.dp_replicate * dims.dp_shard
    ga = cfg.grad_accum
    for seq, _ in parse_stages(cfg.stages):
        rows = cfg.tokens_per_step // seq
        if rows % (ga * dp):
            raise K3ConfigError(
                f"--batch-tokens {cfg.tokens_per_step} at stage seq_len {seq} gives {rows} rows per step, which do "
                f"not split into --grad-accum {ga} micro-batches x {dp} data-parallel ranks (dp_replicate "
                f"{dims.dp_replicate} x dp_shard {dims.dp_shard}): use --batch-tokens a multiple of "
                f"{seq * ga * dp} (seq_len x grad_accum x data ranks), or fewer data ranks")
        dims.check_seq_len(rows // (ga * dp) * seq)
