"""Expert load balancing for K3 routers (architecture.md §3.6: bias trained with Quantile Balancing).

Routing selects top-k experts of ``scores + bias`` (the bias never enters the combine weights). A balancer
adjusts each router's ``e_score_correction_bias`` buffer between optimizer steps so that every expert receives
about ``k·T/n`` of the ``T`` tokens of a step.

Quantile Balancing (QB), closed form per step:

* route with the current bias, i.e. take the top-(k+1) of ``s_i + b`` **including** the current bias: the
  (k+1)-th value is token i's cutoff ``α_i``, the k-th value ``β_i``. Using the biased cutoffs makes the update a
  fixed-point iteration in ``b`` (cutoffs from unbiased scores would give a one-shot estimate that ignores the
  other experts' biases and does not converge to balance);
* margin ``m_ij = s_ij − θ_ij`` with ``θ_ij`` the k-th largest biased score among the *other* experts:
  ``θ_ij = α_i`` if j is currently selected, ``β_i`` if not. Then j is selected for token i iff ``b_j > −m_ij``
  (others fixed), so the count of margins above ``−b_j`` is exactly j's load. (The literal ``θ_ij = α_i`` for
  every j, ``cutoff="alpha"``, has the same fixed point but under-steps for under-loaded experts: measured at
  n=896, k=16 on skewed scores it needs ~3× more iterations.);
* ``b̂_j = −q_j`` where ``q_j`` is the threshold with exactly ``K = round(k·T/n)`` margins of column j above it
  (the empirical ``(1 − k/n)``-quantile; midpoint between the K-th and (K+1)-th largest margin);
* ``b = b̂ − mean(b̂)``, used from the next step on; frozen at inference (no balancer attached / eval mode).

Fixed point: the map is shift-equivariant (``b̂(b + c) = b̂(b) + c``), so a fixed point of the centred map
satisfies ``b̂(b*) = b* + c``. Expert j's load under ``b*`` equals the number of margins above ``−b*_j``, and that
count is non-increasing in the threshold, so ``c ≥ 0`` gives every load ``≤ K`` and ``c ≤ 0`` every load ``≥ K``;
loads sum to ``k·T = n·K``, hence every expert gets ``K`` tokens (up to ties). ``tests/test_balance.py`` checks it.
Simultaneous (Jacobi) updates can cycle within a few tokens of the fixed point on a fixed batch; damping
(``ema < 1``) keeps the fixed point and removes the cycling.

Balancers (``make_balancer(name, **kw)``):

``qb``        exact quantile from all margins of the step (kept in memory; all-gathered across ranks).
``qb_hist``   per-expert histogram (``bins`` bins + under/overflow) over a window around the current
              threshold ``−b_j`` whose half-width is recomputed each step from the last update size; counts
              (plus the loads) are summed over micro-batches and across data-parallel ranks with one
              all-reduce per layer, then the quantile is interpolated linearly inside its bin.
``qb_ema``    exact QB whose bias is an exponential moving average of the per-step QB solutions (less
              sampling noise from small batches, slower to follow drift). ``qb``/``qb_hist`` accept ``ema=``.
``sign``      DeepSeek-V3 rule ``b ← b − γ·sign(load − mean load)`` (``gamma``, default 1e-3).
``aux_loss``  switch-style loss ``coef · n · Σ_j f_j P_j`` returned by :meth:`Balancer.aux_loss`; bias untouched.
``none``      statistics/metrics only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from k3.errors import CheckpointError, K3ConfigError
from k3.ops.router import selection_scores

__all__ = [
    "BALANCERS",
    "Balancer",
    "QBBalancer",
    "QBHistBalancer",
    "SignBalancer",
    "AuxLossBalancer",
    "NoneBalancer",
    "make_balancer",
    "qb_bias",
    "qb_thresholds",
    "hist_thresholds",
    "route_cutoffs",
    "entry_margins",
    "margin_histogram",
    "load_stats",
    "find_routers",
]

BIAS_BUFFER = "e_score_correction_bias"


# ------------------------------------------------------------------------------------------------------------
# Pure functions
# ------------------------------------------------------------------------------------------------------------


def _check_scores(scores_TE: torch.Tensor, top_k: int, bias_E: torch.Tensor | None = None) -> None:
    if scores_TE.dim() != 2:
        raise K3ConfigError(f"scores must be [T, n], got shape {tuple(scores_TE.shape)}")
    n = scores_TE.shape[1]
    if not 1 <= top_k < n:
        raise K3ConfigError(f"top_k must be in [1, n-1] = [1, {n - 1}], got {top_k}")
    if bias_E is not None and tuple(bias_E.shape) != (n,):
        raise K3ConfigError(f"bias must be [{n}], got shape {tuple(bias_E.shape)}")


def route_cutoffs(
    scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, topk_idx_Tk: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k selection of ``scores + bias`` and each token's two cutoffs: α (the (k+1)-th largest biased score)
    and β (the k-th largest). With the router's ``topk_idx_Tk`` given, α is the max biased score over the
    unselected experts and β the min over the selected ones (no second top-k). The biased scores are the router's
    own (k3.ops.router.selection_scores; ungrouped: `Balancer.attach` refuses grouped routers).
    Returns ``(topk_idx_Tk int64, alpha_T fp32, beta_T fp32)``."""
    biased_TE = selection_scores(scores_TE.float(), bias_E.float())
    if topk_idx_Tk is None:
        vals_Tk1, idx_Tk1 = torch.topk(biased_TE, top_k + 1, dim=1)
        return idx_Tk1[:, :top_k], vals_Tk1[:, top_k], vals_Tk1[:, top_k - 1]
    beta_T = biased_TE.gather(1, topk_idx_Tk).amin(dim=1)
    alpha_T = biased_TE.scatter(1, topk_idx_Tk, float("-inf")).amax(dim=1)
    return topk_idx_Tk, alpha_T, beta_T


def entry_margins(
    scores_TE: torch.Tensor,
    bias_E: torch.Tensor,
    top_k: int,
    topk_idx_Tk: torch.Tensor | None = None,
    cutoff: str = "exact",
) -> torch.Tensor:
    """Margins ``m_ij = s_ij − θ_ij`` fp32 [T, n]: expert j is selected for token i iff ``b_j > −m_ij`` (all other
    biases fixed). ``θ_ij`` is the k-th largest biased score among the *other* experts: α_i for a selected j,
    β_i for an unselected j (``cutoff="exact"``, default). ``cutoff="alpha"`` uses α_i for every expert — the
    literal formula; same fixed point, but it under-steps for under-loaded experts and converges slower."""
    idx_Tk, alpha_T, beta_T = route_cutoffs(scores_TE, bias_E, top_k, topk_idx_Tk)
    scores_TE = scores_TE.float()
    if cutoff == "alpha":
        return scores_TE - alpha_T[:, None]
    if cutoff != "exact":
        raise K3ConfigError(f"cutoff must be 'exact' or 'alpha', got '{cutoff}'")
    sel_TE = torch.zeros(scores_TE.shape, dtype=torch.bool, device=scores_TE.device).scatter_(1, idx_Tk, True)
    return scores_TE - torch.where(sel_TE, alpha_T[:, None], beta_T[:, None])


def _target_count(total_tokens: int | float, top_k: int, n: int) -> torch.Tensor | int:
    return int(round(top_k * float(total_tokens) / n))


def qb_thresholds(margins_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per-expert threshold with exactly ``K = round(k·T/n)`` margins above it (midpoint of the K-th and
    (K+1)-th largest margin of each column). ``margins_TE`` fp32 [T, n] -> [n] fp32."""
    T, n = margins_TE.shape
    K = _target_count(T, top_k, n)
    K = min(max(K, 1), T - 1) if T > 1 else 0
    if T <= 1:
        return margins_TE.float().mean(0)
    vals_KE = torch.topk(margins_TE.float(), K + 1, dim=0).values  # descending
    return 0.5 * (vals_KE[K - 1] + vals_KE[K])


def qb_bias(scores: torch.Tensor, top_k: int, bias: torch.Tensor, *, cutoff: str = "exact") -> torch.Tensor:
    """One exact Quantile-Balancing update.

    ``scores`` fp32 [T, n] (router scores, no bias), ``bias`` [n] the bias the tokens were routed with.
    Returns the new mean-zero bias [n] fp32 (to be used from the next step on). ``cutoff``: see
    :func:`entry_margins`."""
    _check_scores(scores, top_k, bias)
    margins_TE = entry_margins(scores.detach(), bias.detach(), top_k, cutoff=cutoff)
    q_E = qb_thresholds(margins_TE, top_k)
    bhat_E = -q_E
    return bhat_E - bhat_E.mean()


def margin_histogram(margins_TE: torch.Tensor, lo_E: torch.Tensor, width: float, bins: int) -> torch.Tensor:
    """Counts [n, bins+2] int64 of each column of ``margins_TE`` in bins ``[lo_j + r·w, lo_j + (r+1)·w)``;
    column 0 counts everything below ``lo_j`` and column ``bins+1`` everything at/above ``lo_j + bins·w``."""
    T, n = margins_TE.shape
    pos_TE = torch.floor((margins_TE.float() - lo_E.float()) / width)
    pos_TE = pos_TE.clamp_(-1, bins).to(torch.int64) + 1
    flat_T = (pos_TE + torch.arange(n, dtype=torch.int64, device=pos_TE.device) * (bins + 2)).reshape(-1)
    return torch.bincount(flat_T, minlength=n * (bins + 2)).view(n, bins + 2)


def hist_thresholds(
    hist_EB: torch.Tensor, lo_E: torch.Tensor, width: float, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram version of :func:`qb_thresholds` (layout of :func:`margin_histogram`).

    The K-th and (K+1)-th largest margins are placed inside their bins (the c samples of a bin assumed at
    its c evenly spaced mid-points) and the threshold is their midpoint, so it lies within one bin width of the
    exact threshold whenever both order statistics fall inside the window. Returns ``(thresholds_E fp32,
    clamped_E bool)``; ``clamped`` marks experts whose order statistics fell in the under/overflow bin — their
    threshold is clamped to the window edge."""
    n, B2 = hist_EB.shape
    bins = B2 - 2
    counts_EB = hist_EB.to(torch.float64)
    T = int(counts_EB[0].sum())
    K = min(max(_target_count(T, top_k, n), 1), max(T - 1, 1))
    tail_EB = counts_EB.flip(1).cumsum(1).flip(1)  # tail[r] = number of margins in bins >= r
    above_EB = torch.cat([tail_EB[:, 1:], tail_EB.new_zeros(n, 1)], dim=1)  # in bins > r
    lo = lo_E.double().to(counts_EB.device)
    hi = lo + bins * width

    def position(j: int) -> tuple[torch.Tensor, torch.Tensor]:
        # bin r holding the j-th largest: above[r] < j <= above[r] + count[r]
        holds_EB = (above_EB < j) & (above_EB + counts_EB >= j)
        r_E = holds_EB.to(torch.int8).argmax(1)
        a_E = above_EB.gather(1, r_E[:, None])[:, 0]
        c_E = counts_EB.gather(1, r_E[:, None])[:, 0].clamp_min(1.0)
        upper_E = lo + r_E.double() * width  # regular bin r (1..bins) spans [lo+(r-1)w, lo+r·w)
        pos_E = upper_E - width * (j - a_E - 0.5) / c_E
        pos_E = torch.where(r_E == 0, lo, torch.where(r_E == bins + 1, hi, pos_E))
        return pos_E, (r_E == 0) | (r_E == bins + 1)

    p1_E, c1_E = position(K)
    p2_E, c2_E = position(K + 1)
    return (0.5 * (p1_E + p2_E)).float(), c1_E | c2_E


def load_stats(load_E: torch.Tensor, bias_E: torch.Tensor | None = None) -> dict[str, float]:
    """MaxVio = (max − mean)/mean, min load / mean, dead experts (load 0), bias range."""
    load = load_E.double()
    mean = float(load.mean())
    out = {
        "maxvio": float((load.max() - mean) / mean) if mean > 0 else 0.0,
        "min_load_ratio": float(load.min() / mean) if mean > 0 else 0.0,
        "dead_experts": float((load == 0).sum()),
    }
    if bias_E is not None:
        out["bias_range"] = float(bias_E.max() - bias_E.min())
    return out


def find_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module with a ``e_score_correction_bias`` buffer and ``top_k``/``num_experts`` attributes."""
    found = []
    for name, mod in model.named_modules():
        if BIAS_BUFFER in dict(mod.named_buffers(recurse=False)) and hasattr(mod, "top_k") and hasattr(
            mod, "num_experts"
        ):
            found.append((name, mod))
    return found


# ------------------------------------------------------------------------------------------------------------
# Distributed helpers (default process group)
# ------------------------------------------------------------------------------------------------------------


def _dist_world() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if _dist_world() > 1:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _all_gather_rows(x_TE: torch.Tensor) -> torch.Tensor:
    """Concatenate the rows of ``x_TE`` of every rank (rank order); row counts may differ."""
    world = _dist_world()
    if world == 1:
        return x_TE
    import torch.distributed as dist

    n_rows = torch.tensor([x_TE.shape[0]], dtype=torch.int64, device=x_TE.device)
    sizes = [torch.zeros_like(n_rows) for _ in range(world)]
    dist.all_gather(sizes, n_rows)
    rows = [int(s) for s in sizes]
    pad = max(rows)
    padded = x_TE.new_zeros(pad, x_TE.shape[1])
    padded[: x_TE.shape[0]] = x_TE
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:r] for g, r in zip(gathered, rows)], dim=0)


def _in_backward() -> bool:
    """True while autograd runs backward (e.g. activation-checkpoint recomputation): skip statistics then."""
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # pragma: no cover - older torch
        return False


# ------------------------------------------------------------------------------------------------------------
# Balancers
# ------------------------------------------------------------------------------------------------------------


@dataclass
class _Router:
    name: str
    module: nn.Module
    top_k: int
    num_experts: int
    handle: Any = None
    load_E: torch.Tensor | None = None  # int64 counts since last step
    tokens: int = 0
    margins: list = field(default_factory=list)  # qb: detached fp32 [N, E] chunks
    hist_EB: torch.Tensor | None = None  # qb_hist
    lo_E: torch.Tensor | None = None
    width: float = 0.0
    half_width: float | None = None  # qb_hist window state
    clamped: int | None = None  # qb_hist: experts whose quantile fell outside the window last step
    aux_terms: list = field(default_factory=list)
    last: dict = field(default_factory=dict)

    @property
    def bias(self) -> torch.Tensor:
        return getattr(self.module, BIAS_BUFFER)

    def zeros_load(self) -> torch.Tensor:
        return self.bias.new_zeros(self.num_experts, dtype=torch.int64)


class Balancer:
    """Base class: hooks, load accounting, metrics, checkpoint state. Subclasses implement ``_observe_extra``
    and ``_new_bias``."""

    name = "base"
    needs_margins = False

    def __init__(self, collect_in_eval: bool = False):
        self.collect_in_eval = bool(collect_in_eval)
        self.routers: list[_Router] = []
        self.num_steps = 0
        self._pending_state: dict[str, dict] = {}

    # ---- integration ---------------------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> "Balancer":
        """Register a forward hook on every router of ``model``. Returns self."""
        routers = find_routers(model)
        if not routers:
            raise K3ConfigError(
                f"no router found: need a module with buffer '{BIAS_BUFFER}' and attributes top_k, num_experts"
            )
        for name, mod in routers:
            if int(getattr(mod, "num_expert_group", 1)) > 1:
                raise K3ConfigError(
                    f"router {name}: num_expert_group = {mod.num_expert_group} (grouped top-k); the balancers' "
                    f"cut-offs assume ungrouped top-k selection (set num_expert_group = 1 to train with a balancer)")
            r = _Router(name=name or "router", module=mod, top_k=int(mod.top_k), num_experts=int(mod.num_experts))
            if tuple(r.bias.shape) != (r.num_experts,):
                raise K3ConfigError(f"{name}.{BIAS_BUFFER} has shape {tuple(r.bias.shape)}, want [{r.num_experts}]")
            r.handle = mod.register_forward_hook(self._make_hook(r))
            self.routers.append(r)
            if r.name in self._pending_state:
                self._load_router_state(r, self._pending_state.pop(r.name))
        return self

    def detach(self) -> None:
        """Remove all hooks and drop unconsumed statistics."""
        for r in self.routers:
            if r.handle is not None:
                r.handle.remove()
        self.routers = []

    def _make_hook(self, r: _Router) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not (module.training or self.collect_in_eval) or _in_backward():
                return None
            topk_idx_Nk, scores_NE = output[0], output[2]  # output[1] (combine weights) is never touched
            scores_NE = scores_NE.reshape(-1, r.num_experts)
            topk_idx_Nk = topk_idx_Nk.reshape(-1, r.top_k)
            self._observe(r, topk_idx_Nk, scores_NE)
            return None  # never modifies the router output

        return hook

    def _observe(self, r: _Router, topk_idx_Nk: torch.Tensor, scores_NE: torch.Tensor) -> None:
        idx = topk_idx_Nk.detach()
        load = torch.bincount(idx.reshape(-1).to(torch.int64), minlength=r.num_experts)
        r.load_E = load if r.load_E is None else r.load_E + load
        r.tokens += idx.shape[0]
        self._observe_extra(r, idx, scores_NE)

    def _observe_extra(self, r: _Router, idx_Nk: torch.Tensor, scores_NE: torch.Tensor) -> None:
        pass

    # ---- step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Update every router's bias in place from the statistics gathered since the last step."""
        updated = False
        for r in self.routers:
            load_E = self._global_load(r)
            if load_E is None:
                continue
            updated = True
            old_bias_E = r.bias.detach().clone()
            new_bias_E = self._new_bias(r, load_E, old_bias_E)
            if new_bias_E is not None:
                r.bias.copy_(new_bias_E.to(r.bias.dtype))
            r.last = load_stats(load_E, r.bias.detach().float())
            r.last["tokens"] = float(load_E.sum()) / r.top_k
            if r.clamped is not None:
                r.last["clamped_experts"] = float(r.clamped)
            self._reset(r)
        if updated:  # steps without statistics (eval, frozen) do not count
            self.num_steps += 1

    def _global_load(self, r: _Router) -> torch.Tensor | None:
        """Summed loads of the step over micro-batches and ranks (one all-reduce). None if nothing observed
        on any rank (every rank must call step())."""
        local = r.load_E if r.load_E is not None else r.zeros_load()
        if _dist_world() > 1:
            local = _all_reduce_sum(local.clone())
        return local if int(local.sum()) > 0 else None

    def _new_bias(self, r: _Router, load_E: torch.Tensor, bias_E: torch.Tensor) -> torch.Tensor | None:
        return None

    def discard_stats(self) -> None:
        """Drop the statistics and aux-loss terms gathered since the last step (e.g. a skipped NaN step)."""
        for r in self.routers:
            self._reset(r)

    def _reset(self, r: _Router) -> None:
        r.load_E = None
        r.tokens = 0
        r.margins = []
        r.hist_EB = None
        r.aux_terms = []

    # ---- aux loss ------------------------------------------------------------------------------------------
    def aux_loss(self) -> torch.Tensor:
        """Summed auxiliary loss of the forwards since the last call (0 for bias-based balancers)."""
        terms = [t for r in self.routers for t in r.aux_terms]
        for r in self.routers:
            r.aux_terms = []
        if not terms:
            device = self.routers[0].bias.device if self.routers else None
            return torch.zeros((), device=device)
        return torch.stack([t.reshape(()) for t in terms]).sum()

    # ---- metrics -------------------------------------------------------------------------------------------
    def metrics(self, prefix: str = "balance/") -> dict[str, float]:
        """Per-layer and aggregated (mean/max over layers) balance metrics of the last step."""
        out: dict[str, float] = {}
        per_key: dict[str, list[float]] = {}
        for r in self.routers:
            if not r.last:
                continue
            for key in ("maxvio", "min_load_ratio", "dead_experts", "bias_range", "clamped_experts"):
                if key in r.last:
                    out[f"{prefix}{r.name}/{key}"] = r.last[key]
                    per_key.setdefault(key, []).append(r.last[key])
        for key, vals in per_key.items():
            out[f"{prefix}{key}_mean"] = sum(vals) / len(vals)
            out[f"{prefix}{key}_max"] = max(vals)
        if key_min := per_key.get("min_load_ratio"):
            out[f"{prefix}min_load_ratio_min"] = min(key_min)
        return out

    # ---- checkpoint ----------------------------------------------------------------------------------------
    def _router_state(self, r: _Router) -> dict:
        return {}

    def _load_router_state(self, r: _Router, state: dict) -> None:
        pass

    def state_dict(self) -> dict:
        return {
            "balancer": self.name,
            "num_steps": self.num_steps,
            "routers": {r.name: self._router_state(r) for r in self.routers},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("balancer") != self.name:
            raise CheckpointError(f"balancer state is for '{state.get('balancer')}', this balancer is '{self.name}'")
        self.num_steps = int(state.get("num_steps", 0))
        routers = dict(state.get("routers", {}))
        by_name = {r.name: r for r in self.routers}
        for name, rs in routers.items():
            if name in by_name:
                self._load_router_state(by_name[name], rs)
            else:  # applied when attach() finds it
                self._pending_state[name] = rs


class NoneBalancer(Balancer):
    """Statistics and metrics only; the bias is never changed."""

    name = "none"


class _EMAMixin:
    ema: float
    ema_warmup: int

    def _blend(self, r: _Router, target_E: torch.Tensor, bias_E: torch.Tensor) -> torch.Tensor:
        """``b ← b + β·(b̂ − b)`` with β = 1 for the first ``ema_warmup`` steps, then β = ``ema``. Same fixed point
        as plain QB (b̂ = b + const routes like b); averages out per-batch sampling noise and damps the
        discrete cycling of simultaneous updates, at the price of following drift ~1/β steps later."""
        if self.ema >= 1.0 or self.num_steps < self.ema_warmup:
            return target_E
        out = bias_E.float() + self.ema * (target_E - bias_E.float())
        return out - out.mean()


class QBBalancer(_EMAMixin, Balancer):
    """Exact Quantile Balancing: keeps every margin of the step (detached fp32 [T, n] per layer)."""

    name = "qb"

    def __init__(
        self, ema: float = 1.0, ema_warmup: int = 0, cutoff: str = "exact", collect_in_eval: bool = False
    ):
        super().__init__(collect_in_eval)
        if not 0.0 < ema <= 1.0:
            raise K3ConfigError(f"ema must be in (0, 1], got {ema}")
        if cutoff not in ("exact", "alpha"):
            raise K3ConfigError(f"cutoff must be 'exact' or 'alpha', got '{cutoff}'")
        self.ema = float(ema)
        self.ema_warmup = int(ema_warmup)
        self.cutoff = cutoff

    def _observe_extra(self, r: _Router, idx_Nk: torch.Tensor, scores_NE: torch.Tensor) -> None:
        r.margins.append(entry_margins(scores_NE.detach(), r.bias.detach(), r.top_k, idx_Nk, self.cutoff))

    def _new_bias(self, r: _Router, load_E: torch.Tensor, bias_E: torch.Tensor) -> torch.Tensor | None:
        local = torch.cat(r.margins) if r.margins else r.bias.new_zeros(0, r.num_experts, dtype=torch.float32)
        margins_TE = _all_gather_rows(local)
        if margins_TE.shape[0] < 2:
            return None
        bhat_E = -qb_thresholds(margins_TE, r.top_k)
        return self._blend(r, bhat_E - bhat_E.mean(), bias_E)


class QBEMABalancer(QBBalancer):
    """Exact QB, then (after ``ema_warmup`` plain steps) ``b ← b + ema·(b̂ − b)``."""

    name = "qb_ema"

    def __init__(
        self, ema: float = 0.25, ema_warmup: int = 10, cutoff: str = "exact", collect_in_eval: bool = False
    ):
        super().__init__(ema=ema, ema_warmup=ema_warmup, cutoff=cutoff, collect_in_eval=collect_in_eval)


class QBHistBalancer(_EMAMixin, Balancer):
    """Histogram Quantile Balancing: O(n·bins) state per layer, one all-reduce per layer per step.

    Window of expert j for a step: ``[−b_j − w, −b_j + w)`` split in ``bins`` bins (+ under/overflow), ``−b_j``
    being where the quantile lies at the fixed point. ``w`` starts at ``init_range`` and is recomputed each step
    as ``range_factor ·`` the largest distance of a quantile from its window centre (at least ``min_range``, at
    most ``max(w, init_range)``); a quantile outside the window is clamped to its edge (a trust-region step) and
    ``w`` doubles."""

    name = "qb_hist"

    def __init__(
        self,
        bins: int = 1000,
        init_range: float = 1.0,
        range_factor: float = 8.0,
        min_range: float = 1e-3,
        ema: float = 1.0,
        ema_warmup: int = 0,
        cutoff: str = "exact",
        collect_in_eval: bool = False,
    ):
        super().__init__(collect_in_eval)
        if cutoff not in ("exact", "alpha"):
            raise K3ConfigError(f"cutoff must be 'exact' or 'alpha', got '{cutoff}'")
        self.cutoff = cutoff
        if bins < 2:
            raise K3ConfigError(f"bins must be >= 2, got {bins}")
        if not 0.0 < ema <= 1.0:
            raise K3ConfigError(f"ema must be in (0, 1], got {ema}")
        self.bins = int(bins)
        self.init_range = float(init_range)
        self.range_factor = float(range_factor)
        self.min_range = float(min_range)
        self.ema = float(ema)
        self.ema_warmup = int(ema_warmup)

    def _observe_extra(self, r: _Router, idx_Nk: torch.Tensor, scores_NE: torch.Tensor) -> None:
        bias_E = r.bias.detach().float()
        if r.hist_EB is None:  # first micro-batch of the step fixes the window
            w = r.half_width if r.half_width is not None else self.init_range
            r.lo_E = -bias_E - w
            r.width = 2.0 * w / self.bins
            r.hist_EB = r.bias.new_zeros(r.num_experts, self.bins + 2, dtype=torch.int64)
        margins_NE = entry_margins(scores_NE.detach(), bias_E, r.top_k, idx_Nk, self.cutoff)
        r.hist_EB += margin_histogram(margins_NE, r.lo_E, r.width, self.bins)

    def _global_load(self, r: _Router) -> torch.Tensor | None:
        # histogram and loads travel in one all-reduce
        n = r.num_experts
        if r.hist_EB is None:  # nothing seen locally; still take part in the collective
            w = r.half_width if r.half_width is not None else self.init_range
            r.lo_E = -r.bias.detach().float() - w
            r.width = 2.0 * w / self.bins
            r.hist_EB = r.bias.new_zeros(n, self.bins + 2, dtype=torch.int64)
        load = r.load_E if r.load_E is not None else r.zeros_load()
        packed = torch.cat([r.hist_EB.reshape(-1), load])
        packed = _all_reduce_sum(packed)
        r.hist_EB = packed[: n * (self.bins + 2)].view(n, self.bins + 2)
        load = packed[n * (self.bins + 2):]
        return load if int(load.sum()) > 0 else None

    def _new_bias(self, r: _Router, load_E: torch.Tensor, bias_E: torch.Tensor) -> torch.Tensor | None:
        thr_E, clamped_E = hist_thresholds(r.hist_EB, r.lo_E, r.width, r.top_k)
        w = self.bins * r.width / 2.0
        centre_E = r.lo_E + w
        r.clamped = int(clamped_E.sum())
        if r.clamped:
            r.half_width = 2.0 * w
        else:
            # shrink toward the observed update size; never widen without a clamp (a big first step would
            # otherwise leave coarse bins for the next one)
            target = self.range_factor * float((thr_E - centre_E).abs().max())
            r.half_width = max(self.min_range, min(target, max(w, self.init_range)))
        bhat_E = -thr_E
        return self._blend(r, bhat_E - bhat_E.mean(), bias_E)

    def _router_state(self, r: _Router) -> dict:
        return {"half_width": r.half_width}

    def _load_router_state(self, r: _Router, state: dict) -> None:
        hw = state.get("half_width")
        r.half_width = None if hw is None else float(hw)


class SignBalancer(Balancer):
    """DeepSeek-V3 auxiliary-loss-free rule: ``b ← b − γ·sign(load − mean load)``."""

    name = "sign"

    def __init__(self, gamma: float = 1e-3, collect_in_eval: bool = False):
        super().__init__(collect_in_eval)
        if gamma <= 0:
            raise K3ConfigError(f"gamma must be > 0, got {gamma}")
        self.gamma = float(gamma)

    def _new_bias(self, r: _Router, load_E: torch.Tensor, bias_E: torch.Tensor) -> torch.Tensor:
        load = load_E.double()
        return bias_E.float() - self.gamma * torch.sign(load - load.mean()).float()


class AuxLossBalancer(Balancer):
    """Switch-style load-balancing loss ``coef · n · Σ_j f_j P_j`` per layer (f_j: fraction of the N·k
    assignments going to j, P_j: mean normalised score of j). Equals ``coef`` when perfectly balanced.
    The loss depends on the scores (differentiable); the bias is not touched."""

    name = "aux_loss"

    def __init__(self, coef: float = 1e-3, collect_in_eval: bool = False):
        super().__init__(collect_in_eval)
        if coef < 0:
            raise K3ConfigError(f"coef must be >= 0, got {coef}")
        self.coef = float(coef)

    def _observe_extra(self, r: _Router, idx_Nk: torch.Tensor, scores_NE: torch.Tensor) -> None:
        N = idx_Nk.shape[0]
        if N == 0:
            return
        n = r.num_experts
        f_E = torch.bincount(idx_Nk.reshape(-1), minlength=n).to(scores_NE.dtype) / (N * r.top_k)
        probs_NE = scores_NE / (scores_NE.sum(-1, keepdim=True) + 1e-20)
        P_E = probs_NE.mean(0)
        r.aux_terms.append(self.coef * n * (f_E.detach() * P_E).sum().float())


BALANCERS: dict[str, type[Balancer]] = {
    "qb": QBBalancer,
    "qb_hist": QBHistBalancer,
    "qb_ema": QBEMABalancer,
    "sign": SignBalancer,
    "aux_loss": AuxLossBalancer,
    "none": NoneBalancer,
}


def make_balancer(name: str, **kw: Any) -> Balancer:
    """Balancer by config/CLI name: qb, qb_hist, qb_ema, sign, aux_loss, none. Keyword arguments go to the
    class (e.g. ``bins=``, ``gamma=``, ``coef=``, ``ema=``); unknown ones raise K3ConfigError."""
    key = str(name).strip().lower().replace("-", "_")
    if key not in BALANCERS:
        raise K3ConfigError(f"unknown balancer '{name}'; choose one of {sorted(BALANCERS)}")
    try:
        return BALANCERS[key](**kw)
    except TypeError as e:
        raise K3ConfigError(f"bad arguments for balancer '{key}': {e}") from None
