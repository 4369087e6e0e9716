"""Gated Multi-head Latent Attention without positional encoding (spec §3.5).

Expanded form (training/prefill): q = q_b(norm(q_a x)); c = kv_a x -> (c_lat, k_pe); k_nope, v = kv_b(norm(c_lat));
K = [k_nope || k_pe] (k_pe shared by heads, unrotated), causal softmax attention with scale (nope+rope)^-1/2,
output gated by sigmoid(g_proj x), then o_proj. The cache (when given) stores the normed latent + k_pe per token
(kv_lora + rope values), the compressed form an absorbed decode needs.
"""
from __future__ import annotations

from typing import Optional

import torch

from k3.ops import f32
from torch import nn

from k3.nn.norm import RMSNorm
from k3.ops.attention import causal_attention


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
        offset = 0
        if cache is not None:
            offset = cache.length
            c, k_pe = cache.update(c, k_pe)
        k, v = self.expand_kv(c, k_pe)
        o, ml = causal_attention(q, k, v, self.softmax_scale, cu_seqlens=cu_seqlens,
                                 return_max_logit=self.track_max_logit and self.training, q_offset=offset)
        if ml is not None:
            self.last_max_logit = ml
        return self.output(o, x_BTd)
