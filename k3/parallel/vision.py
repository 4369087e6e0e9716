"""FSDP2 for the multimodal model (issue #32 §5): `K3ForConditionalGeneration` sharded like the text model, plus
the MoonViT tower and the projector.

    model = build_meta_multimodal(cfg)                   # container config (text + vision_config), on `meta`
    parallelize_multimodal(model, pm)                     # LM units as k3.parallel.parallelize + vision units
    materialize(model, "cpu", init=False); load_full_state_dict(model, sd)   # k3.parallel.parallelize
    # (or materialize(model, dev, seed=0): K3ForConditionalGeneration.reset_parameters on the shards)
    out = model(ids, pixel_values, grid_thw, labels=labels)   # pixel_values/grid_thw None on a rank with no image
    global_mean_loss(out, pm).backward()

FSDP2 units: the language model's (`parallelize_model`: each decoder layer, the embedding, [norm + lm_head], the
language model's root), each tower block (`vision_tower.encoder.blocks.{i}`), the projector (`mm_projector`), and
the root (the tower's patch embedding, position table and final norm).

The tower runs on every rank on every step: a rank whose micro-batch has no image runs the tower and projector on
a blank 2x2-patch image and adds 0 * its sum to the embeddings (`model.always_run_tower`, set here), before the
embedding lookup, as a rank with images does. Every rank then all-gathers and reduce-scatters the same units in
the same order; without it a rank with images waits in the tower's all-gather while a rank without images is
already in the embedding's -- a deadlock (or, on gloo, a size mismatch). The dummy contributes exactly 0 to the
loss and to every gradient.

Not supported together with images: context parallelism (the image expansion happens before a CP split would;
`K3ConfigError`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from k3.errors import K3ConfigError
from k3.parallel.mesh import ParallelMesh

__all__ = ["build_meta_multimodal", "parallelize_multimodal", "vision_fsdp_units"]


def build_meta_multimodal(cfg) -> nn.Module:
    """K3ForConditionalGeneration on the `meta` device (shapes only; load weights after `materialize`)."""
    from k3.multimodal import K3ForConditionalGeneration
    with torch.device("meta"):
        return K3ForConditionalGeneration(cfg, init=False)


def vision_fsdp_units(model: nn.Module) -> list:
    """The vision modules that become their own FSDP units, in forward order."""
    return list(model.vision_tower.encoder.blocks) + [model.mm_projector]


def parallelize_multimodal(model: nn.Module, pmesh: ParallelMesh, *, param_dtype: Optional[torch.dtype] = None,
                           reduce_dtype: Optional[torch.dtype] = torch.float32,
                           activation_checkpointing: bool = False, compile: str = "none",
                           reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 (and EP, activation checkpointing, compile: `k3.parallel.parallelize.parallelize_model`'s options, for
    the language model) over a `K3ForConditionalGeneration`, in place; returns the model. The vision units use
    the same mixed-precision policy (the tower computes in `param_dtype`, as the release runs it in bf16)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from k3.multimodal import K3ForConditionalGeneration
    from k3.parallel.parallelize import parallelize_model
    if not isinstance(model, K3ForConditionalGeneration):
        raise K3ConfigError(f"parallelize_multimodal needs a K3ForConditionalGeneration, got {type(model).__name__} "
                            f"(text-only models: k3.parallel.parallelize.parallelize_model)")
    if pmesh.dims.cp_enabled:
        raise K3ConfigError("parallelize_multimodal: context parallelism (cp > 1) is not supported with images")
    parallelize_model(model.language_model, pmesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                      activation_checkpointing=activation_checkpointing, compile=compile,
                      reshard_after_forward=reshard_after_forward)
    # the same dtype resolution as parallelize_model
    if param_dtype is None and pmesh.device_type == "cuda":
        param_dtype = torch.bfloat16
    if pmesh.device_type == "cpu" and reduce_dtype is not None and param_dtype is None:
        reduce_dtype = None
    kw = dict(mesh=pmesh.fsdp, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    for unit in vision_fsdp_units(model):
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)   # each rank's loss is its share of the global mean: sum gradients
            if pmesh.device_type == "cpu":     # gloo has neither AVG nor PREMUL_SUM
                m.set_force_sum_reduction_for_comms(True)
    model.always_run_tower = True
    model._k3_pmesh = pmesh
    return model
