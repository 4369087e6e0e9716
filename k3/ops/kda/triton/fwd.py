"""Host side of the KDA Triton forward (needs triton; imported lazily by the package): `kda_chunk_fwd` (prefill /
training) and `kda_recurrent_fwd` (decode).

The chunked forward is two kernels on 16-token chunks: `intra_fwd.kda_intra_wy_fwd_kernel`, parallel over chunks
(gate, cumsum, norms, the intra-chunk matrices, T, W, U), then `state_fwd.kda_state_output_fwd_kernel`, sequential
over the chunks of each (sequence, head, value block), which carries the fp32 state and writes o (and, for a training
forward, what the backward's states pass would recompute: `tables.FwdSave`). Long sequences with few (sequence,
head) pairs run in time pieces, the walk of piece p on a high-priority stream next to the prep of piece p + 1.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from k3 import knobs

from .intra_fwd import kda_intra_wy_fwd_kernel
from .recurrent import kda_recurrent_fwd_kernel
from .state_fwd import kda_state_output_fwd_kernel
from .tables import BT, FwdSave, _chunk_tables, _cu_cpu, _fixed_tables, _seq_tables, _walk_grid, _walk_order

REF = 7   # reference row inside a tile: factored exponents are at most max(REF, BT-1-REF) * |g|_max (g >= -10)

# Prep launch (kda_chunk_fwd(prep_cfg=...) overrides any of these keys):
#   c          chunks (of one head) per tile, batched 3-D dots; power of two
#   loop       tiles per program (a loop inside the program)
#   prefetch   load the next tile's inputs before computing the current one (only matters with loop > 1)
#   num_warps, num_stages   launch options of the prep kernel
#   inv        unit-lower inverse: "blk" (recursive 2x2 blocks, tf32), "blkn" (+ Newton step, tf32x3 residual),
#              "ieee" (repeated squaring with fp32 FMA dots: the accuracy reference)
#   qk         precision of the Aqk / Akk dots: "tf32", "tf32x3" or "bf16"
#   head_fast  grid order: heads fastest (programs running together read whole token rows of all heads)
#   kb         0: whole [16, K] tiles; else K block width (a power of two < K): two passes over K blocks
#   maxnreg    None, or a register cap per thread for ptxas
# Default: one chunk per program on 2 warps, no register cap: the fastest of 19 option sets on the H200 (prep 6.40 ms
# at B8 T8K H96 D128 bf16; every capped set spilled; several chunk groups per program lost at every shape).
PREP_DEFAULT = dict(c=1, loop=1, prefetch=False, num_warps=2, num_stages=1, inv="blk", qk="tf32",
                    head_fast=True, kb=0, maxnreg=None)
PREP_INV = ("blk", "blkn", "ieee")
PREP_QK = ("tf32", "tf32x3", "bf16")
# Sequential pass (kda_chunk_fwd(state_cfg=...) or $K3_KDA_STATE_CFG override any of these keys; None = the rule):
#   bv         value columns per program (power of two >= 16); None: _pick_bv
#   num_warps, num_stages   launch options (None: 4 warps, STATE_STAGES stages)
#   maxnreg    None, or a register cap per thread for ptxas
#   pipe       time pieces: 0 = off; a token count (multiple of 16) = run the prep of piece p + 1 on the current
#              stream while the walk does piece p of every sequence on a high-priority side stream (state carried
#              between pieces in fp32, so the result is the unpiped one); None = pipe_tokens' rule
#   lpt        varlen walks: None / True = the sequences longest first in a sequence-major grid (`_walk_order`),
#              False = grid order; same arithmetic
STATE_CFG_DEFAULT = dict(bv=None, num_warps=None, num_stages=None, maxnreg=None, pipe=None, lpt=None)
ENV_STATE_CFG = "K3_KDA_STATE_CFG"  # JSON: state_cfg keys for every call (a call's state_cfg wins where both give one)
STATE_STAGES = 3  # best of 18 option sets at B8 T8K on the H200 (walk 3.94 ms vs 4.58 at 2 stages)
# pipe=None: pieces of PIPE_AUTO tokens when the longest sequence spans at least two of them and there are at most
# PIPE_MAX_PROGS (sequence, head) pairs, with value blocks of at least PIPE_MIN_BV. Pieces hide the prep behind the
# walk where the walk has few programs (B1 T128K H96: 23.81 -> 21.45 ms, B2 T32K 11.96 -> 11.13); with more pairs the
# walk fills the GPU by itself (varlen 64K / 12 documents, 1,152 pairs: 11.07 ms unpiped vs 12.25 in pieces).
PIPE_AUTO = 8192
PIPE_MAX_PROGS = 384
PIPE_MIN_BV = 64
# Value block cap of a walk that saves the backward's states (FwdSave; unless bv is given): at BV 128 the stores of
# the [128, 128] state spill (varlen 64K at H96, fwd+bwd: BV 128 78.90 ms, BV 64 75.46)
SAVE_MAX_BV = 64
# Register cap of the walk at value blocks of at most 32 on 4 warps (no maxnreg given): with the final state stored
# or an initial one loaded it took 176-191 registers (2 programs per SM; B1 T8K H96 in two waves, 1.14 ms instead of
# 0.68); capped: 168, no spill in the loop (sm_90)
STATE_SMALL_BV_MAXNREG = 168
LAST_LAUNCH = {}  # benchmarks: the compiled handles of the last launched "prep" and "state" kernels


def _merged(what: str, default: dict, given: Optional[dict]) -> dict:
    """default updated with given; unknown keys name `what`."""
    cfg = dict(default)
    bad = set(given or {}) - set(cfg)
    if bad:
        raise ValueError(f"{what}: unknown keys {sorted(bad)} (known: {sorted(cfg)})")
    cfg.update(given or {})
    return cfg


def _check_maxnreg(what: str, cfg: dict) -> None:
    n = cfg["maxnreg"]
    if n is not None and not (isinstance(n, int) and 24 <= n <= 255):
        raise ValueError(f"{what}['maxnreg']: expected None or an int in [24, 255], got {n!r}")


def prep_config(prep_cfg: Optional[dict] = None) -> dict:
    """PREP_DEFAULT updated with prep_cfg, validated."""
    cfg = _merged("prep_cfg", PREP_DEFAULT, prep_cfg)
    for key in ("c", "loop", "num_warps"):
        n = cfg[key]
        if not (isinstance(n, int) and 1 <= n <= 64 and n & (n - 1) == 0):
            raise ValueError(f"prep_cfg[{key!r}]: expected a power of two in [1, 64], got {n!r}")
    if cfg["inv"] not in PREP_INV:
        raise ValueError(f"prep_cfg['inv']: expected one of {PREP_INV}, got {cfg['inv']!r}")
    if cfg["qk"] not in PREP_QK:
        raise ValueError(f"prep_cfg['qk']: expected one of {PREP_QK}, got {cfg['qk']!r}")
    kb = cfg["kb"]
    if not (isinstance(kb, int) and (kb == 0 or (16 <= kb and kb & (kb - 1) == 0))):
        raise ValueError(f"prep_cfg['kb']: expected 0 or a power of two >= 16, got {kb!r}")
    _check_maxnreg("prep_cfg", cfg)
    return cfg


def prep_meta(pcfg: dict, H: int, K: int, V: int, varlen: bool, USE_GATE: bool, L2NORM: bool, piece: bool = False):
    """(constexpr arguments, launch options) of kda_intra_wy_fwd_kernel for a validated config. piece: equal-length
    rows whose chunks start at a token offset (a pipelined time piece after the first; its own compiled variant, so
    the unpiped kernel is unchanged)."""
    kb = K if pcfg["kb"] in (0, None) or pcfg["kb"] >= K else pcfg["kb"]
    consts = dict(H=H, K=K, V=V, C=pcfg["c"], LOOP=pcfg["loop"], REF=REF, HEAD_FAST=bool(pcfg["head_fast"]),
                  VARLEN=bool(varlen), PIECE=bool(piece) and not varlen, USE_GATE=bool(USE_GATE),
                  L2NORM=bool(L2NORM), QK_PREC=pcfg["qk"], INV=pcfg["inv"],
                  PREFETCH=bool(pcfg["prefetch"]) and pcfg["loop"] > 1, KB=kb, VB=min(kb, V))
    launch = dict(num_warps=pcfg["num_warps"], num_stages=pcfg["num_stages"])
    if pcfg["maxnreg"] is not None:
        launch["maxnreg"] = pcfg["maxnreg"]
    return consts, launch


def env_state_cfg() -> dict:
    """The state_cfg keys of $K3_KDA_STATE_CFG (JSON object), {} when unset."""
    env_cfg = knobs.get(ENV_STATE_CFG)   # parsed and checked (a JSON object) by k3.knobs
    if not env_cfg:
        return {}
    _merged(ENV_STATE_CFG, STATE_CFG_DEFAULT, env_cfg)
    return env_cfg


def state_config(state_cfg: Optional[dict] = None) -> dict:
    """STATE_CFG_DEFAULT updated with $K3_KDA_STATE_CFG, then with state_cfg, validated."""
    env_cfg = env_state_cfg()
    if env_cfg:
        state_cfg = {**env_cfg, **(state_cfg or {})}
    cfg = _merged("state_cfg", STATE_CFG_DEFAULT, state_cfg)
    bv = cfg["bv"]
    if bv is not None and not (isinstance(bv, int) and bv >= 16 and bv & (bv - 1) == 0):
        raise ValueError(f"state_cfg['bv']: expected None or a power of two >= 16, got {bv!r}")
    nw = cfg["num_warps"]
    if nw is not None and nw not in (1, 2, 4, 8, 16):
        raise ValueError(f"state_cfg['num_warps']: expected None or 1, 2, 4, 8, 16, got {nw!r}")
    ns = cfg["num_stages"]
    if ns is not None and not (isinstance(ns, int) and 1 <= ns <= 6):
        raise ValueError(f"state_cfg['num_stages']: expected None or an int in [1, 6], got {ns!r}")
    _check_maxnreg("state_cfg", cfg)
    pipe = cfg["pipe"]
    if pipe is not None and not (isinstance(pipe, int) and pipe >= 0 and pipe % BT == 0):
        raise ValueError(f"state_cfg['pipe']: expected None or a non-negative multiple of {BT} (tokens), got {pipe!r}")
    if cfg["lpt"] is not None and not isinstance(cfg["lpt"], bool):
        raise ValueError(f"state_cfg['lpt']: expected None, True or False, got {cfg['lpt']!r}")
    return cfg


def state_launch(scfg: dict, bv: Optional[int] = None, k: Optional[int] = None) -> dict:
    """Launch options of the walk for a validated config; bv and k: the value block and key width it runs at (the
    register cap at K <= 128 and value blocks <= 32: STATE_SMALL_BV_MAXNREG)."""
    nw = scfg["num_warps"] or 4
    launch = {} if scfg["maxnreg"] is None else dict(maxnreg=scfg["maxnreg"])
    if not launch and nw == 4 and bv is not None and bv <= 32 and k is not None and k <= 128:
        launch = dict(maxnreg=STATE_SMALL_BV_MAXNREG)
    return dict(launch, num_warps=nw, num_stages=scfg["num_stages"] or STATE_STAGES)


def kernel_info(which: str = "prep") -> dict:
    """Registers, spills and shared memory of the last "prep" or "state" kernel launched (GPU only; {} else)."""
    ck = LAST_LAUNCH.get(which)
    if ck is None:
        return {}
    out = {}
    for key in ("n_regs", "n_spills"):
        if getattr(ck, key, None) is not None:
            out[key] = int(getattr(ck, key))
    shared = getattr(getattr(ck, "metadata", None), "shared", None)
    if shared is not None:
        out["shared"] = int(shared)
    return out


def pipe_tokens(scfg: dict, max_len: int, n_pairs: int) -> int:
    """Piece length of the pipelined forward (0 = not pipelined) for a validated state config: scfg['pipe'] when
    given, else PIPE_AUTO when there are at most PIPE_MAX_PROGS (sequence, head) pairs; 0 unless the longest
    sequence spans at least two pieces."""
    piece = scfg["pipe"]
    if piece is None:
        piece = PIPE_AUTO if n_pairs <= PIPE_MAX_PROGS else 0
    return piece if piece and max_len > piece else 0


_SIDE_STREAMS = {}


def _side_stream(device) -> "torch.cuda.Stream":
    """A high-priority stream per device for the pipelined forward's walks: when one is launched while a prep grid
    occupies the SMs, the block scheduler gives the walk's programs the next free slots."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx, priority=-1)
    return _SIDE_STREAMS[idx]


def _interm_dtype(q):
    return q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _gate_args(q, use_gate, A_log, dt_bias, lower_bound):
    if use_gate:
        return A_log.contiguous(), dt_bias.contiguous(), float(lower_bound)
    dummy = q.new_zeros(1, dtype=torch.float32)
    return dummy, dummy, 0.0


def _pick_bv(V: int, nprog: int) -> int:
    """Value-column block of the walk: split V while there are fewer than 264 (2 per SM) programs. H200, B8 T8K H96
    D128 bf16: BV=128 17.2 ms, 64 18.4 ms, 32 21.2 ms for the whole forward of the time (fewer re-reads of the
    K-wide intermediates win while there are >= 2 programs per SM)."""
    bv = min(V, 128)
    while bv > 16 and nprog * (V // bv) < 264:
        bv //= 2
    return bv


def kda_chunk_fwd(q, k, v, g, beta, scale: float, initial_state=None, output_final_state: bool = False,
                  cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                  A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0, prep_only: bool = False,
                  prep_cfg: Optional[dict] = None, state_cfg: Optional[dict] = None, save: Optional[FwdSave] = None):
    """Chunked forward: (o [B,T,H,V] v.dtype, final state [N,H,K,V] fp32 or None). Inputs validated/supported.

    prep_cfg: options of the prep kernel (PREP_DEFAULT); state_cfg: options of the walk (STATE_CFG_DEFAULT, over
    $K3_KDA_STATE_CFG). prep_only (benchmarks): run the prep kernel only and return (None, None). save: a FwdSave
    the walk fills for the backward (see FwdSave)."""
    scfg = state_config(state_cfg)
    bv = scfg["bv"]
    bv = None if bv is None else min(bv, v.shape[-1])
    B, T, H, K = q.shape
    V = v.shape[-1]
    pcfg = prep_config(prep_cfg)
    cu_cpu = _cu_cpu(B, T, cu_seqlens)
    N = cu_cpu.numel() - 1
    max_len = int((cu_cpu[1:] - cu_cpu[:-1]).max()) if N else 0
    ins = tuple(x.contiguous() for x in (q, k, v, g, beta))
    gate = _gate_args(q, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    flags = dict(USE_GATE=bool(use_gate_in_kernel), L2NORM=bool(use_qk_l2norm_in_kernel))
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    ht = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    piece = 0 if prep_only else pipe_tokens(scfg, max_len, N * H)
    if save is not None and (prep_only or save.bt % BT or piece % save.bt):
        save = None  # (this pass cannot store the backward's chunk states: the backward recomputes them)
    order = _walk_order(cu_cpu, q.device, scfg["lpt"]) if cu_seqlens is not None else None
    if save is not None:
        save.order = order
        save.tables = _seq_tables(B, T, cu_seqlens, q.device, save.bt, cu_cpu)
        save.states = torch.empty(max(save.tables[5], 1), H, K, V, device=q.device, dtype=save.states_dtype)
        save.uns = torch.empty(H, B * T, V, device=q.device, dtype=save.uns_dtype)
        save.filled = True
    if piece:
        BV = bv or max(_pick_bv(V, N * H), min(V, PIPE_MIN_BV))
        BV = BV if bv or save is None else min(BV, SAVE_MAX_BV)
        launch = state_launch(scfg, BV, K)
        _fwd_pipelined(ins, gate, flags, float(scale), cu_cpu, piece, o, h0, ht, pcfg, dict(BV=BV, **launch),
                       fixed_T=T if cu_seqlens is None else None, order=order, save=save)
        return o, ht
    cu, ctok, cend, seq_chunk, N, NC = _seq_tables(B, T, cu_seqlens, q.device, BT, cu_cpu)
    fixed = None if cu_seqlens is not None else (T, (T + BT - 1) // BT)
    inter = _prep(ins, gate, flags, float(scale), ctok, cend, NC, pcfg, fixed)
    if prep_only:
        return None, None
    if N == 0:
        return o, ht
    qg, kd, w, u, aqk, eg = inter
    dummy = eg
    BV = bv or _pick_bv(V, N * H)
    BV = BV if bv or save is None else min(BV, SAVE_MAX_BV)
    grid, ordered = _walk_grid(N, H, V // BV, order)
    LAST_LAUNCH["state"] = kda_state_output_fwd_kernel[grid](
        qg, kd, w, u, aqk, eg, o, h0 if h0 is not None else dummy, ht if ht is not None else dummy, cu,
        seq_chunk, B * T, H=H, K=K, V=V, BT=BT, BV=BV, CU_STRIDE=1, HAS_H0=h0 is not None, STORE_HT=ht is not None,
        **state_launch(scfg, BV, K), **_walk_args(save, dummy, cu, order, ordered))
    return o, ht


def _walk_args(save: Optional[FwdSave], dummy, dummy_i32, order=None, ordered: bool = False,
               save_off: int = 0) -> dict:
    """The walk's FwdSave and walk-order arguments (dummies, SAVE=0 without a save, ORDERED as `_walk_grid` gave).
    save_off: added to the save's first chunk of each sequence (a time piece's offset, in backward chunks)."""
    ords = dict(order=order if ordered else dummy_i32, ORDERED=ordered)
    if save is None:
        return dict(states=dummy, uns=dummy, save_chunk=dummy_i32, save_off=0, SAVE=0, **ords)
    return dict(states=save.states, uns=save.uns, save_chunk=save.tables[3], save_off=save_off, SAVE=save.bt // BT,
                **ords)


def _prep(ins, gate, flags, scale, ctok, cend, NC, pcfg, fixed=None, out=None):
    """Run the prep kernel; returns the intermediates (qg, kd, w, u, aqk, eg). pcfg: its validated config;
    fixed = (T, chunks per sequence[, first token]) for equal-length sequences (no cu_seqlens; the first token of
    each sequence's chunks: a pipelined time piece), else None (the chunk tables).
    out: the intermediates to write (_alloc_inter; eg may be a row slice: row c = chunk c of the tables)."""
    q, k, v, g, beta = ins
    B, T, H, K = q.shape
    V = v.shape[-1]
    qg, kd, w, u, aqk, eg = out if out is not None else _alloc_inter(q, v, NC)
    a_log, dtb, lb = gate
    if NC > 0:
        c, loop = pcfg["c"], pcfg["loop"]
        n_prog = -(-(-(-NC // c)) // loop)  # programs per head: ceil(ceil(NC / c) / loop)
        t_seq, nct, t_off = (tuple(fixed) + (0,))[:3] if fixed is not None else (1, 1, 0)
        consts, launch = prep_meta(pcfg, H, K, V, varlen=fixed is None, piece=bool(t_off), **flags)
        LAST_LAUNCH["prep"] = kda_intra_wy_fwd_kernel[(H * n_prog,)](
            q, k, v, g, beta, a_log, dtb, qg, kd, w, u, aqk, eg, ctok, cend, NC, n_prog, t_seq, nct, t_off, scale,
            lb, B * T, **consts, **launch)
    return qg, kd, w, u, aqk, eg


def _alloc_inter(q, v, NC: int):
    """Empty intermediates (qg, kd, w [H, B*T, K], u [H, B*T, V], aqk [H, B*T, BT] in the input dtype (fp32 for
    fp32 inputs), eg [NC, H, K] fp32) for _prep."""
    B, T, H, K = q.shape
    dt = _interm_dtype(q)
    qg = torch.empty(H, B * T, K, device=q.device, dtype=dt)
    u = torch.empty(H, B * T, v.shape[-1], device=q.device, dtype=dt)
    aqk = torch.empty(H, B * T, BT, device=q.device, dtype=dt)
    eg = torch.empty(max(NC, 1), H, K, device=q.device, dtype=torch.float32)
    return qg, torch.empty_like(qg), torch.empty_like(qg), u, aqk, eg


@torch.compiler.disable
def _fwd_pipelined(ins, gate, flags, scale, cu_cpu, piece, o, h0, ht, pcfg, kw, fixed_T=None, order=None, save=None):
    """The forward in time pieces of `piece` tokens per sequence: piece p of every sequence is prepped (its own chunk
    tables, its rows of eg), then walked from the state piece p - 1 left (fp32, two ping-pong buffers; CU_STRIDE=2
    start/end pairs). On CUDA the preps run in order on the current stream and the walks on a high-priority side
    stream, each walk waiting only for its own piece's prep, so prep p + 1 overlaps walk p; the current stream waits
    for the last walk before returning. Elsewhere (the interpreter) the same launches run one after another. Writes
    o and ht (if given) in place. kw: the walk's BV and launch options. fixed_T: the sequence length when every
    sequence has it (no cu_seqlens): the prep then finds its chunks without tables. order: the walks' sequence order
    (`_walk_order`; None: grid order). save: a FwdSave with its tables and buffers (piece a multiple of its bt),
    filled piece by piece."""
    q, v = ins[0], ins[2]
    B, T, H, K = q.shape
    V = v.shape[-1]
    starts, ends = cu_cpu[:-1], cu_cpu[1:]
    lens = ends - starts
    N = lens.numel()
    P = -(-int(lens.max()) // piece)

    def build():
        tabs, blobs = [], []
        off = 0
        for p in range(P):  # every table of every piece in one int32 host tensor, one copy to the device
            s = starts + lens.clamp(max=p * piece)
            e = starts + lens.clamp(max=(p + 1) * piece)
            ctok, cend, seq_chunk, NC = _chunk_tables(s, e, BT)
            parts = (torch.stack([s, e], 1).reshape(-1), ctok, cend, seq_chunk)
            tabs.append((off, NC, [x.numel() for x in parts]))
            blobs += parts
            off += NC
        return tabs, off, torch.cat(blobs).to(torch.int32).to(q.device, non_blocking=True)
    if fixed_T is not None:
        tabs, off, dev_tab = _fixed_tables(("pipe", B, T, BT, piece, str(q.device)), build)
    else:
        tabs, off, dev_tab = build()
    inter = _alloc_inter(q, v, off)
    eg_all = inter[5]
    cuda = q.is_cuda
    if cuda:
        main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
    grid, ordered = _walk_grid(N, H, V // kw["BV"], order)
    carry = [torch.empty(N, H, K, V, device=q.device, dtype=torch.float32) for _ in range(2 if P > 2 else P - 1)]
    h_in = h0
    pos = 0
    for p, (eg_off, NC, sizes) in enumerate(tabs):
        pairs, ctok, cend, seq_chunk = torch.split(dev_tab[pos:pos + sum(sizes)], sizes)
        pos += sum(sizes)
        eg = eg_all[eg_off:eg_off + max(NC, 1)]
        fixed = None
        if fixed_T is not None:  # chunks of every sequence's piece [p * piece, min((p + 1) * piece, T))
            fixed = (fixed_T, -(-(min((p + 1) * piece, fixed_T) - p * piece) // BT), p * piece)
        _prep(ins, gate, flags, scale, ctok, cend, NC, pcfg, fixed, out=inter[:5] + (eg,))
        h_out = ht if p == P - 1 else carry[p % 2]
        dummy = eg
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            if cuda:  # everything before it on the current stream (inputs, tables, buffers, this piece's prep)
                side.wait_stream(main)
            LAST_LAUNCH["state"] = kda_state_output_fwd_kernel[grid](
                *inter[:5], eg, o, h_in if h_in is not None else dummy, h_out if h_out is not None else dummy,
                pairs, seq_chunk, B * T, H=H, K=K, V=V, BT=BT, HAS_H0=h_in is not None, STORE_HT=h_out is not None,
                CU_STRIDE=2, **kw, **_walk_args(save, dummy, pairs, order, ordered,
                                                p * piece // save.bt if save is not None else 0))
        h_in = h_out
    if cuda:
        main.wait_stream(side)


def kda_recurrent_fwd(q, k, v, g, beta, scale: float, initial_state=None, output_final_state: bool = False,
                      cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                      A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0, inplace: bool = False,
                      bv: Optional[int] = None):
    """Token recurrence (decode). With inplace=True the fp32 initial_state [N,H,K,V] (contiguous) is updated in place
    and returned as the final state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    if cu_seqlens is None:
        cu = (torch.arange(B + 1, dtype=torch.int32) * T).to(dev)
        N = B
    else:
        cu = cu_seqlens.to(dev, torch.int32)
        N = cu.numel() - 1
    qc, kc, vc, gc, bc = (x.contiguous() for x in (q, k, v, g, beta))
    a_log, dtb, lb = _gate_args(q, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    o = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    if inplace:
        if initial_state is None or initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
            raise ValueError("initial_state: in-place decode needs a contiguous fp32 state [N,H,K,V]")
        h0 = ht = initial_state
    else:
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    BV = bv or min(V, 32)
    dummy = o
    if N > 0:
        kda_recurrent_fwd_kernel[(N, H, V // BV)](
            qc, kc, vc, gc, bc, a_log, dtb, o, h0 if h0 is not None else dummy, ht if ht is not None else dummy, cu,
            float(scale), lb, H=H, K=K, V=V, BV=BV, USE_GATE=bool(use_gate_in_kernel),
            L2NORM=bool(use_qk_l2norm_in_kernel), HAS_H0=h0 is not None, STORE_HT=ht is not None, num_warps=4)
    return o, ht
