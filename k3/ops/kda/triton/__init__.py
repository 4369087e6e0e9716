"""The "triton" backend of `chunk_kda`: our own Triton kernels for K3's bounded-decay KDA.

Forward (prefill / training) is two kernels over 16-token chunks:
1. `kda_prep_fwd_kernel`, parallel over (chunk, head): gate activation, chunk-local cumsum, q/k L2 norm, scale,
   beta, the intra-chunk matrices as dense tl.dot (decays factored through a reference row of the tile: with
   g >= -5 the factored exponents stay <= 8*5 = 40, far inside fp32 range), the unit-lower inverse by repeated
   squaring, and the WY vectors W = T (beta k e^G), U = T (beta v).
2. `kda_state_fwd_kernel`, parallel over (sequence, head, value block), sequential over chunks: carries the
   fp32 state in registers and writes the output directly (no per-chunk state is materialised).
Decode is `kda_recurrent_fwd_kernel` (one program per sequence/head/value block, state read and written once,
optionally in place).
Backward: an autograd.Function whose backward recomputes the forward through the pure-PyTorch chunk path
(`chunk_kda_torch`) and differentiates that: correct gradients, not fast (no Triton backward yet).

Notable:
- Imports without triton or CUDA: triton is imported the first time `available()` says yes.
- Available where triton imports and CUDA is present (or TRITON_INTERPRET=1, for CPU tests).
- `chunk_size` is ignored (the kernels use 16-token chunks).
- What the kernels do not cover falls back to the torch backend, logged once: fp64 inputs, K or V not a power of
  two in [16, 256], an unbounded gate (lower_bound None) or lower_bound < -10, and precomputed g steeper than -10.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
from typing import Optional

import torch

log = logging.getLogger("k3")
_FALLBACK_LOGGED: set = set()
MIN_LOG_DECAY = -10.0  # steepest per-token log-decay the 16-token tiles handle (exponents <= 8*10 = 80)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def _ops():
    """The kernel wrappers module, or None where triton cannot be imported."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        from . import ops
    except Exception as e:  # broken triton install
        log.info("k3: triton failed to import (%s); the KDA triton backend is off", e)
        return None
    return ops


def available() -> bool:
    if not (torch.cuda.is_available() or _interpret()):
        return False
    return _ops() is not None


def _pow2(n: int) -> bool:
    return 16 <= n <= 256 and (n & (n - 1)) == 0


def _unsupported(q, k, v, g, beta, initial_state, use_gate_in_kernel, lower_bound) -> Optional[str]:
    if q.device.type != "cuda" and not _interpret():
        return f"tensors on {q.device.type}"
    if any(t is not None and t.dtype == torch.float64 for t in (q, k, v, g, beta, initial_state)):
        return "fp64 inputs"
    if not (_pow2(q.shape[-1]) and _pow2(v.shape[-1])):
        return f"K={q.shape[-1]}, V={v.shape[-1]} (need powers of two in [16, 256])"
    if use_gate_in_kernel:
        if lower_bound is None:
            return "unbounded gate (lower_bound None)"
        if not (MIN_LOG_DECAY <= float(lower_bound) <= 0.0):
            return f"lower_bound {lower_bound} outside [{MIN_LOG_DECAY}, 0]"
    elif g.numel() and float(g.detach().min()) < MIN_LOG_DECAY:
        return f"log-decay g below {MIN_LOG_DECAY}"
    return None


def _fallback(reason, *args, **kw):
    from ..chunk import chunk_kda_torch
    if reason not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(reason)
        log.info("k3: kda backend triton cannot run this call (%s); using torch", reason)
    return chunk_kda_torch(*args, **kw)


class _ChunkKDATriton(torch.autograd.Function):
    """Forward: Triton kernels. Backward: recompute through the torch chunk path and differentiate it."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, A_log, dt_bias, cfg):
        o, ht = _ops().kda_chunk_fwd(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                     A_log=A_log, dt_bias=dt_bias, **cfg)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, g, beta, initial_state, A_log, dt_bias)
        return o, ht

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        from ..chunk import chunk_kda_torch
        saved = ctx.saved_tensors
        cfg = dict(ctx.cfg)
        ins = [None if t is None else t.detach().requires_grad_(ctx.needs_input_grad[i] and t.is_floating_point())
               for i, t in enumerate(saved)]
        q, k, v, g, beta, h0, A_log, dt_bias = ins
        with torch.enable_grad():
            o, ht = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log,
                                    dt_bias=dt_bias, **cfg)
            outs, grads = [o], [do]
            if dht is not None:
                outs.append(ht)
                grads.append(dht.to(ht.dtype))
            wrt = [t for t in ins if t is not None and t.requires_grad]
            got = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True)) if wrt else iter(())
        res = [next(got) if (t is not None and t.requires_grad) else None for t in ins]
        return (*res, None)


def chunk_kda_triton(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                     output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False,
                     use_gate_in_kernel: bool = False, A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0,
                     chunk_size: int = 64):
    """Same arguments and result as k3.ops.kda.chunk_kda (inputs already validated there)."""
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
              use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
              chunk_size=chunk_size)
    why = _unsupported(q, k, v, g, beta, initial_state, use_gate_in_kernel, lower_bound)
    if why is not None:
        return _fallback(why, q, k, v, g, beta, **kw)
    B, T, H, K = q.shape
    cfg = dict(scale=K ** -0.5 if scale is None else float(scale), cu_seqlens=cu_seqlens,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
               lower_bound=lower_bound)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    if grad:
        o, ht = _ChunkKDATriton.apply(q, k, v, g, beta, initial_state, A_log, dt_bias, cfg)
        return o, (ht if output_final_state else None)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    ops = _ops()
    if (T == 1 if cu_seqlens is None else T == N):  # one token per sequence: the recurrent (decode) kernel
        return ops.kda_recurrent_fwd(q, k, v, g, beta, initial_state=initial_state,
                                     output_final_state=output_final_state, A_log=A_log, dt_bias=dt_bias, **cfg)
    return ops.kda_chunk_fwd(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                             A_log=A_log, dt_bias=dt_bias, **cfg)


def fused_recurrent_kda_triton(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                               output_final_state: bool = False, cu_seqlens=None,
                               use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                               A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0, inplace: bool = False):
    """Decode step(s) without autograd: same contract as recurrent_kda. inplace=True updates the contiguous fp32
    initial_state [N,H,K,V] in place (and returns it as the final state)."""
    from ..common import validate_kda_inputs
    validate_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias)
    if not available():
        raise RuntimeError("fused_recurrent_kda_triton: needs triton and CUDA (or TRITON_INTERPRET=1)")
    if use_gate_in_kernel and lower_bound is None:
        raise ValueError("lower_bound: the triton decode kernel implements the bounded gate only")
    K = q.shape[-1]
    if not (_pow2(K) and _pow2(v.shape[-1])):
        raise ValueError(f"K={K}, V={v.shape[-1]}: need powers of two in [16, 256]")
    return _ops().kda_recurrent_fwd(
        q, k, v, g, beta, scale=K ** -0.5 if scale is None else float(scale), initial_state=initial_state,
        output_final_state=output_final_state or inplace, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log if use_gate_in_kernel else None, dt_bias=dt_bias if use_gate_in_kernel else None,
        lower_bound=lower_bound, inplace=inplace)


PRIORITY = 5  # below "fla" (10): fwd 1.14x fla at B8 T8K H96 on the H200, but the backward is a torch recompute


def register() -> None:
    from .. import register_kda_backend
    register_kda_backend("triton", chunk_kda_triton, available, priority=PRIORITY)
