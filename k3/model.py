"""K3ForCausalLM: embedding, the KDA/MLA layer pattern, Block Attention Residuals, head and (chunked) loss.

What is notable (spec §3):
- There is no residual stream. Each sub-layer reads a softmax mix (fp32) over depth sources: the embedding, the
  completed block sums, and the current partial block sum. Blocks are `attn_res_block_size` layers long.
  Nothing is detached.
- 3 of 4 layers are KDA (linear attention with bounded per-channel decay), the rest NoPE Gated MLA.
- Layer 0 has a dense SiTU-GLU FFN; the others a Stable LatentMoE.
- Packed sequences travel as `cu_seqlens` (batch size 1) and behave exactly like separate sequences.
- Labels are *aligned targets*: `labels[b, t]` is the token position t must predict (already shifted), -100 ignored.
- The loss can run in token chunks under activation checkpointing, so [T, vocab] logits never exist at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from k3.ops import f32
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3 import knobs
from k3.config import K3Config
from k3.nn.kda import KDAAttention
from k3.nn.mla import MLAAttention
from k3.nn.mlp import GLUMLP
from k3.nn.moe import LatentMoE, init_moe_
from k3.nn.mtp import MTPBlock, mtp_targets, shift_embeddings
from k3.nn.norm import RMSNorm
from k3.ops.attnres import ATTNRES_EPS, attnres_mix, attnres_mix_decode, mix_query
from k3.ops.loss import IGNORE_INDEX, ce_chunk_grad, linear_cross_entropy_sum


def ce_chunk_sum(lm_head: nn.Module, h_Nd: torch.Tensor, y_N: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk of tokens (fp32 logits). `k3.compile_model` swaps in a compiled copy
    (`K3ForCausalLM.ce_chunk`): Inductor fuses the fp32 cast, log-softmax and its backward into passes over the
    16-bit logits instead of materialising fp32 logits and log-probabilities."""
    return F.cross_entropy(f32(lm_head(h_Nd)), y_N, ignore_index=IGNORE_INDEX, reduction="sum")


@dataclass
class K3Output:
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = None
    # tokens that contributed to the loss: a 0-dim int64 tensor on the labels' device (reading it on the host, e.g.
    # int(out.num_tokens), waits for the GPU; the model itself never does, so a CUDA step has no host sync here)
    num_tokens: Union[int, torch.Tensor] = 0
    # with MTP blocks (config.num_nextn_predict_layers > 0) and labels: `loss` = main_loss + mtp_loss_weight *
    # mean(mtp_losses); main_loss the next-token loss alone, mtp_losses [k] the per-depth losses (k3/nn/mtp.py)
    main_loss: Optional[torch.Tensor] = None
    mtp_losses: Optional[torch.Tensor] = None


def _mix_weight(norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    return mix_query(norm.weight, proj.weight)


class LayerDecodeState:
    """Per-layer state of the shape-static decode step (`K3DecoderLayer.prepare_decode`): the attention's and the
    FFN's decode states, the norms', and the two AttnRes pseudo-queries in fp32."""
    __slots__ = ("attn", "ffn", "in_norm", "post_norm", "w_attn", "w_mlp")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw[k])


class DecodeState:
    """State of the shape-static decode step of the whole model (`K3ForCausalLM.prepare_decode`)."""
    __slots__ = ("embed", "lm_head", "layers", "w_out", "final_norm")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw[k])


class K3DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, layer_idx: int):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = layer_idx
        self.block_size = cfg.attn_res_block_size
        self.layer_type = cfg.layer_types[layer_idx]
        # attn_res_mode "none": a standard pre-norm residual stream, no AttnRes norms / pseudo-queries
        self.attn_res = cfg.attn_res_mode == "block"
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if self.attn_res:
            self.self_attention_res_norm = RMSNorm(d, eps)
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
        self.self_attn = KDAAttention(cfg, layer_idx) if self.layer_type == "kda" else MLAAttention(cfg, layer_idx)
        if cfg.is_moe_layer(layer_idx):
            self.block_sparse_moe = LatentMoE(cfg)
        else:
            self.mlp = GLUMLP(d, cfg.intermediate_size, cfg.hidden_act, cfg.activation_situ_beta,
                              cfg.activation_situ_linear_beta)
        self.res_eps = ATTNRES_EPS

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, partial: Optional[torch.Tensor], blocks: list, cu_seqlens=None, cache=None):
        """(partial sum of the current block, completed block sources) -> the same, after this layer (§3.2).
        attn_res_mode "none": `partial` is the residual stream h (blocks stay empty): h += attn(norm(h)),
        h += ffn(norm(h))."""
        if not self.attn_res:
            h = partial + self.self_attn(self.input_layernorm(partial), cu_seqlens=cu_seqlens, cache=cache)
            return h + self.ffn(self.post_attention_layernorm(h)), blocks
        if blocks:
            a_in = attnres_mix(blocks + [partial], _mix_weight(self.self_attention_res_norm,
                                                              self.self_attention_res_proj), self.res_eps)
        else:
            a_in = partial
        if self.layer_idx % self.block_size == 0:
            blocks = blocks + [partial]
            partial = None
        y = self.self_attn(self.input_layernorm(a_in), cu_seqlens=cu_seqlens, cache=cache)
        partial = y if partial is None else partial + y
        m_in = attnres_mix(blocks + [partial], _mix_weight(self.mlp_res_norm, self.mlp_res_proj), self.res_eps)
        partial = partial + self.ffn(self.post_attention_layernorm(m_in))
        return partial, blocks

    # ------------------------------------------------------------------ decode step (k3.generation.static)
    @torch.no_grad()
    def prepare_decode(self, layer_cache, dtype: torch.dtype, window: int, lens: torch.Tensor, rows: torch.Tensor,
                       mla_kernel: str = "torch") -> LayerDecodeState:
        """Fused weights of every part of this layer for `decode_step` (see the modules' `prepare_decode`)."""
        if self.layer_type == "kda":
            attn = self.self_attn.prepare_decode(layer_cache, dtype)
        else:
            attn = self.self_attn.prepare_decode(layer_cache, dtype, window, lens, rows, mla_kernel)
        return LayerDecodeState(
            attn=attn, ffn=self.ffn.prepare_decode(dtype), in_norm=self.input_layernorm.prepare_decode(dtype),
            post_norm=self.post_attention_layernorm.prepare_decode(dtype),
            w_attn=_mix_weight(self.self_attention_res_norm, self.self_attention_res_proj).detach()
            if self.attn_res else None,
            w_mlp=_mix_weight(self.mlp_res_norm, self.mlp_res_proj).detach() if self.attn_res else None)

    def decode_step(self, st: LayerDecodeState, partial: torch.Tensor, blocks: list):
        """`forward` for one token per cache row ([N, d] sources), shape-static: the modules' `decode_step`s and
        the AttnRes mix as one stacked softmax (k3.ops.attnres.attnres_mix_decode)."""
        if not self.attn_res:
            h = partial + self.self_attn.decode_step(st.attn, self.input_layernorm.decode_step(st.in_norm, partial))
            return h + self.ffn.decode_step(st.ffn, self.post_attention_layernorm.decode_step(st.post_norm, h)), blocks
        a_in = attnres_mix_decode(blocks + [partial], st.w_attn, self.res_eps) if blocks else partial
        if self.layer_idx % self.block_size == 0:
            blocks = blocks + [partial]
            partial = None
        y = self.self_attn.decode_step(st.attn, self.input_layernorm.decode_step(st.in_norm, a_in))
        partial = y if partial is None else partial + y
        m_in = attnres_mix_decode(blocks + [partial], st.w_mlp, self.res_eps)
        partial = partial + self.ffn.decode_step(st.ffn, self.post_attention_layernorm.decode_step(st.post_norm,
                                                                                                    m_in))
        return partial, blocks


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        d = cfg.hidden_size
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.attn_res = cfg.attn_res_mode == "block"
        if self.attn_res:
            self.output_attn_res_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(d, 1, bias=False)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gradient_checkpointing = False

    def forward(self, input_ids=None, inputs_embeds=None, cu_seqlens=None, cache=None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        partial, blocks = inputs_embeds, []
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            if self.gradient_checkpointing and self.training:
                partial, blocks = checkpoint(layer, partial, blocks, cu_seqlens, layer_cache, use_reentrant=False)
            else:
                partial, blocks = layer(partial, blocks, cu_seqlens=cu_seqlens, cache=layer_cache)
        if not self.attn_res:
            return self.norm(partial)
        h = attnres_mix(blocks + [partial], _mix_weight(self.output_attn_res_norm, self.output_attn_res_proj),
                        ATTNRES_EPS)
        return self.norm(h)


class K3ForCausalLM(nn.Module):
    def __init__(self, config: K3Config, init: bool = True):
        super().__init__()
        if not isinstance(config, K3Config):
            raise TypeError(f"K3ForCausalLM needs a K3Config, got {type(config).__name__}")
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # multi-token prediction (off by default, as released): k blocks after the model, k3/nn/mtp.py
        n_mtp = config.num_nextn_predict_layers
        self.mtp = nn.ModuleList(MTPBlock(config, i + 1) for i in range(n_mtp)) if n_mtp else None
        self.loss_chunk_size = 4096  # tokens per CE chunk; 0 = one shot
        self.ce_chunk = ce_chunk_sum  # (lm_head, h, y) -> summed CE; compile_model compiles it
        # training loss with its gradient formed in the forward pass (k3/ops/loss.py; the K3_FUSED_CE knob, read
        # here, k3/knobs.py: 0 = the checkpointed chunks, which recompute each chunk's logits in backward)
        self.fused_ce = knobs.get("K3_FUSED_CE")
        self.ce_grad = ce_chunk_grad  # (logits, y) -> (summed CE, dCE/dlogits); compile_model compiles it
        if init:
            self.reset_parameters()

    # ---------------------------------------------------------------- init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if name.endswith("_res_proj"):
                    nn.init.zeros_(m.weight)  # pseudo-queries start at 0: a uniform mix over sources
                else:
                    nn.init.normal_(m.weight, std=std)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, KDAAttention):
                m.reset_gate_parameters()
                nn.init.ones_(m.o_norm.weight)
            elif isinstance(m, LatentMoE):
                init_moe_(m, std)

    # ---------------------------------------------------------------- helpers
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def set_gradient_checkpointing(self, on: bool = True) -> None:
        self.model.gradient_checkpointing = on

    @classmethod
    def from_pretrained(cls, path: str, **kw) -> "K3ForCausalLM":
        from k3.checkpoint import from_pretrained
        return from_pretrained(path, **kw)

    def save_pretrained(self, path: str, **kw) -> None:
        from k3.checkpoint import save_pretrained
        save_pretrained(self, path, **kw)

    # ---------------------------------------------------------------- decode step (k3.generation.static)
    @torch.no_grad()
    def prepare_decode(self, cache, window: int, lens: torch.Tensor, rows: torch.Tensor,
                       mla_kernel: str = "torch") -> DecodeState:
        """Fused weights and preallocated views for `decode_step` on `cache` (every layer's `prepare_decode`);
        rebuild after changing the weights. window / lens / rows: see MLAAttention.prepare_decode."""
        m, dtype = self.model, self.dtype
        return DecodeState(
            embed=m.embed_tokens.weight.detach(), lm_head=self.lm_head.weight.detach().t().contiguous(),
            layers=[layer.prepare_decode(cache.layers[i], dtype, window, lens, rows, mla_kernel)
                    for i, layer in enumerate(m.layers)],
            w_out=_mix_weight(m.output_attn_res_norm, m.output_attn_res_proj).detach() if m.attn_res else None,
            final_norm=m.norm.prepare_decode(dtype))

    def decode_step(self, st: DecodeState, ids_N: torch.Tensor) -> torch.Tensor:
        """One token per cache row (ids [N]) -> logits [N, V] fp32 (fp64 for fp64 models); shape-static, no host
        reads (CUDA-graph capturable). Same math as `forward(ids[:, None], cache=cache)`; the caller advances the
        cache's lengths (host and device) after the step."""
        partial = st.embed.index_select(0, ids_N)                               # [N, d]
        blocks: list = []
        for layer, L in zip(self.model.layers, st.layers):
            partial, blocks = layer.decode_step(L, partial, blocks)
        if st.w_out is not None:
            partial = attnres_mix_decode(blocks + [partial], st.w_out, ATTNRES_EPS)
        h = self.model.norm.decode_step(st.final_norm, partial)
        return f32(h @ st.lm_head)

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                cache=None, logits_to_keep: int = 0, return_logits: Optional[bool] = None,
                routing: Optional[dict] = None) -> K3Output:
        """routing: replayed expert choices {router module name: LongTensor [tokens, k]} (-1 rows: routed live),
        e.g. a rollout's `GenerationOutput.routing`; the router still gets gradients (k3.rl.routing)."""
        if routing:
            from k3.rl.routing import replay_routing   # lazy: k3.rl imports the model
            with replay_routing(self, routing):
                return self.forward(input_ids, labels, cu_seqlens, inputs_embeds, cache, logits_to_keep,
                                    return_logits)
        self._check_inputs(input_ids, inputs_embeds, labels, cu_seqlens)
        h = self.model(input_ids, inputs_embeds, cu_seqlens=cu_seqlens, cache=cache)
        out = K3Output(hidden_states=h)
        if labels is not None:
            out.loss, out.num_tokens = self.loss(h, labels)
            if self.mtp is not None:
                emb = self.model.embed_tokens(input_ids) if input_ids is not None else inputs_embeds
                out.main_loss = out.loss
                losses = []
                for i, h_i in enumerate(self.mtp_hidden_states(h, emb, cu_seqlens)):
                    y_i = mtp_targets(labels, i + 1, cu_seqlens)
                    losses.append(self.loss(self.mtp[i].shared_head.norm(h_i), y_i)[0])
                out.mtp_losses = torch.stack(losses)
                out.loss = out.main_loss + self.config.mtp_loss_weight * out.mtp_losses.mean()
        if return_logits is None:
            return_logits = labels is None
        if return_logits:
            hk = h[:, -logits_to_keep:] if logits_to_keep else h
            out.logits = self.lm_head(hk)
        return out

    def mtp_hidden_states(self, h_BTd: torch.Tensor, emb_BTd: torch.Tensor, cu_seqlens=None) -> list:
        """Outputs h_1..h_k of the MTP blocks (before their shared_head.norm) for the model output `h_BTd` and the
        input embeddings `emb_BTd` of the same positions (teacher forcing: depth i reads the embedding of token
        t+i, zero past the end or across a document end)."""
        outs, prev = [], h_BTd
        for i, block in enumerate(self.mtp or ()):
            e = shift_embeddings(emb_BTd, i + 1, cu_seqlens)
            if self.model.gradient_checkpointing and self.training:
                prev = checkpoint(block, prev, e, cu_seqlens, None, use_reentrant=False)
            else:
                prev = block(prev, e, cu_seqlens=cu_seqlens)
            outs.append(prev)
        return outs

    def token_logprobs(self, input_ids: torch.Tensor, mask: Optional[torch.Tensor] = None, **kw):
        """log p(input_ids[b, t] | prefix) as fp32 [B, T], chunked over tokens (never [T, vocab] logits at once);
        k3.rl.logprobs.token_logprobs (keywords: cu_seqlens, chunk, return_entropy, temperature; `routing=`
        replays expert choices)."""
        from k3.rl.logprobs import token_logprobs   # lazy: k3.rl imports the model
        routing = kw.pop("routing", None)
        if routing:
            from k3.rl.routing import replay_routing
            with replay_routing(self, routing):
                return token_logprobs(self, input_ids, mask, **kw)
        return token_logprobs(self, input_ids, mask, **kw)

    def _check_inputs(self, input_ids, inputs_embeds, labels, cu_seqlens):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        ref = input_ids if input_ids is not None else inputs_embeds
        if ref.dim() < 2:
            raise ValueError(f"inputs must be [batch, seq], got shape {tuple(ref.shape)}")
        # range check on CPU only: on CUDA it would cost two host syncs per forward (the embedding kernel
        # asserts on bad ids there; generate/serve validate token ids at their entry points)
        if input_ids is not None and input_ids.numel() and input_ids.device.type == "cpu":
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"input_ids out of range [0, {self.config.vocab_size}): min {lo}, max {hi}")
        if labels is not None and tuple(labels.shape) != tuple(ref.shape[:2]):
            raise ValueError(f"labels shape {tuple(labels.shape)} != inputs shape {tuple(ref.shape[:2])}")
        if cu_seqlens is not None:
            if ref.shape[0] != 1:
                raise ValueError(f"cu_seqlens (packed sequences) needs batch size 1, got {ref.shape[0]}")
            if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
                raise ValueError(f"cu_seqlens must be 1-D with at least 2 boundaries, got shape "
                                 f"{tuple(cu_seqlens.shape)}")
            # one host read (a CUDA cu_seqlens costs one sync, not three)
            first, last, falls = torch.stack((cu_seqlens[0], cu_seqlens[-1],
                                              (cu_seqlens[1:] < cu_seqlens[:-1]).any().to(cu_seqlens.dtype))).tolist()
            if first != 0 or last != ref.shape[1] or falls:
                raise ValueError(f"cu_seqlens must rise from 0 to the sequence length {ref.shape[1]}, "
                                 f"got {cu_seqlens.tolist()[:8]}...")

    def loss(self, h_BTd: torch.Tensor, labels_BT: torch.Tensor):
        """(mean cross-entropy over non-ignored targets, their count as a 0-dim int64 tensor); computed in token
        chunks so only one [chunk, vocab] logits block is alive at a time (also in backward). No host sync: the
        mean divides by the count on the device."""
        h = h_BTd.reshape(-1, h_BTd.shape[-1])
        y = labels_BT.reshape(-1)
        n = (y != IGNORE_INDEX).sum()
        C = self.loss_chunk_size or h.shape[0]
        if self.fused_ce and torch.is_grad_enabled() and self.lm_head.bias is None \
                and (h.requires_grad or self.lm_head.weight.requires_grad):
            return linear_cross_entropy_sum(h, self.lm_head.weight, y, C, self.ce_grad) / n.clamp_min(1), n

        def ce_sum(hc, yc):
            return self.ce_chunk(self.lm_head, hc, yc)

        total = h.new_zeros((), dtype=f32(h).dtype)
        for s in range(0, h.shape[0], C):
            hc, yc = h[s:s + C], y[s:s + C]
            if torch.is_grad_enabled() and h.shape[0] > C:
                total = total + checkpoint(ce_sum, hc, yc, use_reentrant=False)
            else:
                total = total + ce_sum(hc, yc)
        return total / n.clamp_min(1), n
