"""The device mesh of a distributed k3 run (issue #30; context parallelism, issue #31, slots into the `cp` dim).

Dims, outermost first (`init_device_mesh` names):

    dp_replicate   HSDP replicas: parameters replicated, gradients all-reduced across them
    dp_shard       FSDP2 sharding of every parameter
    cp             context parallelism (a sequence split over ranks); also shards parameters, as TorchTitan does

Every rank is a data rank (each sees its own tokens), so the loss and the balancer statistics reduce over all of
them (`dp_cp`). Expert parallelism is *folded* into the data ranks: the dp_shard x cp ranks of one replica are
viewed as (efsdp, ep), consecutive ranks forming one `ep` group. Routed experts are split over `ep` (each rank
computes E/ep of them on the tokens of its whole ep group, moved there by all-to-all) and FSDP-sharded over
`efsdp`; every other parameter is FSDP-sharded over `dp_shard_cp`.

Submeshes that `build_mesh` creates (all views of one root mesh):

    fsdp         (dp_replicate, dp_shard_cp) or (dp_shard_cp,)   FSDP mesh of non-expert parameters
    expert_fsdp  (dp_replicate, efsdp) or (efsdp,)               FSDP mesh of the routed experts (ep > 1)
    ep           (ep,)                                            token all-to-all group
    data         (dp_cp,)                                         loss count / balancer / grad-norm reductions
    cp           (cp,)                                            the ranks sharing one sequence (cp > 1;
                                                                  consecutive ranks, k3/parallel/context.py)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from k3.errors import K3ConfigError

__all__ = ["ParallelDims", "ParallelMesh", "build_mesh"]


def _bad(key: str, msg: str):
    raise K3ConfigError(f"parallel dims: {key}: {msg}")


@dataclass
class ParallelDims:
    """The parallel degrees of a run. `dp_shard=-1` fills the world: world_size / (dp_replicate * cp).
    `num_experts` (optional, also checked by `check_model`) validates `ep` against the model.

    Raises K3ConfigError (naming the field) on: non-positive degrees, a product != world_size, ep not dividing
    dp_shard * cp (EP is folded into the data/context ranks), num_experts % ep != 0, ep > 1 on a model without
    routed experts."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    ep: int = 1
    world_size: int = 1
    num_experts: Optional[int] = None

    def __post_init__(self):
        for key in ("dp_replicate", "dp_shard", "cp", "ep", "world_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int):
                _bad(key, f"must be an int, got {v!r}")
        if self.world_size < 1:
            _bad("world_size", f"must be >= 1, got {self.world_size}")
        for key in ("dp_replicate", "cp", "ep"):
            if getattr(self, key) < 1:
                _bad(key, f"must be >= 1, got {getattr(self, key)}")
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.cp
            if self.world_size % rest:
                _bad("dp_shard", f"-1 (fill the world) needs dp_replicate * cp = {rest} to divide the world size "
                                 f"{self.world_size}")
            self.dp_shard = self.world_size // rest
        elif self.dp_shard < 1:
            _bad("dp_shard", f"must be >= 1 or -1 (fill the world), got {self.dp_shard}")
        prod = self.dp_replicate * self.dp_shard * self.cp
        if prod != self.world_size:
            _bad("world_size", f"dp_replicate * dp_shard * cp = {self.dp_replicate} * {self.dp_shard} * {self.cp} "
                               f"= {prod} != world size {self.world_size}")
        if self.dp_shard_cp % self.ep:
            _bad("ep", f"expert parallelism is folded into the data/context ranks of one replica: ep={self.ep} must "
                       f"divide dp_shard * cp = {self.dp_shard} * {self.cp} = {self.dp_shard_cp}")
        if self.num_experts is not None:
            self.check_experts(self.num_experts)

    def check_experts(self, num_experts: int) -> None:
        if self.ep > 1 and num_experts <= 0:
            _bad("ep", f"ep={self.ep} needs a model with routed experts (num_experts = {num_experts})")
        if num_experts > 0 and num_experts % self.ep:
            _bad("ep", f"num_experts = {num_experts} is not divisible by ep = {self.ep}")

    def check_seq_len(self, seq_len: int) -> None:
        """Context parallelism cuts each sequence into cp contiguous slices of ceil(seq_len / cp) tokens (the
        tail padded): a sequence shorter than cp would leave a rank nothing but padding."""
        if self.cp > 1 and int(seq_len) < self.cp:
            _bad("cp", f"cp={self.cp} needs sequences of at least cp tokens, got seq_len={seq_len}")

    def check_model(self, cfg) -> None:
        """Validate against a K3Config (num_experts % ep); raises K3ConfigError."""
        self.check_experts(int(getattr(cfg, "num_experts", 0)))

    # ---- derived sizes
    @property
    def dp_shard_cp(self) -> int:
        return self.dp_shard * self.cp

    @property
    def data_ranks(self) -> int:
        """Ranks holding distinct tokens (dp_replicate * dp_shard * cp = world size)."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """FSDP degree of the routed experts inside one replica: dp_shard * cp / ep."""
        return self.dp_shard_cp // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def describe(self) -> str:
        s = f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp}"
        if self.ep > 1:
            s += f" ep={self.ep} (experts FSDP over {self.efsdp})"
        return s + f" world={self.world_size}"


@dataclass
class ParallelMesh:
    """The root mesh (dp_replicate, dp_shard, cp) and the named views a run uses (see module doc)."""

    dims: ParallelDims
    world: object                       # DeviceMesh (dp_replicate, dp_shard, cp)
    fsdp: object                        # DeviceMesh, FSDP of non-expert parameters
    data: object                        # 1-D DeviceMesh over all data ranks (dp_cp)
    ep: Optional[object] = None         # 1-D DeviceMesh (ep > 1)
    cp: Optional[object] = None         # 1-D DeviceMesh (cp > 1): the ranks of one sequence's slices
    expert_fsdp: Optional[object] = None  # DeviceMesh, FSDP of the routed experts (ep > 1)
    extra: dict = field(default_factory=dict)

    @property
    def device_type(self) -> str:
        return self.world.device_type

    def data_group(self):
        return self.data.get_group()

    def ep_group(self):
        return self.ep.get_group() if self.ep is not None else None

    def cp_group(self):
        return self.cp.get_group() if self.cp is not None else None

    def dp_index(self) -> int:
        """This rank's data-parallel index in 0 .. dp_replicate * dp_shard - 1: which sequences it loads. The cp
        ranks of one group (consecutive, cp is the innermost dim) share it and each takes a slice of the same
        sequences (k3.parallel.context.ContextParallel.shard)."""
        import torch.distributed as dist
        return dist.get_rank() // self.dims.cp

    def cp_rank(self) -> int:
        """This rank's position in its cp group (0 when cp = 1)."""
        import torch.distributed as dist
        return dist.get_rank() % self.dims.cp


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> ParallelMesh:
    """`init_device_mesh(device_type, (dp_replicate, dp_shard, cp))` with the flattened/unflattened views of the
    module doc. Needs an initialised default process group of `dims.world_size` ranks (or the environment of
    torchrun, from which `init_device_mesh` initialises it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != dims.world_size:
        _bad("world_size", f"{dims.world_size} != the process group's world size {dist.get_world_size()}")
    # one 1-D root over all ranks, unflattened into each layout (views of the same root; no flattened-dim slicing)
    root = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("dp_cp",))
    R, S, C, E = dims.dp_replicate, dims.dp_shard, dims.cp, dims.ep
    world = root._unflatten(0, (R, S, C), ("dp_replicate", "dp_shard", "cp"))
    rep_shard = root._unflatten(0, (R, S * C), ("dp_replicate", "dp_shard_cp"))
    fsdp = rep_shard if dims.hsdp else rep_shard["dp_shard_cp"]
    data = root
    ep = expert_fsdp = None
    extra = {"dp_replicate_dp_shard_cp": rep_shard}
    if dims.ep_enabled:
        # (dp_replicate, dp_shard_cp) -> (dp_replicate, efsdp, ep): consecutive ranks of a replica form an ep group
        emesh = root._unflatten(0, (R, dims.efsdp, E), ("dp_replicate", "efsdp", "ep"))
        ep = emesh["ep"]
        expert_fsdp = emesh["dp_replicate", "efsdp"] if dims.hsdp else emesh["efsdp"]
        extra["expert_mesh"] = emesh
    cp = world["cp"] if dims.cp_enabled else None
    return ParallelMesh(dims=dims, world=world, fsdp=fsdp, data=data, ep=ep, expert_fsdp=expert_fsdp, cp=cp,
                        extra=extra)
