"""Stable LatentMoE (spec §3.6): full-width fp32 sigmoid router with a non-trainable correction bias, routed
experts in a latent width l (down-projection, stacked experts, RMSNorm, up-projection), shared experts at full
width. Expert weights are stacked [E, ...] (see docs/CONTRACTS.md)."""
from __future__ import annotations


import torch
from torch import nn

from k3.nn.mlp import GLUMLP
from k3.nn.norm import RMSNorm
from k3.ops.activations import get_glu, situ_glu, situ_glu_packed
from k3.ops.moe import experts_forward, route


class K3Router(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, renormalize: bool = True, scaling: float = 1.0):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.scaling = renormalize, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x_Nd):
        return route(x_Nd, self.weight, self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling)


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, latent: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, latent, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, latent))

    def extra_repr(self):
        E, l, M2 = self.gate_up_proj.shape
        return f"experts={E}, latent={l}, inter={M2 // 2}"


class LatentMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, l = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.gate = K3Router(d, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_renormalize,
                             cfg.routed_scaling_factor)
        self.routed_expert_down_proj = nn.Linear(d, l, bias=False)
        self.experts = StackedExperts(cfg.num_experts, l, cfg.moe_intermediate_size)
        self.routed_expert_norm = RMSNorm(l, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else nn.Identity()
        self.routed_expert_up_proj = nn.Linear(l, d, bias=False)
        self.shared_experts = (GLUMLP(d, cfg.shared_intermediate_size, cfg.hidden_act, cfg.activation_situ_beta,
                                      cfg.activation_situ_linear_beta) if cfg.num_shared_experts else None)
        self._glu = get_glu(cfg.hidden_act)
        self.beta1, self.beta2 = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
        self.expert_backend = None  # None = dispatch default

    def glu(self, g, u):
        return self._glu(g, u, self.beta1, self.beta2)

    def glu_packed(self, h):
        return situ_glu_packed(h, self.beta1, self.beta2)

    def forward(self, x_BTd):
        shape = x_BTd.shape
        x_Nd = x_BTd.reshape(-1, shape[-1])
        topk_idx_Nk, topk_w_Nk, _ = self.gate(x_Nd)
        x_Nl = self.routed_expert_down_proj(x_Nd)
        u_Nl = experts_forward(x_Nl, topk_idx_Nk, topk_w_Nk, self.experts.gate_up_proj, self.experts.down_proj,
                               self.glu, backend=self.expert_backend,
                               glu_packed=self.glu_packed if self._glu is situ_glu else None)
        out = self.routed_expert_up_proj(self.routed_expert_norm(u_Nl))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_Nd)
        return out.view(shape)


def init_moe_(m: LatentMoE, std: float) -> None:
    nn.init.normal_(m.gate.weight, std=std)
    nn.init.normal_(m.experts.gate_up_proj, std=std)
    nn.init.normal_(m.experts.down_proj, std=std)
    m.gate.e_score_correction_bias.zero_()


class pinned_routing:
    """Record the experts every router picks, then replay those picks in another run of the same model (another
    device, dtype or backend). Top-k selection is discontinuous: at random init the score margins are small, so a
    bf16 rounding flips some picks and whole-model comparisons measure those flips, not the numerics. Replayed
    picks keep the gradient path: weights are recomputed from the replaying run's own fp32 scores.

        rec = pinned_routing(m_ref)            # hooks every K3Router of m_ref
        with rec: out_ref = m_ref(ids)         # records (one list per router, in call order)
        with rec.replay(m_other): out = m_other(ids)
    """

    def __init__(self, model: nn.Module):
        self.model, self.picks, self._hooks = model, {}, []

    def _routers(self, model):
        return [(n, mod) for n, mod in model.named_modules() if isinstance(mod, K3Router)]

    def __enter__(self):
        self.picks = {}

        def rec(name):
            def hook(mod, inp, out):
                self.picks.setdefault(name, []).append(out[0].detach())
            return hook
        self._hooks = [mod.register_forward_hook(rec(n)) for n, mod in self._routers(self.model)]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def replay(self, model: nn.Module) -> "_Replay":
        return _Replay(self, model)


class _Replay:
    def __init__(self, rec: pinned_routing, model: nn.Module):
        self.rec, self.model, self._hooks = rec, model, []

    def __enter__(self):
        routers = self.rec._routers(self.model)
        missing = [n for n, _ in routers if n not in self.rec.picks]
        if missing:
            raise ValueError(f"pinned_routing: no recorded picks for routers {missing[:3]} (record a run first)")
        cursor = {n: 0 for n, _ in routers}

        def play(name):
            def hook(mod, inp, out):
                i = cursor[name]
                if i >= len(self.rec.picks[name]):
                    raise RuntimeError(f"pinned_routing: router {name} called more often than recorded")
                cursor[name] = i + 1
                scores = out[2]
                idx = self.rec.picks[name][i].to(scores.device)
                if idx.shape != out[0].shape:
                    raise ValueError(f"pinned_routing: router {name}: recorded picks {tuple(idx.shape)} vs "
                                     f"{tuple(out[0].shape)} in this run (same inputs are needed)")
                w = scores.gather(1, idx)
                if mod.renormalize:
                    w = w / (w.sum(-1, keepdim=True) + 1e-20)
                return idx, w * mod.scaling, scores
            return hook
        self._hooks = [mod.register_forward_hook(play(n)) for n, mod in routers]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
