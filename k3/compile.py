"""torch.compile for K3 models: `compile_model(model)` compiles the sub-modules (default), each layer, or the model.

Notable:
- The fused kernels (fla KDA, fla AttnRes) are opaque to Dynamo (`torch.compiler.disable`), so each KDA layer
  is compiled as a few graphs around the kernel call; Inductor fuses the element-wise work between them
  (RMSNorms, SiTU-GLU, the gates, casts, the short convs' activation).
- mode="modules" (default) compiles every KDAAttention, MLAAttention, LatentMoE, GLUMLP and RMSNorm instance.
  Instances of one class share one compiled graph (Dynamo inlines nn.Modules and treats parameters as
  inputs), so there are ~5 compilations whatever the depth. mode="layers" compiles whole decoder layers:
  Dynamo specialises on each layer's constants (layer index, number of AttnRes sources), so it compiles once
  per layer (the recompile limit is raised to allow it) - slow to start on deep models.
  Both also compile the chunked cross-entropy (`compile_loss`); mode="model" compiles it with the rest.
- `explain(model, ...)` runs torch._dynamo.explain on one call and returns the graph/graph-break counts and
  reasons, for reports (benchmarks/gpu_model.py prints them).
Whether compiling pays off is measured in benchmarks/gpu_model.py (see docs/performance.md); the training
entry points call `compile_model` only when asked.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("k3")


def _raise_limits(n: int) -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), n))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8 * n)
    elif hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 8 * n)


def compile_loss(model, dynamic: bool = False, **kw):
    """Compile the model's chunked cross-entropy (`model.ce_chunk`, k3.model.ce_chunk_sum): the fp32 cast,
    log-softmax, NLL and their backward fuse into passes over the 16-bit logits (eager: fp32 logits and
    log-probabilities of [chunk, vocab] written and read ~4 times per chunk)."""
    from k3.model import ce_chunk_sum
    from k3.ops.loss import ce_chunk_grad
    model.ce_chunk = torch.compile(ce_chunk_sum, dynamic=dynamic, **kw)
    model.ce_grad = torch.compile(ce_chunk_grad, dynamic=dynamic, **kw)   # the training loss (k3/ops/loss.py)
    return model


def compile_model(model, mode: str = "modules", dynamic: bool = False, fullgraph: bool = False, loss: bool = True,
                  **kw):
    """Compile `model` (a K3ForCausalLM) in place and return it.

    mode="modules": attention / FFN / norm sub-modules (few compilations; works with activation checkpointing).
    mode="layers": each decoder layer (and the final norm). mode="model": the whole K3ForCausalLM forward.
    `loss`: also compile the chunked cross-entropy (modules / layers; not yet timed on its own on a GPU).
    Extra keyword arguments go to torch.compile (e.g. options={"max_autotune": True}).
    """
    layers = model.model.layers
    _raise_limits(2 * len(layers) + 8)
    if mode == "modules":
        from k3.nn.kda import KDAAttention
        from k3.nn.mla import MLAAttention
        from k3.nn.mlp import GLUMLP
        from k3.nn.moe import LatentMoE
        from k3.nn.norm import RMSNorm
        kinds = (KDAAttention, MLAAttention, LatentMoE, GLUMLP, RMSNorm)
        for m in model.modules():
            if isinstance(m, kinds):
                m.compile(dynamic=dynamic, fullgraph=fullgraph, **kw)
    elif mode == "layers":
        for layer in layers:
            layer.compile(dynamic=dynamic, fullgraph=fullgraph, **kw)
        model.model.norm.compile(dynamic=dynamic, **kw)
    elif mode == "model":
        model.compile(dynamic=dynamic, fullgraph=fullgraph, **kw)
    else:
        raise ValueError(f"compile_model: mode must be 'modules', 'layers' or 'model', got {mode!r}")
    if loss and mode != "model":
        compile_loss(model, dynamic=dynamic, **kw)
    log.info("k3: compiled %s (mode=%s)", type(model).__name__, mode)
    return model


def explain(fn, *args, **kwargs) -> dict:
    """Graph count, graph-break count and break reasons for one call of fn(*args, **kwargs)."""
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = []
    for b in getattr(ex, "break_reasons", []):
        r = getattr(b, "reason", str(b))
        where = ""
        st = getattr(b, "user_stack", None)
        if st:
            fr = st[-1]
            where = f" @ {fr.filename.split('/k3/')[-1]}:{fr.lineno}"
        reasons.append(f"{r}{where}")
    return {"graphs": ex.graph_count, "graph_breaks": ex.graph_break_count, "reasons": reasons}
