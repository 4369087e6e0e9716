"""Routing replay for RL: record the experts the sampler's routers picked for every token of a trajectory during
`k3.generate`, and replay them in the training forward (the router still gets gradients: the weights are
recomputed from the training run's own fp32 scores at the replayed experts, as `k3.nn.moe.pinned_routing` does).

`GenerateRoutingRecorder` hooks every `K3Router` while one `k3.generate` call runs and maps each router call back
to (row, position) from the structure of that call: the prefill (equal-length prompts as one batch, ragged ones row
by row, in chunks of `prefill_chunk_size`), then one decode forward per step for the whole batch (a row's generated
token s is fed at decode step s). The per-call sizes are checked against that structure; on a mismatch (e.g. a
generate that batches differently) the recording is dropped with a warning and trajectories carry no routing. The
static / CUDA-graph decode step bypasses module hooks: it writes each step's picks into static buffers, which
`generate` hands to `add_step`. The last generated token of a call is never fed in that call: its picks come from
the next turn's prefill, or stay unknown (-1: routed live in replay).

`replay_routing(model, picks)` replays per-token picks {router name: LongTensor [N, k]} on every call of each
router whose token count is N (the packed training forward; gradient-checkpoint recomputation calls it again with
the same picks). Rows of -1 keep the live choice.
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Sequence

import torch

from k3.errors import K3Error
from k3.nn.moe import K3Router

__all__ = ["RoutingReplayError", "GenerateRoutingRecorder", "replay_routing", "concat_routing", "routers"]


class RoutingReplayError(K3Error, ValueError):
    """Replayed routing that does not fit the forward it is applied to."""


def routers(model) -> List[tuple]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, K3Router)]


def _chunks(n: int, chunk: Optional[int]):
    c = n if not chunk or chunk <= 0 else int(chunk)
    return [(s, min(n, s + c)) for s in range(0, n, c)]


class GenerateRoutingRecorder:
    """with GenerateRoutingRecorder(model) as rec: out = generate(model, prompts, ..., prefill_chunk_size=c,
    static=False, return_dict=True); picks = rec.assign(prompts, out.new_tokens, c) -> per row
    {router: LongTensor [len(prompt) + len(new), k]} with -1 where unknown, or None if the calls do not match."""

    def __init__(self, model):
        self.model = model
        self.calls: Dict[str, List[torch.Tensor]] = {}
        self._hooks = []

    def __enter__(self):
        self.calls = {}

        def rec(name):
            def hook(mod, inp, out):
                self.calls.setdefault(name, []).append(out[0].detach())   # no host sync per step
            return hook
        self._hooks = [m.register_forward_hook(rec(n)) for n, m in routers(self.model)]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def add_step(self, picks: Dict[str, torch.Tensor]) -> None:
        """One decode step of the static / CUDA-graph decoder (k3.generation.static.StaticDecoder(record_routing=
        True)): its picks {router name: [B, k]} (static buffers: copied here, on the device, no host sync)."""
        for name, idx in picks.items():
            self.calls.setdefault(name, []).append(idx.clone())

    def assign(self, prompts: Sequence[Sequence[int]], new_tokens: Sequence[Sequence[int]],
               prefill_chunk_size: Optional[int]) -> Optional[List[Dict[str, torch.Tensor]]]:
        B = len(prompts)
        plen = [len(p) for p in prompts]
        nnew = [len(n) for n in new_tokens]
        # expected calls: (kind, rows, start, end) with kind "prefill" or "decode"
        plan = []
        groups = [list(range(B))] if len(set(plen)) == 1 else [[i] for i in range(B)]
        for rows in groups:
            for s, e in _chunks(plen[rows[0]], prefill_chunk_size):
                plan.append(("prefill", rows, s, e))
        for step in range(max(nnew) - 1 if nnew and max(nnew) > 0 else 0):
            plan.append(("decode", list(range(B)), step, step + 1))
        names = [n for n, _ in routers(self.model)]
        out = []
        for i in range(B):
            out.append({})
        for name in names:
            calls = self.calls.get(name, [])
            if len(calls) != len(plan):
                warnings.warn(f"routing replay: router {name} was called {len(calls)} times, the generate call "
                              f"structure expects {len(plan)}; this batch carries no routing")
                return None
            k = calls[0].shape[1] if calls else 0
            calls = list(torch.cat(calls).cpu().split([c.shape[0] for c in calls])) if calls else []  # one copy
            per_row = [torch.full((plen[i] + nnew[i], k), -1, dtype=torch.long) for i in range(B)]
            for (kind, rows, s, e), idx in zip(plan, calls):
                if idx.shape[0] != len(rows) * (e - s):
                    warnings.warn(f"routing replay: router {name} call of {idx.shape[0]} tokens, expected "
                                  f"{len(rows) * (e - s)}; this batch carries no routing")
                    return None
                idx = idx.view(len(rows), e - s, k)
                for j, r in enumerate(rows):
                    if kind == "prefill":
                        per_row[r][s:e] = idx[j]
                    elif s < nnew[r] - 1:     # token gen[r][s] at position plen + s was fed at this step
                        per_row[r][plen[r] + s] = idx[j, 0]
            for i in range(B):
                out[i][name] = per_row[i]
        return out


def concat_routing(parts: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Concatenate per-trajectory picks (in packing order) into the picks of one packed forward."""
    if not parts:
        return {}
    names = list(parts[0])
    for j, p in enumerate(parts):
        if list(p) != names:
            raise RoutingReplayError(f"routing of trajectory {j} has routers {list(p)[:3]}..., expected "
                                     f"{names[:3]}...")
    return {n: torch.cat([p[n] for p in parts]) for n in names}


class replay_routing:
    """Context manager: replay {router name: LongTensor [N, k]} (-1 rows: live choice) in `model`'s forwards."""

    def __init__(self, model, picks: Dict[str, torch.Tensor]):
        self.model, self.picks, self._hooks = model, picks, []

    def __enter__(self):
        rs = routers(self.model)
        missing = [n for n, _ in rs if n not in self.picks]
        if missing:
            raise RoutingReplayError(f"replay_routing: no picks for routers {missing[:3]}")

        def play(name):
            def hook(mod, inp, out):
                idx_live, _, scores = out
                rec = self.picks[name].to(scores.device)
                if rec.shape != idx_live.shape:
                    raise RoutingReplayError(f"replay_routing: router {name}: picks {tuple(rec.shape)} vs "
                                             f"{tuple(idx_live.shape)} tokens x top-k in this forward")
                idx = torch.where(rec >= 0, rec, idx_live)
                w = scores.gather(1, idx)
                if mod.renormalize:
                    w = w / (w.sum(-1, keepdim=True) + 1e-20)
                return idx, w * mod.scaling, scores
            return hook
        self._hooks = [m.register_forward_hook(play(n)) for n, m in rs]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
