"""Host side of the KDA Triton chunk backward (needs triton; imported lazily by the package): `kda_chunk_bwd` runs
eight kernels on 64-token chunks (32 at K > 128), one file per stage, launch parameters from `bwd_config`:
  bwd_prep.py   kda_bwd_chunk_matrices_kernel, kda_bwd_wy_kernel      (chunk, head[, column block])
  bwd_state.py  kda_bwd_states_kernel, kda_bwd_dstates_kernel         (sequence, head, V block), sequential
  bwd_value.py  kda_bwd_value_grad_kernel                             (chunk, head)
  bwd_inter.py  kda_bwd_inter_grad_kernel                             (chunk, head, K block)
  bwd_intra.py  kda_bwd_intra_grad_kernel                             (chunk, head, 16-row tile, K block)
  bwd_gate.py   kda_bwd_gate_norm_grad_kernel                         (chunk, head)
then sums the per-chunk partials of dA_log / ddt_bias in torch. The states pass is skipped when the training forward
saved the states (`tables.FwdSave`). `selfcheck.gpu_selfcheck()` compares it against the torch path on a CUDA device.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from k3.ops.dispatch import triton_interpreting

from .bwd_config import (BT, KEY_ALIASES, PTS32_MIN_LOG_DECAY, REF, SCRATCH, TS, _canonical, apply_launch, chunk_len,
                         env_launch, launch_config, scratch_dtypes)
from .bwd_gate import kda_bwd_gate_norm_grad_kernel
from .bwd_inter import kda_bwd_inter_grad_kernel
from .bwd_intra import kda_bwd_intra_grad_kernel
from .bwd_prep import kda_bwd_chunk_matrices_kernel, kda_bwd_wy_kernel
from .bwd_state import kda_bwd_dstates_kernel, kda_bwd_states_kernel
from .bwd_value import kda_bwd_value_grad_kernel
from .tables import FwdSave, _cu_cpu, _seq_tables, _walk_grid, _walk_order  # shared with the forward

__all__ = ["kda_chunk_bwd", "fwd_save", "kernel_table", "launch_config", "apply_launch",
           "env_launch", "KEY_ALIASES"]


def _split_grid(NC: int, H: int, NS: int, inner: bool) -> tuple:
    """Grid of a kernel whose (chunk, head) pairs are split NS ways (bwd_common._split_pid): (NC * NS, H, 1) with a
    chunk's splits consecutive (inner), else (NC, H, NS)."""
    return (NC * NS, H, 1) if inner else (NC, H, NS)


def _kw(cfg: dict, *drop) -> dict:
    """A kernel's launch keywords from its launch_config entry: without the entries in `drop` (not kernel
    parameters), and without maxnreg when it is None (no register cap)."""
    return {n: c for n, c in cfg.items() if n not in drop and not (n == "maxnreg" and c is None)}


def kernel_table():
    """(launch_config key, kernel, kind) of the backward kernels in launch order; kind: "chunk" (per chunk and head,
    the chunk constexprs) or "states"/"dstates" (the sequential passes)."""
    return [("matrices", kda_bwd_chunk_matrices_kernel, "chunk"), ("wy", kda_bwd_wy_kernel, "chunk"),
            ("states", kda_bwd_states_kernel, "states"), ("dstates", kda_bwd_dstates_kernel, "dstates"),
            ("value", kda_bwd_value_grad_kernel, "chunk"), ("inter", kda_bwd_inter_grad_kernel, "chunk"),
            ("intra", kda_bwd_intra_grad_kernel, "chunk"), ("gate_norm", kda_bwd_gate_norm_grad_kernel, "chunk")]


def fwd_save(K: int, V: int, dtype: torch.dtype, launch: Optional[dict] = None) -> Optional[FwdSave]:
    """The FwdSave a training forward should fill for this backward (its chunk length and scratch dtypes under the
    launch config, $K3_KDA_BWD_LAUNCH and `launch`), or None where the backward would not use one (scratch FWD off,
    or value without PRE: u' is then formed in value)."""
    lc = apply_launch(launch_config(K, V, 1, dtype), env_launch(), launch)
    if not (lc["scratch"]["FWD"] and lc["value"]["PRE"]):
        return None
    dt = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    return FwdSave(chunk_len(K), *scratch_dtypes(lc, dt))


def kda_chunk_bwd(q, k, v, g, beta, do, dht, scale: float, initial_state=None, cu_seqlens=None,
                  use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False, A_log=None,
                  dt_bias=None, lower_bound: Optional[float] = -5.0, launch: Optional[dict] = None,
                  saved: Optional[FwdSave] = None):
    """Gradients of chunk_kda's (o, final_state) given do [B,T,H,V] and dht [N,H,K,V] (or None = zero).

    Returns (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias): token gradients in their inputs' dtypes, dg w.r.t. g
    as given (the raw gate input f when use_gate_in_kernel), dh0 [N,H,K,V] fp32, dA_log [H] / ddt_bias [H*K] fp32
    (None without the gate). Inputs are validated and supported (see the package's `_unsupported`).
    launch: per-kernel overrides of `launch_config` ({kernel name: {param: value}}, for benchmarks). saved: the
    FwdSave the forward filled (`fwd_save`): its chunk tables, per-chunk states and u' replace the states pass (and
    wy's U); one of another chunk length or dtypes than this backward's config is not used."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    Tt = B * T
    BT = chunk_len(K)
    if saved is not None and not (saved.filled and saved.bt == BT):
        saved = None
    # (the forward's tables and walk order: no second copy of cu_seqlens to the host, whose wait stalls the GPU)
    if saved is not None:
        (cu, ctok, cend, seq_chunk, N, NC), order = saved.tables, saved.order
    else:
        # (fixed-length batches: cached tables, no host boundaries to build, no order)
        cu_cpu = _cu_cpu(B, T, cu_seqlens) if cu_seqlens is not None else None
        cu, ctok, cend, seq_chunk, N, NC = _seq_tables(B, T, cu_seqlens, dev, BT, cu_cpu)
        order = _walk_order(cu_cpu, dev) if cu_cpu is not None else None
    qc, kc, vc, gc, bc, doc = (x.contiguous() for x in (q, k, v, g, beta, do))
    dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    ieee = dt == torch.float32
    upcast = dt != torch.float32 and triton_interpreting()
    gate = bool(use_gate_in_kernel)
    if gate:
        a_log, dtb, lb = A_log.contiguous(), dt_bias.contiguous(), float(lower_bound)
    else:
        a_log = dtb = q.new_zeros(1, dtype=torch.float32)
        lb = 0.0
    const = dict(H=H, K=K, V=V, BT=BT, TS=TS, REF=REF, LOG2_TS=int(math.log2(TS)), LOG2_NB=int(math.log2(BT // TS)),
                 USE_GATE=gate, L2NORM=bool(use_qk_l2norm_in_kernel), IEEE=ieee)
    dq, dk, dg = torch.empty_like(qc), torch.empty_like(kc), torch.empty_like(gc)
    dv, dbeta = torch.empty_like(vc), torch.empty_like(bc)
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=torch.float32)
    dal_part = torch.zeros(max(NC, 1), H, K, device=dev, dtype=torch.float32)  # per chunk, head and intra K block
    ddt_part = torch.zeros(max(NC, 1), H, K, device=dev, dtype=torch.float32)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    dS0 = dht.float().contiguous() if dht is not None else None
    if NC == 0:
        dh0.copy_(dS0 if dS0 is not None else torch.zeros_like(dh0))
        dq.zero_(), dk.zero_(), dg.zero_(), dv.zero_(), dbeta.zero_()
    else:
        qg = torch.empty(H, Tt, K, device=dev, dtype=dt)
        kd, w = torch.empty_like(qg), torch.empty_like(qg)
        aq = torch.empty(H, Tt, BT, device=dev, dtype=dt)
        eg = torch.empty(NC, H, K, device=dev, dtype=torch.float32)
        lc = apply_launch(launch_config(K, V, N * H, dt), env_launch(), launch)
        tpp = lc["intra"]["TPP"]
        if not isinstance(tpp, int) or tpp < 1 or (BT // TS) % tpp:
            raise ValueError(f"kda_chunk_bwd: intra TPP={tpp!r} must divide the {BT // TS} row tiles of a chunk")
        if not lc["value"]["PRE"]:
            asked = {**env_launch().get("value", {}), **(_canonical(launch).get("value") or {})}
            if asked.get("PRE_F32"):
                raise ValueError("kda_chunk_bwd: value PRE_F32 (how the sequential passes form u' / du' for value) needs "
                                 "value PRE")
            lc["value"]["PRE_F32"] = False  # the default's PRE_F32 has nothing to act on without PRE
        for name, c in lc.items():
            n = c.get("maxnreg")
            if n is not None and not (isinstance(n, int) and 24 <= n <= 255):
                raise ValueError(f"kda_chunk_bwd: {name} maxnreg={n!r}: expected None or an int in [24, 255]")
        if lc["intra"]["RED"] and lc["intra"]["FIN"]:
            raise ValueError("kda_chunk_bwd: intra RED (its terms added by atomics) and FIN (it finishes the columns) "
                             "exclude each other")
        if lc["intra"]["FIN"] and tpp != BT // TS:
            raise ValueError(f"kda_chunk_bwd: intra FIN needs all {BT // TS} row tiles of a chunk per program, TPP={tpp}")
        if lc["intra"]["PREC"] not in ("tf32", "split_b"):
            raise ValueError(f"kda_chunk_bwd: intra PREC={lc['intra']['PREC']!r} must be 'tf32' or 'split_b'")
        if lc["matrices"]["INV"] not in ("blk", "pow"):
            raise ValueError(f"kda_chunk_bwd: matrices INV={lc['matrices']['INV']!r} must be 'blk' or 'pow'")
        pts = lc["matrices"]["PTS"]
        if pts not in (16, 32):
            raise ValueError(f"kda_chunk_bwd: matrices PTS={pts!r} must be 16 or 32")
        # 32-row tiles need the normalised q / k and a gate bounded at -5 or above (the in-kernel gate's lower_bound:
        # e^(16 |g|) factors; precomputed g is only known to be >= -10, where e^160 overflows); a chunk has BT rows.
        # FACTOR's steps between 16-row tiles' reference rows, e^(-16 |g|), underflow below g = -5.4: the same bound
        if not (gate and lb >= PTS32_MIN_LOG_DECAY):
            lc["matrices"] = {**lc["matrices"], "PTS": TS, "FACTOR": False}
        elif not const["L2NORM"] or pts > BT:
            lc["matrices"] = {**lc["matrices"], "PTS": TS}
        scr = lc["scratch"]["DTYPE"]
        if scr not in SCRATCH:
            raise ValueError(f"kda_chunk_bwd: scratch DTYPE={scr!r} must be one of {SCRATCH}")
        # the per-chunk states' and the scratch's dtypes (the input dtype or fp32; fp32 at fp32 inputs either way)
        st_dt, sdt = scratch_dtypes(lc, dt)
        if saved is not None and not (lc["value"]["PRE"] and (saved.states.dtype, saved.uns.dtype) == (st_dt, sdt)):
            saved = None  # (config changed since the forward: the states pass recomputes them)
        if sdt != torch.float32 and lc["value"]["BK"] > 32:
            # correct in the interpreter, but an illegal memory access on the H200 (triton 3.6)
            raise ValueError(f"kda_chunk_bwd: value BK={lc['value']['BK']} with the bf16 scratch is refused (an illegal "
                             "memory access on the H200 with triton 3.6); use BK <= 32")
        # the gradient kernels' operands, fp32: T, tril_-1(L) (cmat slots 0, 1), W, k e^(G_l - G), tril(Aq), G, norms
        cmat = torch.empty(NC, H, 4, BT, BT, device=dev, dtype=torch.float32)
        f32_wk = sdt == torch.float32
        pre = bool(lc["value"]["PRE"])
        sf32 = bool(lc["value"]["PRE_F32"])
        # W / k e^(G_l - G) for the gradient kernels: fp32 copies, or the intermediate-dtype ones (w, kd); with value's
        # PRE only inter reads W (not with value's DNU either) and nothing k e^(G_l - G) (inter's fp32 x1s / x2s are then
        # allocated by _grads); the fp32 Aq only without PRE (value forming du' itself; 3.2 GB less at B1 T128K H96)
        if pre and lc["value"]["DNU"]:
            ws = None  # (nothing reads W after the passes)
        else:
            ws = torch.empty(H, Tt, K, device=dev, dtype=torch.float32) if f32_wk else w
        ks = None if pre else torch.empty(H, Tt, K, device=dev, dtype=torch.float32) if f32_wk else kd
        aqf = cmat if pre else torch.empty(NC, H, BT, BT, device=dev, dtype=torch.float32)
        gcs = torch.empty(H, Tt, K, device=dev, dtype=torch.float32)
        rqk = torch.empty(2, H, Tt, device=dev, dtype=torch.float32)
        kda_bwd_chunk_matrices_kernel[(NC, H)](
            qc, kc, gc, bc, a_log, dtb, aq, cmat, aqf, rqk, gcs, ctok, cend, float(scale), lb, Tt, **_kw(lc["matrices"]),
            AQF=not pre, **{n: c for n, c in const.items() if n != "V"})  # (PTS: checked above)
        pw = lc["wy"]
        wsa = w if ws is None else ws  # (wy's fp32 W / k e^(G_l - G) slots: unused without F32_W / F32_K)
        vcols = saved is None  # (with the forward's u' nothing reads U: wy's value blocks do not run)
        u = torch.empty(H, Tt, V, device=dev, dtype=dt) if vcols else eg
        kda_bwd_wy_kernel[_split_grid(NC, H, K // pw["BK"] + vcols * (V // pw["BV"]), pw["INNER"])](
            qc, kc, vc, bc, qg, kd, w, u, eg, cmat, wsa, wsa if ks is None else ks, gcs, rqk, ctok, cend,
            float(scale), Tt, H=H, K=K, V=V, BT=BT, IEEE=ieee, F32_W=f32_wk and ws is not None,
            F32_K=f32_wk and not pre, VCOLS=vcols, **_kw(pw))
        if saved is not None:  # the forward's per-chunk states and u'
            states, uns = saved.states, saved.uns
            dstates = torch.empty_like(states)
        else:
            # the per-chunk states / state gradients: at the scratch dtype, or with "states" alone at the input dtype
            states = torch.empty(NC, H, K, V, device=dev, dtype=st_dt)
            dstates = torch.empty_like(states)
            # u', du': with value's PRE stored by the sequential passes (du' once U, read by the forward pass alone, is
            # freed), else allocated by _grads once the passes' bf16 operands are freed (not to raise the peak)
            uns = torch.empty(H, Tt, V, device=dev, dtype=sdt) if pre else None
            grid, ordered = _walk_grid(N, H, V // lc["states"]["BV"], order, lc["states"]["ORDERED"])
            kda_bwd_states_kernel[grid](
                kd, w, u, eg, h0 if h0 is not None else eg, states, uns if pre else eg, cu, seq_chunk, Tt,
                order if ordered else cu, H=H, K=K, V=V, BT=BT, HAS_H0=h0 is not None, IEEE=ieee, UPCAST=upcast,
                STORE_U=pre, SF32=sf32, **_kw(lc["states"], "ORDERED"), ORDERED=ordered)
        del u
        dus = torch.empty(H, Tt, V, device=dev, dtype=sdt) if pre else None
        grid, ordered = _walk_grid(N, H, V // lc["dstates"]["BV"], order, lc["dstates"]["ORDERED"])
        kda_bwd_dstates_kernel[grid](
            qg, kd, w, aq, eg, doc, dS0 if dS0 is not None else eg, dstates, dh0, dus if pre else eg, cu, seq_chunk, Tt,
            order if ordered else cu, H=H, K=K, V=V, BT=BT, HAS_DHT=dS0 is not None, IEEE=ieee, UPCAST=upcast,
            STORE_U=pre, SF32=sf32, **_kw(lc["dstates"], "ORDERED"), ORDERED=ordered)
        del qg, kd, w, aq, eg
        _grads(qc, kc, vc, gc, bc, a_log, dtb, doc, ws, ks, aqf, gcs, rqk, states, dstates, uns, dus, cmat,
               dq, dk, dv, dg, dbeta, dal_part, ddt_part, ctok, cend, float(scale), lb, Tt, NC, lc, const, upcast)
    dA_log = ddt_bias = None
    if gate:
        dA_log = dal_part.sum((0, 2))
        ddt_bias = ddt_part.sum(0).reshape(H * K)
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias


CHECK_NONFINITE = False  # debug aid (benchmarks/kda_bwd_nan.py sets it): print each intermediate's non-finite count


def _nonfinite(**tensors) -> None:
    if CHECK_NONFINITE:
        print("kda_bwd nonfinite:", {n: int((~torch.isfinite(t)).sum()) for n, t in tensors.items() if t is not None},
              flush=True)


def _grads(qc, kc, vc, gc, bc, a_log, dtb, doc, ws, ks, aqf, gcs, rqk, states, dstates, uns, dus, cmat,
           dq, dk, dv, dg, dbeta, dal_part, ddt_part, ctok, cend, scale, lb, Tt, NC, lc, const, upcast):
    """The gradient kernels value, inter, intra, gate_norm (bwd_value.py ... bwd_gate.py) after the prep and the sequential passes."""
    H, K, V, BT, ieee = const["H"], const["K"], const["V"], const["BT"], const["IEEE"]
    _nonfinite(T=cmat[:, :, 0], L=cmat[:, :, 1], ws=ws, ks=ks, aqf=aqf, states=states, dstates=dstates)
    dev = qc.device
    cdb = torch.empty(NC, H, BT, device=dev, dtype=torch.float32)
    if uns is None:  # the W / U scratch dtype
        uns, dus = (torch.empty(H, Tt, V, device=dev, dtype=ws.dtype) for _ in range(2))
    dnu = bool(lc["value"]["DNU"])
    # (ws / ks: value reads them only without PRE; uns stands in)
    kda_bwd_value_grad_kernel[(NC, H)](vc, bc, doc, aqf, uns if ws is None else ws, uns if ks is None else ks, states,
                                  dstates, uns, dus, cmat, cdb, dv, ctok, cend, Tt, H=H, K=K, V=V, BT=BT, IEEE=ieee,
                                  UPCAST=upcast, **_kw(lc["value"], "PRE_F32"))  # (PRE_F32: for the passes above)
    _nonfinite(uns=uns, dus=dus, dAq=cmat[:, :, 2], dNv=cmat[:, :, 3], cdb=cdb, dv=dv)
    BKW = lc["inter"]["BK"]
    NKB = K // BKW  # inter's K blocks, and how many per-block parts of dN (NKW) / dbeta (NDB) intra and gate_norm add up
    NDB = 0 if lc["inter"]["ATOMIC"] else NKB
    NKW = 0 if dnu else NDB
    # inter's fp32 outputs x1s / x2s take the places of the fp32 W / k e^(G_l - G) copies where there are such: value
    # (done) reads them whole, inter reads only its own block of W before it writes x1s there (-2 x 4 B per token-head
    # and K column, 12.9 GB at B1 T128K H96 D128)
    f32 = ws is not None and ws.dtype == torch.float32
    x1s = ws if f32 else torch.empty(H, Tt, K, device=dev, dtype=torch.float32)
    x2s = ks if f32 and ks is not None else torch.empty(H, Tt, K, device=dev, dtype=torch.float32)
    dgis = torch.empty(H, Tt, K, device=dev, dtype=torch.float32)
    nkp = torch.empty(NC, H, NKW, BT, BT, device=dev, dtype=torch.float32) if NKW else cdb
    dbp = torch.empty(NC, H, NDB, BT, device=dev, dtype=torch.float32) if NDB else cdb
    gate = dict(USE_GATE=const["USE_GATE"], L2NORM=const["L2NORM"])
    BKI = lc["intra"]["BK"]
    NKI = K // BKI
    # FIN: intra (all of a chunk's row tiles per program) also finishes the columns (dg, the gate, dq / dk or their
    # pre-norm form with row-sum partials sqk), leaving dbeta and the L2 norm's backward to gate_norm
    fused = bool(lc["intra"]["FIN"])
    # RED: intra adds its terms into inter's by atomics; with the L2 norm inter and intra then store the row-sum partials of
    # their own terms (NSQ slots per q / k: intra's NKI, then inter's NKB)
    red = bool(lc["intra"]["RED"])
    # gate_norm's ONEPASS: intra (without FIN) stores the same row-sum partials (its SQK), so gate_norm finishes dq / dk in its one
    # pass over the columns
    onepass = bool(lc["gate_norm"]["ONEPASS"]) and not fused and const["L2NORM"]
    NSQ = NKI + NKB if red and onepass else NKI
    sqk = torch.empty(2, NSQ, H, Tt, device=dev, dtype=torch.float32) if (fused or onepass) and const["L2NORM"] \
        else cdb
    kda_bwd_inter_grad_kernel[_split_grid(NC, H, NKB, lc["inter"]["INNER"])](
        qc, kc, gcs, bc, doc, x1s if ws is None else ws, states, dstates, uns, dus, cmat, cdb, rqk, x1s, x2s, dgis,
        nkp, dbp, sqk, ctok, cend, scale, Tt, H=H, K=K, V=V, BT=BT, IEEE=ieee, UPCAST=upcast, DNW=not dnu, RED=red,
        NSQ=NSQ if red and onepass else 0, **_kw(lc["inter"]))
    _nonfinite(x1s=x1s, x2s=x2s, dgis=dgis, nkp=nkp, dbp=dbp)
    kda_bwd_intra_grad_kernel[_split_grid(NC, H, (BT // const["TS"] // lc["intra"]["TPP"]) * NKI, lc["intra"]["INNER"])](
        qc, kc, gc, bc, a_log, dtb, cmat, nkp, gcs, rqk, x1s, x2s, dgis, dq, dk, dg, dal_part, ddt_part, sqk,
        ctok, cend, scale, lb, Tt, H=H, K=K, BT=BT, TS=const["TS"], REF=const["REF"], NKW=NKW, IEEE=ieee, SQK=onepass,
        NSQ=NSQ, **gate, **_kw(lc["intra"]))
    kda_bwd_gate_norm_grad_kernel[(NC, H)](
        qc, kc, gc, bc, a_log, dtb, cmat, cdb, nkp, dbp, x1s, x2s, dgis, rqk, sqk, dq, dk, dg, dbeta, dal_part,
        ddt_part, ctok, cend, scale, lb, Tt, H=H, K=K, BT=BT, NKW=NKW, NDB=NDB, FUSED=fused, NKI=NSQ, **gate,
        **{**_kw(lc["gate_norm"]), "ONEPASS": onepass})
