"""Absorbed MLA decode attention as a split-K ("flash-decoding") Triton kernel (architecture.md §7, absorbed MLA decode).

Math, per cache row n and head h, with the folded query q_n,h = [q~ || q_pe] * scale in R^(C+R) (C = kv_lora_rank,
R = qk_rope_head_dim) and the cached rows x_t = [c_t || k_pe,t] of row n, t = 0..len_n (len_n = `lens[n]`, the
position the new token was just written to, so len_n + 1 positions are visible):

    s_t   = q~ . c_t + q_pe . k_pe,t                      (q is already scaled)
    o_lat = sum_t softmax(s)_t c_t        in R^C          (the caller unfolds o_lat through W_UV)

Split-K over the window: program (n, head block, split j) walks the key blocks j, j + S, j + 2S, ... (BN positions
each, S = number of splits) below len_n + 1, and keeps an online softmax in fp32, in base 2 (s2 = s * log2 e):

    m  = max over its visible t of s2_t,   l = sum_t 2^(s2_t - m),   a = sum_t 2^(s2_t - m) c_t

A new block with scores s2 rescales by alpha = 2^(m_old - m_new); m starts at -1e30 (finite), so a split with no
visible position keeps (m, l, a) = (-1e30, 0, 0) and never makes a NaN. The combine kernel then forms, per (n, h),

    M = max_j m_j,  w_j = 2^(m_j - M),  o_lat = (sum_j w_j a_j) / (sum_j w_j l_j)

(empty splits get w_j = 0; the split holding the maximum has l_j >= 1, so the denominator is >= 1).

Blocks are dealt out cyclically (not as contiguous slices), so every split has work whatever the row's length:
a row whose length is far below the window (a reserved 1M window holding 10K tokens) still spreads over all S
programs, and positions beyond len_n are never read (the torch path reads the whole window every step).

Tiles: the latent part and the rope part are loaded as two tiles (C + R is not a power of two), each padded to a
power of two >= 16 with masked loads; heads are padded to >= 16 (tl.dot needs M >= 16) and split into blocks of
at most 64 heads (a head block re-reads the latent, which the released model's 96 heads pay twice). The dots take
the cache dtype (q and the softmax weights are rounded to it, as `bmm_acc` does in the torch path) with fp32
accumulation; an fp32 cache uses IEEE fp32 dots (no tf32), like torch's default matmul.

CUDA-graph capturable: the number of splits depends only on static shapes (N, H, W) and the device's SM count,
the lengths are read on the device, there are no host syncs and no data-dependent shapes; the partial results are
[N, S, H, C] fp32 (+ two [N, S, H]) allocated per call (from the graph's pool when captured).

Importing this module imports triton: callers (k3.generation.static) import it inside a try and fall back to the
torch path when it fails, when `unsupported_reason` says so (CPU without TRITON_INTERPRET, an fp64 model, ...).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from k3.ops.dispatch import triton_interpreting as _interpret

__all__ = ["available", "unsupported_reason", "plan", "mla_decode", "MLADecodePlan"]

MAX_BH = 64            # heads per program (larger H: several head blocks)
MIN_BLOCKS_PER_SPLIT = 2


@triton.jit
def _partial_kernel(
        Q, KV, LENS, ACC, MAX, SUM,
        H, W, NSPLIT,
        s_qn, s_qh, s_kn, s_kw,
        C: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
        BH: tl.constexpr, BN: tl.constexpr, NHB: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    row = pid // NHB
    heads = (pid % NHB) * BH + tl.arange(0, BH)
    hmask = heads < H
    cc = tl.arange(0, BC)
    rr = tl.arange(0, BR)
    cmask = cc < C
    rmask = rr < R
    nn = tl.arange(0, BN)
    row64 = row.to(tl.int64)
    kvt = KV.dtype.element_ty
    # folded query [BH, C] and [BH, R], rounded to the cache dtype for the dots
    qp = Q + row64 * s_qn + heads.to(tl.int64)[:, None] * s_qh
    q_lat = tl.load(qp + cc[None, :], mask=hmask[:, None] & cmask[None, :], other=0.0).to(kvt)
    q_pe = tl.load(qp + C + rr[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0).to(kvt)
    length = tl.load(LENS + row)
    hi = tl.minimum(length + 1, W).to(tl.int32)          # visible positions: [0, hi)
    m_i = tl.full([BH], -1.0e30, tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BC], dtype=tl.float32)
    kv_row = KV + row64 * s_kn
    for start in tl.range(split * BN, hi, NSPLIT * BN):
        pos = start + nn
        pmask = pos < hi
        kp = kv_row + pos.to(tl.int64)[:, None] * s_kw
        c = tl.load(kp + cc[None, :], mask=pmask[:, None] & cmask[None, :], other=0.0)        # [BN, BC]
        kpe = tl.load(kp + C + rr[None, :], mask=pmask[:, None] & rmask[None, :], other=0.0)  # [BN, BR]
        s = tl.dot(q_lat, tl.trans(c), input_precision=PREC)
        s = tl.dot(q_pe, tl.trans(kpe), s, input_precision=PREC)                              # [BH, BN]
        s = tl.where(pmask[None, :], s * 1.4426950408889634, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(kvt), c, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    idx = (row64 * NSPLIT + split) * H + heads                                                # [N, S, H]
    tl.store(MAX + idx, m_i, mask=hmask)
    tl.store(SUM + idx, l_i, mask=hmask)
    tl.store(ACC + idx[:, None] * C + cc[None, :], acc, mask=hmask[:, None] & cmask[None, :])


@triton.jit
def _combine_kernel(ACC, MAX, SUM, O, H, NSPLIT, s_on, s_oh, C: tl.constexpr, BS: tl.constexpr, BCC: tl.constexpr):
    nh = tl.program_id(0)
    row = (nh // H).to(tl.int64)
    h = nh % H
    cols = tl.program_id(1) * BCC + tl.arange(0, BCC)
    cm = cols < C
    ss = tl.arange(0, BS)
    base = row * NSPLIT * H + h
    mx = tl.full([BS], -1.0e30, tl.float32)
    for s0 in range(0, NSPLIT, BS):
        sm = s0 + ss < NSPLIT
        mx = tl.maximum(mx, tl.load(MAX + base + (s0 + ss) * H, mask=sm, other=-1.0e30))
    m_all = tl.max(mx, 0)
    acc = tl.zeros([BCC], dtype=tl.float32)
    den = tl.zeros([BS], dtype=tl.float32)
    for s0 in range(0, NSPLIT, BS):
        sm = s0 + ss < NSPLIT
        idx = base + (s0 + ss) * H
        w = tl.where(sm, tl.exp2(tl.load(MAX + idx, mask=sm, other=-1.0e30) - m_all), 0.0)
        den += w * tl.load(SUM + idx, mask=sm, other=0.0)
        a = tl.load(ACC + idx[:, None] * C + cols[None, :], mask=sm[:, None] & cm[None, :], other=0.0)
        acc += tl.sum(w[:, None] * a, 0)
    d = tl.sum(den, 0)
    o = acc / tl.where(d > 0.0, d, 1.0)
    tl.store(O + row * s_on + h * s_oh + cols, o, mask=cm)


def available() -> bool:
    """There is somewhere to run the kernels: CUDA, or the interpreter (TRITON_INTERPRET=1 set before triton was
    imported). Triton itself was imported with this module (callers import it inside a try)."""
    return torch.cuda.is_available() or _interpret()


def unsupported_reason(device: torch.device, cache_dtype: torch.dtype,
                       compute_dtype: torch.dtype = torch.float32) -> Optional[str]:
    """Why the kernel cannot serve this layer (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda" and not _interpret():
        return f"tensors on {device.type} (set TRITON_INTERPRET=1 to run the kernel on CPU)"
    if compute_dtype != torch.float32:
        return f"compute dtype {compute_dtype} (the kernel accumulates in fp32)"
    if cache_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"cache dtype {cache_dtype}"
    if not available():
        return "triton is not available"
    return None


def _pow2_16(n: int) -> int:
    p = 16
    while p < n:
        p *= 2
    return p


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class MLADecodePlan:
    """Static launch parameters for one (N, H, W, C, R, cache dtype, device)."""
    N: int
    H: int
    W: int
    C: int
    R: int
    BH: int
    NHB: int
    BC: int
    BR: int
    BN: int
    splits: int
    num_warps: int
    num_stages: int
    prec: str
    BS: int = 32
    BCC: int = 64


def balanced_splits(units: int, lo: int, hi: int, sms: int) -> int:
    """The split count in [lo, hi] whose program count units x splits spreads most evenly over `sms`
    multiprocessors (every SM gets the same number of programs, within 5%), the smallest such; else the most even.
    Why: with 28 rows of the `small` hybrid at 1M context the old count (ceil(2 x 132 / 28) = 10: 280 programs
    for 264 slots) left 16 programs for a second round, and the hybrid read its cache at 2.3 TB/s where the
    all-MLA control (8 rows x 33 splits = 264 programs) read at 3.3 (benchmarks/RESULTS.md, seventh session)."""
    best, best_imb = lo, float("inf")
    for s in range(lo, max(lo, hi) + 1):
        p = units * s
        imb = -(-p // sms) * sms / p
        if imb <= 1.05:
            return s
        if imb < best_imb - 1e-9:
            best, best_imb = s, imb
    return best


def plan(N: int, H: int, W: int, C: int, R: int, cache_dtype: torch.dtype, device: torch.device, *,
         splits: Optional[int] = None, block_n: Optional[int] = None, num_warps: Optional[int] = None,
         num_stages: Optional[int] = None, target_programs: Optional[int] = None,
         sms: Optional[int] = None) -> MLADecodePlan:
    """Launch parameters from static shapes only (no tensor values). Splits: enough programs to cover the GPU
    twice (target 2 x SMs; 8 under the CPU interpreter), at most one split per MIN_BLOCKS_PER_SPLIT key blocks of
    the window; on CUDA (or with `sms` given) raised up to 4x so that the programs spread evenly over the SMs
    (`balanced_splits`). Key block and warps by the size of a program's fp32 accumulator BH x BC: >= 64 x 512:
    32 keys, 8 warps, 2 stages; >= 64 x 256 (or 32 x 512): 64 keys, 8 warps, 2 stages; else 64 keys, 4 warps,
    3 stages (heuristics, not tuned on a GPU yet: benchmarks/mla_decode.py --sweep tries others)."""
    device = torch.device(device)
    BH = min(_pow2_16(H), MAX_BH)
    NHB = -(-H // BH)
    BC, BR = _pow2_16(C), _pow2_16(R)
    big, mid = BH * BC >= 64 * 512, BH * BC >= 64 * 256
    BN = int(block_n) if block_n is not None else (32 if big else 64)
    if BN < 16 or BN & (BN - 1):
        raise ValueError(f"mla_decode: block_n {BN} must be a power of two >= 16")
    if sms is None and device.type == "cuda":
        sms = _sm_count(device.index or 0)
    if target_programs is None:
        target_programs = 2 * sms if device.type == "cuda" else 8
    if splits is None:
        cap = max(1, -(-W // BN) // MIN_BLOCKS_PER_SPLIT)
        splits = max(1, min(-(-target_programs // (N * NHB)), cap))
        if sms:
            splits = balanced_splits(N * NHB, splits, min(cap, 4 * splits), sms)
    splits = max(1, int(splits))
    if num_warps is None:
        num_warps = 8 if mid else 4
    if num_stages is None:
        num_stages = 2 if mid else 3
    prec = "ieee" if cache_dtype == torch.float32 else "tf32"
    return MLADecodePlan(N=N, H=H, W=W, C=C, R=R, BH=BH, NHB=NHB, BC=BC, BR=BR, BN=BN, splits=splits,
                         num_warps=int(num_warps), num_stages=int(num_stages), prec=prec)


def mla_decode(qf: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, kv_lora_rank: int,
               plan_: Optional[MLADecodePlan] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """o_lat [N, H, C] fp32 = softmax over t <= lens[n] of (qf[n, h] . kv[n, t]) applied to kv[n, t, :C].

    qf [N, H, C+R] fp32 (already scaled); kv [N, W, C+R] bf16/fp16/fp32 with unit last stride (a strided view of
    the cache buffer is fine); lens [N] int64 on the device (row n sees positions 0..lens[n]; lens[n] < W);
    kv_lora_rank = C. `plan_` (from `plan`) fixes the launch; by default it is derived from the shapes."""
    N, H, D = qf.shape
    W = kv.shape[1]
    C = int(kv_lora_rank)
    R = D - C
    if kv.shape[0] != N or kv.shape[2] != D or R <= 0:
        raise ValueError(f"mla_decode: qf {tuple(qf.shape)}, kv {tuple(kv.shape)}, C={C}")
    if qf.dtype != torch.float32:
        qf = qf.float()
    if qf.stride(-1) != 1:
        qf = qf.contiguous()
    if kv.stride(-1) != 1:
        raise ValueError("mla_decode: kv needs a unit last stride")
    p = plan_ if plan_ is not None else plan(N, H, W, C, R, kv.dtype, kv.device)
    if (p.N, p.H, p.W, p.C, p.R) != (N, H, W, C, R):
        raise ValueError(f"mla_decode: plan for {(p.N, p.H, p.W, p.C, p.R)}, inputs {(N, H, W, C, R)}")
    S = p.splits
    dev = kv.device
    acc = torch.empty(N, S, H, C, dtype=torch.float32, device=dev)
    mx = torch.empty(N, S, H, dtype=torch.float32, device=dev)
    sm = torch.empty(N, S, H, dtype=torch.float32, device=dev)
    if out is None:
        out = torch.empty(N, H, C, dtype=torch.float32, device=dev)
    _partial_kernel[(N * p.NHB, S)](
        qf, kv, lens, acc, mx, sm, H, W, S, qf.stride(0), qf.stride(1), kv.stride(0), kv.stride(1),
        C=C, R=R, BC=p.BC, BR=p.BR, BH=p.BH, BN=p.BN, NHB=p.NHB, PREC=p.prec,
        num_warps=p.num_warps, num_stages=p.num_stages)
    _combine_kernel[(N * H, -(-C // p.BCC))](
        acc, mx, sm, out, H, S, out.stride(0), out.stride(1), C=C, BS=p.BS, BCC=p.BCC, num_warps=2)
    return out
