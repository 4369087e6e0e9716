"""Start a distributed run from weights: a released safetensors checkpoint read lazily per rank, or a model-only
DCP checkpoint (`k3 convert --to dcp`) (issue #30 §6).

    load_released(model, "kimi-k3-release/")     # after parallelize_model + materialize(init=False)

`load_released` fills a parallelised model (FSDP2 shards, EP expert slices) from the released layout, each rank
reading only what it holds: the safetensors files are memory-mapped (`safe_open`) and

* a routed-expert tensor reads only the experts of the local shard (its ep slice, then its FSDP rows over
  `efsdp`; without EP the FSDP rows over the data ranks) -- per-expert `w1`/`w3`/`w2` tensors (or MXFP4 blocks) of
  other experts are never opened;
* any other tensor that maps 1:1 to a released tensor reads only its FSDP rows (`get_slice`);
* the few tensors with a released-only encoding (A_log's zero padding) are read whole (they are [H]).

Names, per-expert stacking, MXFP4 decoding, fp32-kept tensors: the one mapping of k3.checkpoint
(`ReleasedAssembler`, `model_key_of`). `load_released(..., record=[])` appends each released key read with the
rows read, for the tests. No rank ever holds more than one tensor's local part.

`load_init(model, path)` dispatches: a DCP checkpoint (`.metadata`) loads the model through
k3.parallel.checkpoint.load_checkpoint (resharded by DCP, any mesh); a released directory through load_released.
"""
from __future__ import annotations

import os
import re
from typing import Optional

import torch

from k3.errors import CheckpointError

__all__ = ["load_released", "load_init", "init_dir", "is_dcp_checkpoint"]

_STACKED = (".experts.gate_up_proj", ".experts.down_proj")
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.w[123]\.")


def is_dcp_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata"))


def init_dir(cfg) -> Optional[str]:
    """The directory a new distributed run starts from (`cfg.init_from`): a DCP checkpoint as it is, else the
    released model directory `resolve_init_checkpoint` finds. None without init_from."""
    if getattr(cfg, "init_from", None) is None:
        return None
    if is_dcp_checkpoint(cfg.init_from):
        return cfg.init_from
    from k3.train.config import resolve_init_checkpoint
    return resolve_init_checkpoint(cfg.init_from)


def load_init(model, path: str, record: Optional[list] = None) -> None:
    """Collective. Fill the parallelised model's shards from `path` (DCP or released)."""
    if is_dcp_checkpoint(path):
        from k3.parallel.checkpoint import load_checkpoint
        load_checkpoint(path, model)
    else:
        load_released(model, path, record=record)


def _local_rows(t, logical_rows: int) -> tuple:
    """(first, count) of the dim-0 rows of the logical tensor (an EP slice for experts) held by this rank."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if not isinstance(t, DTensor):
        return 0, logical_rows
    shape = (logical_rows,) + tuple(t.shape[1:])
    lshape, off = compute_local_shape_and_global_offset(torch.Size(shape), t.device_mesh, t.placements)
    return (int(off[0]), int(lshape[0])) if len(lshape) else (0, logical_rows)


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def load_released(model, directory: str, config=None, record: Optional[list] = None) -> None:
    """Fill the (parallelised, materialised) model from the released checkpoint `directory`, per rank (module doc).
    Raises CheckpointError naming the tensor on a missing or mis-shaped one."""
    from k3.checkpoint.adapter import PREFIX, model_key_of
    from k3.checkpoint.assemble import ReleasedAssembler
    from k3.checkpoint.io import load_config
    from k3.export import SourceShards
    from k3.parallel.expert import EP_PARAM_FLAG, is_ep_param
    from k3.parallel.parallelize import refresh_ep_flags
    cfg = config if config is not None else load_config(directory)
    src = SourceShards(directory)
    by_model: dict = {}
    for k in src.meta:
        by_model.setdefault(model_key_of(k), []).append(k)
    refresh_ep_flags(model)
    own = dict(model.named_parameters())
    saved = set(model.state_dict().keys())          # persistent buffers only (non-persistent ones are rebuilt)
    own.update({n: b for n, b in model.named_buffers() if n in saved})
    for name, t in own.items():
        keys = by_model.get(name)
        if not keys:
            raise CheckpointError(f"{directory}: no released tensor for {name} ({PREFIX}{name})")
        loc = _local(t)
        if name.endswith(_STACKED):
            base, E = 0, cfg.num_experts
            if is_ep_param(t):
                ep_rank, ep_size, E = getattr(t, EP_PARAM_FLAG)
                base, E = ep_rank * (E // ep_size), E // ep_size
            r0, n = _local_rows(t, E)
            if n == 0:
                continue
            e0, e1 = base + r0, base + r0 + n
            mine = [k for k in keys if e0 <= int(_EXPERT_INDEX.search(k).group(1)) < e1]
            asm = ReleasedAssembler(cfg, targets=None, dtype=loc.dtype, strict=False, experts=(e0, e1))
            for k in mine:
                asm.add(k, src.get(k))
                if record is not None:
                    record.append((k, None))
            part = asm.finish(f"checkpoint {directory}").get(name)
        elif keys == [PREFIX + name] and not name.endswith("A_log") and src.meta[keys[0]][0] == _shape_of(t):
            r0, n = _local_rows(t, src.meta[keys[0]][0][0]) if t.dim() else (0, 0)
            if t.dim() == 0:
                part = src.get(keys[0])
            else:
                part = src._handles[src.where[keys[0]]].get_slice(keys[0])[r0:r0 + n]
            if record is not None:
                record.append((keys[0], (r0, n) if t.dim() else None))
        else:
            asm = ReleasedAssembler(cfg, targets=None, dtype=loc.dtype, strict=False)
            for k in keys:
                asm.add(k, src.get(k))
                if record is not None:
                    record.append((k, None))
            full = asm.finish(f"checkpoint {directory}").get(name)
            from k3.parallel.parallelize import _write_local
            if full is None or tuple(full.shape) != _shape_of(t):
                raise CheckpointError(f"{directory}: {name} has shape "
                                      f"{None if full is None else tuple(full.shape)}, the model expects "
                                      f"{_shape_of(t)}")
            _write_local(t, full)
            continue
        if part is None or tuple(part.shape) != tuple(loc.shape):
            raise CheckpointError(f"{directory}: {name}: read {None if part is None else tuple(part.shape)} for "
                                  f"this rank's shard {tuple(loc.shape)}")
        loc.copy_(part.to(device=loc.device, dtype=loc.dtype))


def _shape_of(t) -> tuple:
    return tuple(t.shape)
