"""Stable LatentMoE (architecture.md §3.6): full-width fp32 sigmoid router with a non-trainable correction bias, routed
experts in a latent width l (down-projection, stacked experts, RMSNorm, up-projection), shared experts at full
width. Expert weights are stacked [E, ...] (see docs/CONTRACTS.md)."""
from __future__ import annotations


import torch
from torch import nn

from k3.nn.mlp import GLUMLP, cat_weights
from k3.nn.norm import RMSNorm
from k3.ops.activations import get_glu, situ_glu, situ_glu_packed
from k3.ops import f32
from k3.ops.moe import experts_forward, packed_experts_forward, route
from k3.ops.router import expert_weights, select_experts


class K3Router(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, renormalize: bool = True, scaling: float = 1.0,
                 num_expert_group: int = 1, topk_group: int = 1):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.scaling = renormalize, scaling
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x_Nd):
        return route(x_Nd, self.weight, self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling,
                     self.num_expert_group, self.topk_group)


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, latent: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, latent, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, latent))

    def extra_repr(self):
        E, l, M2 = self.gate_up_proj.shape
        return f"experts={E}, latent={l}, inter={M2 // 2}"


class PackedMXFP4Experts(nn.Module):
    """Routed experts kept MXFP4-packed in memory (inference): 4.25 bits per weight (a 4-bit code + one 8-bit
    scale per 32), dequantised inside the expert matmul (k3.ops.moe.packed_experts_forward). Buffers, not
    parameters: no gradients. Layout = the released per-expert tensors stacked ([out, in] rows):
    gate_up_packed [E, 2M, l/2] + gate_up_scale [E, 2M, l/32] (w1 rows then w3 rows), down_packed [E, l, M/2] +
    down_scale [E, l, M/32] (w2). Built by `from_pretrained(..., packed_experts=True)` (the checkpoint's packed
    bytes are copied in, no decode) or `pack_experts_(model)` (encodes a dense model)."""

    def __init__(self, num_experts: int, latent: int, inter: int):
        super().__init__()
        if latent % 32 or inter % 32:
            raise ValueError(f"MXFP4 experts need latent ({latent}) and expert width ({inter}) multiples of 32")
        E, l, M = num_experts, latent, inter
        self.register_buffer("gate_up_packed", torch.zeros(E, 2 * M, l // 2, dtype=torch.uint8))
        self.register_buffer("gate_up_scale", torch.zeros(E, 2 * M, l // 32, dtype=torch.uint8))
        self.register_buffer("down_packed", torch.zeros(E, l, M // 2, dtype=torch.uint8))
        self.register_buffer("down_scale", torch.zeros(E, l, M // 32, dtype=torch.uint8))

    @classmethod
    @torch.no_grad()
    def from_dense(cls, experts: "StackedExperts") -> "PackedMXFP4Experts":
        """Encode stacked dense experts (lossy unless the weights lie on the MXFP4 grid, e.g. a decoded release)."""
        from k3.checkpoint.mxfp4 import mxfp4_encode
        E, l, M2 = experts.gate_up_proj.shape
        new = cls(E, l, M2 // 2).to(experts.gate_up_proj.device)
        new.gate_up_packed, new.gate_up_scale = mxfp4_encode(experts.gate_up_proj.detach().transpose(1, 2))
        new.down_packed, new.down_scale = mxfp4_encode(experts.down_proj.detach().transpose(1, 2))
        return new

    @torch.no_grad()
    def dense(self, dtype=torch.float32) -> tuple:
        """(gate_up_proj [E, l, 2M], down_proj [E, M, l]) decoded (the whole stack; for tests / conversion)."""
        from k3.checkpoint.mxfp4 import mxfp4_decode
        return (mxfp4_decode(self.gate_up_packed, self.gate_up_scale, dtype).transpose(1, 2).contiguous(),
                mxfp4_decode(self.down_packed, self.down_scale, dtype).transpose(1, 2).contiguous())

    def forward(self, x_Nl, topk_idx_Nk, topk_w_Nk, glu):
        return packed_experts_forward(x_Nl, topk_idx_Nk, topk_w_Nk, self.gate_up_packed, self.gate_up_scale,
                                      self.down_packed, self.down_scale, glu)

    def extra_repr(self):
        E, M2, _ = self.gate_up_packed.shape
        return f"experts={E}, latent={self.down_packed.shape[1]}, inter={M2 // 2}, mxfp4"


def pack_experts_(model: nn.Module) -> nn.Module:
    """Replace every LatentMoE's dense `StackedExperts` by `PackedMXFP4Experts` (MXFP4-encoding them), in place.
    Returns the model."""
    for m in model.modules():
        if isinstance(m, LatentMoE) and isinstance(m.experts, StackedExperts):
            m.experts = PackedMXFP4Experts.from_dense(m.experts)
    return model


class MoEDecodeState:
    """Fused weights of a LatentMoE for `LatentMoE.decode_step` (built by `prepare_decode`). `picks`: None, or a
    LongTensor [N, top_k] the step writes its selected experts into (routing replay's record of a static decode)."""
    __slots__ = ("W_r", "bias", "W_in", "l", "gate_up", "down", "norm", "W_up", "shared", "picks")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))


class LatentMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, l = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.gate = K3Router(d, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_renormalize,
                             cfg.routed_scaling_factor, cfg.num_expert_group, cfg.topk_group)
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
        if isinstance(self.experts, PackedMXFP4Experts):
            u_Nl = self.experts(x_Nl, topk_idx_Nk, topk_w_Nk, self.glu)
        else:
            u_Nl = experts_forward(x_Nl, topk_idx_Nk, topk_w_Nk, self.experts.gate_up_proj, self.experts.down_proj,
                                   self.glu, backend=self.expert_backend,
                                   glu_packed=self.glu_packed if self._glu is situ_glu else None)
        out = self.routed_expert_up_proj(self.routed_expert_norm(u_Nl))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_Nd)
        return out.view(shape)

    def prepare_decode(self, dtype: torch.dtype) -> MoEDecodeState:
        """Fused weights for `decode_step` (one matmul for the latent down-projection + the shared gate/up, the
        router weight transposed in fp32, the stacked experts in `dtype`). Rebuild after changing weights."""
        m, sh = self, self.shared_experts
        packed = isinstance(m.experts, PackedMXFP4Experts)  # decode_step then dequantises the selected experts
        lins = [m.routed_expert_down_proj] + ([sh.gate_proj, sh.up_proj] if sh is not None else [])
        return MoEDecodeState(
            W_r=f32(m.gate.weight.detach()).t().contiguous(),                       # [d, E] fp32
            bias=f32(m.gate.e_score_correction_bias.detach()),
            W_in=cat_weights(*lins), l=m.routed_expert_down_proj.weight.shape[0],
            gate_up=None if packed else m.experts.gate_up_proj.detach().to(dtype),  # [E, l, 2M]
            down=None if packed else m.experts.down_proj.detach().to(dtype),        # [E, M, l]
            norm=m.routed_expert_norm.prepare_decode(dtype) if isinstance(m.routed_expert_norm, RMSNorm) else None,
            W_up=m.routed_expert_up_proj.weight.detach().t().contiguous(),
            shared=sh.prepare_decode(dtype, input_proj=False) if sh is not None else None)

    def decode_step(self, st: MoEDecodeState, x_Nd: torch.Tensor) -> torch.Tensor:
        """The layer on a few tokens x [N, d], shape-static (CUDA-graph capturable, no host reads): the router by
        k3.ops.router.select_experts; for N x top_k <= experts the selected experts' weights are gathered and run as
        one bmm per projection, else every expert runs on every token (dense bmm) with zero weights where not
        selected. Same math as `forward`."""
        g = self.gate
        N, k, E = x_Nd.shape[0], g.top_k, g.num_experts
        scores = torch.sigmoid(f32(x_Nd) @ st.W_r)                                  # [N, E]
        idx, w = select_experts(scores, st.bias, k, g.renormalize, g.scaling, g.num_expert_group, g.topk_group)
        if st.picks is not None:
            st.picks.copy_(idx)
        proj = x_Nd @ st.W_in
        x_l = proj[:, :st.l]
        if st.gate_up is None:  # packed MXFP4 experts (host-side loop over the selected experts: not graph-safe)
            out = f32(self.experts(x_l, idx, w, self.glu))
        elif N * k <= E:   # gather the selected experts' weights: one bmm per projection
            gu = st.gate_up.index_select(0, idx.reshape(-1))                        # [N*k, l, 2M]
            x_k = x_l.unsqueeze(1).expand(N, k, st.l).reshape(N * k, 1, st.l)
            h = torch.bmm(x_k, gu)                                                  # [N*k, 1, 2M]
            gg, u = h.chunk(2, -1)
            y = torch.bmm(self.glu(gg, u), st.down.index_select(0, idx.reshape(-1)))   # [N*k, 1, l]
            out = (f32(y.view(N, k, st.l)) * w.unsqueeze(-1)).sum(1)
        else:            # every expert on every token, weights zero where not selected
            h = torch.bmm(x_l.unsqueeze(0).expand(E, N, st.l), st.gate_up)         # [E, N, 2M]
            gg, u = h.chunk(2, -1)
            y = torch.bmm(self.glu(gg, u), st.down)                                    # [E, N, l]
            wd = torch.zeros(N, E, dtype=w.dtype, device=w.device).scatter(1, idx, w)
            out = (f32(y) * wd.t().unsqueeze(-1)).sum(0)
        u_l = out.to(x_Nd.dtype)
        if st.norm is not None:
            u_l = self.routed_expert_norm.decode_step(st.norm, u_l)
        y = u_l @ st.W_up
        if st.shared is not None:
            y = y + self.shared_experts.decode_from_gate_up(st.shared, proj[:, st.l:])
        return y


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
                return idx, expert_weights(scores, idx, mod.renormalize, mod.scaling), scores
            return hook
        self._hooks = [mod.register_forward_hook(play(n)) for n, mod in routers]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
