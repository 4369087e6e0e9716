"""Split-K Triton absorbed-MLA decode (k3.ops.mla_decode_triton) on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported, and pytest imports every test module into one process,
so the checks run in one subprocess (this file run as a script, with TRITON_INTERPRET=1) that prints a JSON table;
the tests below read it. Skips cleanly when triton is not installed.

Kernel vs an fp64 reference, row by row: o_lat[n, h] = sum_{t <= lens[n]} softmax_t(q[n, h] . x[n, t]) x[n, t, :C]
with q rounded to the cache dtype (the kernel's dot operand, as the torch path's `bmm_acc`), over ragged lengths
(0: only the new token visible; W - 1: the full window), W not a multiple of the key block, a strided view of a
larger buffer, and NaN written beyond each row's length (never read). End to end: a micro model's StaticDecoder
with mla_kernel="triton" against the torch static path. The interpreter computes dots exactly in fp32, so GPU
precision is checked by benchmarks/mla_decode.py, not here.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 1.5e-2}  # relative RMSE vs the fp64 reference
# the softmax weights enter the second dot rounded to the cache dtype (as in the torch path): bf16 ~4e-3 measured


from k3.ops.triton_interp import fix_interpreter_bf16_dot  # noqa: E402
# bound at import: several test folders have a conftest module, so `conftest` later names whichever loaded last
from conftest import build as _build, micro_config as _micro_config  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/, also in the child
from helpers import interpreted_results, rel_err  # noqa: E402  (relative RMSE = ||a - b|| / ||b||)


def reference(qf, kv, lens, C):
    """fp64, row by row over the visible positions only: q rounded to the cache dtype, as the kernel's dot."""
    out = []
    for n in range(qf.shape[0]):
        x = kv[n, :int(lens[n]) + 1].double()                                  # [t, C + R]
        q = qf[n].to(kv.dtype).double()                                         # [H, C + R]
        out.append(torch.softmax(q @ x.T, -1) @ x[:, :C])
    return torch.stack(out)


def _kernel_checks(res: dict) -> None:
    from k3.ops import mla_decode_triton as mdt
    gen = torch.Generator().manual_seed(0)
    cases = [  # (name, H, C, R, W, dtype, splits, key block)  W = 200, 300: not multiples of the key block
        ("h8_c256_fp32", 8, 256, 32, 300, torch.float32, None, None),
        ("h8_c256_bf16", 8, 256, 32, 300, torch.bfloat16, None, None),
        ("h16_c64_fp32", 16, 64, 16, 200, torch.float32, None, None),
        ("h16_c64_bf16", 16, 64, 16, 200, torch.bfloat16, None, None),
        ("h64_c64_bf16", 64, 64, 16, 200, torch.bfloat16, None, None),
        ("h64_c256_fp32", 64, 256, 32, 200, torch.float32, None, None),
        ("h8_c64_fp16", 8, 64, 16, 300, torch.float16, None, None),
        ("h96_c64_fp32", 96, 64, 16, 200, torch.float32, None, None),  # two head blocks of 64 (the last padded)
        ("h8_c64_split1", 8, 64, 16, 300, torch.float32, 1, None),
        ("h8_c64_split7", 8, 64, 16, 300, torch.float32, 7, None),     # 5 key blocks: splits with no keys at all
        ("h8_c64_bn32_bf16", 8, 64, 16, 200, torch.bfloat16, 3, 32),   # the key block of the C=512, H=64 plan
        ("h8_c64_bn16", 8, 64, 16, 200, torch.float32, 4, 16),
    ]
    for name, H, C, R, W, dt, splits, bn in cases:
        N = 4
        lens = torch.tensor([0, W - 1, 57, W // 2 + 3])                       # ragged; 0 and the full window
        full = (torch.randn(N, W + 40, C + R, generator=gen) * 0.7).to(dt)    # capacity > W: a strided view
        for n in range(N):
            full[n, int(lens[n]) + 1:] = float("nan")                          # beyond the length: never read
        kv = full[:, :W]
        qf = torch.randn(N, H, C + R, generator=gen) * 0.25
        p = mdt.plan(N, H, W, C, R, dt, kv.device, splits=splits, block_n=bn)
        o = mdt.mla_decode(qf, kv, lens, C, p)
        ref = reference(qf, kv, lens, C)
        res[name] = dict(rr=rel_err(o, ref), finite=bool(torch.isfinite(o).all()), shape=list(o.shape),
                         dtype=str(o.dtype), tol=TOL[str(dt).split(".")[-1]], splits=p.splits, NHB=p.NHB, BN=p.BN,
                         row0_rr=rel_err(o[0], ref[0]))
    # the plan depends on static shapes only, and the default interpreter plan splits the window
    a = mdt.plan(4, 8, 300, 256, 32, torch.bfloat16, torch.device("cpu"))
    b = mdt.plan(4, 8, 300, 256, 32, torch.bfloat16, torch.device("cpu"))
    res["plan"] = dict(equal=a == b, splits=a.splits, BH=a.BH, BC=a.BC, BR=a.BR,
                       h64=mdt.plan(1, 64, 1 << 20, 512, 64, torch.bfloat16, "cpu", target_programs=264).splits)


def _decoder_checks(res: dict) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import build, micro_config
    from k3.generation import K3Cache, StaticDecoder

    def prefilled(model, prompts):
        cache = K3Cache.for_model(model, len(prompts), max_length=64)
        with torch.inference_mode():
            for i, p in enumerate(prompts):
                model(torch.tensor([p]), cache=cache.rows(i))
                cache.rows(i).advance(len(p))
        return cache

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (7, 1, 12)]
    for dtype, tag, steps in ((torch.float32, "fp32", 5), (torch.bfloat16, "bf16", 3)):
        model = build(micro_config(all_mla=True, layers=4), dtype)
        decs = {k: StaticDecoder(model, prefilled(model, prompts), len(prompts), mla_kernel=k)
                for k in ("torch", "triton")}
        kernels = {k: sorted({L["attn"].kernel for L in d.layers if hasattr(L["attn"], "kernel")})
                   for k, d in decs.items()}
        tok = torch.tensor([[5], [6], [7]])
        err, scale = 0.0, 0.0
        for _ in range(steps):
            a = decs["torch"].step(tok).clone()
            b = decs["triton"].step(tok).clone()
            err, scale = max(err, float((a - b).abs().max())), max(scale, float(a.abs().max()))
            tok = a.argmax(-1, keepdim=True)
        res["decoder_" + tag] = dict(err=err, scale=scale, kernels=kernels, window=decs["triton"].window,
                                     lengths=decs["triton"].cache.layers[0].lengths)
    # the env switch, and the fp64 fallback to the torch path
    os.environ["K3_MLA_DECODE"] = "triton"
    m64 = build(micro_config(all_mla=True, layers=2))
    d64 = StaticDecoder(m64, K3Cache.for_model(m64, 1, max_length=16), 1)
    del os.environ["K3_MLA_DECODE"]
    res["env"] = dict(selected=d64.mla_kernel, fp64_kernel=d64.layers[0]["attn"].kernel)


def _checks() -> dict:
    torch.set_num_threads(1)
    import k3.ops.mla_decode_triton  # noqa: F401 - triton imported here, after TRITON_INTERPRET=1
    fix_interpreter_bf16_dot()
    res: dict = {}
    _kernel_checks(res)
    _decoder_checks(res)
    return res


@pytest.fixture(scope="module")
def results():
    return interpreted_results(__file__, timeout=300, env_pop=("K3_MLA_DECODE",))


KERNEL_CASES = ["h8_c256_fp32", "h8_c256_bf16", "h16_c64_fp32", "h16_c64_bf16", "h64_c64_bf16", "h64_c256_fp32",
                "h8_c64_fp16", "h96_c64_fp32", "h8_c64_split1", "h8_c64_split7", "h8_c64_bn32_bf16", "h8_c64_bn16"]


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_matches_fp64_reference(results, name):
    r = results[name]
    assert r["finite"], r                      # NaN beyond the lengths is never read; empty splits add nothing
    assert r["rr"] <= r["tol"], r
    assert r["row0_rr"] <= r["tol"], r         # length 0: only the new token
    assert r["dtype"] == "torch.float32" and r["shape"][0] == 4 and r["shape"][2] in (64, 256)


def test_split_counts(results):
    assert results["h8_c64_split7"]["splits"] == 7 and results["h8_c64_split1"]["splits"] == 1
    assert results["h96_c64_fp32"]["NHB"] == 2
    assert results["h8_c64_bn32_bf16"]["BN"] == 32 and results["h8_c64_bn16"]["BN"] == 16
    pl = results["plan"]
    assert pl["equal"] and pl["splits"] >= 2 and (pl["BH"], pl["BC"], pl["BR"]) == (16, 256, 32)
    assert pl["h64"] == 264                    # N=1, H=64, 1M window: 2 x 132 programs


@pytest.mark.parametrize("tag,tol", [("fp32", 1e-4), ("bf16", 5e-2)])
def test_static_decoder_triton_matches_torch(results, tag, tol):
    r = results["decoder_" + tag]
    assert r["kernels"] == {"torch": ["torch"], "triton": ["triton"]}, r
    assert r["err"] <= tol * max(1.0, r["scale"]), r


def test_env_switch_and_fp64_fallback(results):
    assert results["env"] == {"selected": "triton", "fp64_kernel": "torch"}


def test_cpu_without_interpreter_falls_back():
    """In this process (no TRITON_INTERPRET) on CPU, mla_kernel='triton' runs the torch path; bad names raise."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("needs a CPU-only process without the interpreter")
    from k3.generation import K3Cache, StaticDecoder
    m = _build(_micro_config(all_mla=True, layers=2), torch.float32)
    dec = StaticDecoder(m, K3Cache.for_model(m, 1, max_length=16), 1, mla_kernel="triton")
    assert dec.mla_kernel == "triton" and dec.layers[0]["attn"].kernel == "torch"
    dec.step(torch.tensor([3]))
    with pytest.raises(ValueError):
        StaticDecoder(m, K3Cache.for_model(m, 1, max_length=16), 1, mla_kernel="cuda")


if __name__ == "__main__":
    print(json.dumps(_checks()))


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_splits_spread_evenly_over_the_sms():
    """On an H200 (132 SMs): 28 rows of one head block at 1M context got 10 splits (280 programs for 264 slots:
    16 programs in a second round); balanced, 14 splits (392 programs, 3 per SM but 4 SMs). Counts that already
    divide evenly stay (8 rows x 33, 1 row x 264); a short window caps the count as before."""
    from k3.ops import mla_decode_triton as mdt
    sp = lambda N, W=1 << 20, H=8: mdt.plan(N, H, W, 256, 32, torch.bfloat16, "cpu", target_programs=264,  # noqa
                                            sms=132).splits
    assert mdt.balanced_splits(28, 10, 40, 132) == 14
    assert (sp(28), sp(8), sp(1), sp(4)) == (14, 33, 264, 66)
    for N in range(1, 80):   # never fewer splits than before, never more than 4x, every SM within 6% of the mean
        s, lo = sp(N), -(-264 // N)
        assert lo <= s <= 4 * lo
        p = N * s
        assert -(-p // 132) * 132 / p <= 1.06, (N, s)
    assert sp(28, W=64 * 4) == 2                     # 4 key blocks: at most 2 splits
    assert mdt.plan(28, 8, 1 << 20, 256, 32, torch.bfloat16, "cpu", target_programs=264).splits == 10  # no sms
