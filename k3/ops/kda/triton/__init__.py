"""The "triton" backend of `chunk_kda`: our own Triton kernels for K3's bounded-decay KDA.

Forward (prefill / training): five variants of `ops.kda_chunk_fwd`, picked by its `variant=` argument, else
$K3_KDA_TRITON_FWD, else `ops.DEFAULT_FWD` ("c16p", measured fastest on the H200).
Per chunk with cumsum G of g, T = (I + diag(beta) L)^-1, L_ti = sum_K k_t k_i e^(G_t - G_i) (i < t):
W = T diag(beta)(k e^G), U = T diag(beta) v, Aqk_ti = sum_K q_t k_i e^(G_t - G_i) (i <= t); then per chunk
u' = U - W S, o = (q e^G) S + Aqk u', S <- e^(G_last) S + (k e^(G_last - G))^T u' with the fp32 state S.
- "c16": two kernels on 16-token chunks.
  1. `kda_prep_fwd_kernel`, parallel over (chunk, head): gate activation, chunk-local cumsum, q/k L2 norm,
     scale, beta, the intra-chunk matrices as dense tl.dot (decays factored through reference row 7 of the
     tile: exponents <= 8*|g| <= 80 for g >= -10), the unit-lower inverse by repeated squaring, W, U, and
     q e^G, k e^(G_last - G), Aqk, e^(G_last) to memory (input dtype, fp32 for fp32 inputs).
  2. `kda_state_fwd_kernel`, parallel over (sequence, head, value block), sequential over chunks: carries the
     fp32 state in registers and writes o directly (no per-chunk state is materialised, except what a training
     forward saves for the backward: `ops.FwdSave`). Packed documents of unequal lengths are walked longest first
     in a sequence-major grid (`ops._walk_order`; so are the backward's states / dstates passes).
- "c16p": c16's sequential pass after `kda_prep16p_fwd_kernel`, a re-tuned 16-token prep (`ops.PREP16P_DEFAULT`,
  per-call `prep_cfg`): 2 warps with a 128-register cap (the old prep held 246 registers, 2 programs per SM),
  two full-tile exponentials instead of four, the unit-lower inverse by recursive 2x2 block inversion on tf32
  tensor cores (tf32 repeated squaring was unusable on near-collinear keys), heads-fastest grid, optional
  K-in-blocks / several chunks per program / next-tile prefetch. Same intermediates as c16.
- "c64": the same two-kernel shape on 64-token chunks, so the sequential pass takes 4x fewer, M=64 steps.
  `kda_prep64_fwd_kernel` treats a chunk as four 16-row tiles: diagonal blocks through the tile's reference
  row as in c16; a block (a, b < a) as (q e^c)_a diag(e^(P_a - P_b - s_b)) (k e^(s_b - c))_b^T with c the
  in-tile cumsum, s the tile total, P the tile's chunk offset (all factors <= 1); T is never formed: block
  forward substitution Y_a = (I + n_aa)^-1 (R_a - sum_{b<a} n_ab Y_b) for Y = [W | U], R = diag(beta)[k e^G | v],
  n = diag(beta) L. The sequential pass is `kda_state_fwd_kernel` with BT = 64.
- "c64s": 3-phase split. Same prep; `kda_state_h_kernel` (sequential, lean: two dots per step) stores each
  chunk's incoming state (input dtype) and u'; `kda_out_kernel`, parallel over (chunk, head, value block),
  computes o. More bytes (+1.5 KB per token-head at K = V = 128), shorter sequential steps.
- "c64f": one kernel per (sequence, head), all value columns: each chunk's prep goes to a private scratch
  (reused every chunk, L2-resident), then a CTA barrier and the c64 state step; HBM traffic is about the
  inputs and o only, but the per-chunk work is serial inside N*H programs. Runs with num_stages=1 (the scratch
  loads must not be prefetched across the barrier).
The four agree to rounding (c64/c64s/c64f are the same arithmetic); predictions and measurements:
benchmarks/kda_triton.py and benchmarks/RESULTS.md.
Decode is `kda_recurrent_fwd_kernel` (one program per sequence/head/value block, state read and written once,
optionally in place).

Backward (ops_bwd.kda_chunk_bwd, kernels in kernels_bwd.py) works on 64-token chunks, WY form with a 64x64
T = (I + diag(beta) L)^-1 (16-row diagonal blocks inverted by repeated squaring, then a block-level Neumann
product; one-pass tf32 tensor-core products for bf16/fp16 inputs, 3-pass for fp32), every pairwise decay
e^(G_t - G_i) factored per 16-row tile through that tile's reference row (the same overflow bound as the forward,
while a 64-token span may decay by e^-320). Nothing is recomputed:
1. `kda_bwd_pmat_kernel` (chunk, head): tril(Aq), tril_-1(L) over K-column blocks (no [64, K] fp32 tile), T and
   the L2-norm factors, in fp32 (Aq also in the input dtype for step 4), and the chunk-local cumsum G (fp32) that
   every later kernel reads instead of recomputing the gate.
2. `kda_bwd_pwu_kernel` (chunk, head, column block): q e^G, k e^(G_l - G), W, U, e^(G_l) for the sequential passes
   (input dtype).
3. `kda_bwd_states_kernel` (sequence, head, V block), sequential: the fp32 state at every chunk start, and u' = U -
   W S (W S against the fp32 state as two bf16 products, ~16 mantissa bits). Skipped when the training forward saved
   them (`ops.FwdSave`, the default at bf16 / fp16 inputs: the forward's walk stores the state at every 64-token
   boundary and every u', which is the same per-token innovation for 16- and 64-token chunks; pwu then computes no U,
   and the forward's chunk tables are reused). Off: '{"scratch": {"FWD": false}}'.
4. `kda_bwd_dstates_kernel` (sequence, head, V block), reverse sequential from dht: the fp32 state gradient at
   every chunk end, du' = Aq^T do + (k e^(G_l - G)) dS, dS <- e^(G_l) dS + (q e^G)^T do - W^T du'; ends with dh0.
5. `kda_bwd_gv_kernel` (chunk, head): value side per value block from the passes' u' / du': dXv = T^T du', dv, dAq,
   the whole dN = -tril(dXv u'^T) (gw's former part dXk W^T is -dXv (U - u')^T, since W S0 = U - u') and the
   value part of dbeta.
6. `kda_bwd_gw_kernel` (chunk, head, K block): dXk, the state-side dq / dk / dG terms (fp32 scratch) and their L2-norm
   row sums, its dbeta part (atomics).
7. `kda_bwd_gi2_kernel` (chunk, head, 16-row tile, K block): the intra-chunk backward of everything landing on the
   tile's rows, walking the chunk in 16-row blocks, added into gw's terms by fp32 atomic adds (one per element:
   order-independent) rather than read and rewritten.
8. `kda_bwd_gfin_kernel` (chunk, head): dbeta, dg through the suffix sum and the gate (per-chunk partials of
   dA_log / ddt_bias that torch sums), dq / dk through the L2 norm and the q scale.
Memory: two K x V states per 64 tokens and head (bf16 at bf16 inputs: 1 KiB per token-head at K = V = 128; fp32 with
the fp32 scratch, the default at fp16 / fp32 inputs) plus ~6 KB of scratch per token-head at K = V = 128 (~38 GB at
B8 T8K H96).
Measured on the H200 at B1 T8K H96 D128 (benchmarks/RESULTS.md): 19.5 ms in the fifth session, 17.3-17.5 ms in the ninth
(the one-pass tf32 inverse), 16.0 in the tenth, 15.2 in the eleventh, 11.9 in the twelfth (u' / du' from the sequential
passes, dstates in one wave, pwu under a register cap, the stored cumsum instead of recomputed gates in gw / gi2 / pwu),
10.2 in the thirteenth, 9.7 in the fourteenth, 8.9 in the fifteenth (the whole dN in gv, gi2 adding by atomics), 8.4 in
the sixteenth (the scratch and states in the input dtype, as fla keeps them), 7.65 in the seventeenth (the forward's
saved states; the forward's walk 0.70 -> 0.90 ms for the stores); fwd+bwd against fla's at B1 T8K / T32K / T128K and
varlen 64K in one process (1.33-1.37× in the seventeenth session): benchmarks/RESULTS.md.
Launch parameters: `ops_bwd.launch_config`, overridden per call (`launch=`) or by $K3_KDA_BWD_LAUNCH (JSON, e.g.
'{"pmat": {"INV_PREC": "tf32x3"}}'; every kernel also takes "maxnreg"). Opt-in: the scratch in fp32 at bf16 inputs
('{"scratch": {"DTYPE": "fp32"}}': +0.6 ms at B1 T8K H96, dk 2.6e-3 vs 3.2e-3), gv forming u' / du' itself in fp32
against the stored states ('{"gv": {"PRE": false}}': the default until the twelfth session, ~1.7 ms slower, ~2/3 of the
default's dq / dk / dv error in the interpreter), the passes against the state's bf16 rounding ('{"gv": {"PRE_F32":
false}}': dv ~9e-3 there), gi2 finishing the columns ('{"gi2": {"FIN": true}}': slower), the states / state gradients
alone in bf16 ('{"scratch": {"DTYPE": "states"}}'), gi2's products with the decayed q / k in two tf32 parts ('{"gi2":
{"PREC": "split_b"}}': +0.5 ms, the gate's gradients several times more accurate: ddt_bias 1.6e-2 -> 2.7e-3, dg at the
bound 2.2e-2 -> 3.1e-3 in the interpreter's GPU-rounding cases). gw's dbeta atomics (order-dependent last bits) are off
under torch.use_deterministic_algorithms; gi2's (order-independent) stay. The earlier recomputing pair ("v1": prep,
grad_v, grad_k) took 41 ms and was removed, as were the per-chunk intra backward (gi, 9.5 ms vs gi2's 3.5), the
one-kernel prep (6.8 ms vs 5.9 for pmat + pwu), pmat by 16-row tiles (6.2 ms), gv reloading T per value block (3.26 vs
2.98 ms), the states pass on a side stream and bf16 x1s / x2s (no gain). Their numbers stay in benchmarks/RESULTS.md.
K3_KDA_TRITON_BWD=torch selects the old backward (recompute through `chunk_kda_torch` and autograd).

Notable:
- Imports without triton or CUDA: triton is imported the first time `available()` says yes.
- Available where triton imports and CUDA is present (or TRITON_INTERPRET=1, for CPU tests).
- `chunk_size` is ignored (the forward variant fixes 16 or 64 tokens; the backward uses 64).
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

from k3.ops.dispatch import triton_interpreting as _interpret

log = logging.getLogger("k3")
_FALLBACK_LOGGED: set = set()
MIN_LOG_DECAY = -10.0  # steepest per-token log-decay the 16-token tiles handle (exponents <= 8*10 = 80)




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


BWD_IMPLS = ("triton", "torch")
DEFAULT_BWD = "triton"


def _bwd_mode() -> str:
    """The backward: $K3_KDA_TRITON_BWD, else DEFAULT_BWD. "triton": the Triton kernels (ops_bwd); "torch":
    recompute through the torch path + autograd."""
    mode = os.environ.get("K3_KDA_TRITON_BWD", "").strip().lower() or DEFAULT_BWD
    if mode not in BWD_IMPLS:
        raise ValueError(f"K3_KDA_TRITON_BWD={mode!r}: known values are {', '.join(BWD_IMPLS)}")
    return mode


@functools.lru_cache(maxsize=1)
def _ops_bwd():
    from . import ops_bwd
    return ops_bwd


class _ChunkKDATriton(torch.autograd.Function):
    """Forward: Triton kernels. Backward: Triton kernels (ops_bwd), or the torch recompute (K3_KDA_TRITON_BWD)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, A_log, dt_bias, cfg):
        # the forward's sequential pass also stores what the backward's states pass would recompute (its chunk
        # tables, per-chunk states, u'), where the backward's config uses them (ops_bwd.fwd_save)
        save = _ops_bwd().fwd_save(q.shape[-1], v.shape[-1], q.dtype) if _bwd_mode() == "triton" else None
        o, ht = _ops().kda_chunk_fwd(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                     A_log=A_log, dt_bias=dt_bias, save=save, **cfg)
        ctx.cfg = cfg
        ctx.fwd_save = save if save is not None and save.filled else None  # (read, never written, by backward)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, A_log, dt_bias)
        return o, ht

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        mode = _bwd_mode()
        if mode == "torch":
            return _ChunkKDATriton._backward_torch(ctx, do, dht)
        q, k, v, g, beta, h0, A_log, dt_bias = ctx.saved_tensors
        cfg = ctx.cfg
        if do is None:
            do = torch.zeros(v.shape, device=v.device, dtype=v.dtype)
        dq, dk, dv, dg, db, dh0, dal, ddt = _ops_bwd().kda_chunk_bwd(
            q, k, v, g, beta, do, dht, scale=cfg["scale"], initial_state=h0, cu_seqlens=cfg["cu_seqlens"],
            use_qk_l2norm_in_kernel=cfg["use_qk_l2norm_in_kernel"], use_gate_in_kernel=cfg["use_gate_in_kernel"],
            A_log=A_log, dt_bias=dt_bias, lower_bound=cfg["lower_bound"], saved=ctx.fwd_save)
        res = [dq, dk, dv, dg, db,
               None if h0 is None else dh0.to(h0.dtype),
               None if A_log is None else dal.to(A_log.dtype).view_as(A_log),
               None if dt_bias is None else ddt.to(dt_bias.dtype).view_as(dt_bias)]
        return (*[r if need else None for r, need in zip(res, ctx.needs_input_grad)], None)

    @staticmethod
    def _backward_torch(ctx, do, dht):
        """Fallback: recompute the forward through `chunk_kda_torch` and differentiate it with autograd."""
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


@torch.compiler.disable
def chunk_kda_triton(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                     output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False,
                     use_gate_in_kernel: bool = False, A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0,
                     chunk_size: int = 64):
    """Same arguments and result as k3.ops.kda.chunk_kda (inputs already validated there). Opaque to torch.compile
    (as the fla backend): Dynamo tracing into the launch code and the autograd.Function failed (fake-tensor errors in
    the interpreter; thirteenth session), so a compiled model calls it as one eager region, forward and backward."""
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


PRIORITY = 5  # below "fla" (10) for calls with gradients: our fwd+bwd measured 0.29x fla's (third session),
# 1.33-1.37x (seventeenth, H96 D128 bf16 on the H200), but the compiled `small` training step with it is even with
# fla's (host-bound; see k3.ops.kda); calls without gradients prefer this backend on CUDA
# (k3.ops.kda.FORWARD_ONLY_TRITON_MIN_TOKENS)


def register() -> None:
    from .. import register_kda_backend
    register_kda_backend("triton", chunk_kda_triton, available, priority=PRIORITY)
