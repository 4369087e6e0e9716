"""Pin down KDA Triton backward blow-ups (huge finite gradients, then inf / NaN, with K3_BACKEND=kda:triton) on a GPU.

Found in the twenty-second session (CPU, Triton interpreter with GPU-like tf32 / bf16 rounding): the backward's 64 x 64
inverse T = (I + diag(beta) L)^-1, formed by repeated squaring in one-pass tf32 (matrices INV "pow", then the
default), cancels catastrophically for chunks of nearly collinear keys with weak decay and beta near 1 (a run of one
repeated token after the short conv): |N^8| reaches thousands while T stays O(1), so T and every gradient came back
as garbage (dv relative RMSE 1e4-1e6). The block inversion (INV "blk", now the default) keeps ~1e-2 there. Three
modes:

  synthetic  the collinear-key case (as tests/ops/test_kda_triton_bwd.py case 11) through the backward under several
             launch configs, against the fp64 token-loop reference: the mechanism on the GPU, no training.
  capture    runs `k3 train ...` (arguments after `--`) with every Triton KDA backward call checked against the torch
             chunk path's backward on the same inputs (fp32 recompute: ~2x the backward's time); a call whose
             gradients differ by more than --rel (relative RMSE) or are not finite is saved to --out (inputs, do, dht,
             arguments) and reported; training goes on, --max-saves files at most.
  replay     loads saved calls and reports each launch config's gradients (and the torch path's) against the fp64
             reference: relative RMSE, max abs error, non-finite count per gradient.

Commands (repo root, one H200):
  python benchmarks/kda_blowup_replay.py synthetic
  K3_BACKEND=kda:triton,attnres:torch python benchmarks/kda_blowup_replay.py capture --out /tmp/kda_cap -- \\
      train --preset small --steps 80 --batch-tokens 4096 --stages 2048:1 --lr 2e-3 --param-dtype fp32 --seed 1 \\
      --out /tmp/cap_run --overwrite
  python benchmarks/kda_blowup_replay.py replay /tmp/kda_cap/*.pt
(with K3_KDA_BWD_LAUNCH='{"matrices": {"INV": "pow"}}' the capture should save calls within the first ~30-60 steps,
as the former default did; with the default, none.) Imports on CPU; the synthetic and replay modes also run under
TRITON_INTERPRET=1 (slowly) with --device cpu.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")
LAUNCHES = {"default": None, "inv_pow": {"matrices": {"INV": "pow"}},
            "inv_pow_tf32x3": {"matrices": {"INV": "pow", "INV_PREC": "tf32x3"}},
            "inv_blk_tf32x3": {"matrices": {"INV_PREC": "tf32x3"}},
            "pts16_nofactor": {"matrices": {"PTS": 16, "FACTOR": False}}}


def _stats(got, ref) -> dict:
    """{grad: (relative RMSE, max abs error, reference max abs, non-finite count)} of gradient lists against ref."""
    out = {}
    for n, a, b in zip(GRADS, got, ref):
        if a is None or b is None:
            continue
        a, b = a.double().cpu(), b.double().cpu()
        nf = int((~torch.isfinite(a)).sum())
        err = (a - b).nan_to_num(nan=float("inf"))
        rr = float(err.pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))
        out[n] = (rr, float(err.abs().max()), float(b.abs().max()), nf)
    return out


def _line(name: str, st: dict) -> str:
    return f"{name:>16} " + " ".join(f"{n} {v[0]:.1e}/{v[1]:.1e}{' NONFINITE %d' % v[3] if v[3] else ''}"
                                      for n, v in st.items())


def _bwd_args(call: dict) -> tuple:
    kw = dict(scale=call["scale"], initial_state=call.get("h0"), cu_seqlens=call.get("cu_seqlens"),
              use_qk_l2norm_in_kernel=call["l2"], use_gate_in_kernel=call["gate"], A_log=call.get("A_log"),
              dt_bias=call.get("dt_bias"), lower_bound=call["lower_bound"])
    return (call["q"], call["k"], call["v"], call["g"], call["beta"], call["do"], call.get("dht")), kw


def _reference(call: dict, fp64: bool = True) -> list:
    """Gradients of sum(o do) + sum(S dht) through recurrent_kda in fp64 (fp64=True) or the torch chunk path."""
    from k3.ops.kda import recurrent_kda
    from k3.ops.kda.chunk import chunk_kda_torch
    (q, k, v, g, beta, do, dht), kw = _bwd_args(call)
    h0, al, db = kw.pop("initial_state"), kw.pop("A_log"), kw.pop("dt_bias")
    xs = [None if t is None else (t.double() if fp64 else t).detach().clone().requires_grad_(True)
          for t in (q, k, v, g, beta, h0, al, db)]
    with torch.enable_grad():
        fn = recurrent_kda if fp64 else chunk_kda_torch
        o, S = fn(*xs[:5], initial_state=xs[5], output_final_state=True, A_log=xs[6], dt_bias=xs[7], **kw)
        loss = (o * do.to(o.dtype)).sum()
        if dht is not None:
            loss = loss + (S * dht.to(S.dtype)).sum()
        loss.backward()
    return [None if x is None else x.grad for x in xs]


def _triton(call: dict, launch) -> list:
    from k3.ops.kda.triton import bwd as ob
    args, kw = _bwd_args(call)
    return list(_REAL_BWD[0](*args, launch=launch, **kw) if _REAL_BWD else ob.kda_chunk_bwd(*args, launch=launch, **kw))


_REAL_BWD: list = []  # the unpatched kda_chunk_bwd while capture's wrapper is installed


def _report(call: dict, launches: dict, torch_path: bool = True) -> dict:
    ref = _reference(call)
    res = {}
    for name, launch in launches.items():
        res[name] = _stats(_triton(call, launch), ref)
        print(_line(name, res[name]), flush=True)
    if torch_path:
        res["torch_chunk"] = _stats(_reference(call, fp64=False), ref)
        print(_line("torch_chunk", res["torch_chunk"]), flush=True)
    return res


def collinear_call(T: int = 128, H: int = 2, K: int = 128, V: int = 128, seed: int = 0, device: str = "cuda",
                   dtype=torch.bfloat16, jitter: float = 0.1, f_shift: float = -30.0) -> dict:
    """A run of one repeated token: every key the first one plus `jitter` noise, the gate far below its midpoint
    (g ~ 0: long memory), beta in [0.9, 1); initial state and dht; K3's gate (lower_bound -5) and L2 norm."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    k = r(1, 1, H, K).expand(1, T, H, K) + jitter * r(1, T, H, K)
    call = dict(q=r(1, T, H, K), k=k, v=r(1, T, H, V), g=r(1, T, H, K) * 2 + f_shift,
                beta=0.9 + 0.1 * torch.rand(1, T, H, generator=gen), do=r(1, T, H, V), dht=r(1, H, K, V),
                h0=r(1, H, K, V), A_log=torch.rand(H, generator=gen), dt_bias=r(H * K) * 0.5)
    for n in ("q", "k", "v", "g", "beta", "do"):
        call[n] = call[n].to(dtype)
    call = {n: t.to(device) for n, t in call.items()}
    call.update(scale=K ** -0.5, l2=True, gate=True, lower_bound=-5.0)
    return call


def synthetic(a) -> int:
    if a.device == "cpu":
        from k3.ops.triton_interp import emulate_gpu, fix_interpreter_bf16_dot
        fix_interpreter_bf16_dot()
        emulate_gpu(True)  # tf32 operand rounding and round-to-nearest bf16 casts, as on the GPU
    out = {}
    for jitter in a.jitter:
        print(f"collinear keys, jitter {jitter}, T {a.T} H {a.H} K=V {a.K}", flush=True)
        out[str(jitter)] = _report(collinear_call(a.T, a.H, a.K, a.K, a.seed, a.device, jitter=jitter), LAUNCHES)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def capture(a, train_argv) -> int:
    from k3.ops.kda.triton import bwd as ob
    os.makedirs(a.out, exist_ok=True)
    _REAL_BWD.append(ob.kda_chunk_bwd)
    state = {"calls": 0, "saved": 0}

    def checked(q, k, v, g, beta, do, dht, scale, initial_state=None, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=-5.0, launch=None, saved=None):
        got = _REAL_BWD[0](q, k, v, g, beta, do, dht, scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                           A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, launch=launch, saved=saved)
        state["calls"] += 1
        if state["saved"] >= a.max_saves:
            return got
        call = dict(q=q, k=k, v=v, g=g, beta=beta, do=do, dht=dht, h0=initial_state, cu_seqlens=cu_seqlens,
                    A_log=A_log, dt_bias=dt_bias, scale=float(scale), l2=bool(use_qk_l2norm_in_kernel),
                    gate=bool(use_gate_in_kernel), lower_bound=lower_bound)
        st = _stats(got, _reference(call, fp64=False))
        worst = max(v[0] for v in st.values())
        if worst > a.rel or any(v[3] for v in st.values()):
            path = os.path.join(a.out, f"call_{state['calls']:06d}.pt")
            torch.save({n: (t.detach().cpu() if isinstance(t, torch.Tensor) else t) for n, t in call.items()
                        if t is not None}, path)
            state["saved"] += 1
            print(f"kda_blowup_replay: backward call {state['calls']} off the torch path (worst rel. RMSE "
                  f"{worst:.2e}) -> {path}\n{_line('vs torch', st)}", file=sys.stderr, flush=True)
        return got

    ob.kda_chunk_bwd = checked
    from k3.cli import main
    rc = main(train_argv)
    print(f"kda_blowup_replay: {state['calls']} backward calls checked, {state['saved']} saved to {a.out}",
          file=sys.stderr)
    return rc


def replay(a) -> int:
    launches = dict(LAUNCHES)
    for i, spec in enumerate(a.launch or ()):
        launches[f"arg{i}"] = json.loads(spec)
    if a.device == "cpu":
        from k3.ops.triton_interp import emulate_gpu, fix_interpreter_bf16_dot
        fix_interpreter_bf16_dot()
        emulate_gpu(True)
    for path in a.files:
        call = torch.load(path, map_location=a.device, weights_only=True)  # (tensors and numbers only)
        print(f"{path}: q {tuple(call['q'].shape)} {call['q'].dtype}", flush=True)
        _report(call, launches)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_argv = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_argv = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("synthetic", help="the collinear-key case under several launch configs")
    s.add_argument("--T", type=int, default=256)
    s.add_argument("--H", type=int, default=2)
    s.add_argument("--K", type=int, default=128)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--jitter", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    s.add_argument("--device", default="cuda")
    s.add_argument("--json", default=None)
    c = sub.add_parser("capture", help="k3 train (arguments after --) with every Triton KDA backward checked")
    c.add_argument("--out", required=True)
    c.add_argument("--rel", type=float, default=0.1, help="relative RMSE vs the torch path that saves a call")
    c.add_argument("--max-saves", type=int, default=4)
    r = sub.add_parser("replay", help="saved calls under several launch configs vs the fp64 reference")
    r.add_argument("files", nargs="+")
    r.add_argument("--launch", action="append", help="an extra launch override (JSON), repeatable")
    r.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    if a.mode == "capture":
        if not train_argv:
            ap.error("capture: give the k3 command after --, e.g. -- train --preset small ...")
        return capture(a, train_argv)
    return synthetic(a) if a.mode == "synthetic" else replay(a)


if __name__ == "__main__":
    sys.exit(main())
