"""Next-token selection on fp32 logits [B, V] of the last position: repetition penalty, temperature, top-k, top-p
(nucleus), greedy or multinomial sampling with an optional torch.Generator. Masks set removed entries to -inf."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["SamplingParams", "apply_repetition_penalty", "top_k_mask", "top_p_mask", "process_logits",
           "select_next"]


@dataclass
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1.0 = off
    repetition_penalty: float = 1.0

    def validate(self) -> None:
        from k3.errors import RequestError
        if self.do_sample and not self.temperature > 0:
            raise RequestError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


def apply_repetition_penalty(logits_BV: torch.Tensor, seen_BV: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style: for every token already present (seen_BV bool), divide a positive logit by `penalty` and
    multiply a negative one by it."""
    if penalty == 1.0:
        return logits_BV
    pen = torch.where(logits_BV > 0, logits_BV / penalty, logits_BV * penalty)
    return torch.where(seen_BV, pen, logits_BV)


def top_k_mask(logits_BV: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row (ties at the k-th value are kept), the rest -inf."""
    if k <= 0 or k >= logits_BV.shape[-1]:
        return logits_BV
    kth = torch.topk(logits_BV, k, dim=-1).values[..., -1:]
    return logits_BV.masked_fill(logits_BV < kth, float("-inf"))


def top_p_mask(logits_BV: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= p (always >= 1 token)."""
    if p >= 1.0:
        return logits_BV
    srt, idx = torch.sort(logits_BV, dim=-1, descending=True)
    probs = torch.softmax(srt, dim=-1)
    before = probs.cumsum(-1) - probs          # mass of strictly more likely tokens
    remove_sorted = before >= p
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(remove_sorted).scatter(-1, idx, remove_sorted)
    return logits_BV.masked_fill(remove, float("-inf"))


def process_logits(logits_BV: torch.Tensor, params: SamplingParams, seen_BV: Optional[torch.Tensor] = None):
    """fp32 logits after penalty, temperature and top-k/top-p (the distribution that is sampled)."""
    x = logits_BV.float()
    if seen_BV is not None and params.repetition_penalty != 1.0:
        x = apply_repetition_penalty(x, seen_BV, params.repetition_penalty)
    if params.do_sample:
        if params.temperature != 1.0:
            x = x / params.temperature
        x = top_k_mask(x, params.top_k)
        x = top_p_mask(x, params.top_p)
    return x


def select_next(logits_BV: torch.Tensor, params: SamplingParams, seen_BV: Optional[torch.Tensor] = None,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids [B] (greedy argmax unless params.do_sample)."""
    x = process_logits(logits_BV, params, seen_BV)
    if not params.do_sample:
        return x.argmax(-1)
    probs = torch.softmax(x, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
