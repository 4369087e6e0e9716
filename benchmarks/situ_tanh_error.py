"""Error of SiTU-GLU's hardware-tanh kernel (K3_SITU_TANH=approx, the CUDA default for 16-bit inputs) against fp64
on the activations a model actually produces, next to the exact-tanh kernel and bf16's own output rounding.

    python benchmarks/situ_tanh_error.py [--preset small] [--checkpoint DIR] [--batch 2 --seq 2048]
                                         [--backward] [--out situ_tanh_error.json]

What it does: builds the model in bf16 (a preset at its random init, or a trained checkpoint with --checkpoint:
trained activations are larger than init ones, so use one when you have it), runs one forward on random tokens
(or the built-in corpus, --tokens corpus), and intercepts every SiTU-GLU call the model makes (dense FFN, shared
experts, routed experts), labelled by site. For each call the same inputs go through
  fp64    the formula of architecture.md §2 in fp64 (the reference),
  approx  the Triton kernel with the hardware tanh.approx.f32 (bf16 output, and fp32 output = before rounding),
  exact   the Triton kernel with the exp-based tanh (bf16 and fp32 outputs),
  torch   the eager formula (fp32 math, bf16 output; the CPU path),
and the errors against fp64 are summarised: max abs, max rel (over |ref| >= 1e-6 · max|ref| of the call), max
error in bf16 ulps of the reference, and "mismatch": the share of bf16 outputs that differ from the correctly
rounded bf16(fp64). bf16 rounding alone (bf16(fp64) vs fp64) is the floor every bf16 path shares: its max is half an
ulp and its mismatch 0. With --backward the same for the backward kernels (dg, du) on a real upstream gradient
(the model's loss on shifted tokens). A synthetic sweep over g in [-40, 40] x u in [-120, 120] adds the worst case
over the whole input range (the saturating tails, where sigmoid = 0.5 + 0.5·tanh(x/2) cancels).

How to decide the default from the output (issue #28.8): the approximate tanh is acceptable for *training* if its
bf16 outputs stay within ~1 ulp of fp64 (max_ulp <= 1: at most the neighbouring bf16 value) and its mismatch rate
is small next to the bf16 GEMM noise around it; for *inference* it should be the default only if its bf16 outputs
equal the exact kernel's (mismatch_vs_exact ~ 0) on the activations a trained checkpoint produces.

Measured (H200, torch 2.11, Triton 3.6; `small` bf16, B2 x T2048 random ids at init, and a 22-step trained
checkpoint on corpus text, B2 x T1024; ~0.25-0.5 G SiTU elements each; with --backward):
  out   approx: max 0.503-0.509 ulp, mismatch vs correctly rounded 8.0e-4 - 8.8e-4, differs from the exact kernel on
        1.3e-3 - 2.1e-3 of the outputs (one ulp); before rounding (fp32 out) max rel 2e-5 - 7e-5 (<= 0.015 ulp).
        exact kernel: mismatch 7.9e-4 - 1.8e-3, max 226-256 ulp / rel 0.08-0.32: its exp-based tanh,
        (1 - e^-2|x|)/(1 + e^-2|x|), cancels for tiny |x| (tiny outputs get large relative errors; absolute
        errors <= 3.3e-6). torch eager: mismatch 7e-6 - 1.2e-5, max 0.500 ulp.
  du    approx max 0.51 ulp, mismatch 5e-4; exact kernel 190-256 ulp (same cancellation), mismatch 1.3e-4 - 2.4e-4.
  dg    approx and exact kernels both up to ~207 / ~256 ulp near the zero of dSiTU/dg (approx max rel 0.81 there),
        mismatch approx 6e-4 - 2.7e-3, exact 1.2e-3 - 1.6e-3; torch 0.91 ulp.
  sweep (g in [-40, 40], u in [-120, 120]): approx max abs error 1.2e-3 (fp32 out) but relative error unbounded in
        the saturated tail g << 0, where sigmoid = 0.5 + 0.5 tanh(g/2) cancels (37.7% of bf16 outputs differ from
        the correctly rounded value there, vs 0.1% for the exact kernel).
  Inputs the model produced: |g|, |u| <= 4 (99.9th percentile <= 2.4), i.e. far from that tail at these stages.

On CPU there are no Triton kernels (the interpreter has no inline PTX: the hardware tanh is CUDA-only); the script
then reports that and measures the exact path the CPU runs (the eager formula), so it can be smoke-tested:
    python benchmarks/situ_tanh_error.py --preset tiny --seq 64 --out /tmp/situ.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

B1_DEFAULT, B2_DEFAULT = 4.0, 25.0


# ---------------------------------------------------------------------------------------------- reference math
def situ64(g, u, b1, b2):
    g, u = g.double(), u.double()
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


def situ64_bwd(g, u, d, b1, b2):
    g, u, d = g.double(), u.double(), d.double()
    tg, s, tu = torch.tanh(g / b1), torch.sigmoid(g), torch.tanh(u / b2)
    dg = d * (b2 * tu) * ((1 - tg * tg) * s + b1 * tg * s * (1 - s))
    du = d * (b1 * tg * s) * (1 - tu * tu)
    return dg, du


def bf16_ulp(x64):
    """Spacing of bf16 numbers at |x| (8 significant bits): 2^(floor(log2|x|) - 7); bf16's smallest normal's
    spacing for 0 / subnormal magnitudes."""
    m, e = torch.frexp(x64.abs())
    ulp = torch.ldexp(torch.ones_like(x64), (e - 8).to(torch.int32))
    return torch.clamp(ulp, min=2.0 ** -133)


# ---------------------------------------------------------------------------------------------- kernels
def kernel_fwd(g, u, b1, b2, approx: bool, out_dtype):
    from k3.ops import activations_triton as at
    g2, sg = at._rows(g)
    u2, su = at._rows(u)
    R, C = g2.shape
    o = torch.empty(R, C, device=g.device, dtype=out_dtype)
    if o.numel():
        bc, br, grid = at._tiles(R, C)
        at._situ_fwd_kernel[grid](g2, u2, o, R, C, sg, su, C, b1, b2, BR=br, BC=bc, APPROX=approx, num_warps=4)
    return o


def kernel_bwd(g, u, d, b1, b2, approx: bool, out_dtype):
    from k3.ops import activations_triton as at
    g2, sg = at._rows(g)
    u2, su = at._rows(u)
    d2, sd = at._rows(d)
    R, C = g2.shape
    dg = torch.empty(R, C, device=g.device, dtype=out_dtype)
    du = torch.empty(R, C, device=g.device, dtype=out_dtype)
    if dg.numel():
        bc, br, grid = at._tiles(R, C)
        at._situ_bwd_kernel[grid](g2, u2, d2, dg, du, R, C, sg, su, sd, C, b1, b2, BR=br, BC=bc, APPROX=approx,
                                  num_warps=4)
    return dg, du


# ---------------------------------------------------------------------------------------------- statistics
class Stat:
    """Running error summary of one (site, quantity, variant)."""

    def __init__(self):
        self.n = 0
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.max_ulp = 0.0
        self.sum_sq = 0.0
        self.mismatch = 0
        self.mismatch_vs_exact = 0
        self.exact_seen = False
        self.worst = None

    def add(self, out, ref64, rounded_ref=None, exact_out=None, inputs=None):
        out64 = out.double().reshape(-1)
        ref = ref64.reshape(-1)
        err = (out64 - ref).abs()
        scale = ref.abs().max().item() if ref.numel() else 0.0
        rel_mask = ref.abs() >= 1e-6 * scale
        self.n += ref.numel()
        if not ref.numel():
            return
        i = int(err.argmax())
        if err[i].item() > self.max_abs:
            self.max_abs = err[i].item()
            if inputs is not None:
                self.worst = dict(ref=ref[i].item(), out=out64[i].item(),
                                  **{k: v.reshape(-1)[i].item() for k, v in inputs.items()})
        if rel_mask.any():
            self.max_rel = max(self.max_rel, (err[rel_mask] / ref.abs()[rel_mask]).max().item())
        self.max_ulp = max(self.max_ulp, (err / bf16_ulp(ref)).max().item())
        self.sum_sq += (err * err).sum().item()
        if rounded_ref is not None:
            self.mismatch += int((out.reshape(-1) != rounded_ref.reshape(-1)).sum())
        if exact_out is not None:
            self.exact_seen = True
            self.mismatch_vs_exact += int((out.reshape(-1) != exact_out.reshape(-1)).sum())

    def row(self, lowp: bool):
        r = dict(n=self.n, max_abs=self.max_abs, max_rel=self.max_rel, max_ulp_bf16=self.max_ulp,
                 rms=math.sqrt(self.sum_sq / max(self.n, 1)))
        if lowp:
            r["mismatch_vs_rounded_fp64"] = self.mismatch / max(self.n, 1)
            if self.exact_seen:
                r["mismatch_vs_exact_kernel"] = self.mismatch_vs_exact / max(self.n, 1)
        if self.worst is not None:
            r["worst"] = self.worst
        return r


class Collector:
    def __init__(self, b1, b2, kernels: bool, backward: bool):
        self.b1, self.b2, self.kernels, self.backward = b1, b2, kernels, backward
        self.stats: dict = {}
        self.inputs: dict = {}
        self.site = "?"
        self.labels: dict = {}

    def stat(self, site, qty, variant) -> Stat:
        return self.stats.setdefault((site, qty, variant), Stat())

    def _variants_fwd(self, g, u):
        b1, b2 = self.b1, self.b2
        from k3.ops.activations import _situ_fwd_torch
        out = {"torch": _situ_fwd_torch(g, u, b1, b2)}
        if self.kernels:
            out["exact"] = kernel_fwd(g, u, b1, b2, False, g.dtype)
            out["approx"] = kernel_fwd(g, u, b1, b2, True, g.dtype)
            out["exact_fp32out"] = kernel_fwd(g, u, b1, b2, False, torch.float32)
            out["approx_fp32out"] = kernel_fwd(g, u, b1, b2, True, torch.float32)
        return out

    def forward_call(self, g, u, site=None):
        site = site or self.site
        with torch.no_grad():
            ref = situ64(g, u, self.b1, self.b2)
            rounded = ref.to(g.dtype)
            variants = self._variants_fwd(g, u)
            exact = variants.get("exact")
            ins = dict(g=g, u=u)
            self.stat(site, "out", "bf16(fp64)").add(rounded, ref, rounded)
            for name, o in variants.items():
                lowp = o.dtype == g.dtype
                self.stat(site, "out", name).add(o, ref, rounded if lowp else None,
                                                 exact if (lowp and exact is not None) else None, ins)
            a = self.inputs.setdefault(site, dict(n=0, max_abs_g=0.0, max_abs_u=0.0, calls=0))
            a["calls"] += 1
            a["n"] += g.numel()
            a["max_abs_g"] = max(a["max_abs_g"], g.abs().max().item() if g.numel() else 0.0)
            a["max_abs_u"] = max(a["max_abs_u"], u.abs().max().item() if u.numel() else 0.0)
            if g.numel():
                sub = g.reshape(-1)[:: max(1, g.numel() // 200000)].float()
                subu = u.reshape(-1)[:: max(1, u.numel() // 200000)].float()
                a["p999_abs_g"] = max(a.get("p999_abs_g", 0.0), torch.quantile(sub.abs(), 0.999).item())
                a["p999_abs_u"] = max(a.get("p999_abs_u", 0.0), torch.quantile(subu.abs(), 0.999).item())

    def backward_call(self, g, u, d, site):
        with torch.no_grad():
            rg, ru = situ64_bwd(g, u, d, self.b1, self.b2)
            from k3.ops.activations import _situ_bwd_torch
            outs = {"torch": _situ_bwd_torch(g, u, d, self.b1, self.b2)}
            if self.kernels:
                outs["exact"] = kernel_bwd(g, u, d, self.b1, self.b2, False, g.dtype)
                outs["approx"] = kernel_bwd(g, u, d, self.b1, self.b2, True, g.dtype)
                outs["exact_fp32out"] = kernel_bwd(g, u, d, self.b1, self.b2, False, torch.float32)
                outs["approx_fp32out"] = kernel_bwd(g, u, d, self.b1, self.b2, True, torch.float32)
            for qi, (qty, ref) in enumerate((("dg", rg), ("du", ru))):
                rounded = ref.to(g.dtype)
                self.stat(site, qty, "bf16(fp64)").add(rounded, ref, rounded)
                ex = outs.get("exact")
                for name, o in outs.items():
                    lowp = o[qi].dtype == g.dtype
                    self.stat(site, qty, name).add(o[qi], ref, rounded if lowp else None,
                                                   ex[qi] if (lowp and ex is not None) else None,
                                                   dict(g=g, u=u, d=d))


def site_kind(site: str) -> str:
    return site.split(".")[-1]


def summarise(col: Collector, kinds=True) -> list:
    """Rows per (site kind: dense / shared / routed / sweep, quantity, variant), merged over layers."""
    merged: dict = {}
    for (site, qty, var), st in col.stats.items():
        key = (site_kind(site) if kinds else site, qty, var)
        m = merged.setdefault(key, Stat())
        m.n += st.n
        m.max_abs = max(m.max_abs, st.max_abs)
        if st.max_abs >= m.max_abs:
            m.worst = st.worst
        m.max_rel = max(m.max_rel, st.max_rel)
        m.max_ulp = max(m.max_ulp, st.max_ulp)
        m.sum_sq += st.sum_sq
        m.mismatch += st.mismatch
        m.mismatch_vs_exact += st.mismatch_vs_exact
        m.exact_seen |= st.exact_seen
    rows = []
    for (kind, qty, var), st in sorted(merged.items()):
        lowp = not var.endswith("fp32out")
        rows.append(dict(site=kind, qty=qty, variant=var, **st.row(lowp)))
    return rows


def print_table(rows):
    print(f"{'site':8s} {'qty':4s} {'variant':15s} {'n':>10s} {'max_abs':>10s} {'max_rel':>10s} {'max_ulp':>8s} "
          f"{'rms':>10s} {'mism(fp64)':>10s} {'mism(exact)':>11s}")
    for r in rows:
        mm = r.get("mismatch_vs_rounded_fp64")
        me = r.get("mismatch_vs_exact_kernel")
        print(f"{r['site']:8s} {r['qty']:4s} {r['variant']:15s} {r['n']:10d} {r['max_abs']:10.3e} {r['max_rel']:10.3e} "
              f"{r['max_ulp_bf16']:8.3f} {r['rms']:10.3e} "
              f"{'' if mm is None else f'{mm:.2e}':>10s} {'' if me is None else f'{me:.2e}':>11s}")


# ---------------------------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=None, help="model preset (default: small on CUDA, tiny on CPU)")
    ap.add_argument("--checkpoint", default=None, help="a saved model directory (trained activations)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (default 2048 on CUDA, 64 on CPU)")
    ap.add_argument("--tokens", choices=("random", "corpus"), default="random",
                    help="random ids, or the built-in corpus through k3.train.data's tokenizer")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--backward", action="store_true", help="also measure the backward kernels (dg, du)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the synthetic input-range sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "situ_tanh_error.json"))
    a = ap.parse_args(argv)

    import k3.ops.activations as act
    import k3.nn.moe as nnmoe
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.nn.mlp import GLUMLP
    from k3.nn.moe import LatentMoE

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, a.dtype)
    kernels = device.type == "cuda" and act._HAVE_TRITON
    note = None
    if not kernels:
        note = ("no CUDA device: the hardware tanh (tanh.approx.f32 inline PTX) is CUDA-only and Triton's interpreter "
                "cannot run it; measured the exact path the CPU runs (the eager fp32 formula) only")
        print("note:", note)
    torch.manual_seed(a.seed)
    if a.checkpoint:
        model = K3ForCausalLM.from_pretrained(a.checkpoint)
        source = f"checkpoint {a.checkpoint}"
    else:
        preset = a.preset or ("small" if device.type == "cuda" else "tiny")
        model = K3ForCausalLM(K3Config.from_preset(preset))
        source = f"preset {preset} (random init)"
    cfg = model.config
    model = model.to(device=device, dtype=dtype)
    # keep the fp32-stored tensors fp32, as a bf16 load does
    for n, p in list(model.named_parameters()) + list(model.named_buffers()):
        if n.endswith(("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")):
            p.data = p.data.float()
    seq = a.seq or (2048 if device.type == "cuda" else 64)
    if a.tokens == "corpus":
        from k3.train.data import get_tokenizer, load_corpus
        tok = get_tokenizer(cfg.vocab_size)
        text = "\n\n".join(load_corpus()[1])
        ids_all = tok.encode(text).ids
        need = a.batch * seq
        ids_all = (ids_all * (need // max(len(ids_all), 1) + 1))[:need]
        ids = torch.tensor(ids_all, dtype=torch.long).view(a.batch, seq)
    else:
        ids = torch.randint(0, cfg.vocab_size, (a.batch, seq), generator=torch.Generator().manual_seed(a.seed))
    ids = ids.to(device)

    b1, b2 = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    col = Collector(b1, b2, kernels, a.backward)

    # label every SiTU call by the module that makes it
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, GLUMLP):
            kind = "shared" if name.endswith("shared_experts") else "dense"
            hooks.append(m.register_forward_pre_hook(lambda mod, inp, lab=f"{name}.{kind}": setattr(col, "site", lab)))
        elif isinstance(m, LatentMoE):
            hooks.append(m.register_forward_pre_hook(lambda mod, inp, lab=f"{name}.routed": setattr(col, "site", lab)))

    orig_fwd, orig_bwd, orig_packed = act._fwd, act._bwd, nnmoe.situ_glu_packed

    def fwd_hook(g, u, bb1, bb2):
        col.forward_call(g, u)
        if a.backward:
            col.labels[(g.data_ptr(), tuple(g.shape))] = col.site
        return orig_fwd(g, u, bb1, bb2)

    def bwd_hook(g, u, d, bb1, bb2):
        site = col.labels.get((g.data_ptr(), tuple(g.shape)), "?.unknown")
        col.backward_call(g, u, d.contiguous(), site)
        return orig_bwd(g, u, d, bb1, bb2)

    act._fwd, act._bwd = fwd_hook, bwd_hook
    # the packed MoE node's backward bypasses _bwd: route the experts through situ_glu (same forward math)
    nnmoe.situ_glu_packed = lambda h, bb1=4.0, bb2=25.0: act.situ_glu(*h.chunk(2, dim=-1), bb1, bb2)
    t0 = time.time()
    try:
        if a.backward:
            model.train()
            os.environ.setdefault("K3_SITU_NODE", "1")  # CPU: the node (with _bwd) instead of plain autograd
            labels = torch.roll(ids, -1, dims=1)
            out = model(ids, labels=labels)
            out.loss.backward()
        else:
            model.eval()
            with torch.no_grad():
                model(ids)
    finally:
        act._fwd, act._bwd, nnmoe.situ_glu_packed = orig_fwd, orig_bwd, orig_packed
        for h in hooks:
            h.remove()
    model_s = time.time() - t0

    if not a.no_sweep:
        # the whole input range: g in [-40, 40] (beta1 = 4: tanh saturates past ~|g| 12, sigmoid past ~|g| 17),
        # u in [-120, 120] (beta2 = 25), on a grid of bf16-representable values
        gs = torch.linspace(-40, 40, 4001, device=device).to(dtype)
        us = torch.linspace(-120, 120, 1201, device=device).to(dtype)
        G = gs.view(-1, 1).expand(gs.numel(), us.numel()).contiguous()
        U = us.view(1, -1).expand(gs.numel(), us.numel()).contiguous()
        col.forward_call(G, U, site="sweep.sweep")
        if a.backward:
            D = torch.ones_like(G)
            col.backward_call(G, U, D, "sweep.sweep")

    rows = summarise(col)
    print(f"\nSiTU-GLU error vs fp64 — {source}, {a.dtype}, ids [{a.batch}, {seq}] ({a.tokens}), device {device}"
          f"{'' if kernels else ' (no Triton kernels)'}; model pass {model_s:.1f} s")
    print("variants: bf16(fp64) = the correctly rounded reference (the floor); torch = eager formula; exact / approx ="
          " Triton kernels with exp-based / hardware tanh; *_fp32out = the same kernels storing fp32 (before rounding)")
    print_table(rows)
    print("\ninputs per site kind (max |g|, |u|; 99.9th percentile of |g|, |u|):")
    kinds: dict = {}
    for site, v in col.inputs.items():
        k = kinds.setdefault(site_kind(site), dict(calls=0, n=0, max_abs_g=0.0, max_abs_u=0.0, p999_abs_g=0.0,
                                                   p999_abs_u=0.0))
        for key in ("calls", "n"):
            k[key] += v[key]
        for key in ("max_abs_g", "max_abs_u", "p999_abs_g", "p999_abs_u"):
            k[key] = max(k[key], v.get(key, 0.0))
    for kind, v in sorted(kinds.items()):
        print(f"  {kind:8s} calls {v['calls']:3d}  elements {v['n']:11d}  max|g| {v['max_abs_g']:8.3f}  "
              f"max|u| {v['max_abs_u']:8.3f}  p99.9|g| {v['p999_abs_g']:7.3f}  p99.9|u| {v['p999_abs_u']:7.3f}")
    result = dict(source=source, dtype=a.dtype, device=str(device),
                  gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                  batch=a.batch, seq=seq, tokens=a.tokens, beta1=b1, beta2=b2, kernels_measured=kernels, note=note,
                  approx_tanh_env=os.environ.get("K3_SITU_TANH", "approx"), backward=a.backward,
                  rows=rows, inputs=kinds, per_site=summarise(col, kinds=False), model_pass_s=model_s,
                  torch=torch.__version__)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\nwrote {a.out}")
    return result


if __name__ == "__main__":
    main()
