"""The "fla" backend of `chunk_kda`: flash-linear-attention's Triton kernels (fla-core 0.6.x) on CUDA.

Training / prefill goes through fla `chunk_kda` with the gate, the q/k L2 norm and the scale fused in-kernel and,
for the K3 bounded gate (lower_bound in [-5, 0), fla's `safe_gate` contract), `safe_gate=True` (fla's M=16
tensor-core path); the unbounded softplus gate (lower_bound None) takes fla's general path (safe_gate=False).
Bounded gates steeper than fla's safe range (lower_bound in [-10, -5): see k3.ops.kda.LOWER_BOUND_LIMITS) go to our
"triton" backend (16-row tiles, fine down to -10), or to "torch" where triton cannot run. A forward
without autograd and with T == 1 per sequence (decode) goes through `fused_recurrent_kda`.

Notable:
- beta is passed post-sigmoid, as our contract says (fla's `use_beta_sigmoid_in_kernel=False`, its default).
- fla wants the initial state in fp32 and cu_seqlens as int64 on the device; we also hand it a CPU copy of
  cu_seqlens so it needs no device-to-host sync to build its chunk index.
- What fla cannot run (fp64, CPU tensors, K > 256, an unbounded gate without A_log, ...) falls back to the
  pure-PyTorch "torch" backend, logged once. The module imports without fla, triton or CUDA: fla is imported
  lazily, the first time `available()` is asked.
- Under torch.compile the fla call is opaque (torch.compiler.disable): Dynamo does not trace fla's Python.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Optional

import torch

log = logging.getLogger("k3")
_FALLBACK_LOGGED: set = set()
FLA_SAFE_MIN_LOWER_BOUND = -5.0  # fla chunk_kda(safe_gate=True) requires lower_bound in [-5, 0)


@functools.lru_cache(maxsize=1)
def _fla_ops():
    """(chunk_kda, fused_recurrent_kda) from fla, or None if fla cannot be imported here."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_recurrent
    except Exception as e:  # broken install, no triton, ...
        log.info("k3: fla is installed but failed to import (%s); KDA uses the torch backend", e)
        return None
    return fla_chunk, fla_recurrent


def available() -> bool:
    """True where the fla backend can run: CUDA is present and fla imports."""
    return torch.cuda.is_available() and _fla_ops() is not None


def _unsupported(q, v, g, beta, use_gate_in_kernel, A_log, lower_bound, chunk_size) -> Optional[str]:
    if q.device.type != "cuda":
        return f"tensors on {q.device.type}"
    if any(t.dtype not in (torch.bfloat16, torch.float16, torch.float32) for t in (q, v, g, beta)):
        return "fp64 inputs"
    if q.shape[-1] > 256:
        return f"head dim K={q.shape[-1]} > 256"
    if use_gate_in_kernel and lower_bound is None and A_log is None:
        return "unbounded gate without A_log"
    return None


def safe_gate_for(use_gate_in_kernel: bool, lower_bound: Optional[float]) -> Optional[bool]:
    """fla's `safe_gate` for this gate: True for a bound in fla's safe range [-5, 0), False for no in-kernel gate
    or the unbounded gate (lower_bound None; fla's general path), None when fla cannot take the bound."""
    if not use_gate_in_kernel or lower_bound is None:
        return False
    return True if FLA_SAFE_MIN_LOWER_BOUND <= float(lower_bound) < 0.0 else None


def _fallback(reason: str, *args, to_triton: bool = False, **kw):
    from .chunk import chunk_kda_torch
    if to_triton:
        from . import triton as ktriton
        if ktriton.available():
            if reason not in _FALLBACK_LOGGED:
                _FALLBACK_LOGGED.add(reason)
                log.info("k3: kda backend fla cannot run this call (%s); using triton", reason)
            return ktriton.chunk_kda_triton(*args, **kw)
    if reason not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(reason)
        log.info("k3: kda backend fla cannot run this call (%s); using torch", reason)
    return chunk_kda_torch(*args, **kw)


@torch.compiler.disable
def chunk_kda_fla(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                  output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False,
                  use_gate_in_kernel: bool = False, A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0,
                  chunk_size: int = 64):
    """Same arguments and result as k3.ops.kda.chunk_kda (inputs already validated there)."""
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
              use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
              chunk_size=chunk_size)
    why = _unsupported(q, v, g, beta, use_gate_in_kernel, A_log, lower_bound, chunk_size)
    if why is not None:
        return _fallback(why, q, k, v, g, beta, **kw)
    fla_chunk, fla_recurrent = _fla_ops()
    B, T, H, K = q.shape
    dtype = v.dtype
    # one activation dtype for q, k, v (fla's kernels assume it); g and beta may stay fp32
    if k.dtype != q.dtype or v.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    cu, cu_cpu, N = None, None, B
    if cu_seqlens is not None:
        cu_cpu = cu_seqlens.detach().to("cpu", torch.int64)
        cu = cu_seqlens.to(q.device, torch.int64)
        N = cu_cpu.numel() - 1
    gate_kw = {}
    if use_gate_in_kernel:
        gate_kw = dict(A_log=A_log, dt_bias=dt_bias)
    safe = safe_gate_for(use_gate_in_kernel, lower_bound)
    lb = float(lower_bound) if (use_gate_in_kernel and lower_bound is not None) else None
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta) if t is not None)
    if safe is None:
        return _fallback(f"lower_bound {lower_bound} outside fla's safe range [{FLA_SAFE_MIN_LOWER_BOUND}, 0)",
                         q, k, v, g, beta, to_triton=True, **kw)
    if not grad and (T == 1 if cu is None else T == N):
        # decode: one token per sequence -> the fused recurrent kernel (state read+write once)
        o, S = fla_recurrent(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                             scale=scale, initial_state=h0, output_final_state=output_final_state,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                             lower_bound=lb, cu_seqlens=cu, **gate_kw)
    else:
        o, S = fla_chunk(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                         scale=scale, initial_state=h0, output_final_state=output_final_state,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                         safe_gate=safe, lower_bound=lb, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                         chunk_size=64 if chunk_size not in (32, 64) else chunk_size, **gate_kw)
    return o.to(dtype), (S.float() if (output_final_state and S is not None) else None)
