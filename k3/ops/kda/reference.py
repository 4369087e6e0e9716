"""Token-by-token KDA recurrence: the oracle every other KDA path is tested against, and the decode step.

Per head, with fp32 state S [K, V] (fp64 if inputs are fp64):
    S <- diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T (scale * q_t).
Notable: varlen (`cu_seqlens`) runs all sequences side by side, padded to the longest with g=0, beta=0, k=0
(steps that leave the state unchanged), so the Python loop is over time only. A T=1 call is one step.
"""
from __future__ import annotations

from typing import Optional

import torch

from .common import gather_blocks, make_layout, prepare_inputs, scatter_tokens, to_grid, validate_kda_inputs


def _step(S_NHKV, q_NHK, k_NHK, v_NHV, g_NHK, b_NH):
    S_NHKV = S_NHKV * g_NHK.exp()[..., None]
    pred_NHV = torch.einsum("nhk,nhkv->nhv", k_NHK, S_NHKV)
    S_NHKV = S_NHKV + (b_NH[..., None, None] * k_NHK[..., None]) * (v_NHV - pred_NHV)[..., None, :]
    o_NHV = torch.einsum("nhk,nhkv->nhv", q_NHK, S_NHKV)
    return S_NHKV, o_NHV


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                  output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                  use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                  A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                  lower_bound: Optional[float] = -5.0):
    """q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K] log-decay (raw gate f if use_gate_in_kernel); beta [B,T,H].

    Returns (o [B,T,H,V] in v.dtype, final_state [N,H,K,V] fp32/fp64 or None). With cu_seqlens (B must be 1),
    the N = len(cu_seqlens)-1 packed sequences each start from initial_state[n] (or zeros).
    """
    N = validate_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias)
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, b_BTH, dt = prepare_inputs(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound,
        initial_state)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    if initial_state is None:
        S_NHKV = q_BTHK.new_zeros(N, H, K, V)
    else:
        S_NHKV = initial_state.to(dt)

    if cu_seqlens is None:
        outs = []
        steps = zip(*(x.unbind(1) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, b_BTH)))  # one stack in backward
        for q_NHK, k_NHK, v_NHV, g_NHK, b_NH in steps:
            S_NHKV, o_NHV = _step(S_NHKV, q_NHK, k_NHK, v_NHV, g_NHK, b_NH)
            outs.append(o_NHV)
        o_BTHV = torch.stack(outs, 1) if outs else v_BTHV.new_zeros(B, 0, H, V)
    else:
        lay = make_layout(B, T, cu_seqlens, 1, q.device)
        # [Nb, H, 1, D] single-token blocks -> grid [N, J, H, D] padded with zero tokens (state-preserving).
        grid = [to_grid(gather_blocks(x, lay)[:, :, 0], lay).unbind(1) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK)]
        grid.append(to_grid(gather_blocks(b_BTH[..., None], lay)[:, :, 0, 0], lay).unbind(1))
        outs = []
        for q_NHK, k_NHK, v_NHV, g_NHK, b_NH in zip(*grid):
            S_NHKV, o_NHV = _step(S_NHKV, q_NHK, k_NHK, v_NHV, g_NHK, b_NH)
            outs.append(o_NHV)
        if outs:
            o_BTHV = scatter_tokens(torch.stack(outs, 1)[:, :, :, None], lay, B, T)
        else:
            o_BTHV = v_BTHV.new_zeros(B, T, H, V)
    return o_BTHV.to(v.dtype), (S_NHKV if output_final_state else None)
