"""Ahead-of-time compile of our Triton kernels for sm_90 (H100/H200) with triton's bundled ptxas: catches kernels
that would not compile on the GPU (shared memory over the 227 KB limit, unsupported ops) without a GPU.
~6 s on 2 cores."""
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

from k3.ops.triton_sm90 import SMEM_LIMIT, compile_sm90  # noqa: E402


TYPES = dict(R="i32", C="i32", sg="i32", su="i32", so="i32", sd="i32", sdg="i32", b1="fp32", b2="fp32", Q="*fp32",
             LENS="*i64", ACC="*fp32", MAX="*fp32", SUM="*fp32", O="*fp32", KV="*bf16", H="i32", W="i32",
             NSPLIT="i32", s_qn="i32", s_qh="i32", s_kn="i32", s_kw="i32", s_on="i32", s_oh="i32",
             eg="*fp32", h0="*fp32", ht="*fp32", cu="*i32", seq_chunk="*i32", Ttot="i32", states="*fp32",
             save_chunk="*i32", save_off="i32", order="*i32",
             dht="*fp32", dstates="*fp32", dh0="*fp32", A_log="*fp32", dt_bias="*fp32", eg_out="*fp32",
             chunk_tok="*i32", chunk_end="*i32", scale="fp32", lower_bound="fp32", hs="*bf16", vn="*bf16",
             uns="*fp32", dus="*fp32", cmat="*fp32", cdb="*fp32", x1s="*fp32", x2s="*fp32", dgis="*fp32",
             nkp="*fp32", dbp="*fp32", dal_part="*fp32", ddt_part="*fp32", ws="*fp32", ks="*fp32", aqf="*fp32",
             gcs="*fp32", rqk="*fp32", sqk="*fp32", wt="*fp32", starts="*i32", T="i32", sxb="i32", sxt="i32", syb="i32",
             syt="i32", sdb="i32", sdt="i32", sob="i32", sot="i32", dwp="*fp32", m_idx="*i64", m_w="*fp32",
             m_dots="*fp32", n_tok="i32", width="i32", s_y="i32", s_o="i32", s_d="i32", mbuf="*fp32", aw="*fp32",
             n_el="i32", mu="fp32", decay="fp32", step="fp32", l_rows="i32", m_cols="i32")
CONV_STRIDES = ("sxb", "sxt", "syb", "syt", "sdb", "sdt", "sob", "sot")
# every launch option the conv backward's autotuner may pick (k3.ops.conv_triton.BWD_CONFIGS), dense and varlen
CONV_BWD = [f"conv_bwd {bt}x{bc}w{nw}{v}" for bt, bc, nw in
            [(8, 64, 4), (16, 64, 8), (16, 64, 4), (32, 64, 8), (8, 128, 4), (16, 128, 8), (64, 64, 8), (8, 64, 2),
             (1, 128, 1), (1, 256, 2), (1, 256, 4), (1, 512, 4)]
            for v in ("", " varlen")]


def _bwd_cases(cb, cg):
    """The backward kernels at the block sizes, warps and stages of their real launch (bwd_config.launch_config,
    bf16, K = V = 128, 8 x 96 (sequence, head) pairs)."""
    import torch
    from k3.ops.kda.triton.bwd import kernel_table
    from k3.ops.kda.triton.bwd_config import SCRATCH_PTRS, launch_config
    lc = launch_config(128, 128, 8 * 96, torch.bfloat16)
    scratch = {n: "*bf16" for n in SCRATCH_PTRS[lc["scratch"]["DTYPE"]]}  # (pointers in the input dtype)
    gk = {n: c for n, c in cg.items() if n not in ("V", "USE_GATE", "L2NORM")}
    consts = {
        # STORE_U / SF32 from value's PRE / PRE_F32, as launched (the forms without: benchmarks/kda_bwd_static.py)
        "states": dict(cb, HAS_H0=True, STORE_U=lc["value"]["PRE"], SF32=lc["value"]["PRE_F32"]),
        "dstates": dict(cb, HAS_DHT=True, STORE_U=lc["value"]["PRE"], SF32=lc["value"]["PRE_F32"]),
        "value": dict(H=96, K=128, V=128, BT=64, IEEE=False, UPCAST=False),
        "inter": dict({n: c for n, c in cg.items() if n not in ("TS", "REF", "USE_GATE", "L2NORM")}, UPCAST=False,
                      DNW=not lc["value"]["DNU"], RED=lc["intra"]["RED"], NSQ=4 if lc["intra"]["RED"] else 0),
        "matrices": dict({n: c for n, c in cg.items() if n != "V"}, LOG2_TS=4, LOG2_NB=2, AQF=not lc["value"]["PRE"]),
        "wy": dict({n: c for n, c in cg.items() if n not in ("TS", "REF", "L2NORM", "USE_GATE")},
                   F32_W=not (lc["value"]["PRE"] and lc["value"]["DNU"]), F32_K=not lc["value"]["PRE"]),
        # (inter's per-K-block parts of dN / dbeta as stored without its atomics, value's DNU aside: the largest form)
        "intra": dict(gk, NKW=2, USE_GATE=True, L2NORM=True,
                      SQK=lc["gate_norm"]["ONEPASS"] and not lc["intra"]["FIN"], NSQ=4 if lc["intra"]["RED"] else 0),
        "gate_norm": dict({n: c for n, c in cg.items() if n not in ("V", "TS", "REF", "IEEE")}, NKW=2, NDB=2,
                          FUSED=False, NKI=4 if lc["intra"]["RED"] else 2)}
    kernels = {name: kern for name, kern, _ in kernel_table()}
    out = {}
    for name, c in consts.items():
        launch = dict(lc[name])  # (lc["scratch"] is not a kernel)
        launch.pop("PRE_F32", None)  # value's entry for the sequential passes (their SF32)
        opts = {o: launch.pop(o) for o in ("num_warps", "num_stages") if o in launch}
        if launch.pop("maxnreg", None) is not None:
            opts["maxnreg"] = lc[name]["maxnreg"]
        opts["types"] = scratch
        out[f"kda_bwd {name}"] = (kernels[name], dict(c, **launch), opts)
    return out


def _fwd_prep_case(varlen: bool):
    """The forward's prep kernel at its default launch (fwd.PREP_DEFAULT, bf16, K = V = 128, H96)."""
    from k3.ops.kda.triton.fwd import prep_config, prep_meta
    from k3.ops.kda.triton.intra_fwd import kda_intra_wy_fwd_kernel
    consts, launch = prep_meta(prep_config(), 96, 128, 128, varlen=varlen, USE_GATE=True, L2NORM=True)
    types = dict(NC="i32", NP="i32", Tseq="i32", NCT="i32", T0="i32")
    return kda_intra_wy_fwd_kernel, consts, dict(launch, types=types)


def _cases():
    from k3.ops import activations_triton as at, conv_triton as ct, mla_decode_triton as md, moe_triton as mt
    from k3.train import optim_triton as ot
    from k3.ops.kda.triton.recurrent import kda_recurrent_fwd_kernel
    from k3.ops.kda.triton.state_fwd import kda_state_output_fwd_kernel
    c = dict(H=96, K=128, V=128, BT=16, BV=64, HAS_H0=True, STORE_HT=True, SAVE=0)
    cb = dict(H=96, K=128, V=128, BT=64, BV=32, IEEE=False, UPCAST=False)
    cg = dict(H=96, K=128, V=128, BT=64, TS=16, REF=7, USE_GATE=True, L2NORM=True, IEEE=False)
    return {
        "kda_intra_wy_fwd": _fwd_prep_case(varlen=False),
        "kda_intra_wy_fwd varlen": _fwd_prep_case(varlen=True),
        "kda_state_output_fwd": (kda_state_output_fwd_kernel, dict(c, CU_STRIDE=1), dict(num_stages=3)),
        "kda_state_output_fwd pairs": (kda_state_output_fwd_kernel, dict(c, CU_STRIDE=2), dict(num_stages=3)),
        # a training forward saving the backward's chunk states and u' (bf16), at B1 T8K H96's launch
        "kda_state_output_fwd save": (kda_state_output_fwd_kernel, dict(c, BV=32, CU_STRIDE=1, SAVE=4),
                                      dict(num_stages=3, maxnreg=168, types=dict(states="*bf16", uns="*bf16"))),
        "kda_recurrent_fwd": (kda_recurrent_fwd_kernel, dict(H=96, K=128, V=128, BV=32, USE_GATE=True,
                                                             L2NORM=True, HAS_H0=True, STORE_HT=True)),
        **_bwd_cases(cb, cg),
        "situ_fwd": (at._situ_fwd_kernel, dict(BR=2, BC=512)),
        "situ_bwd": (at._situ_bwd_kernel, dict(BR=2, BC=512)),
        "situ_fwd approx": (at._situ_fwd_kernel, dict(BR=2, BC=512, APPROX=True)),
        "situ_bwd approx": (at._situ_bwd_kernel, dict(BR=2, BC=512, APPROX=True)),
        "mla_decode_partial C512 R64 H64": (md._partial_kernel, dict(C=512, R=64, BC=512, BR=64, BH=64, BN=32,
                                                                      NHB=1, PREC="tf32")),
        "mla_decode_combine": (md._combine_kernel, dict(C=512, BS=16, BCC=64)),
        "conv_fwd varlen": (ct._conv_fwd_kernel, dict(K=4, BT=ct.FWD[0], BC=ct.FWD[1], VARLEN=True, ACT=True),
                            dict(divisible=CONV_STRIDES, num_warps=ct.FWD[2])),
        **{f"conv_bwd {bt}x{bc}w{nw}{' varlen' * v}": (
            ct._conv4_bwd_kernel, dict(SXT=1024, SDT=1024, SOT=1024, SPAN=ct.SPAN, BT=bt, BC=bc, VARLEN=v,
                                       ACT=True), dict(divisible=CONV_STRIDES + ("C",), num_warps=nw))
            for bt, bc, nw in ct.BWD_CONFIGS for v in (False, True)},
        "moe_gather_sum k8": (mt._gather_sum_kernel, dict(KT=8, HAS_W=True, BN=mt.BN, BL=mt.BL),
                              dict(divisible=("s_y", "s_o"), num_warps=mt.NW)),
        "muon_momentum": (ot._momentum_kernel, dict(NESTEROV=True, BLOCK=ot.BLOCK), dict(num_warps=8)),
        "muon_apply gate_up": (ot._apply_kernel, dict(HAS_P=True, GATE_UP=True, BLOCK=ot.BLOCK), dict(num_warps=8)),
        "moe_gather_dot k8": (mt._gather_dot_kernel, dict(KT=8, KP=8, BN=mt.DOT_ROWS // 512, BW=512),
                              dict(divisible=("s_y", "s_d"), num_warps=mt.NW)),
    }


@pytest.mark.parametrize("name", ["kda_intra_wy_fwd", "kda_intra_wy_fwd varlen", "kda_state_output_fwd",
                                  "kda_state_output_fwd pairs", "kda_state_output_fwd save", "kda_recurrent_fwd",
                                  "kda_bwd matrices", "kda_bwd wy", "kda_bwd states", "kda_bwd dstates",
                                  "kda_bwd value", "kda_bwd inter", "kda_bwd intra", "kda_bwd gate_norm",
                                  "situ_fwd", "situ_bwd", "situ_fwd approx", "situ_bwd approx",
                                  "mla_decode_partial C512 R64 H64", "mla_decode_combine",
                                  "conv_fwd varlen", *CONV_BWD, "moe_gather_sum k8",
                                  "moe_gather_dot k8", "muon_momentum", "muon_apply gate_up"])
def test_kernel_compiles_for_sm90(name):
    if name.startswith("conv_bwd"):
        from k3.ops.conv_triton import BWD_CONFIGS
        assert CONV_BWD == [f"conv_bwd {bt}x{bc}w{nw}{v}" for bt, bc, nw in BWD_CONFIGS for v in ("", " varlen")]
    fn, consts, *opts = _cases()[name]
    opts = dict(opts[0]) if opts else {}
    ck = compile_sm90(fn, consts, {**TYPES, **opts.pop("types", {})}, **opts)
    assert ck.asm.get("cubin"), "no cubin produced"
    assert ck.metadata.shared <= SMEM_LIMIT, f"{name}: {ck.metadata.shared} B of shared memory"
    if name.startswith(("conv", "moe", "muon")):  # the launch tiles were chosen to fit the registers: no spills
        from k3.ops.triton_sm90 import stats
        assert stats(ck, opts.get("num_warps", 4))["stack_B"] == 0, name
