"""Kimi Delta Attention ops: gate, token-by-token reference/decode, and the chunked prefill/training path.

Notable: `chunk_kda` validates once, then dispatches through `k3.ops.dispatch` (op family "kda"). This module
registers the built-in backends: "torch" (pure PyTorch, always), "fla" (`fla_backend`) and "triton" (the `triton`
package), the latter two through lazy imports, so the dependency points one way: backends never import this
registry. Other code may add one with `register_kda_backend(name, fn, available, priority)`, where fn takes
chunk_kda's keyword arguments (minus `backend`) and returns (o, final_state). `recurrent_kda` is the oracle every
backend is tested against.
"""
from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch

from .. import dispatch
from .chunk import chunk_kda_torch
from .common import l2norm, validate_kda_inputs
from .gate import kda_gate
from .reference import recurrent_kda

__all__ = ["chunk_kda", "recurrent_kda", "kda_gate", "l2norm", "register_kda_backend", "kda_backends",
           "MIN_LOWER_BOUND", "LOWER_BOUND_LIMITS", "lower_bound_problem"]

# The steepest bounded gate (lower_bound) each chunked path runs with its decay tiles in fp32 range. A tile factors
# exp(G_t - G_i) (G: the cumulative log-decay inside the chunk) through a reference row m of its own:
# exp(G_t - G_m) * exp(G_m - G_i), so single factors reach exp(d * |lb|), d = the most rows between m and a row of
# the tile. fp32 holds exp(x) for |x| < 87.3 (normal numbers; GPUs flush subnormals) - 88.7, and the kernels keep
# d * |lb| <= 80 (room for |q|, |k| up to ~e^7):
#   "triton": 16-row tiles forward (chunks of 16) and backward (chunks of 64), reference row 7: d = 8, lb >= -10
#             (its backward's 32-row matrices tiles need lb >= -5 and are switched to 16 rows below it);
#   "fla":    fla's safe_gate kernels (M=16 tensor-core tiles) promise [-5, 0) only (fla refuses the rest); steeper
#             bounds go to the "triton" backend (or "torch" where triton cannot run);
#   "torch":  the tile shrinks with the bound (16 rows up to |lb| 7.5 at its budget of 60, then 8, 4, 2, 1: one
#             row is exact for any g <= 0), so no limit of its own.
# The chunked entry point (chunk_kda) and the model config accept lb in [MIN_LOWER_BOUND, 0): every path runs there.
LOWER_BOUND_LIMITS = {"triton": -10.0, "fla": -5.0, "torch": float("-inf")}
MIN_LOWER_BOUND = LOWER_BOUND_LIMITS["triton"]


def lower_bound_problem(lower_bound) -> Optional[str]:
    """Why `lower_bound` (of the bounded gate) is refused, or None when every chunked path accepts it."""
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
        return f"must be a number (or None/null for the unbounded softplus gate), got {lower_bound!r}"
    lb = float(lower_bound)
    if not (lb < 0.0):
        return f"must be < 0 (a log-decay floor), got {lower_bound}"
    if not (lb >= MIN_LOWER_BOUND):
        return (f"{lower_bound} is below the safe limit {MIN_LOWER_BOUND}: the chunked KDA kernels (Triton path: "
                f"16-token tiles with decays factored through a reference row 8 tokens away) form exp(8 * |lb|) "
                f"in fp32, which must stay <= exp(80); accepted: [{MIN_LOWER_BOUND}, 0)")
    return None

_IMPLS: dict[str, Callable] = {}


def register_kda_backend(name: str, fn: Callable, available: Callable[[], bool] = lambda: True,
                         priority: int = 0) -> None:
    """Register a chunk_kda implementation. Priority > 0 is only auto-selected on CUDA (see dispatch.resolve)."""
    _IMPLS[name] = fn
    dispatch.register("kda", name, available, priority)


def kda_backends() -> list[str]:
    return sorted(_IMPLS)


register_kda_backend("torch", chunk_kda_torch, lambda: True, priority=0)


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
              output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
              use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
              A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
              lower_bound: Optional[float] = -5.0, backend: Optional[str] = None, chunk_size: int = 64):
    """Chunkwise KDA. Same arguments and result as `recurrent_kda`, plus `backend` and `chunk_size`.

    q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K] per-channel log-decay (<= 0), or the raw gate input f when
    use_gate_in_kernel (then g = kda_gate(f, A_log, dt_bias, lower_bound)); beta [B,T,H]; scale defaults to K^-0.5.
    lower_bound: in [MIN_LOWER_BOUND, 0) = [-10, 0) (ValueError below: see LOWER_BOUND_LIMITS), or None for the
    unbounded softplus gate.
    cu_seqlens: int [N+1] packed-sequence starts (B must be 1); initial_state [N,H,K,V].
    Returns (o [B,T,H,V] in v.dtype, final_state [N,H,K,V] fp32 (fp64 for fp64 inputs) or None).
    """
    validate_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias)
    if use_gate_in_kernel and lower_bound is not None:
        why = lower_bound_problem(lower_bound)
        if why is not None:
            raise ValueError(f"lower_bound: {why}")
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % 16:
        raise ValueError(f"chunk_size: expected a positive multiple of 16, got {chunk_size!r}")
    name = dispatch.resolve("kda", backend, q.device.type)
    if name == "fla" and backend is None and FORWARD_ONLY_TRITON_MIN_TOKENS and not dispatch.env_choice("kda"):
        name = _forward_only_choice(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens) or name
    fn = _IMPLS.get(name)
    if fn is None:
        raise ValueError(f"backend: {name!r} is registered with k3.ops.dispatch for 'kda' but has no "
                         f"implementation; use register_kda_backend (known: {', '.join(kda_backends())})")
    return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
              use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
              chunk_size=chunk_size)

# Automatic choice on CUDA (no backend= and no K3_BACKEND kda entry): calls that need no gradient (prefill,
# evaluation) with at least this many tokens per sequence on average go to our Triton forward ("triton", c16p),
# measured 1.6-2.0x fla's forward at H96 D128 on the H200 (benchmarks/RESULTS.md, third session); calls with
# gradients stay on fla (our Triton fwd+bwd: 0.29x fla's in the third session, 1.33-1.37x in the seventeenth at K3
# heads and 1.59x at the `small` preset's 8 heads in one process, but the whole compiled `small` training step with
# K3_BACKEND=kda:triton took 341.8 / 352.2 ms against fla's 338.7 / 363.9 in the seventeenth session, 340.1 vs
# 335.7-337.6 in the fifteenth: host-bound, and 9 GiB more peak memory with ours), and so do decode-sized calls
# (fla's fused_recurrent). 0 disables the rule.
FORWARD_ONLY_TRITON_MIN_TOKENS = 256


def _forward_only_choice(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens) -> Optional[str]:
    if torch.compiler.is_compiling():  # compiled graphs keep the resolved backend (no data-dependent choice)
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k, v, g, beta, initial_state, A_log, dt_bias)):
        return None
    n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if q.shape[0] * q.shape[1] < FORWARD_ONLY_TRITON_MIN_TOKENS * max(n_seq, 1):
        return None
    if "triton" not in _IMPLS or not dispatch.is_available("kda", "triton"):
        return None
    dispatch.log_once("kda", "triton", q.device.type, "forward-only calls (no gradient)")
    return "triton"


def _lazy(module: str, attr: str) -> Callable:
    """A function that imports `module` (relative to this package) on its first call and calls its `attr`, looked
    up at every call."""
    mod = []

    def call(*args, **kw):
        if not mod:
            mod.append(importlib.import_module(module, __name__))
        return getattr(mod[0], attr)(*args, **kw)
    call.__name__ = attr
    return call


# Fused-kernel backends; each imports its kernels lazily (CPU-only installs are fine). Priority > 0 is auto-selected
# on CUDA only: fla (10) for calls with gradients; triton (5) below it (our fwd+bwd measured 1.33-1.37x fla's in one
# process at H96 D128 bf16 on the H200, seventeenth session, but the compiled `small` training step with it is even
# with fla's: host-bound), and for calls without gradients FORWARD_ONLY_TRITON_MIN_TOKENS above.
FLA_PRIORITY = 10
TRITON_PRIORITY = 5
register_kda_backend("fla", _lazy(".fla_backend", "chunk_kda_fla"), _lazy(".fla_backend", "available"),
                     priority=FLA_PRIORITY)
register_kda_backend("triton", _lazy(".triton", "chunk_kda_triton"), _lazy(".triton", "available"),
                     priority=TRITON_PRIORITY)
