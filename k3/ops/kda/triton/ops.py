"""Python side of the KDA Triton kernels (needs triton; imported lazily by the package __init__)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Optional

import torch

from . import kernels as _k

# Forward variants (see the package docstring and benchmarks/kda_triton.py for the design and predictions):
#   c16   two kernels on 16-token chunks (prep, then a sequential pass that also writes o)
#   c64   two kernels on 64-token chunks (prep64, then the same sequential pass with 64-token steps)
#   c64s  three kernels on 64-token chunks (prep64, lean sequential pass storing states and u', parallel output)
#   c64f  one kernel per (sequence, head): prep64 into an L2-resident scratch + the 64-token state step
#   c16p  c16 with the faster prep kernel kda_prep16p_fwd_kernel (same intermediates, same sequential pass)
FWD_VARIANTS = ("c16", "c64", "c64s", "c64f", "c16p")
DEFAULT_FWD = "c16p"  # measured fastest on the H200 (2026-11-30, third session); K3_KDA_TRITON_FWD overrides
ENV_FWD = "K3_KDA_TRITON_FWD"

BT = 16   # chunk (= tile) length of c16: exp(+-cumsum) inside a tile stays within fp32 range for g >= -10
REF = 7   # reference row inside a tile: factored exponents are at most max(REF, BT-1-REF) * |g|_max
BT64 = 64  # chunk of the c64* variants (four 16-row tiles, same reference row)
N_SM = 132  # H200; only used to size the value blocks of the sequential passes

# Prep of "c16p" (kda_prep16p_fwd_kernel); kda_chunk_fwd(prep_cfg=...) overrides any of these keys:
#   c          chunks (of one head) per tile, batched 3-D dots; power of two
#   loop       tiles per program (a loop inside the program)
#   prefetch   load the next tile's inputs before computing the current one (only matters with loop > 1)
#   num_warps, num_stages   launch options of the prep kernel
#   inv        unit-lower inverse: "blk" (recursive 2x2 blocks, tf32), "blkn" (+ Newton step, tf32x3 residual),
#              "ieee" (the old repeated squaring with fp32 FMA dots)
#   qk         precision of the Aqk / Akk dots: "tf32" (as c16), "tf32x3" or "bf16"
#   head_fast  grid order: heads fastest (programs running together read whole token rows of all heads)
#   kb         0: whole [16, K] tiles; else K block width (a power of two < K): two passes over K blocks (Aqk/Akk and
#              norms, then qg, kd, W with gate and cumsum recomputed), U over value blocks of min(kb, V): about a
#              quarter of the registers at kb = 32, for twice the gate work and q/k/g reloads from L2
#   maxnreg    None, or a register cap per thread for ptxas (more resident programs, maybe spills)
# Default = the best of the sweep on static grounds only (sm_90 compile on a CPU: 128 registers with 240 B spilled,
# 8 programs / 16 warps per SM vs the old prep's 2 / 8, 6,080 vs 10,144 warp-instructions per chunk), before any GPU
# measurement: predicted 4.9 ms (3.5-7) for the prep at B8 T8K H96 D128 bf16 (c16's prep: 12.4 ms), 9.5 ms for the
# c16p forward. Per-option predictions: benchmarks/kda_triton.py PREP16P_SWEEP (`--static` prints the counts).
# Measured on the H200 (third session, benchmarks/RESULTS.md): the register cap of that static choice made ptxas spill
# 212 B per thread and the prep ran at 13.8 ms; without the cap ("c1_w2", 254 registers, no spills) it runs at
# 6.40 ms, the fastest of the 19 option sets, so the default is now c1_w2.
PREP16P_DEFAULT = dict(c=1, loop=1, prefetch=False, num_warps=2, num_stages=1, inv="blk", qk="tf32",
                       head_fast=True, kb=0, maxnreg=None)
PREP16P_INV = ("blk", "blkn", "ieee")
PREP16P_QK = ("tf32", "tf32x3", "bf16")
# Sequential pass of c16 / c16p / c64 (kda_chunk_fwd(state_cfg=...) overrides any of these keys; None = heuristic):
#   kernel     "base": kda_state_fwd_kernel (the measured one); "v2": kda_state16_fwd_kernel with the options below
#   bv         value columns per program (power of two >= 16); None: _pick_bv / _pick_bv64
#   num_warps, num_stages   launch options (None: 4 and 2; "v2" with prefetch: num_stages 1)
#   ch         "v2": chunks per loop iteration (1 or 2)
#   prefetch   "v2": load the next iteration's tiles into registers before this iteration's dots
#   out_late   "v2": issue the output dots after the state update (they are not on the state chain)
#   fold       "v2": o = (qg - Aqk W) S + Aqk U (output off the u' chain; one more 16x16xK dot per chunk)
#   maxnreg    None, or a register cap per thread for ptxas (8 warps at BV 128 take 234 registers: 1 program per SM)
#   pipe       time pieces (c16 / c16p / c64): 0 = off; a token count (multiple of the chunk) = run the prep of
#              piece p + 1 on the current stream while the sequential pass walks piece p of every sequence on a
#              high-priority side stream (state carried between pieces in fp32, so the result is the unpiped one);
#              None = pipe_tokens' rule (on above PIPE_AUTO tokens).
#   lpt        varlen walks (base kernel), pipelined or not: None / True = the sequences longest first in a
#              sequence-major grid (`_walk_order`, `kernels._walk_ids`), False = grid order; same arithmetic. Until the
#              seventeenth session this sorted the sequences inside each head's group of the (N, H, NV) grid only, so
#              the last wave still started long documents' walks (measured: no effect, eighth session).
#   (pipe)     Long sequences give the sequential pass few programs (B1 T128K H96: 384 at BV 32 for 132 SMs) and
#              it ran after the memory-bound prep (12.8 + ~11 ms there); overlapping them hides the shorter one.
# The old kwargs bv / num_warps / num_stages of kda_chunk_fwd still work (state_cfg wins where both are given).
# Predictions per option set: benchmarks/kda_triton.py STATE_SWEEP (`--static --state` prints the counts).
# c16 / c16p with the base kernel and num_stages None run 3 stages (BASE16_STAGES): "base_s3", measured best of 18
# option sets at B8 T8K on the H200 (third session: sequential pass 3.94 vs 4.58 ms at 2 stages).
BASE16_STAGES = 3
STATE_CFG_DEFAULT = dict(kernel="base", bv=None, num_warps=None, num_stages=None, ch=1, prefetch=False,
                         out_late=False, fold=False, maxnreg=None, pipe=None, lpt=None)
# pipe=None: pieces of PIPE_AUTO tokens when the longest sequence spans at least two of them and there are at most
# PIPE_MAX_PROGS (sequence, head) pairs, with value blocks of at least PIPE_MIN_BV.
# Measured on the H200 (eighth session, benchmarks/RESULTS.md; H96 D128 bf16, whole forward, same process):
# B1 T128K 23.81 -> 21.45 ms (8K pieces, BV 64; BV 32 26.4: its 384 walk programs crowd out the prep), B2 T32K
# 11.96 -> 11.13 (4K pieces 11.02), varlen 64K / 12 documents 12.52 -> 11.97; B8 T8K is one piece (10.33; 2K pieces
# 10.57: its 768 walk programs fill the GPU, nothing to overlap).
PIPE_AUTO = 8192
# Value block cap of a sequential pass that saves the backward's states (FwdSave; unless bv is given): at BV 128 on 4
# warps (the pick from 264 (sequence, head) pairs, e.g. the varlen 12-document 64K batch at H96) the stores of the
# [128, 128] state spill (sm_90: 144 -> 456 B per thread); measured there (seventeenth session, H200, fwd+bwd): BV 128
# 78.90 ms (forward 18.00), BV 64 75.46 (14.67), 8 warps at BV 128 75.57 (15.14); not saving 81.28 (12.77)
SAVE_MAX_BV = 64
# PIPE_MAX_PROGS: 1536 until the seventeenth session; with the varlen walks longest first (`_walk_order`) the unpiped
# forward of the varlen 12-document 64K batch (1,152 pairs) took 11.07 ms against 12.25 in 8K pieces (walk 3.76 vs
# 4.94 ms: ordered, the walk fills the GPU by itself), so pieces are for at most 384 pairs (measured gains at 96 and
# 192; B8 T8K's 768 lost in 2K pieces, eighth session)
PIPE_MAX_PROGS = 384
PIPE_MIN_BV = 64
LAST_STATE = {}  # benchmarks: the last launched sequential kernel's compiled handle by variant name
LAST_PREP = {}  # benchmarks: the last launched prep kernel's compiled handle (n_regs, n_spills) by variant name


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


def prep16p_config(prep_cfg: Optional[dict] = None) -> dict:
    """PREP16P_DEFAULT updated with prep_cfg, validated."""
    cfg = _merged("prep_cfg", PREP16P_DEFAULT, prep_cfg)
    for key in ("c", "loop", "num_warps"):
        n = cfg[key]
        if not (isinstance(n, int) and 1 <= n <= 64 and n & (n - 1) == 0):
            raise ValueError(f"prep_cfg[{key!r}]: expected a power of two in [1, 64], got {n!r}")
    if cfg["inv"] not in PREP16P_INV:
        raise ValueError(f"prep_cfg['inv']: expected one of {PREP16P_INV}, got {cfg['inv']!r}")
    if cfg["qk"] not in PREP16P_QK:
        raise ValueError(f"prep_cfg['qk']: expected one of {PREP16P_QK}, got {cfg['qk']!r}")
    kb = cfg["kb"]
    if not (isinstance(kb, int) and (kb == 0 or (16 <= kb and kb & (kb - 1) == 0))):
        raise ValueError(f"prep_cfg['kb']: expected 0 or a power of two >= 16, got {kb!r}")
    _check_maxnreg("prep_cfg", cfg)
    return cfg


def prep16p_meta(pcfg: dict, H: int, K: int, V: int, varlen: bool, USE_GATE: bool, L2NORM: bool,
                 piece: bool = False):
    """(constexpr arguments, launch options) of kda_prep16p_fwd_kernel for a validated config. piece: equal-length
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


ENV_STATE_CFG = "K3_KDA_STATE_CFG"  # JSON: state_cfg keys for every call (a call's state_cfg wins where both give one)


def state_config(state_cfg: Optional[dict] = None) -> dict:
    """STATE_CFG_DEFAULT updated with $K3_KDA_STATE_CFG, then with state_cfg, validated."""
    env = os.environ.get(ENV_STATE_CFG, "").strip()
    if env:
        try:
            env_cfg = json.loads(env)
        except ValueError as e:
            raise ValueError(f"{ENV_STATE_CFG}: not JSON ({e}): {env!r}") from None
        if not isinstance(env_cfg, dict):
            raise ValueError(f"{ENV_STATE_CFG}: expected a JSON object of state_cfg keys, got {env!r}")
        state_cfg = {**_merged(ENV_STATE_CFG, STATE_CFG_DEFAULT, env_cfg), **(state_cfg or {})}
    cfg = _merged("state_cfg", STATE_CFG_DEFAULT, state_cfg)
    if cfg["kernel"] not in ("base", "v2"):
        raise ValueError(f"state_cfg['kernel']: expected 'base' or 'v2', got {cfg['kernel']!r}")
    if cfg["ch"] not in (1, 2):
        raise ValueError(f"state_cfg['ch']: expected 1 or 2, got {cfg['ch']!r}")
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
    if cfg["kernel"] == "base" and (cfg["ch"] != 1 or cfg["prefetch"] or cfg["out_late"] or cfg["fold"]):
        raise ValueError("state_cfg: ch / prefetch / out_late / fold need kernel='v2'")
    return cfg


# Register cap of the base sequential pass at value blocks of at most 32 on 4 warps (no maxnreg in the config): it
# holds 165 registers (3 programs per SM) until it also stores the final state or loads an initial one, which took
# 176-191 (2 per SM: B1 T8K H96's 384 programs then ran in two waves, 1.14 ms instead of 0.68 in the training
# forward, which always stored the final state; seventeenth session). Capped: 168, no spill in the loop (sm_90).
BASE_SMALL_BV_MAXNREG = 168


def state_meta(scfg: dict, bv: Optional[int] = None, k: Optional[int] = None):
    """(kernel, extra constexpr arguments, launch options) of the sequential pass for a validated config; bv and k:
    the value block and key width it runs at (the base kernel's register cap at K <= 128 and value blocks <= 32:
    BASE_SMALL_BV_MAXNREG)."""
    nw = scfg["num_warps"] or 4
    launch = {} if scfg["maxnreg"] is None else dict(maxnreg=scfg["maxnreg"])
    if scfg["kernel"] == "base" and not launch and nw == 4 and bv is not None and bv <= 32 and k is not None \
            and k <= 128:
        launch = dict(maxnreg=BASE_SMALL_BV_MAXNREG)
    if scfg["kernel"] == "base":
        return _k.kda_state_fwd_kernel, {}, dict(launch, num_warps=nw, num_stages=scfg["num_stages"] or 2)
    ns = scfg["num_stages"] or (1 if scfg["prefetch"] else 2)
    consts = dict(CH=scfg["ch"], PREFETCH=bool(scfg["prefetch"]), OUT_LATE=bool(scfg["out_late"]),
                  FOLD=bool(scfg["fold"]))
    return _k.kda_state16_fwd_kernel, consts, dict(launch, num_warps=nw, num_stages=ns)


def kernel_info(variant: str, which: str = "prep") -> dict:
    """Registers, spills and shared memory of the last prep ("prep") or sequential ("state") kernel launched for
    `variant` (GPU only; {} else)."""
    ck = (LAST_PREP if which == "prep" else LAST_STATE).get(variant)
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


def fwd_variant(variant: Optional[str] = None) -> str:
    """The forward variant to run: the argument, else $K3_KDA_TRITON_FWD, else DEFAULT_FWD."""
    name = (variant or os.environ.get(ENV_FWD, "").strip() or DEFAULT_FWD).lower()
    if name not in FWD_VARIANTS:
        raise ValueError(f"variant: expected one of {FWD_VARIANTS} (argument or ${ENV_FWD}), got {name!r}")
    return name


def _cu_cpu(B: int, T: int, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """Sequence boundaries [N+1] int64 on the CPU (B rows of T tokens without cu_seqlens)."""
    if cu_seqlens is None:
        return torch.arange(B + 1, dtype=torch.int64) * T
    return cu_seqlens.detach().to("cpu", torch.int64)


def _chunk_tables(starts: torch.Tensor, ends: torch.Tensor, bt: int):
    """(chunk_tok [NC], chunk_end [NC], seq_chunk [N+1], NC), int64 on the CPU, for the token ranges
    [starts[n], ends[n]) cut into bt-token chunks from each start: chunk c covers tokens
    [chunk_tok[c], min(chunk_tok[c] + bt, chunk_end[c])), range-major order; seq_chunk[n] = first chunk of range n."""
    nch = (ends - starts + bt - 1) // bt
    N = starts.numel()
    seq_chunk = torch.zeros(N + 1, dtype=torch.int64)
    seq_chunk[1:] = torch.cumsum(nch, 0)
    NC = int(seq_chunk[-1])
    seq_of = torch.repeat_interleave(torch.arange(N), nch)
    j = torch.arange(NC) - seq_chunk[:-1][seq_of]
    return starts[seq_of] + j * bt, ends[seq_of], seq_chunk, NC


# device chunk tables of fixed-length batches (no cu_seqlens), per (kind, B, T, chunk, ..., device): built on the host
# and copied once per shape instead of on every call (a training step repeats the same shapes in every KDA layer's
# forward, recomputed forward and backward; a copy from pageable host memory may wait for the stream)
_FIXED_TABLES: "dict[tuple, tuple]" = {}
_FIXED_TABLES_MAX = 64


def _fixed_tables(key: tuple, build):
    """build() for a fixed-length batch's tables, cached under key (at most _FIXED_TABLES_MAX shapes, oldest out)."""
    hit = _FIXED_TABLES.get(key)
    if hit is None:
        hit = build()
        if len(_FIXED_TABLES) >= _FIXED_TABLES_MAX:
            _FIXED_TABLES.pop(next(iter(_FIXED_TABLES)))
        _FIXED_TABLES[key] = hit
    return hit


def _seq_tables(B: int, T: int, cu_seqlens: Optional[torch.Tensor], device, bt: int = BT, cu_cpu=None):
    """(cu int32 [N+1] on device, chunk_tok/chunk_end int32 [NC], seq_chunk int32 [N+1], N, NC) for bt-token
    chunks: chunk c covers tokens [chunk_tok[c], min(chunk_tok[c] + bt, chunk_end[c])), sequence-major order.
    cu_cpu: _cu_cpu(B, T, cu_seqlens) when the caller has it. Without cu_seqlens: built once per (B, T, bt, device)."""
    def build():
        cpu = _cu_cpu(B, T, cu_seqlens) if cu_cpu is None else cu_cpu
        chunk_tok, chunk_end, seq_chunk, NC = _chunk_tables(cpu[:-1], cpu[1:], bt)
        to = lambda x: x.to(torch.int32).to(device, non_blocking=True)
        return to(cpu), to(chunk_tok), to(chunk_end), to(seq_chunk), cpu.numel() - 1, NC
    if cu_seqlens is None:
        return _fixed_tables(("seq", B, T, bt, str(torch.device(device))), build)
    return build()


def pipe_tokens(scfg: dict, variant: str, max_len: int, n_pairs: int, bt: int = BT) -> int:
    """Piece length of the pipelined forward (0 = not pipelined) for a validated state config: scfg['pipe'] when
    given, else PIPE_AUTO when there are at most PIPE_MAX_PROGS (sequence, head) pairs; 0 unless the longest
    sequence spans at least two pieces and the variant has a separate prep (c16, c16p, c64)."""
    if variant not in ("c16", "c16p", "c64"):
        return 0
    piece = scfg["pipe"]
    if piece is None:
        piece = PIPE_AUTO if n_pairs <= PIPE_MAX_PROGS else 0
    if piece and piece % bt:
        raise ValueError(f"state_cfg['pipe']: {piece} tokens is not a multiple of the {variant} chunk ({bt})")
    return piece if piece and max_len > piece else 0


_SIDE_STREAMS = {}


def _side_stream(device) -> "torch.cuda.Stream":
    """A high-priority stream per device for the pipelined forward's sequential walks: when one is launched while
    a prep grid occupies the SMs, the block scheduler gives the walk's programs the next free slots."""
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
    """Value-column block of the c16 sequential pass: split V when there are too few (sequence, head) programs.

    H200, B8 T8K H96 D128 bf16: BV=128 17.2 ms, 64 18.4 ms, 32 21.2 ms for the whole forward (fewer re-reads of
    the K-wide intermediates win while there are >= 2 programs per SM); smaller N*H is unmeasured."""
    bv = min(V, 128)
    while bv > 16 and nprog * (V // bv) < 264:
        bv //= 2
    return bv


def _pick_bv64(V: int, nprog: int) -> int:
    """Value block of the 64-token sequential passes (c64, c64s): at most 64 (the [64, BV] fp32 accumulators and
    the [K, BV] state share one warpgroup's registers), halved down to 16 until there are >= 3 programs per SM
    (a step is a chain of two dependent wgmma's: latency is hidden by other programs). Unmeasured guess."""
    bv = min(V, 64)
    while bv > 16 and nprog * (V // bv) < 3 * N_SM:
        bv //= 2
    return bv


@dataclasses.dataclass
class FwdSave:
    """What a training forward's sequential pass stores for the backward (`kda_chunk_fwd(save=...)`): the state at
    the start of every bt-token chunk (the backward's chunks) and u' = U - W S at every token, which the backward's
    states pass would otherwise recompute. Asked for with bt and the two dtypes; the forward fills tables (the
    backward's chunk tables: _seq_tables at bt), states [C, H, K, V], uns [H, B*T, V] and sets filled, or leaves
    filled False where its pass cannot save (variant, state kernel, a time piece that is not a multiple of bt)."""
    bt: int
    states_dtype: torch.dtype
    uns_dtype: torch.dtype
    tables: Optional[tuple] = None
    states: Optional[torch.Tensor] = None
    uns: Optional[torch.Tensor] = None
    order: Optional[torch.Tensor] = None  # the walks' sequence order (`_walk_order`), for the backward's passes
    filled: bool = False


def kda_chunk_fwd(q, k, v, g, beta, scale: float, initial_state=None, output_final_state: bool = False,
                  cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                  A_log=None, dt_bias=None, lower_bound: Optional[float] = -5.0, variant: Optional[str] = None,
                  bv: Optional[int] = None, num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                  prep_warps: Optional[int] = None, prec: str = "tf32", prep_only: bool = False,
                  prep_cfg: Optional[dict] = None, state_cfg: Optional[dict] = None, save: Optional[FwdSave] = None):
    """Chunked forward: (o [B,T,H,V] v.dtype, final state [N,H,K,V] fp32 or None). Inputs validated/supported.

    variant: one of FWD_VARIANTS (default: fwd_variant()). Tuning knobs (None = heuristic): bv, num_warps and
    num_stages of the sequential kernel (c64f: of the fused kernel; bv is ignored there, its num_stages is
    always 1), prep_warps of the parallel prep kernel. prec: tl.dot input precision of the c64* prep products
    ("tf32", "tf32x3" or "ieee"; the 16x16 diagonal-block inverses are always "ieee"). prep_cfg: options of the
    c16p prep (see PREP16P_DEFAULT; ignored by the other variants). state_cfg: options of the sequential pass of
    c16 / c16p / c64 (see STATE_CFG_DEFAULT; its bv / num_warps / num_stages win over the plain kwargs; ignored by
    c64s / c64f). prep_only (benchmarks): run the parallel prep kernel only and return (None, None). save: a FwdSave
    the sequential pass fills for the backward (c16 / c16p / c64 with the base kernel; see FwdSave)."""
    name = fwd_variant(variant)
    scfg = state_config(state_cfg)
    bv = scfg["bv"] if scfg["bv"] is not None else bv
    num_warps = scfg["num_warps"] or num_warps
    num_stages = scfg["num_stages"] or num_stages
    if num_stages is None and name in ("c16", "c16p") and scfg["kernel"] == "base":
        num_stages = BASE16_STAGES
    if bv is not None and (bv < 16 or bv & (bv - 1)):
        raise ValueError(f"bv: expected a power of two >= 16, got {bv!r}")
    bv = None if bv is None else min(bv, v.shape[-1])
    if prec not in ("tf32", "tf32x3", "ieee"):
        raise ValueError(f"prec: expected 'tf32', 'tf32x3' or 'ieee', got {prec!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if name == "c64f" and prep_only:
        raise ValueError("prep_only: c64f has no separate prep kernel")
    pcfg = prep16p_config(prep_cfg) if name == "c16p" else None
    bt = BT if name in ("c16", "c16p") else BT64
    cu_cpu = _cu_cpu(B, T, cu_seqlens)
    N = cu_cpu.numel() - 1
    max_len = int((cu_cpu[1:] - cu_cpu[:-1]).max()) if N else 0
    ins = tuple(x.contiguous() for x in (q, k, v, g, beta))
    gate = _gate_args(q, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    flags = dict(USE_GATE=bool(use_gate_in_kernel), L2NORM=bool(use_qk_l2norm_in_kernel))
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    ht = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    piece = 0 if prep_only or name == "c64f" else pipe_tokens(scfg, name, max_len, N * H, bt)
    walks = name in ("c16", "c16p", "c64") and scfg["kernel"] == "base"  # (the ordered sequential kernel)
    if save is not None and (not walks or prep_only or save.bt % bt or piece % save.bt):
        save = None  # (this pass cannot store the backward's chunk states: the backward recomputes them)
    order = _walk_order(cu_cpu, q.device, scfg["lpt"]) if cu_seqlens is not None and walks else None
    if save is not None:
        save.order = order
        save.tables = _seq_tables(B, T, cu_seqlens, q.device, save.bt, cu_cpu)
        save.states = torch.empty(max(save.tables[5], 1), H, K, V, device=q.device, dtype=save.states_dtype)
        save.uns = torch.empty(H, B * T, V, device=q.device, dtype=save.uns_dtype)
        save.filled = True
    if piece:
        BV = bv or max(_pick_bv64(V, N * H) if name == "c64" else _pick_bv(V, N * H), min(V, PIPE_MIN_BV))
        BV = BV if bv or save is None else min(BV, SAVE_MAX_BV)
        kern, consts, launch = state_meta(dict(scfg, num_warps=num_warps, num_stages=num_stages), BV, K)
        _fwd_pipelined(name, ins, gate, flags, float(scale), cu_cpu, piece, bt, o, h0, ht, prec, prep_warps, pcfg,
                       kern, dict(consts, BV=BV, **launch), fixed_T=T if cu_seqlens is None else None,
                       order=order, save=save)
        return o, ht
    cu, ctok, cend, seq_chunk, N, NC = _seq_tables(B, T, cu_seqlens, q.device, bt, cu_cpu)
    if name == "c64f":
        _fwd_fused(ins, gate, flags, float(scale), o, h0, ht, cu, N, prec, num_warps)
        return o, ht
    fixed = None if cu_seqlens is not None else (T, (T + BT - 1) // BT)
    inter = _prep(name, ins, gate, flags, float(scale), ctok, cend, NC, prec, prep_warps, pcfg, fixed)
    if prep_only:
        return None, None
    if N == 0:
        return o, ht
    qg, kd, w, u, aqk, eg = inter
    Tt = B * T
    dummy = eg
    state = dict(HAS_H0=h0 is not None, STORE_HT=ht is not None)
    if name in ("c16", "c16p", "c64"):
        BV = bv or (_pick_bv64(V, N * H) if name == "c64" else _pick_bv(V, N * H))
        BV = BV if bv or save is None else min(BV, SAVE_MAX_BV)
        kern, consts, launch = state_meta(dict(scfg, num_warps=num_warps, num_stages=num_stages), BV, K)
        grid, ordered = _walk_grid(N, H, V // BV, order, kern is _k.kda_state_fwd_kernel)
        LAST_STATE[name] = kern[grid](
            qg, kd, w, u, aqk, eg, o, h0 if h0 is not None else dummy, ht if ht is not None else dummy, cu,
            seq_chunk, Tt, H=H, K=K, V=V, BT=bt, BV=BV, CU_STRIDE=1, **state, **consts, **launch,
            **_walk_args(kern, save, bt, dummy, cu, order, ordered))
        return o, ht
    # c64s: lean sequential pass (states + u'), then the chunk-parallel output
    BV = bv or _pick_bv64(V, N * H)
    hs = torch.empty(max(NC, 1), H, K, V, device=q.device, dtype=w.dtype)
    vn = torch.empty(H, Tt, V, device=q.device, dtype=w.dtype)
    _k.kda_state_h_kernel[(N, H, V // BV)](
        kd, w, u, eg, hs, vn, h0 if h0 is not None else dummy, ht if ht is not None else dummy, cu, seq_chunk, Tt,
        H=H, K=K, V=V, BT=bt, BV=BV, **state, num_warps=num_warps or 4, num_stages=num_stages or 2)
    BVo = min(V, 128)
    if NC > 0:
        _k.kda_out_kernel[(NC, H, V // BVo)](qg, aqk, hs, vn, o, ctok, cend, Tt, H=H, K=K, V=V, BT=bt, BV=BVo,
                                             num_warps=4, num_stages=2)
    return o, ht


def _walk_order(cu_cpu: torch.Tensor, device, lpt: Optional[bool] = None) -> Optional[torch.Tensor]:
    """The sequential passes' sequence order (int32 on device): longest first (stable), or None (grid order) when
    lpt is False, or there is one sequence, or all have the same length (fixed batches). lpt None = on.
    Longest-first matters at varlen: with every sequence's walks in launch order by sequence, the last wave may
    start a long document's walks (list scheduling of the varlen 12-document 64K batch at H96 on 264 program slots:
    31,261 token-steps in grid order, 24,075 longest first, against 24,576 for B8 T8K's equal rows)."""
    lens = cu_cpu[1:] - cu_cpu[:-1]
    if lpt is False or lens.numel() < 2 or bool((lens == lens[0]).all()):
        return None
    return torch.sort(lens, descending=True, stable=True).indices.to(torch.int32).to(device, non_blocking=True)


def _walk_grid(N: int, H: int, NV: int, order: Optional[torch.Tensor], ordered: bool = True):
    """(grid, ORDERED) of a sequential pass: sequence-major in `order` (kernels with ORDERED, `kernels._walk_ids`)
    where the caller allows it and there is an order (varlen with unequal lengths: `_walk_order`), else (N, H, NV)
    in grid order."""
    if ordered and order is not None:
        return (H * NV, N), True
    return (N, H, NV), False


def _walk_args(kern, save: Optional[FwdSave], bt: int, dummy, dummy_i32, order=None, ordered: bool = False,
               save_off: int = 0) -> dict:
    """The base sequential kernel's FwdSave and walk-order arguments (dummies, SAVE=0 without a save, ORDERED as
    `_walk_grid` gave; none for the "v2" kernel, which has no such arguments). save_off: added to the save's first
    chunk of each sequence (a time piece's offset, in backward chunks)."""
    if kern is not _k.kda_state_fwd_kernel:
        return {}
    ords = dict(order=order if ordered else dummy_i32, ORDERED=ordered)
    if save is None:
        return dict(states=dummy, uns=dummy, save_chunk=dummy_i32, save_off=0, SAVE=0, **ords)
    return dict(states=save.states, uns=save.uns, save_chunk=save.tables[3], save_off=save_off, SAVE=save.bt // bt,
                **ords)


def _prep(name, ins, gate, flags, scale, ctok, cend, NC, prec, prep_warps, pcfg=None, fixed=None, out=None):
    """Run the chunk-parallel prep kernel; returns the intermediates (qg, kd, w, u, aqk, eg). c16p: pcfg is its
    validated config; fixed = (T, chunks per sequence[, first token]) for equal-length sequences (no cu_seqlens;
    the first token of each sequence's chunks: a pipelined time piece), else None (the chunk tables).
    out: the intermediates to write (_alloc_inter; eg may be a row slice: row c = chunk c of the tables)."""
    q, k, v, g, beta = ins
    B, T, H, K = q.shape
    V = v.shape[-1]
    Tt = B * T
    bt = BT if name in ("c16", "c16p") else BT64
    qg, kd, w, u, aqk, eg = out if out is not None else _alloc_inter(q, v, NC, bt)
    a_log, dtb, lb = gate
    if NC > 0:
        if name == "c16":
            ck = _k.kda_prep_fwd_kernel[(NC, H)](
                q, k, v, g, beta, a_log, dtb, qg, kd, w, u, aqk, eg, ctok, cend, scale, lb, Tt,
                H=H, K=K, V=V, BT=BT, REF=REF, **flags, num_warps=prep_warps or 4)
        elif name == "c16p":
            c, loop = pcfg["c"], pcfg["loop"]
            n_prog = -(-(-(-NC // c)) // loop)  # programs per head: ceil(ceil(NC / c) / loop)
            t_seq, nct, t_off = (tuple(fixed) + (0,))[:3] if fixed is not None else (1, 1, 0)
            consts, launch = prep16p_meta(pcfg, H, K, V, varlen=fixed is None, piece=bool(t_off), **flags)
            if prep_warps:
                launch["num_warps"] = prep_warps
            ck = _k.kda_prep16p_fwd_kernel[(H * n_prog,)](
                q, k, v, g, beta, a_log, dtb, qg, kd, w, u, aqk, eg, ctok, cend, NC, n_prog, t_seq, nct, t_off, scale,
                lb, Tt, **consts, **launch)
        else:
            ck = _k.kda_prep64_fwd_kernel[(NC, H)](
                q, k, v, g, beta, a_log, dtb, qg, kd, w, u, aqk, eg, ctok, cend, scale, lb, Tt,
                H=H, K=K, V=V, **flags, PREC=prec, INV_PREC="ieee", num_warps=prep_warps or 8)
        LAST_PREP[name] = ck
    return qg, kd, w, u, aqk, eg


def _alloc_inter(q, v, NC: int, bt: int):
    """Empty intermediates (qg, kd, w [H, B*T, K], u [H, B*T, V], aqk [H, B*T, bt] in the input dtype (fp32 for
    fp32 inputs), eg [NC, H, K] fp32) for _prep."""
    B, T, H, K = q.shape
    dt = _interm_dtype(q)
    qg = torch.empty(H, B * T, K, device=q.device, dtype=dt)
    u = torch.empty(H, B * T, v.shape[-1], device=q.device, dtype=dt)
    aqk = torch.empty(H, B * T, bt, device=q.device, dtype=dt)
    eg = torch.empty(max(NC, 1), H, K, device=q.device, dtype=torch.float32)
    return qg, torch.empty_like(qg), torch.empty_like(qg), u, aqk, eg


@torch.compiler.disable
def _fwd_pipelined(name, ins, gate, flags, scale, cu_cpu, piece, bt, o, h0, ht, prec, prep_warps, pcfg, kern, kw,
                   fixed_T=None, order=None, save=None):
    """The c16 / c16p / c64 forward in time pieces of `piece` tokens per sequence: piece p of every sequence is
    prepped (its own chunk tables, its rows of eg), then walked by the sequential kernel from the state piece p - 1
    left (fp32, two ping-pong buffers; CU_STRIDE=2 start/end pairs). On CUDA the preps run in order on the current
    stream and the walks on a high-priority side stream, each walk waiting only for its own piece's prep, so prep
    p + 1 overlaps walk p; the current stream waits for the last walk before returning. Elsewhere (the
    interpreter) the same launches run one after another. Writes o and ht (if given) in place. fixed_T: the
    sequence length when every sequence has it (no cu_seqlens): c16p's prep then finds its chunks without tables.
    order: the walks' sequence order (`_walk_order`; None: grid order). save: a FwdSave with its tables and buffers
    (piece a multiple of its bt), filled piece by piece."""
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
            ctok, cend, seq_chunk, NC = _chunk_tables(s, e, bt)
            parts = (torch.stack([s, e], 1).reshape(-1), ctok, cend, seq_chunk)
            tabs.append((off, NC, [x.numel() for x in parts]))
            blobs += parts
            off += NC
        return tabs, off, torch.cat(blobs).to(torch.int32).to(q.device, non_blocking=True)
    if fixed_T is not None:
        tabs, off, dev_tab = _fixed_tables(("pipe", B, T, bt, piece, str(q.device)), build)
    else:
        tabs, off, dev_tab = build()
    inter = _alloc_inter(q, v, off, bt)
    eg_all = inter[5]
    cuda = q.is_cuda
    if cuda:
        main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
    grid, ordered = _walk_grid(N, H, V // kw["BV"], order, kern is _k.kda_state_fwd_kernel)
    carry = [torch.empty(N, H, K, V, device=q.device, dtype=torch.float32) for _ in range(2 if P > 2 else P - 1)]
    h_in = h0
    pos = 0
    for p, (eg_off, NC, sizes) in enumerate(tabs):
        pairs, ctok, cend, seq_chunk = torch.split(dev_tab[pos:pos + sum(sizes)], sizes)
        pos += sum(sizes)
        eg = eg_all[eg_off:eg_off + max(NC, 1)]
        fixed = None
        if fixed_T is not None:  # chunks of every sequence's piece [p * piece, min((p + 1) * piece, T))
            fixed = (fixed_T, -(-(min((p + 1) * piece, fixed_T) - p * piece) // bt), p * piece)
        _prep(name, ins, gate, flags, scale, ctok, cend, NC, prec, prep_warps, pcfg, fixed, out=inter[:5] + (eg,))
        h_out = ht if p == P - 1 else carry[p % 2]
        dummy = eg
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            if cuda:  # everything before it on the current stream (inputs, tables, buffers, this piece's prep)
                side.wait_stream(main)
            LAST_STATE[name] = kern[grid](
                *inter[:5], eg, o, h_in if h_in is not None else dummy, h_out if h_out is not None else dummy,
                pairs, seq_chunk, B * T, H=H, K=K, V=V, BT=bt, HAS_H0=h_in is not None, STORE_HT=h_out is not None,
                CU_STRIDE=2, **kw, **_walk_args(kern, save, bt, dummy, pairs, order, ordered,
                                                p * piece // save.bt if save is not None else 0))
        h_in = h_out
    if cuda:
        main.wait_stream(side)


def _fwd_fused(ins, gate, flags, scale, o, h0, ht, cu, N, prec, num_warps):
    """c64f: one program per (sequence, head) with a private [64, 3K + V + 64] scratch (input dtype)."""
    q, k, v, g, beta = ins
    B, T, H, K = q.shape
    V = v.shape[-1]
    if N == 0:
        return
    scr = torch.empty(N * H * 64 * (3 * K + V + 64), device=q.device, dtype=_interm_dtype(q))
    a_log, dtb, lb = gate
    dummy = scr
    _k.kda_fused64_fwd_kernel[(N, H)](
        q, k, v, g, beta, a_log, dtb, o, h0 if h0 is not None else dummy, ht if ht is not None else dummy, cu, scr,
        scale, lb, H=H, K=K, V=V, **flags, PREC=prec, INV_PREC="ieee", HAS_H0=h0 is not None,
        STORE_HT=ht is not None, num_warps=num_warps or 8, num_stages=1)


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
        _k.kda_recurrent_fwd_kernel[(N, H, V // BV)](
            qc, kc, vc, gc, bc, a_log, dtb, o, h0 if h0 is not None else dummy, ht if ht is not None else dummy, cu,
            float(scale), lb, H=H, K=K, V=V, BV=BV, USE_GATE=bool(use_gate_in_kernel),
            L2NORM=bool(use_qk_l2norm_in_kernel), HAS_H0=h0 is not None, STORE_HT=ht is not None, num_warps=4)
    return o, ht
