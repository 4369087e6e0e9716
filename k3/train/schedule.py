"""Training schedules: context-extension stages and the learning-rate curve.

Context extension: K3 pre-trains at 8K and extends 8K -> 64K -> 256K -> 1M. Scaled-down presets keep the shape
(short context for most steps, a few long stages at the end). A schedule is a list of (seq_len, share_of_steps);
the number of tokens per optimizer step is held constant, so a stage with a longer context uses fewer rows:
`batch_rows = tokens_per_step // seq_len`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from k3.errors import K3ConfigError

__all__ = ["TINY_STAGES", "SMALL_STAGES", "K3_CONTEXT_LENGTHS", "ContextSchedule", "stage_at", "batch_rows",
           "stage_boundaries", "cosine_with_warmup"]

TINY_STAGES = [(256, 0.6), (1024, 0.3), (4096, 0.1)]
SMALL_STAGES = [(1024, 0.7), (4096, 0.2), (16384, 0.1)]
# K3's context lengths (the step shares of each stage are not published).
K3_CONTEXT_LENGTHS = [8192, 65536, 262144, 1048576]


def _validate(stages: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    if not stages:
        raise K3ConfigError("context schedule: no stages")
    out = []
    for s in stages:
        if len(s) != 2:
            raise K3ConfigError(f"context schedule: stage {s!r} is not (seq_len, share)")
        seq, share = int(s[0]), float(s[1])
        if seq < 2 or not (share >= 0 and math.isfinite(share)):
            raise K3ConfigError(f"context schedule: bad stage {s!r} (seq_len >= 2, share a finite number >= 0)")
        out.append((seq, share))
    total = sum(sh for _, sh in out)
    if total <= 0:
        raise K3ConfigError("context schedule: the shares sum to 0")
    if abs(total - 1.0) > 1e-6:  # shares are relative; normalise
        out = [(seq, sh / total) for seq, sh in out]
    return out


def stage_boundaries(total_steps: int, stages: Sequence[tuple[int, float]] = TINY_STAGES) -> list[int]:
    """First step of every stage (the first is 0): cumulative share * total_steps, rounded."""
    stages = _validate(stages)
    bounds, acc = [], 0.0
    for _, share in stages:
        bounds.append(int(round(acc * total_steps)))
        acc += share
    return bounds


def stage_at(step: int, total_steps: int, stages: Sequence[tuple[int, float]] = TINY_STAGES) -> tuple[int, int]:
    """-> (stage index, seq_len) in force at `step` (0-based). Steps at or past `total_steps` stay in the last
    stage; stages with share 0 are skipped."""
    stages = _validate(stages)
    bounds = stage_boundaries(total_steps, stages)
    idx = 0
    for i, b in enumerate(bounds):
        if step >= b and (stages[i][1] > 0 or i == len(stages) - 1):
            idx = i
    return idx, stages[idx][0]


def batch_rows(tokens_per_step: int, seq_len: int) -> int:
    """Rows of `seq_len` per step for a constant token budget (floor; exact when seq_len divides it)."""
    if seq_len > tokens_per_step:
        raise K3ConfigError(f"seq_len={seq_len} exceeds tokens_per_step={tokens_per_step}: raise the token "
                            f"budget per step or shorten the stage")
    return tokens_per_step // seq_len


@dataclass
class ContextSchedule:
    """Stages + a constant token budget per step. `shape_at(step)` -> (seq_len, batch_rows)."""

    total_steps: int
    tokens_per_step: int
    stages: list = field(default_factory=lambda: list(TINY_STAGES))

    def __post_init__(self):
        self.stages = _validate(self.stages)
        if self.total_steps < 1:
            raise K3ConfigError(f"total_steps={self.total_steps} < 1")
        for seq, _ in self.stages:
            batch_rows(self.tokens_per_step, seq)  # validate every stage up front

    def stage_at(self, step: int) -> tuple[int, int]:
        return stage_at(step, self.total_steps, self.stages)

    def shape_at(self, step: int) -> tuple[int, int]:
        _, seq = self.stage_at(step)
        return seq, batch_rows(self.tokens_per_step, seq)

    def boundaries(self) -> list[int]:
        return stage_boundaries(self.total_steps, self.stages)

    @property
    def max_seq_len(self) -> int:
        return max(s for s, _ in self.stages)


def cosine_with_warmup(warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> Callable[[int], float]:
    """LR multiplier for `torch.optim.lr_scheduler.LambdaLR`: linear warm-up from ~0 to 1 over `warmup_steps`
    (step 0 -> 1/warmup), then cosine decay to `min_lr_ratio` at `total_steps`, constant after."""
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise K3ConfigError(f"min_lr_ratio={min_lr_ratio} not in [0, 1]")
    warmup_steps, total_steps = max(0, int(warmup_steps)), int(total_steps)

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        t = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return f
