"""Host-side tables shared by the forward and the backward: chunk tables of packed / fixed-length batches (cached per
shape for fixed batches), the walks' longest-first sequence order and grid, and `FwdSave` (what a training forward
stores for the backward). Needs torch only."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

BT = 16  # the forward's chunk (= tile) length; the backward's is 64 (bwd.chunk_len)


def _cu_cpu(B: int, T: int, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """Sequence boundaries [N+1] int64 on the CPU (B rows of T tokens without cu_seqlens)."""
    if cu_seqlens is None:
        return torch.arange(B + 1, dtype=torch.int64) * T
    return cu_seqlens.detach().to("cpu", torch.int64)


def _chunk_tables(starts: torch.Tensor, ends: torch.Tensor, bt: int):
    """(chunk_tok [NC], chunk_end [NC], seq_chunk [N+1], NC), int64 on the CPU, for the token ranges
    [starts[n], ends[n]) cut into bt-token chunks from each start: chunk c covers tokens
    [chunk_tok[c], min(chunk_tok[c] + bt, chunk_end[c])), range-major order; seq_chunk[n] = first chunk of range n."""
    nch = (ends - starts + bt - 1) // bt
    N = starts.numel()
    seq_chunk = torch.zeros(N + 1, dtype=torch.int64)
    seq_chunk[1:] = torch.cumsum(nch, 0)
    NC = int(seq_chunk[-1])
    seq_of = torch.repeat_interleave(torch.arange(N), nch)
    j = torch.arange(NC) - seq_chunk[:-1][seq_of]
    return starts[seq_of] + j * bt, ends[seq_of], seq_chunk, NC


# device chunk tables of fixed-length batches (no cu_seqlens), per (kind, B, T, chunk, ..., device): built on the host
# and copied once per shape instead of on every call (a training step repeats the same shapes in every KDA layer's
# forward, recomputed forward and backward; a copy from pageable host memory may wait for the stream)
_FIXED_TABLES: "dict[tuple, tuple]" = {}
_FIXED_TABLES_MAX = 64


def _fixed_tables(key: tuple, build):
    """build() for a fixed-length batch's tables, cached under key (at most _FIXED_TABLES_MAX shapes, oldest out)."""
    hit = _FIXED_TABLES.get(key)
    if hit is None:
        hit = build()
        if len(_FIXED_TABLES) >= _FIXED_TABLES_MAX:
            _FIXED_TABLES.pop(next(iter(_FIXED_TABLES)))
        _FIXED_TABLES[key] = hit
    return hit


def _seq_tables(B: int, T: int, cu_seqlens: Optional[torch.Tensor], device, bt: int = BT, cu_cpu=None):
    """(cu int32 [N+1] on device, chunk_tok/chunk_end int32 [NC], seq_chunk int32 [N+1], N, NC) for bt-token
    chunks: chunk c covers tokens [chunk_tok[c], min(chunk_tok[c] + bt, chunk_end[c])), sequence-major order.
    cu_cpu: _cu_cpu(B, T, cu_seqlens) when the caller has it. Without cu_seqlens: built once per (B, T, bt, device)."""
    def build():
        cpu = _cu_cpu(B, T, cu_seqlens) if cu_cpu is None else cu_cpu
        chunk_tok, chunk_end, seq_chunk, NC = _chunk_tables(cpu[:-1], cpu[1:], bt)
        to = lambda x: x.to(torch.int32).to(device, non_blocking=True)
        return to(cpu), to(chunk_tok), to(chunk_end), to(seq_chunk), cpu.numel() - 1, NC
    if cu_seqlens is None:
        return _fixed_tables(("seq", B, T, bt, str(torch.device(device))), build)
    return build()


def _walk_order(cu_cpu: torch.Tensor, device, lpt: Optional[bool] = None) -> Optional[torch.Tensor]:
    """The sequential passes' sequence order (int32 on device): longest first (stable), or None (grid order) when
    lpt is False, or there is one sequence, or all have the same length (fixed batches). lpt None = on.
    Longest-first matters at varlen: with every sequence's walks in launch order by sequence, the last wave may
    start a long document's walks (list scheduling of the varlen 12-document 64K batch at H96 on 264 program slots:
    31,261 token-steps in grid order, 24,075 longest first, against 24,576 for B8 T8K's equal rows)."""
    lens = cu_cpu[1:] - cu_cpu[:-1]
    if lpt is False or lens.numel() < 2 or bool((lens == lens[0]).all()):
        return None
    return torch.sort(lens, descending=True, stable=True).indices.to(torch.int32).to(device, non_blocking=True)


def _walk_grid(N: int, H: int, NV: int, order: Optional[torch.Tensor], ordered: bool = True):
    """(grid, ORDERED) of a sequential pass: sequence-major in `order` (kernels with ORDERED, `walk._walk_ids`)
    where the caller allows it and there is an order (varlen with unequal lengths: `_walk_order`), else (N, H, NV)
    in grid order."""
    if ordered and order is not None:
        return (H * NV, N), True
    return (N, H, NV), False


@dataclasses.dataclass
class FwdSave:
    """What a training forward's sequential pass stores for the backward (`kda_chunk_fwd(save=...)`): the state at
    the start of every bt-token chunk (the backward's chunks) and u' = U - W S at every token, which the backward's
    states pass would otherwise recompute. Asked for with bt and the two dtypes; the forward fills tables (the
    backward's chunk tables: _seq_tables at bt), states [C, H, K, V], uns [H, B*T, V] and sets filled, or leaves
    filled False where its pass cannot save (prep only, or a time piece that is not a multiple of bt)."""
    bt: int
    states_dtype: torch.dtype
    uns_dtype: torch.dtype
    tables: Optional[tuple] = None
    states: Optional[torch.Tensor] = None
    uns: Optional[torch.Tensor] = None
    order: Optional[torch.Tensor] = None  # the walks' sequence order (`_walk_order`), for the backward's passes
    filled: bool = False
