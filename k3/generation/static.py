"""Static, CUDA-graph-capturable single-token decode step for the whole model (spec §7 decode, fused).

`StaticDecoder(model, cache, batch_size)` runs one decode step (one new token per cache row) with fixed tensor
shapes and fixed addresses, so that on CUDA the step can be captured once with `torch.cuda.CUDAGraph` and replayed
per token; on CPU (or with capture off) the same static code runs eagerly. Same math as the normal cached forward
(`model(ids, cache=cache)`, absorbed MLA + recurrent KDA), with far fewer ops per step:

- fused weights, built once at construction (call `refresh_weights()` after changing the model's weights): per KDA
  layer one matmul for q/k/v/g/f_a/b; per MLA layer one for q_a/kv_a/g; per FFN one for the shared (or dense)
  gate+up (+ the routed latent down-projection); the absorbed MLA weights W_UK / W_UV pre-split per head.
- KDA: the short conv for q/k/v as one [3, B, P, K] multiply-sum, the delta-rule step on the cache's fp32 state in
  place (no stack/unbind, no input validation).
- MLA: the new latent is written at each row's length (a device tensor), and attention runs over the whole
  preallocated window [0, W) with a length mask instead of slicing to the current length; scores read the cached
  [c || k_pe] rows in one batched matmul (q~ and q_pe concatenated). A low-precision cache is not upcast as a
  whole on CUDA: matmuls take the cached dtype with fp32 output (`out_dtype`), else fall back to an upcast.
- MoE for few tokens (N x top_k <= experts): the k selected experts' weights are gathered and run as a bmm (no
  argsort/bincount/grouped GEMM); for larger batches every expert runs on every token (dense bmm), combined with a
  zero-filled [N, E] weight matrix. Both are shape-static.
- AttnRes mixing as one stacked softmax over depth sources.
- no `.item()` / `.tolist()` / Python branching on tensor values: the per-row lengths are kept on the host as
  Python ints (for bookkeeping and bounds checks) and on the device (for the kernels).

Host bookkeeping after each step: the cache's token counts and every MLA layer's host lengths advance by 1 (all
rows advance, as in the normal batched decode); the device lengths are advanced inside the step. The cache stays
usable by the normal forward afterwards (same layout, same lengths). The MLA buffers must not be reallocated
while a captured graph is in use: the decoder reserves its window up front and rebuilds itself (re-captures) if a
buffer address changes.

    dec = StaticDecoder(model, cache, batch_size=B, cuda_graph=True)
    logits = dec.step(next_ids)     # [B, V] fp32, a static buffer overwritten by the next step
"""
from __future__ import annotations

import weakref
from typing import List, Optional

import torch
import torch.nn.functional as F

from k3.generation.cache import K3Cache, KDALayerCache, MLALayerCache
from k3.ops import f32
from k3.nn.mla import bmm_acc, out_dtype_matmul_ok  # noqa: F401 (re-exported)
from k3.ops.kda.common import L2NORM_EPS

__all__ = ["StaticDecoder", "self_check", "out_dtype_matmul_ok", "bmm_acc"]

def _rms(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim (one fused kernel on CUDA)."""
    return torch.rms_norm(x32, (x32.shape[-1],), eps=eps)


class _Norm:
    """RMSNorm as k3.nn.norm: fp32 statistics, cast, then scale by the weight in the activation dtype."""

    def __init__(self, norm, dtype):
        self.w, self.eps = norm.weight.detach().to(dtype), norm.eps

    def __call__(self, x):
        return _rms(f32(x), self.eps).to(x.dtype) * self.w


def _mix(sources: List[torch.Tensor], w32: torch.Tensor, eps: float) -> torch.Tensor:
    """attnres_mix (k3.ops.attnres) for [N, d] sources: one stacked softmax over depth, fp32."""
    if len(sources) == 1:
        return sources[0]
    V = f32(torch.stack(sources, 0))                                            # [S, N, d]
    logit = torch.rsqrt(V.pow(2).mean(-1) + eps) * (V @ w32)                    # [S, N]
    a = torch.softmax(logit, 0)
    return (a.unsqueeze(-1) * V).sum(0).to(sources[0].dtype)


def _cat_w(*linears) -> torch.Tensor:
    return torch.cat([m.weight.detach() for m in linears], 0).t().contiguous()    # [d, sum(out)]


# ---------------------------------------------------------------------------------------------------- layers
class _KDA:
    def __init__(self, attn, lc: KDALayerCache, dtype):
        a = attn
        self.H, self.K, self.Kc = a.num_heads, a.head_dim, a.conv_size
        P = self.H * self.K
        self.P, self.r = P, a.f_b_proj.weight.shape[1]
        self.W_in = _cat_w(a.q_proj, a.k_proj, a.v_proj, a.g_proj, a.f_a_proj, a.b_proj)   # [d, 4P + r + H]
        self.W_fb = a.f_b_proj.weight.detach().t().contiguous()
        self.W_o = a.o_proj.weight.detach().t().contiguous()
        self.conv_w = torch.stack([f32(a.q_conv1d.weight.detach()), f32(a.k_conv1d.weight.detach()),
                                   f32(a.v_conv1d.weight.detach())], 0).reshape(3, 1, P, self.Kc)
        sd = lc.state.dtype
        self.sd = sd
        H, K = self.H, self.K
        self.gate_a = A = a.A_log.detach().to(sd).reshape(H, 1).exp()           # exp(A_log) [H, 1]
        self.dt_bias = a.dt_bias.detach().to(sd).reshape(H, K)
        self.lb = a.lower_bound
        self.scale = K ** -0.5
        self.o_norm = f32(a.o_norm.weight.detach())
        self.eps = a.norm_eps
        self.lc = lc
        del A

    def __call__(self, x_Nd):
        N = x_Nd.shape[0]
        H, K, P, sd = self.H, self.K, self.P, self.sd
        dtype = x_Nd.dtype
        proj = x_Nd @ self.W_in
        qkv, g_lin, f_a, b_lin = proj.split([3 * P, P, self.r, H], -1)
        # short conv (fp32), new history = the last K-1 pre-activation inputs (exact in the activation dtype)
        conv = self.lc.conv                                                     # [3, N, P, Kc-1]
        ext = torch.cat([f32(conv), f32(qkv).view(N, 3, P).transpose(0, 1).unsqueeze(-1)], -1)  # [3,N,P,Kc]
        y = F.silu((ext * self.conv_w).sum(-1)).to(dtype)                       # [3, N, P]
        conv.copy_(ext[..., 1:])
        q, k, v = y.to(sd).view(3, N, H, K).unbind(0)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS) * self.scale
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
        # gate and beta
        f = (f_a @ self.W_fb).view(N, H, K)
        if self.lb is None:
            g = -self.gate_a * F.softplus(f.to(sd) + self.dt_bias)
        else:
            g = self.lb * torch.sigmoid(self.gate_a * (f.to(sd) + self.dt_bias))
        beta = torch.sigmoid(f32(b_lin)).to(sd)                                 # [N, H]
        # delta rule on the cached state, in place: S <- e^g S;  S += beta k (v - S^T k)^T;  o = S^T q
        S = self.lc.state                                                       # [N, H, K, V]
        S.mul_(g.exp().unsqueeze(-1))
        pred = (k.unsqueeze(-2) @ S).squeeze(-2)                                # [N, H, V]
        S.add_((beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - pred).unsqueeze(-2))
        o = (q.unsqueeze(-2) @ S).squeeze(-2).to(dtype)                         # recurrent_kda returns v.dtype
        o32 = _rms(f32(o), self.eps) * self.o_norm
        gate = torch.sigmoid(f32(g_lin)).view(N, H, K)
        return (o32 * gate).to(dtype).reshape(N, P) @ self.W_o


class _MLA:
    """Absorbed MLA decode over the fixed window. kernel "torch": scores for the whole window as one batched
    matmul, length mask, softmax, second matmul. kernel "triton": the split-K flash-decoding kernel of
    k3.ops.mla_decode_triton (reads only the visible latent rows, once; same math); it falls back to "torch"
    (logged once per reason) where triton is missing, on CPU without TRITON_INTERPRET=1, or for fp64 models.
    `self.kernel` is the path actually used."""

    _fallback_logged: set = set()

    def __init__(self, attn, lc: MLALayerCache, dtype, window: int, lens: torch.Tensor, rows: torch.Tensor,
                 kernel: str = "torch"):
        a = attn
        self.H, self.nope, self.rope = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim
        self.vdim, self.C = a.v_head_dim, a.kv_lora_rank
        self.qd = a.q_head_dim
        self.scale = a.softmax_scale
        self.lora = hasattr(a, "q_b_proj")
        first = [a.q_a_proj if self.lora else a.q_proj, a.kv_a_proj_with_mqa]
        self.gated = a.g_proj is not None
        self.W_in = _cat_w(*first, *([a.g_proj] if self.gated else []))
        self.split = [first[0].weight.shape[0], self.C + self.rope] + ([self.H * self.vdim] if self.gated else [])
        if self.lora:
            self.q_norm = _Norm(a.q_a_layernorm, dtype)
            self.W_qb = a.q_b_proj.weight.detach().t().contiguous()
        self.kv_norm = _Norm(a.kv_a_layernorm, dtype)
        self.cd = torch.float64 if dtype == torch.float64 else torch.float32
        W_UK, W_UV = a.absorbed_weights(self.cd)                                # [H, nope, C], [H, v, C]
        self.W_UK = W_UK.contiguous()
        self.W_UVt = W_UV.transpose(1, 2).contiguous()                          # [H, C, v]
        self.W_o = a.o_proj.weight.detach().t().contiguous()
        self.lc, self.window = lc, window
        self.lens, self.rows = lens, rows
        self.pos = torch.arange(window, device=lens.device)
        self.kernel, self.plan, self._decode = "torch", None, None
        if kernel == "triton":
            self._use_triton(lc)

    def _use_triton(self, lc: MLALayerCache) -> None:
        import logging
        why, mdt = None, None
        try:
            from k3.ops import mla_decode_triton as mdt
        except Exception as e:  # noqa: BLE001 - no (or a broken) triton: the torch path
            why = f"triton does not import ({e})"
        if why is None:
            why = mdt.unsupported_reason(lc.buf.device, lc.dtype, self.cd)
        if why is not None:
            if why not in _MLA._fallback_logged:
                _MLA._fallback_logged.add(why)
                logging.getLogger("k3").warning("StaticDecoder: mla_kernel='triton' unavailable (%s); using the "
                                                "torch path", why)
            return
        self.plan = mdt.plan(lc.buf.shape[0], self.H, self.window, self.C, self.rope, lc.dtype, lc.buf.device)
        # an opaque call under torch.compile (the launch plan is static; the kernels are launched eagerly)
        self._decode = torch.compiler.disable(mdt.mla_decode)
        self.kernel = "triton"

    def __call__(self, x_Nd):
        N = x_Nd.shape[0]
        H, C, cd = self.H, self.C, self.cd
        dtype = x_Nd.dtype
        parts = (x_Nd @ self.W_in).split(self.split, -1)
        q = self.q_norm(parts[0]) @ self.W_qb if self.lora else parts[0]
        q = q.view(N, H, self.qd)
        c_lat, k_pe = parts[1].split([C, self.rope], -1)
        new = torch.cat([self.kv_norm(c_lat), k_pe], -1).to(self.lc.dtype)      # what the cache stores
        # the write goes to the whole buffer, not to the window view: under torch.compile an index_put_ into a slice
        # is functionalized into a copy of the whole window per layer (1.2 GB per MLA layer at 1M); into the graph
        # input itself it stays in place (tests/generation/test_static_decode.py checks the compiled code)
        self.lc.buf.index_put_((self.rows, self.lens), new)
        buf = self.lc.buf[:, :self.window]                                      # [N, W, C + R], fixed address
        q_nope, q_pe = q.to(cd).split([self.nope, self.rope], -1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.W_UK).transpose(0, 1)    # [N, H, C]
        qf = torch.cat([q_lat, q_pe], -1) * self.scale                          # [N, H, C + R]
        if self._decode is not None:   # split-K Triton kernel: same o_lat, latent rows <= lens read once
            o_lat = self._decode(qf, buf, self.lens, C, self.plan if self.plan.N == N else None)
        else:
            s = bmm_acc(qf, buf.transpose(1, 2), cd)                            # [N, H, W]
            visible = (self.pos.unsqueeze(0) <= self.lens.unsqueeze(1)).unsqueeze(1)  # [N, 1, W]
            p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
            o_lat = bmm_acc(p, buf[..., :C], cd)                                # [N, H, C]
        o = torch.bmm(o_lat.transpose(0, 1), self.W_UVt).transpose(0, 1)       # [N, H, v]
        o = o.to(dtype).reshape(N, H * self.vdim)
        if self.gated:
            o = (f32(o) * torch.sigmoid(f32(parts[2]))).to(dtype)
        return o @ self.W_o


class _FFN:
    def __init__(self, ffn, dtype):
        from k3.nn.moe import LatentMoE
        self.moe = isinstance(ffn, LatentMoE)
        if not self.moe:
            self.glu, self.b1, self.b2 = ffn._glu, ffn.beta1, ffn.beta2
            self.I = ffn.gate_proj.weight.shape[0]
            self.W_gu = _cat_w(ffn.gate_proj, ffn.up_proj)
            self.W_d = ffn.down_proj.weight.detach().t().contiguous()
            return
        m = ffn
        self.glu_fn = m.glu
        self.E, self.k = m.gate.num_experts, m.gate.top_k
        self.renorm, self.scaling = m.gate.renormalize, m.gate.scaling
        self.W_r = f32(m.gate.weight.detach()).t().contiguous()                 # [d, E] fp32
        self.bias = f32(m.gate.e_score_correction_bias.detach())
        self.l = m.routed_expert_down_proj.weight.shape[0]
        sh = m.shared_experts
        self.shared = sh is not None
        lins = [m.routed_expert_down_proj] + ([sh.gate_proj, sh.up_proj] if self.shared else [])
        self.W_in = _cat_w(*lins)
        if self.shared:
            self.I = sh.gate_proj.weight.shape[0]
            self.sh_glu, self.b1, self.b2 = sh._glu, sh.beta1, sh.beta2
            self.W_sd = sh.down_proj.weight.detach().t().contiguous()
        self.gate_up = m.experts.gate_up_proj.detach().to(dtype)               # [E, l, 2M]
        self.down = m.experts.down_proj.detach().to(dtype)                     # [E, M, l]
        self.norm = _Norm(m.routed_expert_norm, dtype) if hasattr(m.routed_expert_norm, "weight") else None
        self.W_up = m.routed_expert_up_proj.weight.detach().t().contiguous()

    def __call__(self, x_Nd):
        if not self.moe:
            g, u = (x_Nd @ self.W_gu).split(self.I, -1)
            return self.glu(g, u, self.b1, self.b2) @ self.W_d
        N, k, E = x_Nd.shape[0], self.k, self.E
        scores = torch.sigmoid(f32(x_Nd) @ self.W_r)                            # [N, E]
        idx = torch.topk(scores + self.bias, k, dim=-1, sorted=True).indices
        w = scores.gather(1, idx)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.scaling                                                    # [N, k] fp32
        proj = x_Nd @ self.W_in
        x_l = proj[:, :self.l]
        if N * k <= E:   # gather the selected experts' weights: one bmm per projection
            gu = self.gate_up.index_select(0, idx.reshape(-1))                  # [N*k, l, 2M]
            x_k = x_l.unsqueeze(1).expand(N, k, self.l).reshape(N * k, 1, self.l)
            h = torch.bmm(x_k, gu)                                              # [N*k, 1, 2M]
            g, u = h.chunk(2, -1)
            y = torch.bmm(self.glu_fn(g, u), self.down.index_select(0, idx.reshape(-1)))  # [N*k, 1, l]
            out = (f32(y.view(N, k, self.l)) * w.unsqueeze(-1)).sum(1)
        else:            # every expert on every token, weights zero where not selected
            h = torch.bmm(x_l.unsqueeze(0).expand(E, N, self.l), self.gate_up)  # [E, N, 2M]
            g, u = h.chunk(2, -1)
            y = torch.bmm(self.glu_fn(g, u), self.down)                         # [E, N, l]
            wd = torch.zeros(N, E, dtype=w.dtype, device=w.device).scatter(1, idx, w)
            out = (f32(y) * wd.t().unsqueeze(-1)).sum(0)
        u_l = out.to(x_Nd.dtype)
        if self.norm is not None:
            u_l = self.norm(u_l)
        y = u_l @ self.W_up
        if self.shared:
            g, u = proj[:, self.l:].split(self.I, -1)
            y = y + self.sh_glu(g, u, self.b1, self.b2) @ self.W_sd
        return y


# ---------------------------------------------------------------------------------------------------- decoder
class StaticDecoder:
    """One decode step (one token per row for all `batch_size` rows of `cache`) with static shapes/addresses.

    max_length: MLA attention window W (tokens per row; default: the cache capacity, at least the current
    longest row + 1); the MLA buffers are reserved to W up front. cuda_graph: capture the step with
    torch.cuda.CUDAGraph on CUDA (default: True on CUDA). The first step runs eagerly (warm-up), the second is
    captured and every later one replays the graph. step(ids [B] or [B, 1] LongTensor) -> logits [B, V] fp32
    (a static buffer: read or copy it before the next step).
    compile: run the step through torch.compile (Inductor fuses the element-wise work, norms and mixes between the
    GEMMs: fewer kernels in the captured graph, whose ~2,300 launches are the 6 ms fixed cost per token of `small`
    on an H200). Off by default: the compile costs tens of seconds per decoder and its gain is not measured yet.
    mla_kernel: absorbed MLA attention as "torch" (batched matmuls + masked softmax over the whole window) or
    "triton" (split-K flash-decoding kernel, k3.ops.mla_decode_triton: reads each row's visible latent once;
    falls back to "torch", with a warning, where it cannot run). Default: $K3_MLA_DECODE, else "triton" on CUDA
    (measured on the H200, `small` at 1M context: all-MLA step 9.13 vs 26.65 ms, hybrid 6.94 vs 11.50 ms) and
    "torch" elsewhere."""

    def __init__(self, model, cache: K3Cache, batch_size: Optional[int] = None, max_length: Optional[int] = None,
                 cuda_graph: Optional[bool] = None, compile: bool = False, mla_kernel: Optional[str] = None):
        B = cache.batch_size if batch_size is None else int(batch_size)
        if B != cache.batch_size:
            raise ValueError(f"StaticDecoder: batch_size {B} != cache batch size {cache.batch_size}")
        self.model, self.cache, self.B = model, cache, B
        self.device, self.dtype = model.device, model.dtype
        if cache.dtype != self.dtype:
            raise ValueError(f"StaticDecoder: cache dtype {cache.dtype} != model dtype {self.dtype}")
        mla = [lc for lc in cache.layers if isinstance(lc, MLALayerCache)]
        self._mla_caches = mla
        if mla and any(lc.lengths != mla[0].lengths for lc in mla):
            raise ValueError("StaticDecoder: MLA layers hold different lengths")
        host = list(mla[0].lengths) if mla else list(cache.lengths)
        self.window = 0
        if mla:
            cap = max(mla[0].capacity, max(host) + 1)
            W = cap if max_length is None else max(int(max_length), max(host) + 1)
            cache.reserve(W)
            self.window = W
        self.cuda_graph = (self.device.type == "cuda") if cuda_graph is None else bool(cuda_graph)
        if self.cuda_graph and self.device.type != "cuda":
            raise ValueError("StaticDecoder: cuda_graph needs a CUDA model")
        self.ids = torch.zeros(B, dtype=torch.long, device=self.device)
        self.lens = torch.tensor(host, dtype=torch.long, device=self.device)   # MLA rows' lengths (device)
        self._host = host
        self.rows = torch.arange(B, device=self.device)
        self.graph = None
        self._steps = 0
        self.compile = bool(compile)
        if mla_kernel is None:
            import os
            mla_kernel = os.environ.get("K3_MLA_DECODE", "") or ("triton" if self.device.type == "cuda" else "torch")
        if mla_kernel not in ("torch", "triton"):
            raise ValueError(f"StaticDecoder: mla_kernel {mla_kernel!r} (expected 'torch' or 'triton')")
        self.mla_kernel = mla_kernel
        self.refresh_weights()

    # -------------------------------------------------------------- weights
    @torch.no_grad()
    def refresh_weights(self) -> None:
        """(Re)build the fused weights from the model's parameters (after loading/changing weights); drops any
        captured graph."""
        m, dtype = self.model, self.dtype
        self.embed = m.model.embed_tokens.weight.detach()
        self.lm_head = m.lm_head.weight.detach().t().contiguous()
        self.eps = m.config.rms_norm_eps
        self.layers = []
        from k3.model import _mix_weight
        for i, layer in enumerate(m.model.layers):
            lc = self.cache.layers[i]
            if layer.layer_type == "kda":
                attn = _KDA(layer.self_attn, lc, dtype)
            else:
                attn = _MLA(layer.self_attn, lc, dtype, self.window, self.lens, self.rows, self.mla_kernel)
            self.layers.append(dict(
                attn=attn, ffn=_FFN(layer.ffn, dtype), new_block=layer.layer_idx % layer.block_size == 0,
                in_norm=_Norm(layer.input_layernorm, dtype), post_norm=_Norm(layer.post_attention_layernorm, dtype),
                w_attn=_mix_weight(layer.self_attention_res_norm, layer.self_attention_res_proj).detach(),
                w_mlp=_mix_weight(layer.mlp_res_norm, layer.mlp_res_proj).detach(), eps=layer.res_eps))
        self.w_out = _mix_weight(m.model.output_attn_res_norm, m.model.output_attn_res_proj).detach()
        self.final_norm = _Norm(m.model.norm, dtype)
        self._ptrs = [lc.buf.data_ptr() for lc in self._mla_caches]
        self.graph = None
        self.logits = None
        # a fresh compiled callable per weight set (the fused weights are closed-over constants of the graph)
        self._step_fn = torch.compile(self._forward, dynamic=False) if self.compile else self._forward

    # -------------------------------------------------------------- the static step
    def _forward(self) -> torch.Tensor:
        partial = self.embed.index_select(0, self.ids)                          # [B, d]
        blocks: List[torch.Tensor] = []
        for L in self.layers:
            a_in = _mix(blocks + [partial], L["w_attn"], L["eps"]) if blocks else partial
            if L["new_block"]:
                blocks = blocks + [partial]
                partial = None
            y = L["attn"](L["in_norm"](a_in))
            partial = y if partial is None else partial + y
            m_in = _mix(blocks + [partial], L["w_mlp"], L["eps"])
            partial = partial + L["ffn"](L["post_norm"](m_in))
        h = self.final_norm(_mix(blocks + [partial], self.w_out, self.eps))
        if self._mla_caches:   # device lengths advance inside the step (one multi-tensor op)
            torch._foreach_add_([self.lens] + [lc.lengths_t for lc in self._mla_caches], 1)
        return f32(h @ self.lm_head)  # fp32 logits (fp64 for fp64 models)

    def _run(self) -> None:
        if not self.cuda_graph:
            out = self._step_fn()
            if self.logits is None:
                self.logits = out
            else:
                self.logits.copy_(out)
            return
        if self.logits is None:                                                 # warm-up: a real eager step
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                out = self._step_fn()
            torch.cuda.current_stream(self.device).wait_stream(s)
            self.logits = out.clone()
            return
        if self.graph is None:                                                  # capture records, runs nothing
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = self._step_fn()
                self.logits.copy_(out)
            self.graph = g
        self.graph.replay()

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; returns fp32 logits [B, V] (a static buffer)."""
        if [lc.buf.data_ptr() for lc in self._mla_caches] != self._ptrs:
            raise RuntimeError("StaticDecoder: an MLA buffer was reallocated; build a new StaticDecoder")
        if self.window and max(self._host) + 1 > self.window:
            raise RuntimeError(f"StaticDecoder: window of {self.window} tokens is full")
        self.ids.copy_(ids.reshape(self.B))
        self._run()
        self._steps += 1
        self._host = [n + 1 for n in self._host]
        for lc in self._mla_caches:
            lc.lengths = list(self._host)
        self.cache.advance(1)
        return self.logits


# ---------------------------------------------------------------------------------------------------- self-check
_CHECKED: "weakref.WeakKeyDictionary" = None  # type: ignore[assignment]


def self_check(model, steps: int = 3, tol: Optional[float] = None, cuda_graph: Optional[bool] = None) -> bool:
    """Whether the static step (CUDA-graph captured on CUDA) reproduces the normal cached decode for `model` on a
    scratch 2-row ragged batch over `steps` steps: max |logit diff| <= tol * max(1, max |logit|), tol 1e-4 for
    fp32/fp64 and 5e-2 for bf16/fp16. Any error counts as a failure (a warning says why). Cached per model,
    device and dtype."""
    import warnings
    global _CHECKED
    if _CHECKED is None:
        _CHECKED = weakref.WeakKeyDictionary()
    key = (str(model.device), model.dtype, cuda_graph)
    done = _CHECKED.setdefault(model, {})
    if key in done:
        return done[key]
    if tol is None:
        tol = 1e-4 if model.dtype in (torch.float32, torch.float64) else 5e-2
    ok = False
    try:
        with torch.inference_mode():
            V = model.config.vocab_size
            gen = torch.Generator(device="cpu").manual_seed(0)
            prompts = [torch.randint(0, V, (1, n), generator=gen).to(model.device) for n in (5, 3)]
            caches = [K3Cache.for_model(model, 2, max_length=16) for _ in range(2)]
            for c in caches:
                for i, p in enumerate(prompts):
                    model(p, cache=c.rows(i), logits_to_keep=1)
                    c.rows(i).advance(p.shape[1])
            dec = StaticDecoder(model, caches[1], 2, cuda_graph=cuda_graph)
            tok = torch.randint(0, V, (2, 1), generator=gen).to(model.device)
            ok = True
            for _ in range(steps):
                ref = f32(model(tok, cache=caches[0], logits_to_keep=1).logits[:, -1])
                caches[0].advance(1)
                out = dec.step(tok)
                err = float((ref - out).abs().max())
                scale = max(1.0, float(ref.abs().max()))
                if not err <= tol * scale:
                    warnings.warn(f"StaticDecoder self-check failed: max logit diff {err:.3g} (scale {scale:.3g})")
                    ok = False
                    break
                tok = ref.argmax(-1, keepdim=True)
    except Exception as e:  # noqa: BLE001 - fall back to the normal decode on any failure
        warnings.warn(f"StaticDecoder self-check raised {type(e).__name__}: {e}")
        ok = False
    done[key] = ok
    return ok
