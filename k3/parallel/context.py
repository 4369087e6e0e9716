"""Context parallelism (issue #31): one packed sequence split over the `cp` ranks, applied from outside the model.

    cp = ContextParallel.from_mesh(pmesh)           # or ContextParallel(group) for a bare process group
    apply_context_parallel(model, cp)               # KDA and MLA layers get CP forwards (nothing else crosses slices)
    b = cp.shard(input_ids, labels, cu_seqlens)     # this rank's slice; also makes it the current slice
    out = model(b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens)
    loss = global_mean_loss(out, pmesh)             # local CE sum / target tokens of all dp x cp ranks

Feeding. Every rank of a cp group loads the same packed sequence (its data-parallel index,
`ParallelMesh.dp_index()`; cp is the innermost mesh dim, so a cp group is consecutive ranks) and keeps its slice.

Sharding. The (batch 1, packed) sequence of T tokens is cut into cp contiguous equal slices of L = ceil(T / cp)
tokens (KDA needs causal order, so no load-balancing permutation). If cp does not divide T, the tail is padded
with `pad_id` tokens that form a document of their own with ignored labels (they come after every real token, so
nothing real sees them; the MoE layers skip them, so they count in no balancer statistic; the MLA max logit
that QK-clip reads leaves out their queries, and so their keys, which only they see). Each
rank gets local `cu_seqlens` for the pieces of documents in its slice; a document may start, end or span any
number of slices. `CPSlice` records, for every rank, whether its slice starts inside a document (`cont`) and
where that document starts, which is all the layers need.

KDA (gated delta rule, per head, state S [K, V]):  S_t = A_t S_{t-1} + beta_t k_t v_t^T,
A_t = (I - beta_t k_t k_t^T) diag(exp g_t)  (k3/ops/kda/reference.py: decay first, then the delta update), and
o_t = S_t^T q_t. S_t is affine in the incoming state: S_t = P_t S_in + S_t^0 with P_t = A_t ... A_1, so
    o_t = o_t^0 + S_in^T w_t,   w_t = P_t^T q_t,     S_out = M S_in + S_local,   M = P_n.
Each rank runs its first document piece ONCE through the dispatched `chunk_kda` with the value width extended by
K: v' = [v | 0], initial state [0 | I]. By linearity the state is [S_t^0 | P_t], so the output is [o^0 | w] and
the final state [S_local | M] -- the transition operator and the correction vectors come out of the same kernel
call (fla / our Triton on GPU), in fp32 states. The other pieces of the slice start from zero (documents that
begin inside the slice reset the state) and run as one ordinary varlen call. Then one all-gather over the cp
group of [S_last | M] per rank ([H, K, V + K] fp32), and rank r composes its incoming state from the ranks of
its first document, j0 .. r-1:  S = S_local(j0);  S = M_j S + S_last(j)  for j0 < j < r  (those slices lie
wholly inside the document), and adds S_in^T w_t to its first piece's outputs. Autograd runs through all of it;
the all-gather's backward sums the gradients of every rank's use of each [S | M] back to its owner, so the
backward carries dS from later ranks automatically.

Short conv: the (kernel - 1) pre-activation rows before the slice come from the earlier ranks (an all-gather of
every rank's last min(L, kernel - 1) rows of q/k/v, zeros before the document start); they are prepended to the
first document piece as extra tokens (zero history = zero rows, the conv is linear before its SiLU), so the
dispatched `causal_conv1d` (Triton on GPU) runs unchanged, and its outputs for them are dropped.

MLA: an all-gather of the compressed per-token latent [c_kv (normed) || k_pe] (kv_lora + rope values) over the
cp group; the first document piece attends over the gathered prefix from its document's start (causal
`q_offset`, one document, so the flash path applies on GPU), the other pieces over their own local keys with
local `cu_seqlens`. The gather's backward reduces the latent gradients back to their owners.

Cost: the first piece's KDA call carries V + K value columns instead of V (the intra-chunk matrices do not depend
on the width; the state recurrence and outputs cost ~(V + K) / V), one [H, K, V + K] fp32 all-gather per KDA
layer, one [min(L, kernel - 1), 3 H K] all-gather per layer for the halos, and the MLA prefix is expanded through
kv_b on every rank (an absorbed-form attention over the gathered latents would avoid that; not done here).

Every rank calls every collective in the same order (one per KDA layer for the halos, one per KDA layer for the
states, one per MLA layer; none at all when every slice starts a document, which every rank knows) and each
gathered tensor always reaches the layer output (`_anchor` where a rank does not need it), so the backward
collectives match across ranks too. Everything else in the model (embedding, AttnRes, norms, MoE, loss) is
token-local. Nothing in k3.model / k3.nn imports torch.distributed: the CP forwards are installed per instance,
like expert parallelism's (k3/parallel/expert.py).
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from k3.errors import K3ConfigError
from k3.ops import f32
from k3.ops.loss import IGNORE_INDEX

__all__ = ["CPSlice", "CPBatch", "ContextParallel", "plan_slices", "shard_sequence", "apply_context_parallel",
           "all_gather_cp", "kda_local_pass", "kda_incoming_state", "kda_correct", "kda_context_parallel",
           "conv_halo", "IGNORE_INDEX"]

def _bad(msg: str):
    raise K3ConfigError(f"context parallel: {msg}")


# ---------------------------------------------------------------------------------------------- slices

@dataclass
class CPSlice:
    """Where rank `rank` of `size` sits in one packed sequence (every rank holds the same lists).

    slice_len L, total_len = L * size (padded), orig_len T (real tokens), bounds: the sorted document boundaries
    of the padded sequence (0 .. total_len, the pad document included). Per rank r: cont[r] (the slice starts
    inside a document), doc_start[r] (global start of the document holding the slice's first token),
    first_len[r] (tokens of the slice's first document piece)."""

    rank: int
    size: int
    slice_len: int
    orig_len: int
    bounds: List[int]
    cont: List[bool]
    doc_start: List[int]
    first_len: List[int]
    local_cu: List[List[int]] = field(repr=False, default_factory=list)

    @property
    def total_len(self) -> int:
        return self.slice_len * self.size

    @property
    def start(self) -> int:
        return self.rank * self.slice_len

    @property
    def doc_rank(self) -> int:
        """The rank whose slice holds the start of this rank's first document."""
        return self.doc_start[self.rank] // self.slice_len

    def cu_seqlens(self, device=None, dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(self.local_cu[self.rank], dtype=dtype, device=device)

    def for_rank(self, rank: int) -> "CPSlice":
        return CPSlice(rank, self.size, self.slice_len, self.orig_len, self.bounds, self.cont, self.doc_start,
                       self.first_len, self.local_cu)


def plan_slices(total_len: int, cu_seqlens: Optional[Sequence[int]], size: int, rank: int = 0) -> CPSlice:
    """Cut a packed sequence of `total_len` tokens with document boundaries `cu_seqlens` (None: one document)
    into `size` contiguous equal slices (the tail padded to size * ceil(T / size) as a document of its own)."""
    if not isinstance(size, int) or size < 1:
        _bad(f"cp size must be a positive int, got {size!r}")
    if not 0 <= rank < size:
        _bad(f"rank {rank} outside 0..{size - 1}")
    T = int(total_len)
    if T < 1:
        _bad(f"the sequence is empty (length {T})")
    cu = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        _bad(f"cu_seqlens must rise from 0 to the sequence length {T}, got {cu[:8]}...")
    L = -(-T // size)
    Tp = L * size
    bounds = sorted(set(cu) | {Tp})
    starts = set(bounds[:-1])
    cont, doc_start, first_len, local_cu = [], [], [], []
    for r in range(size):
        s, e = r * L, (r + 1) * L
        inner = [b for b in bounds if s < b < e]
        cont.append(s not in starts)
        doc_start.append(max(b for b in bounds if b <= s))
        first_len.append((inner[0] if inner else e) - s)
        local_cu.append([0] + [b - s for b in inner] + [L])
    return CPSlice(rank, size, L, T, bounds, cont, doc_start, first_len, local_cu)


@dataclass
class CPBatch:
    """This rank's slice: input_ids [1, L], labels [1, L] (pad -> -100) or None, local cu_seqlens, the slice."""
    input_ids: torch.Tensor
    labels: Optional[torch.Tensor]
    cu_seqlens: torch.Tensor
    slice: CPSlice


def shard_sequence(input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                   cu_seqlens: Optional[torch.Tensor] = None, *, rank: int, size: int, pad_id: int = 0) -> CPBatch:
    """This rank's contiguous slice of a packed batch (input_ids [1, T], aligned labels [1, T], cu_seqlens)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        _bad(f"context parallelism takes one packed sequence (batch 1 + cu_seqlens), got input shape "
             f"{tuple(input_ids.shape)}")
    if labels is not None and tuple(labels.shape) != tuple(input_ids.shape):
        _bad(f"labels shape {tuple(labels.shape)} != input shape {tuple(input_ids.shape)}")
    T = input_ids.shape[1]
    cu = None if cu_seqlens is None else cu_seqlens.detach().cpu().tolist()
    sl = plan_slices(T, cu, size, rank)
    pad = sl.total_len - T
    ids = input_ids
    if pad:
        ids = torch.cat([ids, ids.new_full((1, pad), pad_id)], 1)
        if labels is not None:
            labels = torch.cat([labels, labels.new_full((1, pad), IGNORE_INDEX)], 1)
    s, e = sl.start, sl.start + sl.slice_len
    lab = labels[:, s:e] if labels is not None else None
    cu_dtype = cu_seqlens.dtype if cu_seqlens is not None else torch.int32
    return CPBatch(ids[:, s:e], lab, sl.cu_seqlens(input_ids.device, cu_dtype), sl)


# ---------------------------------------------------------------------------------------------- collectives

class _GatherCP(torch.autograd.Function):
    """x [...] on every rank -> [size, ...] (rank order); backward: the sum over ranks of each rank's gradient
    w.r.t. my slot (reduce-scatter on NCCL, all-reduce + slice where the backend has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        n = dist.get_world_size(group)
        if dist.get_backend(group) == "nccl":
            out = x.new_empty((n,) + tuple(x.shape))
            dist.all_gather_into_tensor(out, x, group=group)
            return out
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, g):
        group = ctx.group
        g = g.contiguous()
        if dist.get_backend(group) == "nccl":
            out = torch.empty_like(g[0])
            dist.reduce_scatter_tensor(out, g, group=group)
            return out, None
        g = g.clone()
        dist.all_reduce(g, group=group)
        return g[dist.get_rank(group)].clone(), None


def all_gather_cp(x: torch.Tensor, group) -> torch.Tensor:
    """Autograd all-gather over the cp group: [size, *x.shape] (no process group at all: [1, *x.shape])."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return x.unsqueeze(0)
    return _GatherCP.apply(x, group)


class _Anchor(torch.autograd.Function):
    """Returns x; gives `dep` a zero gradient, so a gathered tensor this rank does not need still has its
    all-gather's backward run (every rank must join every backward collective)."""

    @staticmethod
    def forward(ctx, x, dep):
        ctx.dep_shape, ctx.dep_dtype = dep.shape, dep.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, g.new_zeros(ctx.dep_shape, dtype=ctx.dep_dtype)


def _anchor(x: torch.Tensor, dep: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and dep.requires_grad:
        return _Anchor.apply(x, dep)
    return x


# ---------------------------------------------------------------------------------------------- KDA algebra

def _state_dtype(*ts) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def kda_local_pass(q, k, v, g, beta, local_cu: Sequence[int], cont: bool, **kw):
    """One rank's KDA slice from a zero state (q, k, g [1, L, H, K], v [1, L, H, V], beta [1, L, H]; `kw`:
    chunk_kda's keyword arguments except initial_state / output_final_state / cu_seqlens).

    Returns (o [1, L, H, V] local outputs, w [1, n1, H, K] or None, pack [H, K, V + K]): w_t = P_t^T q_t for the
    first document piece (n1 tokens) when the slice continues a document (`cont`); pack = [S_last | M], the final
    state of the slice's last piece and, when the slice is one piece continuing a document, its transition
    operator M (zeros otherwise: a piece that starts a document does not pass the incoming state on)."""
    from k3.ops.kda import chunk_kda
    _, L, H, K = q.shape
    V = v.shape[-1]
    sdt = _state_dtype(q, k, v, g)
    dev = q.device
    if not cont:
        cu = torch.tensor(list(local_cu), dtype=torch.int64, device=dev)
        o, S = chunk_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, **kw)
        pack = torch.cat([S[-1].to(sdt), S.new_zeros(H, K, K, dtype=sdt)], -1)
        return o, None, pack
    n1 = local_cu[1]
    v_ext = torch.cat([v[:, :n1], v.new_zeros(1, n1, H, K)], -1)
    S0 = torch.zeros(1, H, K, V + K, dtype=torch.float32 if sdt == torch.float32 else sdt, device=dev)
    S0[..., V:] = torch.eye(K, dtype=S0.dtype, device=dev)
    o1e, S1e = chunk_kda(q[:, :n1], k[:, :n1], v_ext, g[:, :n1], beta[:, :n1], initial_state=S0,
                         output_final_state=True, **kw)
    o1, w = o1e.split([V, K], -1)
    if n1 == L:
        return o1, w, S1e[0].to(sdt)
    cu = torch.tensor([c - n1 for c in local_cu[1:]], dtype=torch.int64, device=dev)
    o2, S2 = chunk_kda(q[:, n1:], k[:, n1:], v[:, n1:], g[:, n1:], beta[:, n1:], cu_seqlens=cu,
                       output_final_state=True, **kw)
    pack = torch.cat([S2[-1].to(sdt), S2.new_zeros(H, K, K, dtype=sdt)], -1)
    return torch.cat([o1, o2], 1), w, pack


def kda_incoming_state(packs: torch.Tensor, V: int, first_rank: int, rank: int) -> torch.Tensor:
    """The true state entering `rank`'s slice from the ranks of its first document, first_rank .. rank-1:
    packs [size, H, K, V + K] ([S_last | M] per rank). S = S_last(first_rank); S = M_j S + S_last(j) after."""
    if not 0 <= first_rank < rank:
        raise ValueError(f"kda_incoming_state: need 0 <= first_rank < rank, got {first_rank}, {rank}")
    S = packs[first_rank, ..., :V]
    for j in range(first_rank + 1, rank):
        S = packs[j, ..., V:] @ S + packs[j, ..., :V]
    return S


def kda_correct(o: torch.Tensor, w: torch.Tensor, S_in: torch.Tensor) -> torch.Tensor:
    """o [1, L, H, V] with o_t += S_in^T w_t for the first w.shape[1] tokens (math in the state dtype)."""
    n1 = w.shape[1]
    corr = torch.einsum("bthk,hkv->bthv", w.to(S_in.dtype), S_in)
    o1 = (o[:, :n1].to(S_in.dtype) + corr).to(o.dtype)
    return torch.cat([o1, o[:, n1:]], 1) if n1 < o.shape[1] else o1


@torch.compiler.disable
def kda_context_parallel(q, k, v, g, beta, sl: CPSlice, group, **kw):
    """chunk_kda over the whole (sliced) sequence: this rank's outputs [1, L, H, V] equal the corresponding rows
    of one process's chunk_kda on the full sequence with the global cu_seqlens (see the module doc)."""
    r = sl.rank
    o, w, pack = kda_local_pass(q, k, v, g, beta, sl.local_cu[r], sl.cont[r], **kw)
    if not any(sl.cont):            # every slice starts a document (all ranks know): nothing to pass on
        return o
    packs = all_gather_cp(pack, group)
    if not sl.cont[r]:
        return _anchor(o, packs)
    S_in = kda_incoming_state(packs, v.shape[-1], sl.doc_rank, r)
    return kda_correct(o, w, S_in)


# ---------------------------------------------------------------------------------------------- conv halo

@torch.compiler.disable
def conv_halo(x_LC: torch.Tensor, sl: CPSlice, width: int, group) -> torch.Tensor:
    """The `width` pre-activation rows before this rank's slice ([width, C]; zeros before its document's start or
    the sequence start), gathered from the earlier ranks (each contributes its last min(L, width) rows)."""
    L = sl.slice_len
    m = min(L, width)
    if not any(sl.cont):
        return x_LC.new_zeros(width, x_LC.shape[1])
    tails = all_gather_cp(x_LC[L - m:], group)                       # [size, m, C]
    if not sl.cont[sl.rank]:
        return _anchor(x_LC.new_zeros(width, x_LC.shape[1]), tails)
    s, d0 = sl.start, sl.doc_start[sl.rank]
    idx, keep = [], []
    for p in range(s - width, s):
        if p < d0:
            idx.append(0)
            keep.append(False)
        else:
            j = p // L
            idx.append(j * m + (p - j * L) - (L - m))
            keep.append(True)
    flat = tails.reshape(-1, x_LC.shape[1])
    rows = flat.index_select(0, torch.tensor(idx, device=x_LC.device))
    keep_t = torch.tensor(keep, device=x_LC.device).unsqueeze(1)
    return torch.where(keep_t, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


@torch.compiler.disable
def _conv_with_halo(x_BTC, weight, halo, sl: CPSlice):
    """causal_conv1d (SiLU) over this slice with the halo prepended to the first document piece."""
    from k3.ops.conv import causal_conv1d
    r = sl.rank
    cu = sl.local_cu[r]
    if not sl.cont[r]:
        y, _ = causal_conv1d(x_BTC, weight, None, torch.tensor(cu, dtype=torch.int64, device=x_BTC.device),
                             "silu")
        return _anchor(y, halo) if halo.requires_grad else y
    w = halo.shape[0]
    ext = torch.cat([halo.unsqueeze(0).to(x_BTC.dtype), x_BTC], 1)
    cu_ext = torch.tensor([0] + [c + w for c in cu[1:]], dtype=torch.int64, device=x_BTC.device)
    y, _ = causal_conv1d(ext, weight, None, cu_ext, "silu")
    return y[:, w:]


# ---------------------------------------------------------------------------------------------- the wrapper

class ContextParallel:
    """The cp process group of this rank and the slice of the batch being run (set by `shard`). `group` None:
    the default group, or -- where no process group is initialised -- a single rank (cp = 1, for tests)."""

    def __init__(self, group=None):
        self.group = group
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.size, self.rank = 1, 0
        else:
            self.size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        self.current: Optional[CPSlice] = None

    @classmethod
    def from_mesh(cls, pmesh) -> "ContextParallel":
        if pmesh.cp is None:
            _bad("the mesh has no cp dim (cp = 1); build it with ParallelDims(cp=N)")
        return cls(pmesh.cp.get_group())

    def shard(self, input_ids, labels=None, cu_seqlens=None, pad_id: int = 0) -> CPBatch:
        b = shard_sequence(input_ids, labels, cu_seqlens, rank=self.rank, size=self.size, pad_id=pad_id)
        self.current = b.slice
        return b

    def gather(self, x_BLD: torch.Tensor) -> torch.Tensor:
        """The whole sequence of a per-token tensor [1, L, ...] (pad removed): [1, T, ...]; autograd-aware."""
        sl = self._slice()
        full = all_gather_cp(x_BLD[0], self.group)
        return full.reshape((1, -1) + tuple(x_BLD.shape[2:]))[:, :sl.orig_len]

    def _slice(self) -> CPSlice:
        if self.current is None:
            _bad("no current slice: call ContextParallel.shard(input_ids, labels, cu_seqlens) before the forward")
        return self.current

    @torch.compiler.disable
    def check(self, x_BTd: torch.Tensor, cu_seqlens, cache, what: str) -> CPSlice:
        sl = self._slice()
        if cache is not None:
            _bad(f"{what}: generation with a cache does not run under context parallelism")
        if x_BTd.shape[0] != 1 or x_BTd.shape[1] != sl.slice_len:
            _bad(f"{what}: input of shape {tuple(x_BTd.shape[:2])} is not this rank's slice [1, {sl.slice_len}] "
                 f"(feed the model ContextParallel.shard(...)'s input_ids and cu_seqlens)")
        n = len(sl.local_cu[sl.rank])
        got = 2 if cu_seqlens is None else cu_seqlens.numel()
        if got != n:
            _bad(f"{what}: cu_seqlens has {got} entries, the current slice has {n} (pass shard(...).cu_seqlens)")
        return sl


def _cp_kda_forward(self, x_BTd: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, cache=None):
    """KDAAttention.forward (training path) with the conv halo and the KDA state passed across the cp ranks."""
    cp: ContextParallel = self._k3_cp
    sl = cp.check(x_BTd, cu_seqlens, cache, f"KDA layer {self.layer_idx}")
    B, T, _ = x_BTd.shape
    H, K = self.num_heads, self.head_dim
    P = H * K
    xq, xk, xv = self.q_proj(x_BTd), self.k_proj(x_BTd), self.v_proj(x_BTd)
    halo = conv_halo(torch.cat([xq, xk, xv], -1)[0], sl, self.conv_size - 1, cp.group)
    hq, hk, hv = halo.split(P, -1)
    q = _conv_with_halo(xq, self.q_conv1d.weight, hq, sl)
    k = _conv_with_halo(xk, self.k_conv1d.weight, hk, sl)
    v = _conv_with_halo(xv, self.v_conv1d.weight, hv, sl)
    f_BTHK = self.f_b_proj(self.f_a_proj(x_BTd)).view(B, T, H, K)
    beta_BTH = torch.sigmoid(f32(self.b_proj(x_BTd)))
    kw = dict(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log,
              dt_bias=self.dt_bias, lower_bound=self.lower_bound, backend=self.backend)
    o_BTHK = kda_context_parallel(q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, K), f_BTHK, beta_BTH,
                                  sl, cp.group, **kw)
    o32 = f32(o_BTHK)
    o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.norm_eps) * f32(self.o_norm.weight)
    gate = torch.sigmoid(f32(self.g_proj(x_BTd))).view(B, T, H, K)
    y = (o32 * gate).to(x_BTd.dtype).reshape(B, T, H * K)
    return self.o_proj(y)


def _attend(self, q, k, v, n_real: int, track: bool, cu: Optional[list] = None, q_offset: int = 0):
    """causal_attention of local queries (pieces `cu`, or one document at `q_offset`) -> (o, max logit or None),
    the max logit over the first `n_real` queries only: the rows after them are the padding document (it comes
    after every real token and sees only itself), which must not reach QK-clip. The output is the same call."""
    from k3.ops.attention import attention_max_logit, causal_attention
    dev = q.device
    cu_t = None if cu is None else torch.tensor(cu, device=dev)
    if not track or n_real >= q.shape[1]:
        return causal_attention(q, k, v, self.softmax_scale, cu_seqlens=cu_t, q_offset=q_offset,
                                return_max_logit=track)
    o, _ = causal_attention(q, k, v, self.softmax_scale, cu_seqlens=cu_t, q_offset=q_offset)
    cu_r = None if cu is None else torch.tensor([c for c in cu if c < n_real] + [n_real], device=dev)
    ml = attention_max_logit(q[:, :n_real], k[:, :q_offset + n_real], self.softmax_scale, cu_seqlens=cu_r,
                             q_offset=q_offset)
    return o, ml


@torch.compiler.disable
def _mla_cp_attention(self, q, c, k_pe, sl: CPSlice, group):
    """(o [1, L, H, v], max logit or None): this rank's queries over the gathered latents of their documents.
    The max logit (QK-clip) leaves out the padding's queries (and so its keys: only pad queries see them); a
    rank of padding only reports -inf."""
    r, L = sl.rank, sl.slice_len
    C = self.kv_lora_rank
    lat = torch.cat([c, k_pe], -1)[0]                                      # [L, kv_lora + rope]
    # every slice starting a document (all ranks know): no latent crosses ranks
    gathered = all_gather_cp(lat, group) if any(sl.cont) else None       # [size, L, kv_lora + rope]
    track = self.track_max_logit and self.training
    n_real = max(0, min(L, sl.orig_len - sl.start))                      # the padding document follows these
    cu = sl.local_cu[r]
    if not sl.cont[r]:
        k, v = self.expand_kv(c, k_pe)
        o, ml = _attend(self, q, k, v, n_real, track, cu=cu)
        if gathered is not None:
            o = _anchor(o, gathered)
    else:
        n1, s, d0 = cu[1], sl.start, sl.doc_start[r]
        prefix = gathered.reshape(-1, lat.shape[-1])[d0:s]
        lat1 = torch.cat([prefix, lat[:n1]], 0).unsqueeze(0)
        k1, v1 = self.expand_kv(lat1[..., :C], lat1[..., C:])
        o, ml = _attend(self, q[:, :n1], k1, v1, min(n_real, n1), track, q_offset=s - d0)
        if n1 < L:
            k2, v2 = self.expand_kv(c[:, n1:], k_pe[:, n1:])
            cu2 = [x - n1 for x in cu[1:]]
            o2, ml2 = _attend(self, q[:, n1:], k2, v2, max(0, n_real - n1), track, cu=cu2)
            o = torch.cat([o, o2], 1)
            if ml is not None:
                ml = torch.maximum(ml, ml2)
    return o, ml


def _cp_mla_forward(self, x_BTd: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, cache=None):
    """MLAAttention.forward (training path) with the compressed latent all-gathered over the cp ranks."""
    cp: ContextParallel = self._k3_cp
    sl = cp.check(x_BTd, cu_seqlens, cache, f"MLA layer {self.layer_idx}")
    q = self.project_q(x_BTd)
    c, k_pe = self.project_latent(x_BTd)
    o, ml = _mla_cp_attention(self, q, c, k_pe, sl, cp.group)
    if ml is not None:
        self.last_max_logit = ml
    return self.output(o, x_BTd)


def _cp_moe_forward(self, x_BTd: torch.Tensor):
    """LatentMoE.forward (or the EP one) on this rank's real tokens only: the padding at the end of the sequence
    (cp not dividing it) never reaches the router, so it counts in no balancer statistic (load, QB margins,
    histograms, aux loss) and costs no expert compute; its output rows are zeros (nothing real reads them)."""
    sl = self._k3_cp._slice()
    L = x_BTd.shape[1]
    n = max(0, min(L, sl.orig_len - sl.start))
    if n == L:
        return self._k3_moe_forward(x_BTd)
    out = self._k3_moe_forward(x_BTd[:, :n])        # a rank of pad only still joins the EP all-to-alls (0 rows)
    return torch.cat([out, out.new_zeros((x_BTd.shape[0], L - n) + tuple(out.shape[2:]))], 1)


def apply_context_parallel(model: torch.nn.Module, cp: ContextParallel) -> list:
    """Install the CP forwards on every KDAAttention and MLAAttention of `model`, and the pad-skipping forward on
    every LatentMoE (in place; after expert parallelism, before FSDP). Returns the attention modules changed."""
    from k3.nn.kda import KDAAttention
    from k3.nn.mla import MLAAttention
    from k3.nn.moe import LatentMoE
    done = []
    for name, m in model.named_modules():
        if isinstance(m, (KDAAttention, MLAAttention, LatentMoE)):
            if getattr(m, "_k3_cp", None) is not None:
                _bad(f"{name}: context parallelism is already applied")
            m._k3_cp = cp
            if isinstance(m, LatentMoE):
                m._k3_moe_forward = m.forward               # the model's, or expert parallelism's override
                m.forward = types.MethodType(_cp_moe_forward, m)
                continue
            fwd = _cp_kda_forward if isinstance(m, KDAAttention) else _cp_mla_forward
            m.forward = types.MethodType(fwd, m)
            done.append(m)
    return done
