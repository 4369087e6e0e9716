"""Shared KDA plumbing: input validation, in-kernel preprocessing (L2 norm, gate, scale) and the varlen layout.

Notable: every path (reference, chunked, future kernels) validates through `validate_kda_inputs`, so errors
name the same argument everywhere. The layout maps packed tokens to per-sequence padded chunks and back with
index tensors, so varlen needs no Python loop over sequences or tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .gate import check_gate_params, kda_gate

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum_K x^2 + eps) over the last dim (architecture.md §3.4 step 3)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def compute_dtype(*ts: Optional[torch.Tensor]) -> torch.dtype:
    """fp64 if any input is fp64, else fp32 (bf16/fp16 inputs are upcast; the state is never low precision)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def validate_kda_inputs(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                        use_gate_in_kernel=False, A_log=None, dt_bias=None) -> int:
    """Check shapes/dtypes/devices; return N, the number of sequences (B, or len(cu_seqlens) - 1)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {tuple(q.shape)} (same as q), got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v: expected [B, T, H, V] = [{B}, {T}, {H}, V], got shape {tuple(v.shape)}")
    if g.shape != q.shape:
        what = "raw gate input f" if use_gate_in_kernel else "log-decay g"
        raise ValueError(f"g ({what}): expected shape {tuple(q.shape)} (per-channel, same as q), "
                         f"got {tuple(g.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta: expected shape {(B, T, H)}, got {tuple(beta.shape)}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale: expected a float or None, got {type(scale).__name__}")
    if use_gate_in_kernel:
        check_gate_params(g, A_log, dt_bias, f_name="g")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() \
                or cu_seqlens.dtype == torch.bool or cu_seqlens.is_complex():
            raise ValueError("cu_seqlens: expected a 1-D integer tensor [N+1] of sequence starts")
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need batch size B == 1, got B = {B}")
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens: needs at least 2 entries ([0, T] for one sequence)")
        cu = cu_seqlens.detach().to("cpu", torch.int64)
        if int(cu[0]) != 0 or int(cu[-1]) != T:
            raise ValueError(f"cu_seqlens: must start at 0 and end at T = {T}, got {int(cu[0])} .. {int(cu[-1])}")
        if bool((cu[1:] < cu[:-1]).any()):
            raise ValueError("cu_seqlens: must be non-decreasing")
        N = cu.numel() - 1
    else:
        N = B
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise ValueError("initial_state: expected a floating tensor [N, H, K, V]")
        want = (N, H, K, v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state: expected shape {want} (N = {N} sequences), "
                             f"got {tuple(initial_state.shape)}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state: on {initial_state.device}, but q is on {q.device}")
    return N


def prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                   lower_bound, initial_state=None):
    """Upcast to the compute dtype, apply the in-kernel L2 norm, gate and q scale. Returns (q,k,v,g,beta,dtype)."""
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    K = q.shape[-1]
    q_BTHK, k_BTHK = q.to(dt), k.to(dt)
    if use_qk_l2norm_in_kernel:
        q_BTHK, k_BTHK = l2norm(q_BTHK), l2norm(k_BTHK)
    q_BTHK = q_BTHK * (K ** -0.5 if scale is None else float(scale))
    if use_gate_in_kernel:
        g_BTHK = kda_gate(g, A_log, dt_bias, lower_bound).to(dt)
    else:
        g_BTHK = g.to(dt)
    return q_BTHK, k_BTHK, v.to(dt), g_BTHK, beta.to(dt), dt


@dataclass
class _Slots:
    """Tokens [B*T] <-> per-sequence padded blocks of `C` slots: N sequences, at most J blocks each, Nb blocks.
    slot_src_P: for each padded slot (P = Nb*C), the source token, or B*T (a zero dummy row) for padding.
    token_slot_BT: for each token, its slot."""
    N: int
    J: int
    Nb: int
    C: int
    slot_src_P: torch.Tensor
    token_slot_BT: torch.Tensor


@dataclass
class Layout(_Slots):
    """The blocks arranged as a grid [N, J] of block ids (see _Slots for the slot maps).

    grid_NJ: block id of the j-th block of sequence n, or Nb (dummy).
    block_pos_Nb: position n*J + j of each real block in the flattened grid.
    """
    grid_NJ: torch.Tensor
    block_pos_Nb: torch.Tensor


def _seq_bounds(B: int, T: int, cu_seqlens: Optional[torch.Tensor]):
    """(start token, length) of every sequence, int64 on the CPU (fixed-length rows, or packed via cu_seqlens)."""
    if cu_seqlens is None:
        return torch.arange(B, dtype=torch.int64) * T, torch.full((B,), T, dtype=torch.int64)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    return cu[:-1], cu[1:] - cu[:-1]


def make_layout(B: int, T: int, cu_seqlens: Optional[torch.Tensor], C: int, device) -> Layout:
    starts_N, lens_N = _seq_bounds(B, T, cu_seqlens)
    N = lens_N.numel()
    nblk_N = (lens_N + C - 1) // C
    Nb = int(nblk_N.sum())
    J = int(nblk_N.max()) if N else 0
    first_N = torch.cumsum(nblk_N, 0) - nblk_N
    blk_seq_Nb = torch.repeat_interleave(torch.arange(N), nblk_N)
    blk_j_Nb = torch.arange(Nb) - first_N[blk_seq_Nb]
    pos_NbC = blk_j_Nb[:, None] * C + torch.arange(C)
    valid_NbC = pos_NbC < lens_N[blk_seq_Nb][:, None]
    slot_src_NbC = torch.where(valid_NbC, starts_N[blk_seq_Nb][:, None] + pos_NbC, torch.full_like(pos_NbC, B * T))
    token_slot = valid_NbC.reshape(-1).nonzero().squeeze(1)
    jj = torch.arange(J)
    grid_NJ = torch.where(jj[None, :] < nblk_N[:, None], first_N[:, None] + jj[None, :], torch.full((N, J), Nb))
    block_pos = blk_seq_Nb * J + blk_j_Nb
    return Layout(N, J, Nb, C, slot_src_NbC.reshape(-1).to(device), token_slot.to(device), grid_NJ.to(device),
                  block_pos.to(device))


@dataclass
class StepLayout(_Slots):
    """Tokens [B*T] <-> per-sequence padded blocks of `C` slots, ordered for a chunk loop over active sequences only.

    Sequences are sorted by block count, descending (stable): sorted rank r is sequence perm_N[r]. Blocks are in
    step-major order: step j holds the j-th block of sorted ranks 0 .. n_J[j]-1 (a prefix, since counts descend),
    so x_Nb.split(n_J) gives the per-step tensors as contiguous slices, and no padded [N, J] grid is needed.
    slot_src_P / token_slot_BT as in `Layout`; perm_N is None when the order is the identity.
    """
    n_J: list
    perm_N: Optional[torch.Tensor]


def make_step_layout(B: int, T: int, cu_seqlens: Optional[torch.Tensor], C: int, device) -> StepLayout:
    starts_N, lens_N = _seq_bounds(B, T, cu_seqlens)
    N = lens_N.numel()
    nblk_N = (lens_N + C - 1) // C
    perm_N = torch.sort(nblk_N, descending=True, stable=True).indices
    nblk_sorted = nblk_N[perm_N]
    J = int(nblk_sorted[0]) if N else 0
    n_J = (nblk_sorted[None, :] > torch.arange(J)[:, None]).sum(1)
    Nb = int(n_J.sum())
    blk_j_Nb = torch.repeat_interleave(torch.arange(J), n_J)
    blk_seq_Nb = perm_N[torch.arange(Nb) - (torch.cumsum(n_J, 0) - n_J)[blk_j_Nb]]
    pos_NbC = blk_j_Nb[:, None] * C + torch.arange(C)
    valid_P = (pos_NbC < lens_N[blk_seq_Nb][:, None]).reshape(-1)
    src_P = (starts_N[blk_seq_Nb][:, None] + pos_NbC).reshape(-1)
    slot_src_P = torch.where(valid_P, src_P, torch.full_like(src_P, B * T))
    token_slot = torch.empty(B * T, dtype=torch.int64)
    token_slot[src_P[valid_P]] = valid_P.nonzero().squeeze(1)
    identity = bool((perm_N == torch.arange(N)).all())
    return StepLayout(N, J, Nb, C, slot_src_P.to(device), token_slot.to(device), n_J.tolist(),
                      None if identity else perm_N.to(device))


def gather_blocks(x_BTHD: torch.Tensor, lay: Layout) -> torch.Tensor:
    """[B, T, H, D] tokens -> [Nb, H, C, D] padded blocks (padding slots are zero)."""
    B, T, H, D = x_BTHD.shape
    x_TtHD = torch.cat([x_BTHD.reshape(B * T, H, D), x_BTHD.new_zeros(1, H, D)], 0)
    return x_TtHD[lay.slot_src_P].view(lay.Nb, lay.C, H, D).transpose(1, 2)


def scatter_blocks(o_NbHCV: torch.Tensor, lay, B: int, T: int) -> torch.Tensor:
    """[Nb, H, C, V] block outputs (in the layout's block order) -> [B, T, H, V] tokens."""
    Nb, H, C, V = o_NbHCV.shape
    return o_NbHCV.transpose(1, 2).reshape(Nb * C, H, V)[lay.token_slot_BT].view(B, T, H, V)


def to_grid(x_Nb: torch.Tensor, lay: Layout, fill: float = 0.0) -> torch.Tensor:
    """[Nb, ...] per-block tensor -> [N, J, ...] grid; missing blocks take the value `fill`."""
    pad = torch.full((1,) + tuple(x_Nb.shape[1:]), fill, dtype=x_Nb.dtype, device=x_Nb.device)
    return torch.cat([x_Nb, pad], 0)[lay.grid_NJ]


def scatter_tokens(o_NJHCV: torch.Tensor, lay: Layout, B: int, T: int) -> torch.Tensor:
    """[N, J, H, C, V] grid outputs -> [B, T, H, V] tokens."""
    N, J, H, C, V = o_NJHCV.shape
    o_NbHCV = o_NJHCV.reshape(N * J, H, C, V)[lay.block_pos_Nb]
    return o_NbHCV.transpose(1, 2).reshape(lay.Nb * C, H, V)[lay.token_slot_BT].view(B, T, H, V)
