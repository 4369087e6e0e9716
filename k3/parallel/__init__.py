"""Distributed training on torch.distributed (issue #30): the device mesh, FSDP2 + expert parallelism applied from
outside the model, sharded Muon, global-count losses and norms, DCP checkpoints, and context parallelism (sequence slices per rank). Nothing in k3.model / k3.nn
imports torch.distributed; everything here is applied to a built model. `k3 train` under torchrun:
k3.parallel.training (docs/parallelism.md)."""
from k3.parallel.context import ContextParallel, apply_context_parallel
from k3.parallel.mesh import ParallelDims, ParallelMesh, build_mesh

__all__ = ["ParallelDims", "ParallelMesh", "build_mesh", "ContextParallel", "apply_context_parallel"]
