"""Multi-token prediction (MTP) blocks, DeepSeek-V3 style (architecture.md §3.8; off by default, as in the release).

`num_nextn_predict_layers = k > 0` adds k sequential blocks after the main model. Block i (1-based) at position t
reads the previous depth's hidden state h_{i-1}(t) (h_0 = the main model's output after the final norm) and the
embedding of token t+i, and predicts token t+1+i:

    x      = eh_proj(concat(enorm(embed(x_{t+i})), hnorm(h_{i-1}(t))))          [2d -> d]
    h_i    = x + attn(input_layernorm(x));  h_i += ffn(post_attention_layernorm(h_i))
    logits = lm_head(shared_head.norm(h_i))                                       (lm_head shared with the model)

The block is a gated NoPE MLA (full attention, document-causal under `cu_seqlens`) + the FFN of a MoE layer
(LatentMoE; a dense GLU when `num_experts == 0`). It starts WITHOUT Block-AttnRes state: inside the block a plain
pre-norm residual stream (no AttnRes norms / pseudo-queries), the main model's depth sources are not visible.

Names (k3 in memory -> released / vLLM layout, `L = num_hidden_layers`):
    mtp.{i}.{enorm,hnorm,eh_proj,shared_head.norm,input_layernorm,post_attention_layernorm,self_attn.*,
             block_sparse_moe.*|mlp.*}            <->  model.layers.{L+i}.<same suffix>
The released layout also carries `model.layers.{L+i}.shared_head.head.weight` and `model.layers.{L+i}.embed_tokens
.weight` (copies of lm_head / the embedding, as DeepSeek-V3 ships them and vLLM's MTP loader reads them); k3 shares
those with the main model, so on load they are dropped (see `released_key_to_model`).
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

import torch
from torch import nn

from k3.nn.mla import MLAAttention
from k3.nn.mlp import GLUMLP
from k3.nn.moe import LatentMoE
from k3.nn.norm import RMSNorm
from k3.ops.loss import IGNORE_INDEX

__all__ = ["MTPBlock", "MTPSharedHead", "mtp_targets", "mtp_input_mask", "model_key_to_released",
           "released_key_to_model", "mtp_released_state_dict", "SHARED_COPIES"]

# released per-block copies of shared tensors: suffix -> the k3 tensor it copies
SHARED_COPIES = {"shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": "model.embed_tokens.weight"}
_MTP_KEY = re.compile(r"^mtp\.(\d+)\.(.+)$")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class MTPSharedHead(nn.Module):
    """`shared_head`: the block's own output norm; the projection is the model's lm_head (shared, not stored)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(d, eps)


class MTPBlock(nn.Module):
    def __init__(self, cfg, depth: int):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.depth = depth                       # 1-based: predicts token t + 1 + depth
        self.layer_idx = cfg.num_hidden_layers + depth - 1
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.self_attn = MLAAttention(cfg, self.layer_idx)
        if cfg.num_experts > 0:
            self.block_sparse_moe = LatentMoE(cfg)
        else:
            self.mlp = GLUMLP(d, cfg.intermediate_size, cfg.hidden_act, cfg.activation_situ_beta,
                              cfg.activation_situ_linear_beta)
        self.shared_head = MTPSharedHead(d, eps)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, h_prev_BTd: torch.Tensor, emb_BTd: torch.Tensor, cu_seqlens=None, cache=None) -> torch.Tensor:
        """(h_{i-1}, embeddings of the tokens t+i) -> h_i (before shared_head.norm). `cache`: an MLALayerCache
        (generation) for this block's attention."""
        e = self.enorm(emb_BTd.to(h_prev_BTd.dtype))
        x = self.eh_proj(torch.cat([e, self.hnorm(h_prev_BTd)], dim=-1))
        h = x + self.self_attn(self.input_layernorm(x), cu_seqlens=cu_seqlens, cache=cache)
        return h + self.ffn(self.post_attention_layernorm(h))

    def logits(self, lm_head: nn.Module, h_BTd: torch.Tensor) -> torch.Tensor:
        return lm_head(self.shared_head.norm(h_BTd))


# ----------------------------------------------------------------------------------------------- targets
def _doc_end(T: int, cu_seqlens: Optional[torch.Tensor], device) -> torch.Tensor:
    """[T] exclusive end of each position's document (T without cu_seqlens)."""
    if cu_seqlens is None:
        return torch.full((T,), T, dtype=torch.long, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    pos = torch.arange(T, device=device)
    idx = torch.searchsorted(cu[1:], pos, right=True)         # document of each position
    return cu[1:][idx.clamp_max(cu.numel() - 2)]


def mtp_input_mask(T: int, depth: int, cu_seqlens: Optional[torch.Tensor], device) -> torch.Tensor:
    """[T] bool: position t of depth `depth` has its input token t+depth in its own document."""
    pos = torch.arange(T, device=device)
    return pos + depth < _doc_end(T, cu_seqlens, device)


def mtp_targets(labels_BT: torch.Tensor, depth: int, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Targets of MTP depth `depth` (1-based) from the model's aligned labels (labels[t] = token t+1):
    target[t] = labels[t + depth] = token t+1+depth when t+depth lies in t's document (packed documents:
    `cu_seqlens`, batch 1), else -100. A label the main loss ignores stays ignored."""
    B, T = labels_BT.shape
    out = torch.full_like(labels_BT, IGNORE_INDEX)
    if depth >= T:
        return out
    ok = mtp_input_mask(T, depth, cu_seqlens, labels_BT.device)[: T - depth]
    shifted = labels_BT[:, depth:]
    out[:, : T - depth] = torch.where(ok.unsqueeze(0), shifted, torch.full_like(shifted, IGNORE_INDEX))
    return out


def shift_embeddings(emb_BTd: torch.Tensor, depth: int, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """emb[:, t + depth] at position t (zeros past the end or across a document end)."""
    B, T, d = emb_BTd.shape
    out = emb_BTd.new_zeros(B, T, d)
    if depth < T:
        out[:, : T - depth] = emb_BTd[:, depth:]
        ok = mtp_input_mask(T, depth, cu_seqlens, emb_BTd.device)
        out = out * ok.view(1, T, 1).to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------- names
def model_key_to_released(key: str, num_hidden_layers: int) -> str:
    """`mtp.{i}.X` -> `model.layers.{L+i}.X`; other keys unchanged (no prefix)."""
    m = _MTP_KEY.match(key)
    return f"model.layers.{num_hidden_layers + int(m.group(1))}.{m.group(2)}" if m else key


def released_key_to_model(key: str, num_hidden_layers: int, prefix: str = "") -> Optional[str]:
    """Inverse of `model_key_to_released` on a released key (with `prefix`): `model.layers.{j}.X` for j >= L ->
    `mtp.{j-L}.X` (keeping the prefix); None for the per-block copies of shared tensors (SHARED_COPIES), which
    k3 does not store. Other keys unchanged."""
    body = key[len(prefix):] if prefix and key.startswith(prefix) else key
    m = _LAYER_KEY.match(body)
    if m is None or int(m.group(1)) < num_hidden_layers:
        return key
    suffix = m.group(2)
    if suffix in SHARED_COPIES:
        return None
    return f"{prefix if key.startswith(prefix) else ''}mtp.{int(m.group(1)) - num_hidden_layers}.{suffix}"


def mtp_released_state_dict(state_dict: Mapping[str, torch.Tensor], config) -> dict:
    """A k3 state dict with its MTP keys in the released naming, plus each block's copies of the shared lm_head
    and embedding (`SHARED_COPIES`); unchanged when the config has no MTP blocks."""
    n, L = int(getattr(config, "num_nextn_predict_layers", 0) or 0), config.num_hidden_layers
    if n == 0:
        return state_dict
    out = {model_key_to_released(k, L): v for k, v in state_dict.items()}
    head = state_dict.get("lm_head.weight", state_dict.get("model.embed_tokens.weight"))
    for i in range(n):
        for suffix, src in SHARED_COPIES.items():
            t = head if src == "lm_head.weight" else state_dict.get(src)
            if t is not None:
                out[f"model.layers.{L + i}.{suffix}"] = t
    return out


def mtp_key_shapes(config) -> dict:
    """`{name: (shape, dtype)}` of the MTP blocks' in-memory tensors (k3 names `mtp.{i}.*`), read off blocks built
    on the meta device (nothing is allocated); float dtype from `config.dtype` (fp32 for the fp32-kept names)."""
    from k3.checkpoint.adapter import is_fp32_key, torch_dtype
    n = int(config.num_nextn_predict_layers or 0)
    dt = torch_dtype(config.dtype)
    out = {}
    with torch.device("meta"):
        for i in range(n):
            for k, t in MTPBlock(config, i + 1).state_dict().items():
                name = f"mtp.{i}.{k}"
                out[name] = (tuple(t.shape), torch.float32 if is_fp32_key(name) else
                             (dt if t.is_floating_point() else t.dtype))
    return out


def mtp_released_key_shapes(config, quantize_experts: bool = False, prefix: str = "language_model.") -> dict:
    """`{released name: (shape, dtype)}` of the MTP blocks in the released layout (per-expert w1/w2/w3, MXFP4
    parts with `quantize_experts`, the per-block copies of lm_head / embedding), computed on the meta device."""
    from k3.checkpoint.adapter import released_plan, torch_dtype
    n = int(config.num_nextn_predict_layers or 0)
    if n == 0:
        return {}
    dt = torch_dtype(config.dtype)
    with torch.device("meta"):
        sd = {k: torch.empty(s, dtype=d) for k, (s, d) in mtp_key_shapes(config).items()}
        V, d = config.vocab_size, config.hidden_size
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"] = torch.empty(V, d, dtype=dt)
    sd = mtp_released_state_dict(sd, config)
    sd.pop("lm_head.weight")
    sd.pop("model.embed_tokens.weight")
    return {e.key: (tuple(e.shape), e.dtype) for e in released_plan(sd, config, quantize_experts, prefix)}
