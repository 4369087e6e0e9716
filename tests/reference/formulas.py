"""The K3 text model's math, restated in fp64 from the model description (docs/architecture.md §2-§3, per function).

Independent of the implementation on purpose: nothing here imports `k3.nn` or `k3.ops` (the tests check that),
no fused paths, no chunking, no caches. Every function takes plain fp64 tensors and a parameter dict keyed by
the **released** checkpoint names without the ``language_model.`` prefix (architecture.md §4.2: ``model.layers.L.self_attn.
q_proj.weight``, per-expert ``...experts.E.w1.weight`` / ``w3`` (gate / up) / ``w2`` (down), ``A_log`` zero-padded
to its storage size). Loops are written the way the spec states the math (the delta rule token by token, the
short conv tap by tap); only batch / head dimensions are vectorised.

In fp64 the spec's casts (bf16 outputs, "cast then multiply the weight") are identities, so they are not modelled;
what is tested is the order and placement of every operation.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

F64 = torch.float64

# eps values the spec fixes (not config keys): §3.3 AttnRes, §3.4 steps 3 and 7, §2 / §3.5 MLA latent norms
ATTNRES_EPS = 1e-5
KDA_L2_EPS = 1e-6
KDA_ONORM_EPS = 1e-5
MLA_LATENT_EPS = 1e-6
ROUTER_RENORM_EPS = 1e-20

Params = Mapping[str, torch.Tensor]


def _p(params: Params, name: str) -> torch.Tensor:
    return params[name].to(F64)


# ------------------------------------------------------------------------------------------------ elementwise
def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(x)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    e = torch.exp(x - x.amax(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True)


def linear(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """x · Wᵀ, W stored [out, in] (architecture.md §4.2: row-major like nn.Linear, no biases anywhere, §2)."""
    return x @ W.t()


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """§2: x / sqrt(mean(x²) + ε), then · w."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """§2: a = β₁·tanh(g/β₁)·σ(g); b = β₂·tanh(u/β₂); a·b. β₁ (=4) bounds the gated branch, β₂ (=25) the linear one."""
    a = beta1 * torch.tanh(g / beta1) * sigmoid(g)
    b = beta2 * torch.tanh(u / beta2)
    return a * b


def glu_mlp(x: torch.Tensor, W_gate: torch.Tensor, W_up: torch.Tensor, W_down: torch.Tensor, beta1: float,
            beta2: float) -> torch.Tensor:
    """§3.7 / §3.6 step 8: down(SiTU(gate(x), up(x)))."""
    return linear(situ_glu(linear(x, W_gate), linear(x, W_up), beta1, beta2), W_down)


# ------------------------------------------------------------------------------------------------ AttnRes
def attnres_mix(sources: Sequence[torch.Tensor], gamma: torch.Tensor, proj: torch.Tensor,
                eps: float = None) -> torch.Tensor:
    """§3.3 Mix: V = stacked sources (blocks in order, partial sum last); k_s = V_s / sqrt(mean(V_s²) + ε);
    w = γ ⊙ q (q = proj[0]); logit_s = Σ_d k_{s,d} w_d; α = softmax over s; out = Σ_s α_s V_s."""
    eps = ATTNRES_EPS if eps is None else eps
    V = torch.stack(list(sources), 0)
    k = V / torch.sqrt((V * V).mean(-1, keepdim=True) + eps)
    w = gamma * proj[0]
    logit = (k * w).sum(-1)
    alpha = softmax(logit, 0)
    return (alpha.unsqueeze(-1) * V).sum(0)


# ------------------------------------------------------------------------------------------------ KDA
def short_conv_silu(x_BTC: torch.Tensor, W_C1K: torch.Tensor) -> torch.Tensor:
    """§3.4 step 2: y[t,c] = SiLU(Σ_{j=0..K-1} W[c,0,j]·x[t−(K−1)+j, c]), zero history before the start."""
    B, T, C = x_BTC.shape
    K = W_C1K.shape[-1]
    y = torch.zeros_like(x_BTC)
    for t in range(T):
        for j in range(K):
            src = t - (K - 1) + j
            if src >= 0:
                y[:, t] = y[:, t] + W_C1K[:, 0, j] * x_BTC[:, src]
    return silu(y)


def kda_gate(f_BTHD: torch.Tensor, A_log_H: torch.Tensor, dt_bias_P: torch.Tensor,
             lower_bound: float) -> torch.Tensor:
    """§3.4 step 4: g[t,h,c] = lb·σ(exp(A_log[h])·(f[t,h,c] + dt_bias[h·D + c])) ∈ (lb, 0)."""
    H, D = f_BTHD.shape[-2:]
    return lower_bound * sigmoid(torch.exp(A_log_H).view(H, 1) * (f_BTHD + dt_bias_P.view(H, D)))


def gated_delta_rule(q_BTHD, k_BTHD, v_BTHV, g_BTHD, beta_BTH) -> torch.Tensor:
    """§3.4 step 6, token by token, state S [D(key), V(value)] per (batch, head), S = 0 at the start:
    S ← Diag(exp(g_t))·S;  S ← S + β_t·k_t(v_t − Sᵀk_t)ᵀ;  o_t = Sᵀq_t."""
    B, T, H, D = q_BTHD.shape
    S = q_BTHD.new_zeros(B, H, D, v_BTHV.shape[-1])
    outs = []
    for t in range(T):
        S = torch.exp(g_BTHD[:, t]).unsqueeze(-1) * S
        k, v, q = k_BTHD[:, t], v_BTHV[:, t], q_BTHD[:, t]
        Stk = torch.einsum("bhkv,bhk->bhv", S, k)
        S = S + beta_BTH[:, t, :, None, None] * torch.einsum("bhk,bhv->bhkv", k, v - Stk)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q))
    return torch.stack(outs, 1)


def kda_layer(x: torch.Tensor, params: Params, prefix: str, num_heads: int, head_dim: int,
              lower_bound: float) -> torch.Tensor:
    """§3.4 Kimi Delta Attention on an (already normed) input x [B,T,d]; `prefix` e.g. 'model.layers.0.self_attn.'."""
    B, T, _ = x.shape
    H, D = num_heads, head_dim
    p = lambda n: _p(params, prefix + n)  # noqa: E731
    # 1-2. projections, short conv + SiLU
    q1 = short_conv_silu(linear(x, p("q_proj.weight")), p("q_conv1d.weight")).view(B, T, H, D)
    k1 = short_conv_silu(linear(x, p("k_proj.weight")), p("k_conv1d.weight")).view(B, T, H, D)
    v1 = short_conv_silu(linear(x, p("v_proj.weight")), p("v_conv1d.weight")).view(B, T, H, D)
    # 3. L2 norm over D (ε 1e-6), q also scaled by D^-½
    qh = q1 / torch.sqrt((q1 * q1).sum(-1, keepdim=True) + KDA_L2_EPS) * D ** -0.5
    kh = k1 / torch.sqrt((k1 * k1).sum(-1, keepdim=True) + KDA_L2_EPS)
    # 4. low-rank decay gate, bounded below; A_log stored zero-padded: the first H entries are real
    f = linear(linear(x, p("f_a_proj.weight")), p("f_b_proj.weight")).view(B, T, H, D)
    g = kda_gate(f, p("A_log")[:H], p("dt_bias"), lower_bound)
    # 5. beta per head
    beta = sigmoid(linear(x, p("b_proj.weight")))
    # 6. gated delta rule
    o = gated_delta_rule(qh, kh, v1, g, beta)
    # 7. gated output norm: RMS over D (ε 1e-5), · o_norm.weight (shared by heads), · σ(g_proj x)
    G = linear(x, p("g_proj.weight")).view(B, T, H, D)
    y = o / torch.sqrt((o * o).mean(-1, keepdim=True) + KDA_ONORM_EPS) * p("o_norm.weight") * sigmoid(G)
    # 8. output projection
    return linear(y.reshape(B, T, H * D), p("o_proj.weight"))


# ------------------------------------------------------------------------------------------------ MLA
def mla_layer(x: torch.Tensor, params: Params, prefix: str, num_heads: int, qk_nope: int, qk_rope: int,
              v_dim: int) -> torch.Tensor:
    """§3.5 gated MLA, NoPE, expanded (MHA) form on an (already normed) input x [B,T,d]."""
    B, T, _ = x.shape
    H = num_heads
    p = lambda n: _p(params, prefix + n)  # noqa: E731
    # 1. q = q_b(RMSNorm(q_a(x); ε 1e-6))
    q = linear(rmsnorm(linear(x, p("q_a_proj.weight")), p("q_a_layernorm.weight"), MLA_LATENT_EPS),
               p("q_b_proj.weight")).view(B, T, H, qk_nope + qk_rope)
    # 2. c = kv_a(x) = [c_lat | k_pe]; k_pe shared by heads, neither normed nor rotated
    c = linear(x, p("kv_a_proj_with_mqa.weight"))
    kv_lora = c.shape[-1] - qk_rope
    c_lat, k_pe = c[..., :kv_lora], c[..., kv_lora:]
    # 3. kv = kv_b(RMSNorm(c_lat; ε 1e-6)) -> per head [k_nope | v]
    kv = linear(rmsnorm(c_lat, p("kv_a_layernorm.weight"), MLA_LATENT_EPS), p("kv_b_proj.weight"))
    kv = kv.view(B, T, H, qk_nope + v_dim)
    k = torch.cat([kv[..., :qk_nope], k_pe.unsqueeze(2).expand(B, T, H, qk_rope)], -1)
    v = kv[..., qk_nope:]
    # 4. causal softmax(Q·Kᵀ · (nope+rope)^-½), no positional encoding
    s = torch.einsum("bthd,bshd->bhts", q, k) * (qk_nope + qk_rope) ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    s = s.masked_fill(~causal, float("-inf"))
    o = torch.einsum("bhts,bshv->bthv", softmax(s, -1), v).reshape(B, T, H * v_dim)
    # 5. output gate σ(g_proj x) on the attention output, *before* o_proj
    return linear(o * sigmoid(linear(x, p("g_proj.weight"))), p("o_proj.weight"))


# ------------------------------------------------------------------------------------------------ LatentMoE
def router(x_Nd: torch.Tensor, params: Params, prefix: str, top_k: int, renormalize: bool = True,
           scaling: float = 1.0):
    """§3.6 steps 1-3: s = σ(x·W_rᵀ); I = top-k of (s + b); w = s_I / (Σ s_I + 1e-20) · scaling (b selects only).
    Returns (I [N,k], w [N,k], s [N,E])."""
    s = sigmoid(linear(x_Nd, _p(params, prefix + "gate.weight")))
    I = torch.topk(s + _p(params, prefix + "gate.e_score_correction_bias"), top_k, dim=-1).indices
    w = s.gather(1, I)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + ROUTER_RENORM_EPS)
    return I, w * scaling, s


def latent_moe(x: torch.Tensor, params: Params, prefix: str, num_experts: int, top_k: int, beta1: float,
               beta2: float, rms_eps: float, renormalize: bool = True, scaling: float = 1.0,
               use_norm: bool = True) -> torch.Tensor:
    """§3.6 Stable LatentMoE on an (already normed) x [..., d]; `prefix` e.g. 'model.layers.1.block_sparse_moe.'."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    p = lambda n: _p(params, prefix + n)  # noqa: E731
    I, w, _ = router(x, params, prefix, top_k, renormalize, scaling)
    # dense [N, E] combine weights: w where selected, 0 elsewhere
    W_NE = x.new_zeros(x.shape[0], num_experts).scatter(1, I, w)
    x_lat = linear(x, p("routed_expert_down_proj.weight"))                       # 4. latent
    u = x_lat.new_zeros(x_lat.shape)
    for e in range(num_experts):                                                 # 5-6. experts, combine
        y_e = glu_mlp(x_lat, p(f"experts.{e}.w1.weight"), p(f"experts.{e}.w3.weight"), p(f"experts.{e}.w2.weight"),
                      beta1, beta2)
        u = u + W_NE[:, e:e + 1] * y_e
    r = rmsnorm(u, p("routed_expert_norm.weight"), rms_eps) if use_norm else u  # 7. norm, up-projection
    out = linear(r, p("routed_expert_up_proj.weight"))
    out = out + glu_mlp(x, p("shared_experts.gate_proj.weight"), p("shared_experts.up_proj.weight"),  # 8-9.
                        p("shared_experts.down_proj.weight"), beta1, beta2)
    return out.view(shape)


# ------------------------------------------------------------------------------------------------ decoder
def layer_types(full_attn_layers_1based: Sequence[int], num_layers: int) -> list:
    """§1.2: MLA at the 1-indexed `full_attn_layers`, KDA elsewhere."""
    mla = set(full_attn_layers_1based)
    return ["mla" if i + 1 in mla else "kda" for i in range(num_layers)]


def decoder_layer(partial: torch.Tensor, blocks: list, params: Params, cfg, l: int):
    """§3.2 decoder layer l: (partial sum of the current block, completed block sources) -> the same, after it.
    `cfg` supplies sizes only (a k3.config.K3Config)."""
    lac = cfg.linear_attn_config
    eps = cfg.rms_norm_eps
    b1, b2 = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    P = lambda n: _p(params, n)  # noqa: E731
    pre = f"model.layers.{l}."
    # 1. attention read: mix over blocks + partial (only when a completed block exists)
    if blocks:
        a_in = attnres_mix(blocks + [partial], P(pre + "self_attention_res_norm.weight"),
                           P(pre + "self_attention_res_proj.weight"))
    else:
        a_in = partial
    # 2. block boundary: the partial sum becomes a completed block, the new partial starts empty
    if l % cfg.attn_res_block_size == 0:
        blocks = blocks + [partial]
        partial = None
    # 3. attention sub-layer
    h = rmsnorm(a_in, P(pre + "input_layernorm.weight"), eps)
    if layer_types(lac.full_attn_layers, cfg.num_hidden_layers)[l] == "kda":
        y = kda_layer(h, params, pre + "self_attn.", lac.num_heads, lac.head_dim, lac.gate_lower_bound)
    else:
        y = mla_layer(h, params, pre + "self_attn.", cfg.num_attention_heads, cfg.qk_nope_head_dim,
                      cfg.qk_rope_head_dim, cfg.v_head_dim)
    partial = y if partial is None else partial + y
    # 4-5. FFN read (always a mix: blocks is non-empty from layer 0 on), FFN sub-layer
    m_in = attnres_mix(blocks + [partial], P(pre + "mlp_res_norm.weight"), P(pre + "mlp_res_proj.weight"))
    h = rmsnorm(m_in, P(pre + "post_attention_layernorm.weight"), eps)
    if l < cfg.first_k_dense_replace:
        z = glu_mlp(h, P(pre + "mlp.gate_proj.weight"), P(pre + "mlp.up_proj.weight"),
                    P(pre + "mlp.down_proj.weight"), b1, b2)
    else:
        z = latent_moe(h, params, pre + "block_sparse_moe.", cfg.num_experts, cfg.num_experts_per_token, b1, b2,
                       eps, cfg.moe_renormalize, cfg.routed_scaling_factor, cfg.latent_moe_use_norm)
    return partial + z, blocks


def decoder(ids_BT: torch.Tensor, params: Params, cfg) -> torch.Tensor:
    """§3.1 whole text model -> logits [B,T,vocab]. `cfg` supplies sizes only (a k3.config.K3Config)."""
    P = lambda n: _p(params, n)  # noqa: E731
    partial, blocks = P("model.embed_tokens.weight")[ids_BT], []                 # 1-2.
    for l in range(cfg.num_hidden_layers):                                        # 3.
        partial, blocks = decoder_layer(partial, blocks, params, cfg, l)
    h = attnres_mix(blocks + [partial], P("model.output_attn_res_norm.weight"),   # 4.
                    P("model.output_attn_res_proj.weight"))
    h = rmsnorm(h, P("model.norm.weight"), cfg.rms_norm_eps)                      # 5.
    return linear(h, P("lm_head.weight"))                                         # 6.


# ------------------------------------------------------------------------------------------------ Quantile Balancing
def qb_bias_definition(scores_TE: torch.Tensor, top_k: int, bias_E: torch.Tensor) -> dict:
    """One Quantile-Balancing bias update written out (architecture.md §3.6 step 2: the bias is trained with QB; the update
    rule itself is listed in §9 as not pinned by the references, so this is the k3 rule restated literally).

    Per token i and expert j, with biased scores z = s + b:
      θ_ij = the k-th largest biased score among the experts other than j   (j's entry cut-off);
      m_ij = s_ij − θ_ij   (j is selected for i iff b_j > −m_ij, the other biases fixed);
      K = round(k·T/n) (clamped to [1, T−1]); q_j = midpoint of the K-th and (K+1)-th largest m_·j;
      b̂_j = −q_j;  b_new = b̂ − mean(b̂).
    Returns dict(margins [T,n], K, q [n], bias [n]) in fp64, computed by plain loops."""
    s = scores_TE.to(F64)
    z = s + bias_E.to(F64)
    T, n = s.shape
    m = torch.empty(T, n, dtype=F64)
    for i in range(T):
        for j in range(n):
            others = torch.cat([z[i, :j], z[i, j + 1:]])
            theta = torch.sort(others, descending=True).values[top_k - 1]
            m[i, j] = s[i, j] - theta
    K = min(max(int(round(top_k * T / n)), 1), T - 1)
    desc = torch.sort(m, dim=0, descending=True).values
    q = 0.5 * (desc[K - 1] + desc[K])
    bhat = -q
    return dict(margins=m, K=K, q=q, bias=bhat - bhat.mean())


def plain_quantile(x: torch.Tensor, p: float) -> torch.Tensor:
    """The textbook empirical p-quantile of each column (linear interpolation between order statistics at the
    fractional position (T−1)·p of the ascending sort; what numpy/torch.quantile compute by default)."""
    a = torch.sort(x.to(F64), dim=0).values
    T = a.shape[0]
    h = (T - 1) * p
    lo = int(math.floor(h))
    hi = min(lo + 1, T - 1)
    return a[lo] + (h - lo) * (a[hi] - a[lo])
