"""Sharded, atomic, mesh-independent training checkpoints with torch.distributed.checkpoint (issue #30 §6).

    save_checkpoint(out_dir, step, model, optimizer, extra={"scheduler": ..., "balancer": ..., "data": ...})
    path = latest_checkpoint(out_dir)
    extra = load_checkpoint(path, model, optimizer)     # any world size / mesh, e.g. saved at 4, resumed at 1 or 2

Layout: `<out_dir>/step-<N>/` holds DCP's `.metadata` and one `__<rank>_0.distcp` file per writing rank
(model + optimizer shards, by fully-qualified name, with global shapes and offsets) and `extra.pt` (rank 0's
`extra` dict: scheduler, balancer, data position, RNG -- tensors, numbers, strings and containers only; read
back with `weights_only=True`). Every rank writes into `step-<N>.tmp`; after a barrier rank 0 writes `extra.pt`,
fsyncs, and renames the directory to `step-<N>`: a kill at any point leaves the previous good checkpoint as the
latest, and the half-written `.tmp` is ignored (and removed by the next save). `async_save=True` stages the state
in CPU memory and writes it in a background thread (dcp.async_save); `PendingCheckpoint.wait()` publishes it.

Routed experts under EP live on each rank as an [E/ep, ...] slice FSDP-sharded over `efsdp`. For DCP they are
presented as DTensors over an (ep, efsdp) view of the same ranks with placements (Shard(0), Shard(0)) -- the same
local storage, but with the global [E, ...] shape and each slice's true offset -- so a checkpoint never depends
on ep or on the mesh, and DCP reshards it on load.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from k3.errors import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "find_checkpoints", "PendingCheckpoint"]

_STEP_DIR = re.compile(r"^step-(\d+)$")


def find_checkpoints(out_dir: str) -> list:
    """[(step, path)] of complete checkpoints (a `.metadata` file present), oldest first."""
    if not os.path.isdir(out_dir):
        return []
    found = []
    for name in os.listdir(out_dir):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(out_dir, name, ".metadata")):
            found.append((int(m.group(1)), os.path.join(out_dir, name)))
    return sorted(found)


def latest_checkpoint(out_dir: str) -> Optional[str]:
    found = find_checkpoints(out_dir)
    return found[-1][1] if found else None


# ------------------------------------------------------------------------------------------------ EP views

_EP_VIEW_MESHES: dict = {}


def _ep_view_mesh(p):
    """An (ep_ckpt_replicate, ep_ckpt_ep, ep_ckpt_efsdp) DeviceMesh over the world, for the EP param p (created
    once per layout; collective on first use, which every rank reaches at the same parameter)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    ep = dist.get_world_size(p._k3_ep_group)
    efsdp = p.device_mesh.size(p.device_mesh.ndim - 1) if isinstance(p, DTensor) else 1
    world = dist.get_world_size()
    key = (world, ep, efsdp)
    if key not in _EP_VIEW_MESHES:
        # k3.parallel.mesh lays ranks out as rank = (r * efsdp + f) * ep + e; the view orders them [R, ep, efsdp]
        R = world // (ep * efsdp)
        ranks = torch.arange(world).view(R, efsdp, ep).transpose(1, 2).contiguous()
        _EP_VIEW_MESHES[key] = DeviceMesh(_device_type(p), ranks,
                                          mesh_dim_names=("ep_ckpt_replicate", "ep_ckpt_ep", "ep_ckpt_efsdp"))
    return _EP_VIEW_MESHES[key]


def _device_type(t) -> str:
    from torch.distributed.tensor import DTensor
    loc = t.to_local() if isinstance(t, DTensor) else t
    return loc.device.type


def _ep_view(t, p):
    """t (p itself or an optimizer state tensor shaped like p) as a DTensor with the global expert shape."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = _ep_view_mesh(p)
    local = t.to_local() if isinstance(t, DTensor) else t
    _, ep_size, E = p._k3_ep
    shape = (E,) + tuple(t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, (Replicate(), Shard(0), Shard(0)), shape=torch.Size(shape),
                              stride=stride, run_check=False)


def _ep_fqns(model) -> dict:
    from k3.parallel.expert import is_ep_param
    from k3.parallel.parallelize import refresh_ep_flags
    refresh_ep_flags(model)
    return {n: p for n, p in model.named_parameters() if is_ep_param(p)}


def _states(model, optimizer):
    """(DCP state dict with EP views, the raw (model, optim) state dicts of get_state_dict)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, optimizer) if optimizer is not None else (None, None)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        msd = get_model_state_dict(model)
    ep = _ep_fqns(model)
    m_view = {k: (_ep_view(v, ep[k]) if k in ep else v) for k, v in msd.items()}
    state = {"model": m_view}
    if osd is not None:
        o_state = {}
        for fqn, st in osd["state"].items():
            if fqn in ep:
                st = {k: (_ep_view(v, ep[fqn]) if torch.is_tensor(v) and v.ndim == ep[fqn].ndim else v)
                      for k, v in st.items()}
            o_state[fqn] = st
        state["optim"] = {"state": o_state, "param_groups": osd["param_groups"]}
    return state, msd, osd


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def save_checkpoint(out_dir: str, step: int, model, optimizer=None, extra: Optional[dict] = None,
                    async_save: bool = False):
    """Collective: every rank calls it. Returns the final `step-<step>` path; with `async_save`, a
    `PendingCheckpoint` once the state is staged in CPU memory (training may go on and change the weights): every
    rank must call its `wait()` (collective) before the next save or exit; until then the checkpoint is `.tmp`."""
    import torch.distributed.checkpoint as dcp
    final = os.path.join(out_dir, f"step-{step}")
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    dist.barrier()
    state, _, _ = _states(model, optimizer)
    if async_save:
        fut = dcp.async_save(state, checkpoint_id=tmp)
        fut = getattr(fut, "upload_completion", fut)   # AsyncSaveResponse (staging + upload) or a Future
        return PendingCheckpoint(fut, tmp, final, out_dir, extra)
    dcp.save(state, checkpoint_id=tmp)
    _finalize(tmp, final, out_dir, extra)
    return final


class PendingCheckpoint:
    """An async save in flight (see save_checkpoint)."""

    def __init__(self, future, tmp: str, final: str, out_dir: str, extra: Optional[dict]):
        self.future, self.tmp, self.final, self.out_dir, self.extra = future, tmp, final, out_dir, extra
        self.path: Optional[str] = None

    def wait(self) -> str:
        """Collective: wait for this rank's writes, then publish the checkpoint atomically. Returns its path."""
        if self.path is None:
            self.future.result()
            _finalize(self.tmp, self.final, self.out_dir, self.extra)
            self.path = self.final
        return self.path


def _finalize(tmp: str, final: str, out_dir: str, extra: Optional[dict]) -> None:
    """After every rank wrote its shards: rank 0 writes extra.pt, fsyncs and renames .tmp -> final."""
    dist.barrier()
    if dist.get_rank() == 0:
        if extra is not None:
            with open(os.path.join(tmp, "extra.pt"), "wb") as f:
                torch.save(extra, f)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):
            old = final + ".old"
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(out_dir)
    dist.barrier()


def _drop_unsaved_optim_state(path: str, state: dict, osd: dict) -> None:
    """get_state_dict creates optimizer state for every parameter (a zero-gradient step); parameters that had no
    state when saved (never received a gradient, e.g. layer 0's unused AttnRes query) must stay without it."""
    from torch.distributed.checkpoint import FileSystemReader
    saved = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    for fqn in list(state["optim"]["state"]):
        st = state["optim"]["state"][fqn]
        keep = {k: v for k, v in st.items() if f"optim.state.{fqn}.{k}" in saved}
        if keep:
            state["optim"]["state"][fqn] = keep
        else:
            del state["optim"]["state"][fqn]
            osd["state"].pop(fqn, None)


def _refuse_model_only(path: str) -> None:
    """A checkpoint without optimizer state (`k3 convert --to dcp`) is a starting point, not a run to resume."""
    from torch.distributed.checkpoint import FileSystemReader
    if not any(k.startswith("optim.") for k in FileSystemReader(path).read_metadata().state_dict_metadata):
        raise CheckpointError(f"{path}: holds model weights only (no optimizer state, e.g. written by k3 convert "
                              f"--to dcp): start a new run from it (init_from), it cannot be resumed")


def load_checkpoint(path: str, model, optimizer=None) -> dict:
    """Collective. Loads the model (and optimizer) shards of this rank from a checkpoint written on any mesh;
    returns the `extra` dict ({} if none was saved)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                           set_optimizer_state_dict)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path}: not a complete DCP checkpoint (no .metadata)")
    if optimizer is not None:
        _refuse_model_only(path)
    state, msd, osd = _states(model, optimizer)
    if optimizer is not None:
        _drop_unsaved_optim_state(path, state, osd)
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:  # DCP raises CheckpointException listing every rank's failure
        raise CheckpointError(f"{path}: cannot load into this model/optimizer: {e}") from e
    # the EP views and DTensors share storage with msd/osd: those now hold the loaded values
    if optimizer is not None:
        osd = {"state": osd["state"], "param_groups": state["optim"]["param_groups"]}
        # strict=False for the optimizer only: parameters saved without state (never had a gradient) stay so
        set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(strict=False))
    set_model_state_dict(model, msd)
    extra_path = os.path.join(path, "extra.pt")
    if os.path.isfile(extra_path):
        return torch.load(extra_path, weights_only=True, map_location="cpu")
    return {}
