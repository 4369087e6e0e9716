"""Building what a run trains: the model (storage dtype, activation checkpointing, torch.compile, max-logit
tracking for QK-clip) and the MoE load balancer, from the training arguments."""
from __future__ import annotations

import warnings

import torch

from k3.config import K3Config
from k3.errors import K3ConfigError, K3Error
from k3.train.config import TrainConfig, resolve_compile, resolve_param_dtype

__all__ = ["build_model", "make_balancer"]


def build_model(cfg: TrainConfig, mcfg: K3Config, device: torch.device):
    """-> (model in train mode, param dtype "fp32" | "bf16", compile mode)."""
    from k3.model import K3ForCausalLM
    with torch.device(device):
        model = K3ForCausalLM(mcfg)
    model.float()  # fp32 weights (bf16 autocast on GPU), or bf16 weights with fp32 masters in the optimizer
    param_dtype = resolve_param_dtype(cfg.param_dtype, device)
    if param_dtype == "bf16":
        # the release's storage dtypes: bf16, except the spec's fp32 names (A_log, dt_bias, the short convs,
        # KDA's o_norm, the routing bias that the balancers set)
        from k3.checkpoint import cast_to_storage_dtype
        cast_to_storage_dtype(model, torch.bfloat16)
    model.train()
    if cfg.activation_checkpointing:
        model.set_gradient_checkpointing(True)
    compile_mode = resolve_compile(cfg.compile, device)
    if compile_mode != "none":
        # H200, small B8 T4096: modules 45.1K tok/s (126 GiB) vs eager B4 27.6K tok/s (B8 OOM); RESULTS.md
        from k3.compile import compile_model
        compile_model(model, mode=compile_mode)
    for m in model.modules():
        if hasattr(m, "track_max_logit"):
            m.track_max_logit = True
    return model, param_dtype, compile_mode


def make_balancer(balancer: str, model, mcfg: K3Config):
    """The `--balancer` attached to `model`'s routers (None for a dense model)."""
    name = (balancer or "none").lower()
    if mcfg.num_experts <= 0:
        return None
    try:
        from k3.balance import make_balancer as make
    except ImportError:
        if name != "none":
            warnings.warn(f"k3.balance is not available: training without the '{name}' balancer")
        return None
    try:
        return make(name).attach(model)
    except K3Error as e:
        raise K3ConfigError(f"--balancer {name}: {e}") from e
