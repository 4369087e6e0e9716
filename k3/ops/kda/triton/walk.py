"""Prologue of the sequential walks (forward state pass, backward states / dstates passes): which sequence,
head and value block a program walks, and its token range and carried fp32 state."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _walk_ids(order, NV: tl.constexpr, ORDERED: tl.constexpr):
    """(sequence, head, value block) of a sequential pass's program. ORDERED: the grid is (H * NV, N) and slot n walks
    sequence order[n], so with order = the sequences longest first every head's programs of the longest sequence come
    first in the launch order (the block scheduler starts programs in grid order; longest-first list scheduling
    keeps a long document's walks out of the last wave). Else the grid is (N, H, NV)."""
    if ORDERED:
        hv = tl.program_id(0)
        i_n = tl.load(order + tl.program_id(1))
        i_h = hv // NV
        i_v = hv % NV
    else:
        i_n = tl.program_id(0)
        i_h = tl.program_id(1)
        i_v = tl.program_id(2)
    return i_n, i_h, i_v


@triton.jit
def _seq_walk_start(cu, seq_chunk, s0, i_n, i_h, i_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr, CU_STRIDE: tl.constexpr = 1):
    """Prologue of the sequential (per sequence, head, value block) kernels: the sequence's token range
    [bos, eos), its first global chunk c0 and chunk count nc, the row/column offsets, kv = the [K, BV] block's
    offsets inside one K x V matrix, and the carried fp32 matrix S read from s0[n, h] (zeros without HAS_S0).
    CU_STRIDE 1: cu holds N + 1 boundaries (sequence n = [cu[n], cu[n+1])); 2: cu holds N (start, end) pairs, so
    the ranges need not touch (the pipelined forward walks one time piece of every sequence per launch)."""
    bos = tl.load(cu + i_n * CU_STRIDE).to(tl.int64)
    eos = tl.load(cu + i_n * CU_STRIDE + 1).to(tl.int64)
    c0 = tl.load(seq_chunk + i_n).to(tl.int64)
    nc = (eos - bos + BT - 1) // BT
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    kv = o_k[:, None].to(tl.int64) * V + o_v[None, :]
    ps = (i_n * H + i_h).to(tl.int64) * K * V + kv
    if HAS_S0:
        S = tl.load(s0 + ps).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    return bos, eos, c0, nc, o_t, o_k, o_v, kv, ps, S
