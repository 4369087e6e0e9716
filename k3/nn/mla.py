"""Gated Multi-head Latent Attention without positional encoding (spec §3.5).

Expanded form (training/prefill): q = q_b(norm(q_a x)); c = kv_a x -> (c_lat, k_pe); k_nope, v = kv_b(norm(c_lat));
K = [k_nope || k_pe] (k_pe shared by heads, unrotated), causal softmax attention with scale (nope+rope)^-1/2,
output gated by sigmoid(g_proj x), then o_proj. The cache (when given) stores the normed latent + k_pe per token
(kv_lora + rope values), the compressed form an absorbed decode needs.

With a cache (k3.generation.cache.MLALayerCache or a row view of it) two paths give the same result:
- absorbed (spec §7; default for T <= `absorb_max_tokens`, i.e. decode): kv_b's k part is folded into the query,
  q~_h = W_UK,h^T q_nope,h, and its v part into the output, o_h = W_UV,h sum_t a_t c_t; one shared 576-wide KV
  "head" (MQA form), nothing is expanded per cached token. Math in fp32 (fp64 for fp64 models).
- expanded (prefill chunks): k_nope, v = kv_b(cached latents) and causal attention with q_offset.
Rows may hold different lengths (ragged batches): query i of row b sees keys j <= start_b + i.
`cache.mla_mode` ("auto" | "absorbed" | "expanded") overrides the choice.
Packed documents (batch 1 + cu_seqlens) with a cache need a packed view (`K3Cache.packed(rows)`): document n's
latents go to its own row and its queries see only that row, by the path the document alone would take.
"""
from __future__ import annotations

from typing import Optional

import torch

from k3.ops import f32
from torch import nn

from k3.nn.mlp import cat_weights
from k3.nn.norm import RMSNorm
from k3.ops.attention import causal_attention


_OUT_DTYPE_OK: dict = {}


def out_dtype_matmul_ok(device: torch.device, dtype: torch.dtype, acc: torch.dtype = torch.float32) -> bool:
    """Whether torch.bmm(a, b, out_dtype=acc) works for `dtype` inputs on `device` (CUDA bf16/fp16 -> fp32)."""
    key = (device.type, dtype, acc)
    if key not in _OUT_DTYPE_OK:
        ok = False
        if dtype != acc and device.type == "cuda":
            try:
                a = torch.zeros(1, 2, 8, dtype=dtype, device=device)
                ok = torch.bmm(a, a.transpose(1, 2), out_dtype=acc).dtype == acc
            except Exception:  # noqa: BLE001 - any failure: use the upcast fallback
                ok = False
        _OUT_DTYPE_OK[key] = ok
    return _OUT_DTYPE_OK[key]


def bmm_acc(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b (batched) with the result in `acc`: b (a cached low-precision tensor) is never upcast as a whole when
    the device supports `out_dtype` (a is rounded to b's dtype instead); else both are upcast."""
    if b.dtype == acc:
        return torch.matmul(a.to(acc), b)
    if out_dtype_matmul_ok(b.device, b.dtype, acc):
        return torch.bmm(a.to(b.dtype), b, out_dtype=acc)
    return torch.matmul(a.to(acc), b.to(acc))



def _joint_latent(c_BSC, kpe_BSR):
    """[c || k_pe] as one [B, S, C + R] tensor: a view of the cache buffer when both are its adjacent slices
    (MLALayerCache.update returns such views), else a concatenation."""
    C, R = c_BSC.shape[-1], kpe_BSR.shape[-1]
    if (c_BSC.stride() == kpe_BSR.stride() and c_BSC.stride(-1) == 1
            and kpe_BSR.data_ptr() == c_BSC.data_ptr() + C * c_BSC.element_size()):
        return c_BSC.as_strided(c_BSC.shape[:-1] + (C + R,), c_BSC.stride())
    return torch.cat([c_BSC, kpe_BSR], -1)


_DECODE_FALLBACK_LOGGED: set = set()


class MLADecodeState:
    """Fused weights, the layer's cache and the decode window for `MLAAttention.decode_step` (built by
    `prepare_decode`). `kernel` is the attention path actually used ("torch" or "triton")."""
    __slots__ = ("W_in", "split", "q_norm", "W_qb", "kv_norm", "cd", "W_UK", "W_UVt", "W_o", "cache", "window",
                 "lens", "rows", "pos", "kernel", "plan", "decode")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))


class MLAAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        d, H = cfg.hidden_size, cfg.num_attention_heads
        self.layer_idx, self.num_heads = layer_idx, H
        self.qk_nope_head_dim, self.qk_rope_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.q_head_dim = cfg.qk_head_dim
        self.softmax_scale = self.q_head_dim ** -0.5
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_latent_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * self.q_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d, H * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_latent_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.g_proj = nn.Linear(d, H * cfg.v_head_dim, bias=False) if cfg.mla_use_output_gate else None
        self.o_proj = nn.Linear(H * cfg.v_head_dim, d, bias=False)
        self.track_max_logit = False
        self.absorb_max_tokens = 16  # with a cache: T <= this uses the absorbed (decode) path
        self.last_max_logit: Optional[torch.Tensor] = None

    def project_q(self, x_BTd):
        B, T, _ = x_BTd.shape
        if hasattr(self, "q_b_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTd)))
        else:
            q = self.q_proj(x_BTd)
        return q.view(B, T, self.num_heads, self.q_head_dim)

    def project_latent(self, x_BTd):
        """(normed latent c [B,T,kv_lora], k_pe [B,T,rope]) — what the cache stores."""
        c = self.kv_a_proj_with_mqa(x_BTd)
        c_lat, k_pe = c.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(c_lat), k_pe

    def expand_kv(self, c_BTc, k_pe_BTr):
        B, T, _ = c_BTc.shape
        H = self.num_heads
        kv = self.kv_b_proj(c_BTc).view(B, T, H, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe_BTr.unsqueeze(2).expand(B, T, H, self.qk_rope_head_dim)], dim=-1)
        return k, v

    def output(self, o_BTHv, x_BTd):
        B, T = x_BTd.shape[:2]
        o = o_BTHv.reshape(B, T, -1)
        if self.g_proj is not None:
            o = (f32(o) * torch.sigmoid(f32(self.g_proj(x_BTd)))).to(x_BTd.dtype)
        return self.o_proj(o)

    def forward(self, x_BTd: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, cache=None):
        q = self.project_q(x_BTd)
        c, k_pe = self.project_latent(x_BTd)
        if cache is not None:
            if cu_seqlens is not None:
                if not getattr(cache, "packed", False):
                    raise ValueError("MLA: cu_seqlens (packed documents) need a packed cache view "
                                     "(K3Cache.packed(rows)), not a plain cache")
                return self._forward_packed(q, c, k_pe, x_BTd, cache, cu_seqlens)
            return self._forward_cached(q, c, k_pe, x_BTd, cache)
        k, v = self.expand_kv(c, k_pe)
        o, ml = causal_attention(q, k, v, self.softmax_scale, cu_seqlens=cu_seqlens,
                                 return_max_logit=self.track_max_logit and self.training)
        if ml is not None:
            self.last_max_logit = ml
        return self.output(o, x_BTd)

    # ------------------------------------------------------------------ cached paths
    def _forward_cached(self, q, c, k_pe, x_BTd, cache):
        T = x_BTd.shape[1]
        uniform = cache.uniform_length()          # int when every row holds the same length, else None
        starts = cache.lengths_tensor().clone()   # [B] positions of the first new token per row
        c_all, kpe_all = cache.update(c, k_pe)    # [B, S, kv_lora], [B, S, rope] (S = longest row)
        mode = getattr(cache, "mla_mode", "auto")
        if mode == "absorbed" or (mode == "auto" and T <= self.absorb_max_tokens):
            o = self.absorbed_attention(q, c_all, kpe_all, starts)
        elif uniform is not None:
            k, v = self.expand_kv(c_all, kpe_all)
            o, _ = causal_attention(q, k, v, self.softmax_scale, q_offset=uniform)
        else:
            o = self.expanded_attention_masked(q, c_all, kpe_all, starts)
        return self.output(o.to(x_BTd.dtype), x_BTd)

    def _forward_packed(self, q, c, k_pe, x_BTd, cache, cu_seqlens):
        """Packed documents (batch 1) each continuing its own cache row: document n's latents are appended to its
        row and its queries attend to that row only, by the same path a forward of that document alone would take
        (absorbed for <= absorb_max_tokens new tokens, else expanded with q_offset)."""
        cu = [int(x) for x in cu_seqlens.tolist()]
        mode = getattr(cache, "mla_mode", "auto")
        outs = []
        for n in range(len(cu) - 1):
            a, b = cu[n], cu[n + 1]
            if b == a:
                continue
            start = cache.doc_length(n)
            c_all, kpe_all = cache.update_doc(n, c[:, a:b], k_pe[:, a:b])
            if mode == "absorbed" or (mode == "auto" and b - a <= self.absorb_max_tokens):
                starts = torch.full((1,), start, dtype=torch.long, device=q.device)
                o = self.absorbed_attention(q[:, a:b], c_all, kpe_all, starts)
            else:
                k, v = self.expand_kv(c_all, kpe_all)
                o, _ = causal_attention(q[:, a:b], k, v, self.softmax_scale, q_offset=start)
            outs.append(o.to(x_BTd.dtype))
        return self.output(torch.cat(outs, 1), x_BTd)

    @staticmethod
    def _visible(starts_B, T: int, S: int, device) -> torch.Tensor:
        """[B, 1, T, S] bool: key j visible to query i of row b iff j <= starts[b] + i."""
        qi = starts_B.view(-1, 1, 1) + torch.arange(T, device=device).view(1, T, 1)
        return (torch.arange(S, device=device).view(1, 1, S) <= qi).unsqueeze(1)

    def absorbed_weights(self, dtype):
        """(W_UK [H, nope, kv_lora], W_UV [H, v, kv_lora]) from kv_b_proj, in `dtype`."""
        W = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return W[:, :self.qk_nope_head_dim].to(dtype), W[:, self.qk_nope_head_dim:].to(dtype)

    def absorbed_attention(self, q_BTHD, c_BSC, kpe_BSR, starts_B):
        """Absorbed (MQA-form) attention over the compressed cache; returns o [B,T,H,v] in fp32/fp64."""
        B, T, H, _ = q_BTHD.shape
        S = c_BSC.shape[1]
        cd = torch.float64 if q_BTHD.dtype == torch.float64 else torch.float32
        W_UK, W_UV = self.absorbed_weights(cd)
        q_nope, q_pe = q_BTHD.to(cd).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_lat = torch.einsum("bthd,hdc->bhtc", q_nope, W_UK)                     # q~ [B,H,T,kv_lora]
        if c_BSC.dtype != cd:   # low-precision cache: never an upcast copy of it where out_dtype matmuls exist
            C = self.kv_lora_rank
            qf = torch.cat([q_lat, q_pe.transpose(1, 2)], -1) if self.qk_rope_head_dim else q_lat
            lat = c_BSC if not self.qk_rope_head_dim else _joint_latent(c_BSC, kpe_BSR)
            s = bmm_acc(qf.reshape(B, H * T, -1), lat.transpose(1, 2), cd).view(B, H, T, S)
            s = s * self.softmax_scale
            s = s.masked_fill(~self._visible(starts_B, T, S, q_BTHD.device), float("-inf"))
            p = torch.softmax(s, dim=-1)
            o_lat = bmm_acc(p.reshape(B, H * T, S), lat[..., :C], cd).view(B, H, T, C).transpose(1, 2)
            return torch.einsum("bthc,hvc->bthv", o_lat, W_UV)
        c = c_BSC.to(cd)
        s = torch.einsum("bhtc,bsc->bhts", q_lat, c)
        if self.qk_rope_head_dim:
            s = s + torch.einsum("bthr,bsr->bhts", q_pe, kpe_BSR.to(cd))
        s = s * self.softmax_scale
        s = s.masked_fill(~self._visible(starts_B, T, S, q_BTHD.device), float("-inf"))
        p = torch.softmax(s, dim=-1)
        o_lat = torch.einsum("bhts,bsc->bthc", p, c)                              # o-bar [B,T,H,kv_lora]
        return torch.einsum("bthc,hvc->bthv", o_lat, W_UV)

    def expanded_attention_masked(self, q_BTHD, c_BSC, kpe_BSR, starts_B):
        """Expanded attention for rows of different lengths (explicit [B,1,T,S] mask)."""
        B, T, H, _ = q_BTHD.shape
        S = c_BSC.shape[1]
        k, v = self.expand_kv(c_BSC, kpe_BSR)
        cd = torch.float64 if q_BTHD.dtype == torch.float64 else torch.float32
        m = self._visible(starts_B, T, S, q_BTHD.device)
        o = torch.nn.functional.scaled_dot_product_attention(
            q_BTHD.transpose(1, 2).to(cd), k.transpose(1, 2).to(cd), v.transpose(1, 2).to(cd), attn_mask=m,
            scale=self.softmax_scale)
        return o.transpose(1, 2)

    # ------------------------------------------------------------------ decode step (k3.generation.static)
    @torch.no_grad()
    def prepare_decode(self, cache, dtype: torch.dtype, window: int, lens: torch.Tensor, rows: torch.Tensor,
                       kernel: str = "torch") -> MLADecodeState:
        """Fused weights for `decode_step` over the fixed window [0, window) of `cache` (an MLALayerCache reserved
        to at least `window`): one [d, q + C + R (+ H v)] matrix for q_a (or q) / kv_a / g, the absorbed W_UK and
        W_UV^T per head in the compute dtype (fp32, fp64 for fp64 models). `lens` [N] (device): each row's length
        before the step (where the new latent is written); `rows` = arange(N). kernel "torch": scores over the
        whole window as one batched matmul, length mask, softmax, second matmul; "triton": the split-K
        flash-decoding kernel of k3.ops.mla_decode_triton (reads only the visible latent rows, once; same math);
        it falls back to "torch" (logged once per reason) where triton is missing, on CPU without
        TRITON_INTERPRET=1, or for fp64 models."""
        lora = hasattr(self, "q_b_proj")
        first = [self.q_a_proj if lora else self.q_proj, self.kv_a_proj_with_mqa]
        gated = self.g_proj is not None
        C, R = self.kv_lora_rank, self.qk_rope_head_dim
        cd = torch.float64 if dtype == torch.float64 else torch.float32
        W_UK, W_UV = self.absorbed_weights(cd)                                  # [H, nope, C], [H, v, C]
        st = MLADecodeState(
            W_in=cat_weights(*first, *([self.g_proj] if gated else [])),
            split=[first[0].weight.shape[0], C + R] + ([self.num_heads * self.v_head_dim] if gated else []),
            q_norm=self.q_a_layernorm.prepare_decode(dtype) if lora else None,
            W_qb=self.q_b_proj.weight.detach().t().contiguous() if lora else None,
            kv_norm=self.kv_a_layernorm.prepare_decode(dtype), cd=cd,
            W_UK=W_UK.contiguous(), W_UVt=W_UV.transpose(1, 2).contiguous(),   # [H, C, v]
            W_o=self.o_proj.weight.detach().t().contiguous(), cache=cache, window=window, lens=lens, rows=rows,
            pos=torch.arange(window, device=lens.device), kernel="torch")
        if kernel == "triton":
            self._decode_use_triton(st)
        return st

    def _decode_use_triton(self, st: MLADecodeState) -> None:
        import logging
        why, mdt = None, None
        lc = st.cache
        try:
            from k3.ops import mla_decode_triton as mdt
        except Exception as e:  # noqa: BLE001 - no (or a broken) triton: the torch path
            why = f"triton does not import ({e})"
        if why is None:
            why = mdt.unsupported_reason(lc.buf.device, lc.dtype, st.cd)
        if why is not None:
            if why not in _DECODE_FALLBACK_LOGGED:
                _DECODE_FALLBACK_LOGGED.add(why)
                logging.getLogger("k3").warning("StaticDecoder: mla_kernel='triton' unavailable (%s); using the "
                                                "torch path", why)
            return
        st.plan = mdt.plan(lc.buf.shape[0], self.num_heads, st.window, self.kv_lora_rank, self.qk_rope_head_dim,
                           lc.dtype, lc.buf.device)
        # an opaque call under torch.compile (the launch plan is static; the kernels are launched eagerly)
        st.decode = torch.compiler.disable(mdt.mla_decode)
        st.kernel = "triton"

    def decode_step(self, st: MLADecodeState, x_Nd: torch.Tensor) -> torch.Tensor:
        """Absorbed MLA for one token per cache row, x [N, d] -> [N, d], shape-static (CUDA-graph capturable):
        the new latent is written at each row's length (`st.lens`, a device tensor), and attention runs over the
        whole preallocated window with a length mask instead of slicing to the current length; scores read the
        cached [c || k_pe] rows in one batched matmul (q~ and q_pe concatenated). A low-precision cache is not
        upcast as a whole on CUDA (`bmm_acc`). The caller advances `st.lens` after the step."""
        N = x_Nd.shape[0]
        H, C, cd = self.num_heads, self.kv_lora_rank, st.cd
        dtype = x_Nd.dtype
        parts = (x_Nd @ st.W_in).split(st.split, -1)
        q = self.q_a_layernorm.decode_step(st.q_norm, parts[0]) @ st.W_qb if st.q_norm is not None else parts[0]
        q = q.view(N, H, self.q_head_dim)
        c_lat, k_pe = parts[1].split([C, self.qk_rope_head_dim], -1)
        lc = st.cache
        new = torch.cat([self.kv_a_layernorm.decode_step(st.kv_norm, c_lat), k_pe], -1).to(lc.dtype)  # cached
        # the write goes to the whole buffer, not to the window view: under torch.compile an index_put_ into a slice
        # is functionalized into a copy of the whole window per layer (1.2 GB per MLA layer at 1M); into the graph
        # input itself it stays in place (tests/generation/test_static_decode.py checks the compiled code)
        lc.buf.index_put_((st.rows, st.lens), new)
        buf = lc.buf[:, :st.window]                                             # [N, W, C + R], fixed address
        q_nope, q_pe = q.to(cd).split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), st.W_UK).transpose(0, 1)      # [N, H, C]
        qf = torch.cat([q_lat, q_pe], -1) * self.softmax_scale                  # [N, H, C + R]
        if st.decode is not None:   # split-K Triton kernel: same o_lat, latent rows <= lens read once
            o_lat = st.decode(qf, buf, st.lens, C, st.plan if st.plan.N == N else None)
        else:
            s = bmm_acc(qf, buf.transpose(1, 2), cd)                            # [N, H, W]
            visible = (st.pos.unsqueeze(0) <= st.lens.unsqueeze(1)).unsqueeze(1)  # [N, 1, W]
            p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
            o_lat = bmm_acc(p, buf[..., :C], cd)                                # [N, H, C]
        o = torch.bmm(o_lat.transpose(0, 1), st.W_UVt).transpose(0, 1)         # [N, H, v]
        o = o.to(dtype).reshape(N, H * self.v_head_dim)
        if self.g_proj is not None:
            o = (f32(o) * torch.sigmoid(f32(parts[2]))).to(dtype)
        return o @ st.W_o
