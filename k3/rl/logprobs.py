"""Per-token log-probabilities (and entropies) for RL, chunked over tokens from the final hidden states.

`token_logprobs(model, input_ids, mask)` runs the model body once (`return_logits=False`: no [T, V] logits), then
feeds only the positions whose *next* token is wanted through the head in chunks of `chunk` tokens, in fp32:
at most one [chunk, V] block of logits is alive at a time. Under autograd every chunk is activation-checkpointed,
so backward recomputes that chunk's logits instead of keeping them (the same scheme as `K3ForCausalLM.loss`).

Alignment: ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` -- the value sits on the token itself, so
masks over "model-generated tokens" apply directly. Positions without a prediction (t = 0, the first token of
every `cu_seqlens` segment) and masked-out positions are 0.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch.utils.checkpoint import checkpoint

from k3.errors import K3ConfigError

__all__ = ["token_logprobs", "chunk_logprobs", "prediction_mask"]


def chunk_logprobs(lm_head, h_Nd: torch.Tensor, y_N: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log p(y) [N], entropy [N] or an empty tensor) of one chunk, fp32 logits (divided by `temperature`)."""
    logits = lm_head(h_Nd).float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(1, y_N.unsqueeze(1)).squeeze(1) - logz
    if with_entropy:
        p = torch.softmax(logits, dim=-1)
        ent = logz - (p * logits).sum(-1)
    else:
        ent = logits.new_zeros(0)
    return lp, ent


def prediction_mask(input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bool [B, T]: token t has a prediction inside its own sequence (t > 0, not the first token of a segment)."""
    B, T = input_ids.shape
    ok = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
    ok[:, 0] = False
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].long().to(input_ids.device)
        starts = starts[starts < T]
        ok[0, starts] = False
    return ok


def token_logprobs(model, input_ids: torch.Tensor, mask: Optional[torch.Tensor] = None,
                   cu_seqlens: Optional[torch.Tensor] = None, chunk: int = 1024, return_entropy: bool = False,
                   temperature: float = 1.0) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """log p of every token given its prefix, [B, T] fp32 (module doc for the alignment); with
    return_entropy=True also the entropy of the predictive distribution at each token ([B, T], 0 where out[...]
    is 0). `mask` (bool [B, T], default all) selects the tokens to compute -- only those rows go through the head.
    `cu_seqlens` packs sequences (batch size 1) exactly as the model's forward does. `temperature` divides the
    logits (match the sampler's; top-k/top-p truncation is not applied). Differentiable w.r.t. the model."""
    if input_ids.dim() != 2:
        raise K3ConfigError(f"token_logprobs: input_ids must be [B, T], got {tuple(input_ids.shape)}")
    if mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
        raise K3ConfigError(f"token_logprobs: mask {tuple(mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if not temperature > 0:
        raise K3ConfigError(f"token_logprobs: temperature must be > 0, got {temperature}")
    B, T = input_ids.shape
    want = prediction_mask(input_ids, cu_seqlens)
    if mask is not None:
        want &= mask.to(torch.bool).to(want.device)
    out = model(input_ids, cu_seqlens=cu_seqlens, return_logits=False)
    h = out.hidden_states                                  # [B, T, d]
    # the hidden state at t-1 predicts token t
    src = torch.zeros_like(want)
    src[:, :-1] = want[:, 1:]
    h_sel = h[src]                                         # [M, d]
    y_sel = input_ids[want]                                # [M]
    M = y_sel.shape[0]
    lp_out = torch.zeros(B, T, dtype=torch.float32, device=h.device)
    ent_out = torch.zeros(B, T, dtype=torch.float32, device=h.device) if return_entropy else None
    C = int(chunk) if chunk and chunk > 0 else max(M, 1)
    grad = torch.is_grad_enabled() and h_sel.requires_grad
    lps, ents = [], []
    for s in range(0, M, C):
        hc, yc = h_sel[s:s + C], y_sel[s:s + C]
        if grad and M > C:
            lp, ent = checkpoint(chunk_logprobs, model.lm_head, hc, yc, temperature, return_entropy,
                                 use_reentrant=False)
        else:
            lp, ent = chunk_logprobs(model.lm_head, hc, yc, temperature, return_entropy)
        lps.append(lp)
        ents.append(ent)
    if M:
        lp_out = lp_out.masked_scatter(want, torch.cat(lps))
        if return_entropy:
            ent_out = ent_out.masked_scatter(want, torch.cat(ents))
    return (lp_out, ent_out) if return_entropy else lp_out
