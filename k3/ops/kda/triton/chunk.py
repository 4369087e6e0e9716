"""`chunk_kda_triton` (the "triton" backend of k3.ops.kda.chunk_kda), its autograd function, the decode entry point
and the backend's configuration. Needs torch only: the kernels' modules are imported on the first call."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
import logging
from typing import Optional

import torch

from k3.ops.dispatch import triton_interpreting as _interpret
from k3 import knobs

log = logging.getLogger("k3")
_FALLBACK_LOGGED: set = set()
# steepest per-token log-decay the 16-row tiles handle: decays are factored through reference row REF = 7, so single
# factors reach exp(8 |g|) (forward chunks of 16; backward chunks of 64 in 16-row tiles), kept <= exp(80) in fp32
# (k3.ops.kda.LOWER_BOUND_LIMITS); an in-kernel gate bound below it is refused by chunk_kda, precomputed g below it
# falls back to torch
MIN_LOG_DECAY = -10.0
BWD_IMPLS = ("triton", "torch")
DEFAULT_BWD = "triton"
ENV_BWD = "K3_KDA_TRITON_BWD"


@dataclasses.dataclass(frozen=True)
class TritonKDAConfig:
    """Choices of the triton backend; None = the environment's, else the default.

    bwd: "triton" (the kernels of bwd.py) or "torch" (recompute through the torch chunk path + autograd: the
         reference / fallback backward); $K3_KDA_TRITON_BWD, else "triton".
    bwd_launch: overrides of the backward's launch parameters ({kernel key: {param: value}}, bwd_config), applied
         over $K3_KDA_BWD_LAUNCH.
    state_cfg: options of the forward's walk (fwd.STATE_CFG_DEFAULT), applied over $K3_KDA_STATE_CFG.
    prep_cfg: options of the forward's prep kernel (fwd.PREP_DEFAULT)."""
    bwd: Optional[str] = None
    bwd_launch: Optional[dict] = None
    state_cfg: Optional[dict] = None
    prep_cfg: Optional[dict] = None

    def bwd_mode(self) -> str:
        if self.bwd is not None:
            mode, what = str(self.bwd).lower(), "TritonKDAConfig.bwd"
        else:
            mode, what = knobs.get(ENV_BWD) or DEFAULT_BWD, ENV_BWD
        if mode not in BWD_IMPLS:
            raise ValueError(f"{what}={mode!r}: known values are {', '.join(BWD_IMPLS)}")
        return mode


_CONFIG: contextvars.ContextVar = contextvars.ContextVar("k3_kda_triton_config", default=None)


@contextlib.contextmanager
def triton_config(config: Optional[TritonKDAConfig] = None, **fields):
    """Within the block, calls of the triton backend that get no `config=` (e.g. through chunk_kda) use `config`,
    or a TritonKDAConfig of `fields` (e.g. `with triton_config(bwd="torch"): ...`)."""
    token = _CONFIG.set(config if config is not None else TritonKDAConfig(**fields))
    try:
        yield _CONFIG.get()
    finally:
        _CONFIG.reset(token)


def current_config() -> TritonKDAConfig:
    return _CONFIG.get() or TritonKDAConfig()


@functools.lru_cache(maxsize=1)
def _fwd():
    """The forward's host module (imports triton), or None where triton cannot be imported."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        from . import fwd
    except Exception as e:  # broken triton install
        log.info("k3: triton failed to import (%s); the KDA triton backend is off", e)
        return None
    return fwd


@functools.lru_cache(maxsize=1)
def _bwd():
    from . import bwd
    return bwd


def available() -> bool:
    """Triton imports and CUDA is present (or TRITON_INTERPRET=1, for CPU tests)."""
    if not (torch.cuda.is_available() or _interpret()):
        return False
    return _fwd() is not None


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


class ChunkKDATritonFunction(torch.autograd.Function):
    """Forward: the Triton kernels (fwd.py). Backward: the Triton kernels (bwd.py), or the torch recompute
    (config.bwd "torch"), as chosen when the forward ran."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, A_log, dt_bias, cfg, config):
        mode = config.bwd_mode()
        # the forward's walk also stores what the backward's states pass would recompute (its chunk tables, per-chunk
        # states, u'), where the backward's launch config uses them (bwd.fwd_save)
        save = _bwd().fwd_save(q.shape[-1], v.shape[-1], q.dtype, config.bwd_launch) if mode == "triton" else None
        o, ht = _fwd().kda_chunk_fwd(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                     A_log=A_log, dt_bias=dt_bias, save=save, prep_cfg=config.prep_cfg,
                                     state_cfg=config.state_cfg, **cfg)
        ctx.cfg = cfg
        ctx.mode = mode
        ctx.bwd_launch = config.bwd_launch
        ctx.fwd_save = save if save is not None and save.filled else None  # (read, never written, by backward)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, A_log, dt_bias)
        return o, ht

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        if ctx.mode == "torch":
            return ChunkKDATritonFunction._backward_torch(ctx, do, dht)
        q, k, v, g, beta, h0, A_log, dt_bias = ctx.saved_tensors
        cfg = ctx.cfg
        if do is None:
            do = torch.zeros(v.shape, device=v.device, dtype=v.dtype)
        dq, dk, dv, dg, db, dh0, dal, ddt = _bwd().kda_chunk_bwd(
            q, k, v, g, beta, do, dht, scale=cfg["scale"], initial_state=h0, cu_seqlens=cfg["cu_seqlens"],
            use_qk_l2norm_in_kernel=cfg["use_qk_l2norm_in_kernel"], use_gate_in_kernel=cfg["use_gate_in_kernel"],
            A_log=A_log, dt_bias=dt_bias, lower_bound=cfg["lower_bound"], launch=ctx.bwd_launch, saved=ctx.fwd_save)
        res = [dq, dk, dv, dg, db,
               None if h0 is None else dh0.to(h0.dtype),
               None if A_log is None else dal.to(A_log.dtype).view_as(A_log),
               None if dt_bias is None else ddt.to(dt_bias.dtype).view_as(dt_bias)]
        return (*[r if need else None for r, need in zip(res, ctx.needs_input_grad)], None, None)

    @staticmethod
    def _backward_torch(ctx, do, dht):
        """Recompute the forward through `chunk_kda_torch` and differentiate it with autograd."""
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
        return (*res, None, None)


@torch.compiler.disable
def chunk_kda_triton(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                     output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False,
                     use_gate_in_kernel: bool = False, A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0,
                     chunk_size: int = 64, config: Optional[TritonKDAConfig] = None):
    """Same arguments and result as k3.ops.kda.chunk_kda (inputs already validated there), plus `config` (default:
    the one `triton_config` set, else the environment's). `chunk_size` is ignored (16-token chunks forward, 64
    backward). Opaque to torch.compile (as the fla backend): a compiled model calls it as one eager region, forward
    and backward (Dynamo tracing into the launch code and the autograd function failed)."""
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
              use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
              chunk_size=chunk_size)
    why = _unsupported(q, k, v, g, beta, initial_state, use_gate_in_kernel, lower_bound)
    if why is not None:
        return _fallback(why, q, k, v, g, beta, **kw)
    config = config if config is not None else current_config()
    B, T, H, K = q.shape
    cfg = dict(scale=K ** -0.5 if scale is None else float(scale), cu_seqlens=cu_seqlens,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
               lower_bound=lower_bound)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    if grad:
        o, ht = ChunkKDATritonFunction.apply(q, k, v, g, beta, initial_state, A_log, dt_bias, cfg, config)
        return o, (ht if output_final_state else None)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    fwd = _fwd()
    if (T == 1 if cu_seqlens is None else T == N):  # one token per sequence: the recurrent (decode) kernel
        return fwd.kda_recurrent_fwd(q, k, v, g, beta, initial_state=initial_state,
                                     output_final_state=output_final_state, A_log=A_log, dt_bias=dt_bias, **cfg)
    return fwd.kda_chunk_fwd(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                             A_log=A_log, dt_bias=dt_bias, prep_cfg=config.prep_cfg, state_cfg=config.state_cfg,
                             **cfg)


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
    return _fwd().kda_recurrent_fwd(
        q, k, v, g, beta, scale=K ** -0.5 if scale is None else float(scale), initial_state=initial_state,
        output_final_state=output_final_state or inplace, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log if use_gate_in_kernel else None, dt_bias=dt_bias if use_gate_in_kernel else None,
        lower_bound=lower_bound, inplace=inplace)
