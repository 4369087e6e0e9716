"""Each rank's part of a global packed batch (k3.parallel.training): its data-parallel rows, under CP its slice of
them, and with images (a multimodal batch) the images whose placeholders fall in its rows.

A global batch is `{"input_ids" [1, rows * seq], "labels", "cu_seqlens"}` (+ `"pixel_values" [L, 3, p, p]`,
`"grid_thw" [n, 3]` for a multimodal model: one placeholder per image in `input_ids`, images in row-major
placeholder order, as `k3.multimodal` takes them). Every rank draws the same global batch; rank `d` of `D` data
ranks keeps rows [d * rows / D, (d + 1) * rows / D).
"""
from __future__ import annotations

from typing import Optional

import torch

from k3.errors import K3ConfigError
from k3.ops.loss import IGNORE_INDEX

__all__ = ["local_batch", "slice_images", "target_count"]


def target_count(b: dict, placeholder_id: Optional[int] = None) -> int:
    """The supervised positions of a (global) batch; with images, a target equal to the media placeholder is not
    one (the model drops it when it expands the image, k3.multimodal)."""
    keep = b["labels"] != IGNORE_INDEX
    if placeholder_id is not None and "pixel_values" in b:
        keep &= b["labels"] != placeholder_id
    return int(keep.sum())


def slice_images(ids: torch.Tensor, lo: int, hi: int, pixel_values: Optional[torch.Tensor],
                 grid_thw: Optional[torch.Tensor], placeholder_id: int) -> tuple:
    """(pixel_values, grid_thw) of the images whose placeholders lie in ids[0, lo:hi) (row-major placeholder
    order over the whole batch); (None, None) when there are none."""
    if grid_thw is None or not len(grid_thw):
        return None, None
    is_ph = ids[0] == placeholder_id
    n_ph = int(is_ph.sum())
    if n_ph != len(grid_thw):
        raise K3ConfigError(f"a multimodal batch holds {n_ph} media placeholders (id {placeholder_id}) but "
                            f"{len(grid_thw)} images (grid_thw)")
    i0, i1 = int(is_ph[:lo].sum()), int(is_ph[:hi].sum())
    if i1 == i0:
        return None, None
    patches = grid_thw.to(torch.long).prod(-1)
    p0, p1 = int(patches[:i0].sum()), int(patches[:i1].sum())
    return pixel_values[p0:p1], grid_thw[i0:i1]


def local_batch(b: dict, seq: int, *, dims, dp_index: int, device: torch.device, pad_id: int, cp=None,
                placeholder_id: Optional[int] = None, allow_uneven: bool = False) -> dict:
    """This rank's part of the global packed batch `b` (module doc). `allow_uneven` (evaluation): rows are dealt
    as evenly as possible and a rank without rows gets one ignored padding row (every rank must run the forward).
    `cp`: the model's ContextParallel (`model._k3_cp`) under CP, which cuts this rank's slice of the rows.
    Multimodal batches (`pixel_values` in `b`) carry `pixel_values` / `grid_thw` for this rank's images, None on a
    rank with none (its model runs the tower on a blank image, k3.parallel.vision)."""
    ids, labels, cu = b["input_ids"], b["labels"], b["cu_seqlens"]
    rows = ids.shape[1] // seq
    D, d = dims.dp_replicate * dims.dp_shard, dp_index
    if rows % D and not allow_uneven:
        raise K3ConfigError(f"{rows} rows do not split over {D} data-parallel ranks (--batch-tokens)")
    r0, r1 = d * rows // D, (d + 1) * rows // D
    lo, hi = r0 * seq, r1 * seq
    if r1 > r0:
        keep = cu[(cu >= lo) & (cu <= hi)].to(torch.int64) - lo
        loc = {"input_ids": ids[:, lo:hi], "labels": labels[:, lo:hi], "cu_seqlens": keep.to(cu.dtype)}
    else:
        loc = {"input_ids": ids.new_full((1, seq), pad_id), "labels": labels.new_full((1, seq), IGNORE_INDEX),
               "cu_seqlens": torch.tensor([0, seq], dtype=cu.dtype)}
    if cp is not None:
        s = cp.shard(loc["input_ids"], loc["labels"], loc["cu_seqlens"], pad_id=pad_id)
        loc = {"input_ids": s.input_ids, "labels": s.labels, "cu_seqlens": s.cu_seqlens}
    loc = {k: v.to(device, non_blocking=True) for k, v in loc.items()}
    if "pixel_values" in b:
        if cp is not None:
            raise K3ConfigError("context parallelism (--cp > 1) is not supported with images")
        pv, grid = slice_images(ids, lo, hi, b["pixel_values"], b.get("grid_thw"), placeholder_id) \
            if r1 > r0 else (None, None)
        loc["pixel_values"] = pv.to(device, non_blocking=True) if pv is not None else None
        loc["grid_thw"] = grid   # stays on the host (the tower reads its sizes)
    return loc
