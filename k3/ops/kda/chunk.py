"""Chunkwise-parallel KDA in pure PyTorch (the "torch" backend of `chunk_kda`).

Within a chunk of C (=64) tokens with inclusive log-decay cumsum G_t and state S0 at the chunk start, the delta
rule is written in WY/UT form: pseudo-values u = U - W S0 with
    (I + diag(beta) L) [W | U] = diag(beta) [k*exp(G) | v],   L_ti = sum_c k_tc k_ic exp(G_tc - G_ic)  (i < t),
    o = (q*exp(G)) S0 + A_qk u,   A_qk,ti = sum_c q_tc k_ic exp(G_tc - G_ic)  (i <= t),
    S_C = exp(G_C) S0 + (k*exp(G_C - G))^T u.
Notable: L and A_qk are plain matmuls. Rows are taken in tiles of s (=16) tokens that each factor the decay
through one reference token m inside the tile: exp(G_t - G_i) = exp(G_t - G_m) * exp(G_m - G_i). Columns before
the tile get factors <= 1 (no overflow); inside the tile both exponents are bounded by ~s/2 steps of |g|, i.e.
<= 40 for the K3 gate (g >= -5), far inside fp32 range. If g is steeper than the dtype allows (unbounded gate),
the tile shrinks (down to 1 token, which is exact for any g <= 0). The loop runs over chunk positions only,
batched over the (varlen) sequences that still have a chunk there (sorted by length, so a prefix slice);
padding tokens inside a sequence's last chunk have g=0, beta=0, k=0 so they change nothing. The state
between chunks is fp32 (fp64 for fp64 inputs) whatever the input dtype. Decay exponents are differences of
fp64 cumsums, so fp32 results stay ~1e-7 from an fp64 reference even for steep gates. Plain autograd.
"""
from __future__ import annotations

from typing import Optional

import torch

from .common import gather_blocks, make_step_layout, prepare_inputs, scatter_blocks

# Largest exponent magnitude allowed in the factored decays (leaves ~e^28 of headroom for |q|, |k| in fp32).
_EXP_LIMIT = {torch.float32: 60.0, torch.float64: 600.0}
_TILES = (16, 8, 4, 2)
# Decay factors below exp(floor) are set to exactly 0: subnormal results make CPU exp/mul/bmm several times
# slower, and the dropped terms are < 1e-34 (fp32) of the leading ones.
_EXP_FLOOR = {torch.float32: -80.0, torch.float64: -690.0}


def _exp(x_hp: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """exp(x) in dtype dt with subnormal results flushed to 0 (x may be fp64)."""
    return x_hp.masked_fill(x_hp < _EXP_FLOOR[dt], float("-inf")).to(dt).exp()


def _steepness(g: torch.Tensor) -> float:
    return max(0.0, -float(g.detach().min())) if g.numel() else 0.0


def _factored_ok(s: int, steep: float, dt: torch.dtype) -> bool:
    """Whether intra_chunk may factor the column decays through tile ends: exp(-(s-1)*steep) must stay well
    above the flush floor (true for the K3 gate, steep < 5: 15*5 = 75 < 80 in fp32)."""
    return s > 1 and (s - 1) * steep <= -_EXP_FLOOR[dt] - 2.0


def tile_size(g: torch.Tensor, C: int, dt: torch.dtype, steep: Optional[float] = None) -> int:
    """Largest row tile whose factored exponents stay within _EXP_LIMIT for the steepest decay in g."""
    if steep is None:
        steep = _steepness(g)
    for s in _TILES:
        m = (s - 1) // 2
        if C % s == 0 and max(m, s - 1 - m) * steep <= _EXP_LIMIT[dt]:
            return s
    return 1


def _unit_lower_inverse(N_BCC: torch.Tensor, bs: int = 16) -> torch.Tensor:
    """(I + N)^-1 for strictly lower N: forward substitution inside bs-row diagonal blocks, then block rows.

    Much faster on CPU than batched LAPACK trsm for many small matrices; exact up to rounding.
    """
    C = N_BCC.shape[-1]
    bs = min(bs, C)
    n = C // bs
    eye_CC = torch.eye(C, dtype=N_BCC.dtype, device=N_BCC.device)
    Nd_Bnss = torch.stack([N_BCC[..., b * bs:(b + 1) * bs, b * bs:(b + 1) * bs] for b in range(n)], -3)
    Xd_Bnss = eye_CC[:bs, :bs].expand(Nd_Bnss.shape).clone()
    for i in range(1, bs):
        Xd_Bnss[..., i, :] -= (Nd_Bnss[..., i:i + 1, :i] @ Xd_Bnss[..., :i, :]).squeeze(-2)
    rows = []
    for b in range(n):
        rhs_BsC = eye_CC[b * bs:(b + 1) * bs].expand(N_BCC.shape[:-2] + (bs, C))
        if b:
            rhs_BsC = rhs_BsC - N_BCC[..., b * bs:(b + 1) * bs, :b * bs] @ torch.cat(rows, -2)
        rows.append(Xd_Bnss[..., b, :, :] @ rhs_BsC)
    return torch.cat(rows, -2)


class _UnitLowerInverse(torch.autograd.Function):
    """X = (I + N)^-1 for strictly lower N; backward gN = -tril_{-1}(X^T gX X^T). First-order only."""

    @staticmethod
    def forward(ctx, N_BCC):
        with torch.no_grad():
            X_BCC = _unit_lower_inverse(N_BCC)
        ctx.save_for_backward(X_BCC)
        return X_BCC

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gX_BCC):
        (X_BCC,) = ctx.saved_tensors
        XT_BCC = X_BCC.transpose(-1, -2)
        return -(XT_BCC @ gX_BCC @ XT_BCC).tril(-1)


def intra_chunk(q_NbHCK, k_NbHCK, v_NbHCV, g_NbHCK, b_NbHC, s: int, factored: bool = False):
    """Per-chunk quantities that do not depend on the incoming state.

    `factored` (see `_factored_ok`): the column decays of each row tile, exp(G_m - G_i) for i up to the tile end,
    are formed as exp(G_e' - G_i) * exp(G_m - G_e') with e' the last token of column i's own tile: one [C, K]
    exp plus an [n, n, K] table instead of an [n, C, K] exp (same values up to rounding; both factors <= 1 for
    earlier tiles, and exp(G_e' - G_i) >= exp(-(s-1)*steep) stays a normal number)."""
    Nb, H, C, K = q_NbHCK.shape
    n, m = C // s, (s - 1) // 2
    dt = q_NbHCK.dtype
    # Cumsum and differences in fp64: an fp32 difference of cumsums would carry an error ~eps*|G| (|G| up to
    # 320 per chunk at the K3 bound) instead of ~eps*|G_t - G_i|. Cast to the compute dtype before exp.
    G_NbHCK = g_NbHCK.to(torch.float64).cumsum(-2)
    Gref_NbHnK = G_NbHCK[:, :, m::s]
    G_NbHnsK = G_NbHCK.view(Nb, H, n, s, K)
    rowf_NbHnsK = _exp(G_NbHnsK - Gref_NbHnK[:, :, :, None], dt)
    idx = torch.arange(C, device=q_NbHCK.device)
    if factored:
        Gend_NbHnK = G_NbHnsK[:, :, :, -1]
        kend_NbHnsK = k_NbHCK.view(Nb, H, n, s, K) * _exp(Gend_NbHnK[:, :, :, None] - G_NbHnsK, dt)
        jj = torch.arange(n, device=q_NbHCK.device)
        later_nn = jj[None, :] > jj[:, None]  # column tile after the row tile: never visible
        D_NbHnnK = (Gref_NbHnK[:, :, :, None] - Gend_NbHnK[:, :, None]).masked_fill(later_nn[:, :, None],
                                                                                     float("-inf"))
        kcol_NbHnCK = (kend_NbHnsK[:, :, None] * _exp(D_NbHnnK, dt)[:, :, :, :, None]).view(Nb, H, n, C, K)
    else:
        colx_NbHnCK = Gref_NbHnK[:, :, :, None] - G_NbHCK[:, :, None]
        after_tile_nC = idx[None, :] > (idx[::s] + s - 1)[:, None]
        colx_NbHnCK = colx_NbHnCK.masked_fill(after_tile_nC[:, :, None], float("-inf"))
        kcol_NbHnCK = k_NbHCK[:, :, None] * _exp(colx_NbHnCK, dt)
    kcolT_NbHnKC = kcol_NbHnCK.transpose(-1, -2)
    # q and k rows of a tile in one batched matmul
    rows_NbHn2sK = torch.cat([q_NbHCK.view(Nb, H, n, s, K), k_NbHCK.view(Nb, H, n, s, K)], 3) \
        * rowf_NbHnsK.repeat(1, 1, 1, 2, 1)
    A_NbHn2sC = rows_NbHn2sK @ kcolT_NbHnKC
    # split (not two slices): backward is one cat instead of two zero-filled full-size gradients
    Aqk_NbHnsC, Akk_NbHnsC = A_NbHn2sC.split(s, 3)
    Aqk_NbHCC, Akk_NbHCC = Aqk_NbHnsC.reshape(Nb, H, C, C), Akk_NbHnsC.reshape(Nb, H, C, C)
    causal_CC = idx[:, None] >= idx[None, :]
    Aqk_NbHCC = Aqk_NbHCC.masked_fill(~causal_CC, 0.0)
    Akk_NbHCC = (Akk_NbHCC * b_NbHC[..., None]).tril(-1)  # diag(beta) L, strictly lower
    gam_NbHCK = _exp(G_NbHCK, dt)
    rhs = torch.cat([k_NbHCK * gam_NbHCK, v_NbHCV], -1) * b_NbHC[..., None]
    WU = _UnitLowerInverse.apply(Akk_NbHCC) @ rhs
    W_NbHCK, U_NbHCV = WU.split([K, WU.shape[-1] - K], -1)
    Glast_NbHK = G_NbHCK[:, :, -1]
    kdec_NbHCK = k_NbHCK * _exp(Glast_NbHK[:, :, None] - G_NbHCK, dt)
    return q_NbHCK * gam_NbHCK, Aqk_NbHCC, W_NbHCK, U_NbHCV, kdec_NbHCK, _exp(Glast_NbHK, dt)


def chunk_kda_torch(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                    output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False,
                    use_gate_in_kernel: bool = False, A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0,
                    chunk_size: int = 64):
    """Inputs are assumed validated (see k3.ops.kda.chunk_kda). Returns (o [B,T,H,V] v.dtype, state or None)."""
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, b_BTH, dt = prepare_inputs(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound,
        initial_state)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    C = int(chunk_size)
    lay = make_step_layout(B, T, cu_seqlens, C, q.device)
    if lay.J == 0:
        S_NHKV = q_BTHK.new_zeros(lay.N, H, K, V) if initial_state is None else initial_state.to(dt)
        return v_BTHV.new_zeros(B, T, H, V).to(v.dtype), (S_NHKV if output_final_state else None)

    steep = _steepness(g_BTHK)
    s = tile_size(g_BTHK, C, dt, steep)
    blocks = [gather_blocks(x, lay) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK)]
    b_NbHC = gather_blocks(b_BTH[..., None], lay)[..., 0]
    qg, Aqk, W, U, kdec, dlast = intra_chunk(*blocks, b_NbHC, s, factored=_factored_ok(s, steep, dt))
    # Blocks are step-major over length-sorted sequences: step j is a contiguous slice of the n_J[j] sequences
    # that still have a j-th chunk (a prefix of the sorted order), so the loop never touches padding.
    qg_j, Aqk_j, W_j, U_j, kdec_j, dlast_j = (x.split(lay.n_J) for x in (qg, Aqk, W, U, kdec, dlast))

    # state in sorted order; None = zero (no initial state: the first step skips its W S and q S products)
    S_NHKV = None if initial_state is None else initial_state.to(dt)
    if S_NHKV is not None and lay.perm_N is not None:
        S_NHKV = S_NHKV[lay.perm_N]
    done = []  # final states of sequences that ran out of chunks, in order of leaving (descending sorted rank)
    outs = []
    for j in range(lay.J):
        n = lay.n_J[j]
        if S_NHKV is None:
            if output_final_state and n < lay.N:
                done.append(q_BTHK.new_zeros(lay.N - n, H, K, V))
            u_NHCV = U_j[j]
            outs.append(Aqk_j[j] @ u_NHCV)
            S_NHKV = kdec_j[j].transpose(-1, -2) @ u_NHCV
            continue
        if n < S_NHKV.shape[0]:
            S_NHKV, S_done = S_NHKV.split([n, S_NHKV.shape[0] - n])
            if output_final_state:
                done.append(S_done)
        u_NHCV = U_j[j] - W_j[j] @ S_NHKV
        outs.append(qg_j[j] @ S_NHKV + Aqk_j[j] @ u_NHCV)
        S_NHKV = dlast_j[j][..., None] * S_NHKV + kdec_j[j].transpose(-1, -2) @ u_NHCV
    o_BTHV = scatter_blocks(torch.cat(outs, 0), lay, B, T)
    if not output_final_state:
        return o_BTHV.to(v.dtype), None
    S_NHKV = torch.cat([S_NHKV] + done[::-1], 0) if done else S_NHKV
    if lay.perm_N is not None:
        S_NHKV = S_NHKV[torch.argsort(lay.perm_N)]
    return o_BTHV.to(v.dtype), S_NHKV
