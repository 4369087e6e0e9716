"""Next-token selection on fp32 logits [B, V] of the last position: repetition penalty, temperature, top-k, top-p
(nucleus), greedy or multinomial sampling with an optional torch.Generator. Masks set removed entries to -inf.

Numerically safe for any accepted parameters and any logits: NaN logits are never chosen, +inf logits win (ties
shared), a repetition penalty or temperature never turns a finite logit into inf/NaN, temperatures below
MIN_TEMPERATURE act as greedy (the limit of sampling as T -> 0), top_p never empties the distribution, and a row
with nothing left to sample (every logit NaN / -inf) falls back to its argmax instead of raising."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["SamplingParams", "apply_repetition_penalty", "top_k_mask", "top_p_mask", "process_logits",
           "select_next", "sanitize_logits", "MIN_TEMPERATURE"]

MIN_TEMPERATURE = 1e-5     # below this a sampled request is decoded greedily (the T -> 0 limit)
_FMAX = torch.finfo(torch.float32).max


@dataclass
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1.0 = off
    repetition_penalty: float = 1.0

    def validate(self) -> None:
        """RequestError naming the first parameter that is not a finite number in its range."""
        from k3.errors import RequestError
        for name in ("temperature", "top_p", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RequestError(f"{name} must be a finite number, got {v!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise RequestError(f"top_k must be an integer, got {self.top_k!r}")
        if self.do_sample and not self.temperature > 0:
            raise RequestError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (no sampling, or a temperature below MIN_TEMPERATURE)."""
        return not self.do_sample or not self.temperature >= MIN_TEMPERATURE


def sanitize_logits(x: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never chosen); in a row holding +inf, the +inf entries become 0 and the rest -inf (they win,
    shared equally when sampled)."""
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    pos = torch.isposinf(x)                      # (no host sync: the same ops whatever the values)
    return torch.where(pos.any(-1, keepdim=True), torch.where(pos, 0.0, float("-inf")), x)


def _finite_top(x: torch.Tensor) -> torch.Tensor:
    """+inf (an overflow of a finite logit) -> the largest float32: order kept, softmax well defined."""
    return torch.where(torch.isposinf(x), torch.full_like(x, _FMAX), x)


def apply_repetition_penalty(logits_BV: torch.Tensor, seen_BV: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style: for every token already present (seen_BV bool), divide a positive logit by `penalty` and
    multiply a negative one by it (results stay finite: an overflow saturates at the float32 range)."""
    if penalty == 1.0:
        return logits_BV
    pen = torch.where(logits_BV > 0, logits_BV / penalty, logits_BV * penalty)
    pen = torch.where(torch.isinf(pen) & torch.isfinite(logits_BV), torch.sign(pen) * _FMAX, pen)
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
    """fp32 logits after penalty, temperature and top-k/top-p (the distribution that is sampled); never NaN,
    never +inf (see sanitize_logits). With params.greedy only the penalty is applied (and without a penalty only
    NaN -> -inf: the argmax is the same)."""
    x = logits_BV.float()
    if params.greedy and (seen_BV is None or params.repetition_penalty == 1.0):
        return torch.nan_to_num(x, nan=float("-inf"))     # argmax of this = argmax of the sanitized logits
    x = sanitize_logits(x)
    if seen_BV is not None and params.repetition_penalty != 1.0:
        x = apply_repetition_penalty(x, seen_BV, params.repetition_penalty)
    if not params.greedy:
        if params.temperature != 1.0:
            x = _finite_top(x / params.temperature)
        x = top_k_mask(x, params.top_k)
        x = top_p_mask(x, params.top_p)
    return x


def select_next(logits_BV: torch.Tensor, params: SamplingParams, seen_BV: Optional[torch.Tensor] = None,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids [B] (greedy argmax when params.greedy). Never raises on degenerate logits: a row with no
    finite probability mass takes its argmax."""
    x = process_logits(logits_BV, params, seen_BV)
    best = x.argmax(-1)
    if params.greedy:
        return best
    probs = torch.softmax(x, dim=-1)
    ok = torch.isfinite(probs).all(-1, keepdim=True) & (probs.sum(-1, keepdim=True) > 0)   # no host sync
    onehot = torch.nn.functional.one_hot(best, probs.shape[-1]).to(probs.dtype)
    probs = torch.where(ok, torch.nan_to_num(probs, nan=0.0), onehot)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
