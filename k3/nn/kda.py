"""Kimi Delta Attention layer (spec §3.4): q/k/v projections + causal short conv (SiLU), low-rank decay gate
bounded below by `gate_lower_bound` (None: the unbounded Kimi-Linear gate -exp(A_log) softplus(f + dt_bias)),
beta = sigmoid(b_proj x), gated delta rule (k3.ops.kda.chunk_kda with the
gate and q/k L2 norm applied in-kernel), gated output RMSNorm (fp32, weight before the cast), o_proj.

With a cache (k3.generation.cache): the conv history and the fp32 recurrent state are read from / written back to
`cache.conv_state` / `cache.recurrent_state`; short inputs (T <= `recurrent_max_tokens`, i.e. decode steps) run
the token recurrence (`recurrent_kda`), longer ones (prefill chunks) the chunked kernel with `output_final_state`.
`cache.kda_mode` ("auto" | "recurrent" | "chunk") overrides the choice."""
from __future__ import annotations

import math
from typing import Optional

import torch

from k3.ops import f32
from torch import nn

from k3.nn.mlp import cat_weights
from k3.nn.norm import rms_scale
from k3.ops.conv import causal_conv1d
from k3.ops.kda import chunk_kda, recurrent_kda
from k3.ops.kda.common import L2NORM_EPS

# eps of the gated output RMSNorm (spec §3.4 step 7: 1e-5, a constant of the layer, not the config's rms_norm_eps)
O_NORM_EPS = 1e-5


class KDADecodeState:
    """Fused weights and the layer's cache for `KDAAttention.decode_step` (built by `prepare_decode`)."""
    __slots__ = ("W_in", "W_fb", "W_o", "conv_w", "gate_a", "dt_bias", "o_norm", "r", "sd", "cache")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw[k])


class KDAAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        lac = cfg.linear_attn_config
        d, H, K = cfg.hidden_size, lac.num_heads, lac.head_dim
        P = H * K
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, H, K
        self.lower_bound = lac.gate_lower_bound
        self.conv_size = lac.short_conv_kernel_size
        self.q_proj = nn.Linear(d, P, bias=False)
        self.k_proj = nn.Linear(d, P, bias=False)
        self.v_proj = nn.Linear(d, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, self.conv_size, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, self.conv_size, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, self.conv_size, groups=P, bias=False)
        self.f_a_proj = nn.Linear(d, cfg.kda_gate_low_rank, bias=False)
        self.f_b_proj = nn.Linear(cfg.kda_gate_low_rank, P, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(P, dtype=torch.float32))
        self.g_proj = nn.Linear(d, P, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K, dtype=torch.float32))
        self.o_proj = nn.Linear(P, d, bias=False)
        self.norm_eps = O_NORM_EPS
        self.backend: Optional[str] = None
        self.recurrent_max_tokens = 8  # with a cache: T <= this runs the recurrent (decode) path

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """A = 1 (A_log = 0) and dt_bias so the initial per-step decay exp(g) spans [0.5, 0.999] across channels:
        g = lb * sigmoid(dt) => dt = logit(g / lb); for the unbounded gate (lower_bound None) g = -softplus(dt)
        => dt = log(expm1(-g)) = log(1 / decay - 1). A spectrum of memory lengths at init (as Mamba's dt init)."""
        self.A_log.zero_()
        decay = torch.empty_like(self.dt_bias).uniform_(0.5, 0.999)
        if self.lower_bound is None:
            self.dt_bias.copy_(torch.log(1.0 / decay.double() - 1.0).to(self.dt_bias.dtype))
        else:
            r = (torch.log(decay) / self.lower_bound).clamp(1e-6, 1 - 1e-6)
            self.dt_bias.copy_(torch.log(r) - torch.log1p(-r))
        nn.init.uniform_(self.q_conv1d.weight, -1 / math.sqrt(self.conv_size), 1 / math.sqrt(self.conv_size))
        nn.init.uniform_(self.k_conv1d.weight, -1 / math.sqrt(self.conv_size), 1 / math.sqrt(self.conv_size))
        nn.init.uniform_(self.v_conv1d.weight, -1 / math.sqrt(self.conv_size), 1 / math.sqrt(self.conv_size))

    def _conv_step(self, x_BTd, conv_state):
        """Decode-time short conv for q, k and v at once (same math as causal_conv1d, fp32): a few new tokens
        against the carried K-1 pre-activation inputs. Returns ((q, k, v) [B,T,P] in x.dtype, new states)."""
        B, T, _ = x_BTd.shape
        P, Kc = self.num_heads * self.head_dim, self.conv_size
        x = torch.cat([self.q_proj(x_BTd), self.k_proj(x_BTd), self.v_proj(x_BTd)], -1)          # [B,T,3P]
        W = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0).reshape(3 * P, Kc)
        if conv_state[0] is None:
            hist = x.new_zeros(B, 3 * P, Kc - 1, dtype=f32(x).dtype)
        else:
            hist = f32(torch.cat(conv_state, 1))
        ext = torch.cat([hist, f32(x).transpose(1, 2)], -1)                                      # [B,3P,Kc-1+T]
        y = (ext.unfold(-1, Kc, 1) * f32(W).unsqueeze(1)).sum(-1)                                # [B,3P,T]
        y = torch.nn.functional.silu(y).transpose(1, 2).to(x_BTd.dtype)
        st = ext[..., -(Kc - 1):]
        return y.split(P, -1), st.split(P, 1)

    def forward(self, x_BTd: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, cache=None):
        B, T, _ = x_BTd.shape
        H, K = self.num_heads, self.head_dim
        conv_state = cache.conv_state if cache is not None else (None, None, None)
        want_state = cache is not None
        if cache is not None and cu_seqlens is None and T <= self.recurrent_max_tokens:
            (q, k, v), (sq, sk, sv) = self._conv_step(x_BTd, conv_state)
        else:
            q, sq = causal_conv1d(self.q_proj(x_BTd), self.q_conv1d.weight, conv_state[0], cu_seqlens, "silu",
                                  want_state)
            k, sk = causal_conv1d(self.k_proj(x_BTd), self.k_conv1d.weight, conv_state[1], cu_seqlens, "silu",
                                  want_state)
            v, sv = causal_conv1d(self.v_proj(x_BTd), self.v_conv1d.weight, conv_state[2], cu_seqlens, "silu",
                                  want_state)
        f_BTHK = self.f_b_proj(self.f_a_proj(x_BTd)).view(B, T, H, K)
        beta_BTH = torch.sigmoid(f32(self.b_proj(x_BTd)))
        kw = dict(scale=K ** -0.5, initial_state=cache.recurrent_state if cache is not None else None,
                  output_final_state=want_state, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound)
        mode = getattr(cache, "kda_mode", "auto") if cache is not None else "chunk"
        if mode == "recurrent" or (mode == "auto" and T <= self.recurrent_max_tokens):
            o_BTHK, S = recurrent_kda(q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, K), f_BTHK,
                                      beta_BTH, **kw)
        else:
            o_BTHK, S = chunk_kda(q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, K), f_BTHK, beta_BTH,
                                  backend=self.backend, **kw)
        if cache is not None:
            cache.conv_state = (sq, sk, sv)
            cache.recurrent_state = S
        o32 = f32(o_BTHK)
        o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.norm_eps) * f32(self.o_norm.weight)
        gate = torch.sigmoid(f32(self.g_proj(x_BTd))).view(B, T, H, K)
        y = (o32 * gate).to(x_BTd.dtype).reshape(B, T, H * K)
        return self.o_proj(y)

    # ------------------------------------------------------------------ decode step (k3.generation.static)
    @torch.no_grad()
    def prepare_decode(self, cache, dtype: torch.dtype) -> KDADecodeState:
        """Fused weights for `decode_step` on `cache` (a KDALayerCache whose conv history [3, B, P, Kc-1] and
        fp32 state [B, H, K, V] the step updates in place): one [d, 4P + r + H] matrix for q/k/v/g/f_a/b, the
        three conv filters stacked [3, 1, P, Kc] in fp32, exp(A_log) and dt_bias in the state dtype."""
        H, K = self.num_heads, self.head_dim
        P = H * K
        sd = cache.state.dtype
        return KDADecodeState(
            W_in=cat_weights(self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.f_a_proj, self.b_proj),
            W_fb=self.f_b_proj.weight.detach().t().contiguous(),
            W_o=self.o_proj.weight.detach().t().contiguous(),
            conv_w=torch.stack([f32(self.q_conv1d.weight.detach()), f32(self.k_conv1d.weight.detach()),
                                f32(self.v_conv1d.weight.detach())], 0).reshape(3, 1, P, self.conv_size),
            gate_a=self.A_log.detach().to(sd).reshape(H, 1).exp(),              # exp(A_log) [H, 1]
            dt_bias=self.dt_bias.detach().to(sd).reshape(H, K),
            o_norm=f32(self.o_norm.weight.detach()), r=self.f_b_proj.weight.shape[1], sd=sd, cache=cache)

    def decode_step(self, st: KDADecodeState, x_Nd: torch.Tensor) -> torch.Tensor:
        """One token per cache row, x [N, d] -> [N, d], shape-static (CUDA-graph capturable): the short conv for
        q/k/v as one [3, N, P, Kc] multiply-sum, the delta-rule step on the cache's state in place (no
        stack/unbind, no input validation). Same math as `forward` with a cache and T = 1."""
        N = x_Nd.shape[0]
        H, K = self.num_heads, self.head_dim
        P, sd = H * K, st.sd
        dtype = x_Nd.dtype
        proj = x_Nd @ st.W_in
        qkv, g_lin, f_a, b_lin = proj.split([3 * P, P, st.r, H], -1)
        # short conv (fp32), new history = the last K-1 pre-activation inputs (exact in the activation dtype)
        conv = st.cache.conv                                                    # [3, N, P, Kc-1]
        ext = torch.cat([f32(conv), f32(qkv).view(N, 3, P).transpose(0, 1).unsqueeze(-1)], -1)  # [3,N,P,Kc]
        y = torch.nn.functional.silu((ext * st.conv_w).sum(-1)).to(dtype)      # [3, N, P]
        conv.copy_(ext[..., 1:])
        q, k, v = y.to(sd).view(3, N, H, K).unbind(0)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS) * (K ** -0.5)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
        # gate and beta
        f = (f_a @ st.W_fb).view(N, H, K)
        if self.lower_bound is None:
            g = -st.gate_a * torch.nn.functional.softplus(f.to(sd) + st.dt_bias)
        else:
            g = self.lower_bound * torch.sigmoid(st.gate_a * (f.to(sd) + st.dt_bias))
        beta = torch.sigmoid(f32(b_lin)).to(sd)                                 # [N, H]
        # delta rule on the cached state, in place: S <- e^g S;  S += beta k (v - S^T k)^T;  o = S^T q
        S = st.cache.state                                                      # [N, H, K, V]
        S.mul_(g.exp().unsqueeze(-1))
        pred = (k.unsqueeze(-2) @ S).squeeze(-2)                                # [N, H, V]
        S.add_((beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - pred).unsqueeze(-2))
        o = (q.unsqueeze(-2) @ S).squeeze(-2).to(dtype)                         # recurrent_kda returns v.dtype
        o32 = rms_scale(f32(o), self.norm_eps) * st.o_norm
        gate = torch.sigmoid(f32(g_lin)).view(N, H, K)
        return (o32 * gate).to(dtype).reshape(N, P) @ st.W_o
