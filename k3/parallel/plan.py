"""`k3 plan`: size a model on N GPUs before renting them (issue #30 §7). The function behind the CLI.

    from k3.parallel.plan import plan
    rep = plan(K3Config.from_preset("kimi-k3"), gpus=256, gpu_memory=141e9, seq_len=8192)
    print(rep.table()); rep.recommended

For every candidate mesh (dp_replicate x dp_shard x cp, ep dividing dp_shard x cp and num_experts; cp > 1 when given
or when the sequence is long, `cp_candidates`) it reports rank 0's bytes
(rank 0 holds the largest FSDP shards): parameters, gradients, optimizer state, the transient all-gathered units
and an activation estimate, and whether they fit in `gpu_memory` (minus `reserve`). The memory model, per rank:

  parameters   FSDP2 shards in fp32 (MixedPrecisionPolicy casts to bf16 for compute)        4 B / local element
  gradients    sharded, fp32 (reduce dtype)                                                  4 B
  optimizer    Muon momentum 4 B; AdamW exp_avg + exp_avg_sq 8 B
               (neither for the parameters the forward never reads, `never_trained`)
  transient    the largest FSDP unit all-gathered in bf16, twice (current + prefetched), plus its unsharded bf16
               gradient before the reduce-scatter; plus the largest Muon tensor rebuilt in fp32 (x3 for NS)
  activations  with activation checkpointing: every layer's saved input (tokens x d, bf16) plus the AttnRes
               block sums, plus one layer's recomputed internals and one loss chunk's fp32 logits (an estimate);
               tokens = seq_len / cp per rank, plus under CP one MLA layer's latent gathered over the sequence

The shard sizes are computed as FSDP2 computes them (dim-0 chunks, ceil); `verify_with_fake_pg` applies the real
`parallelize_model` on the `meta` device over torch's fake process group of N ranks and returns rank 0's local
element counts, which the tests compare with the model here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict
from typing import Optional

from k3.errors import K3ConfigError
from k3.parallel.mesh import ParallelDims

__all__ = ["MeshEstimate", "PlanReport", "plan", "estimate", "param_table", "verify_with_fake_pg", "cp_candidates"]

GiB = 1024 ** 3


@dataclass
class MeshEstimate:
    dp_replicate: int
    dp_shard: int
    ep: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    transient_bytes: int
    activation_bytes: int
    total_bytes: int
    fits: bool
    local_elements: dict = field(default_factory=dict)
    cp: int = 1
    tokens_per_rank: int = 0          # the activations' tokens on one rank: seq_len / cp (or tokens_per_gpu)

    def mesh(self) -> str:
        s = f"dp_shard={self.dp_shard}"
        if self.dp_replicate > 1:
            s = f"dp_replicate={self.dp_replicate} " + s
        return s + (f" cp={self.cp}" if self.cp > 1 else "") + (f" ep={self.ep}" if self.ep > 1 else "")


@dataclass
class PlanReport:
    gpus: int
    gpu_memory: float
    seq_len: int
    tokens_per_gpu: int
    total_params: int
    candidates: list
    recommended: Optional[MeshEstimate]

    def to_dict(self) -> dict:
        d = asdict(self)
        return d

    def table(self) -> str:
        head = (f"{'mesh':<34} {'params':>9} {'grads':>9} {'optim':>9} {'transient':>9} {'activ.':>9} "
                f"{'total':>9}  fits")
        rows = [head]
        for c in self.candidates:
            rows.append(f"{c.mesh():<34} " + " ".join(f"{b / GiB:8.1f}G" for b in (
                c.param_bytes, c.grad_bytes, c.optim_bytes, c.transient_bytes, c.activation_bytes,
                c.total_bytes)) + ("  yes" if c.fits else "  no"))
        rec = self.recommended.mesh() if self.recommended else "none fits"
        rows.append(f"recommended on {self.gpus} GPUs of {self.gpu_memory / GiB:.0f} GiB: {rec}")
        return "\n".join(rows)


def param_table(cfg) -> list:
    """[(name, shape, is_expert, use_muon)] of a K3ForCausalLM built on `meta` (nothing allocated)."""
    from k3.parallel.parallelize import build_meta_model
    from k3.train.optim import classify_parameters
    model = build_meta_model(cfg)
    routes = {r.name: r for r in classify_parameters(model)}
    out = []
    for n, p in model.named_parameters():
        r = routes.get(n)
        out.append((n, tuple(p.shape), n.endswith(("experts.gate_up_proj", "experts.down_proj")),
                    bool(r and r.use_muon)))
    return out


def never_trained(cfg) -> set:
    """Parameters the forward never reads, so they get no gradient and no optimizer state: with block AttnRes,
    layer 0's attention-input mix (its only source is the embedding; K3DecoderLayer.forward skips the mix)."""
    if getattr(cfg, "attn_res_mode", "block") != "block":
        return set()
    return {"model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}


def _unit_of(name: str, is_expert: bool, ep: int) -> str:
    parts = name.split(".")
    if name.startswith("model.layers."):
        unit = ".".join(parts[:3])
        return unit + ".experts" if (is_expert and ep > 1) else unit
    if name.startswith("model.embed_tokens"):
        return "embed"
    if name.startswith(("model.norm", "lm_head")):
        return "head"
    return "root"


def _local_rows(n0: int, world: int) -> int:
    return math.ceil(n0 / world) if world > 0 else n0


def estimate(cfg, dims: ParallelDims, seq_len: int, tokens_per_gpu: Optional[int] = None,
             gpu_memory: float = 141e9, reserve: float = 0.1, activation_checkpointing: bool = True,
             table: Optional[list] = None) -> MeshEstimate:
    """Rank 0's bytes under `dims` (see module doc)."""
    dims.check_model(cfg)
    table = table if table is not None else param_table(cfg)
    T = tokens_per_gpu or math.ceil(seq_len / dims.cp)     # CP: each rank holds 1/cp of the sequence
    elems = {"dense": 0, "expert": 0}
    pbytes = gbytes = obytes = 0
    units: dict = {}
    max_muon = 0
    unused = never_trained(cfg)
    for name, shape, is_exp, muon in table:
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        if is_exp and dims.ep > 1:
            rows = _local_rows(shape[0] // dims.ep, dims.efsdp)
            full_local = (shape[0] // dims.ep) * rest
        else:
            rows = _local_rows(shape[0], dims.dp_shard_cp)
            full_local = shape[0] * rest
        n = rows * rest
        elems["expert" if is_exp else "dense"] += n
        pbytes += 4 * n
        if name not in unused:              # never receives a gradient: no gradient, no optimizer state
            gbytes += 4 * n
            obytes += (4 if muon else 8) * n
        u = _unit_of(name, is_exp, dims.ep)
        units[u] = units.get(u, 0) + full_local
        if muon:
            max_muon = max(max_muon, full_local)
    big_unit = max(units.values()) if units else 0
    transient = 3 * 2 * big_unit + 3 * 4 * max_muon
    d, L = cfg.hidden_size, cfg.num_hidden_layers
    P = cfg.linear_attn_config.num_heads * cfg.linear_attn_config.head_dim
    n_blocks = math.ceil(L / cfg.attn_res_block_size)
    k, l, M = cfg.num_experts_per_token, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    per_tok_layer = (2 * 12 * d + 2 * 10 * P + 4 * 2 * max(cfg.num_experts, 1)
                     + 2 * 2 * k * (l + 3 * M) + 2 * 3 * cfg.shared_intermediate_size)
    one_layer = T * per_tok_layer
    saved = T * 2 * d * (L + n_blocks) if activation_checkpointing else one_layer * L
    loss_chunk = min(T, 4096) * cfg.vocab_size * (2 + 4 + 4)
    # CP: one MLA layer's compressed latent all-gathered over the whole sequence (bf16), and its gradient
    gathered = 2 * 2 * seq_len * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) if dims.cp > 1 else 0
    act = saved + (one_layer if activation_checkpointing else 0) + loss_chunk + gathered
    total = pbytes + gbytes + obytes + transient + act
    return MeshEstimate(dims.dp_replicate, dims.dp_shard, dims.ep, pbytes, gbytes, obytes, transient, act, total,
                        total <= gpu_memory * (1 - reserve), local_elements=elems, cp=dims.cp, tokens_per_rank=T)


def _divisors(n: int) -> list:
    return [i for i in range(1, n + 1) if n % i == 0]


# context parallelism enters the automatic candidates for sequences of at least LONG_SEQ tokens, with slices of at
# least MIN_CP_SLICE tokens per rank (shorter slices spend more on the state / latent exchange than they save)
LONG_SEQ = 32768
MIN_CP_SLICE = 4096


def cp_candidates(gpus: int, seq_len: int, cp: Optional[int] = None, max_cp: int = 64) -> list:
    """The cp degrees `plan` tries: `[cp]` when given (it must divide `gpus`), else 1, plus every divisor of `gpus`
    up to `max_cp` that leaves MIN_CP_SLICE tokens per rank when seq_len >= LONG_SEQ."""
    if cp is not None:
        if cp < 1 or gpus % cp:
            raise K3ConfigError(f"plan: --cp {cp} must be >= 1 and divide the number of GPUs ({gpus})")
        return [cp]
    out = [1]
    if seq_len >= LONG_SEQ:
        out += [c for c in _divisors(gpus) if 1 < c <= max_cp and seq_len // c >= MIN_CP_SLICE]
    return out


def plan(cfg, gpus: int, gpu_memory: float = 141e9, seq_len: int = 8192, tokens_per_gpu: Optional[int] = None,
         reserve: float = 0.1, max_ep: int = 64, gpus_per_node: int = 8, cp: Optional[int] = None) -> PlanReport:
    """Candidate meshes for `gpus` ranks, rank 0's memory under each, the recommended one (fits; the fewest
    expert-parallel ranks, since EP adds two all-to-alls per MoE layer; then the least context parallelism; then
    HSDP replicas of at least one node before plain FSDP across nodes; then the least memory). `seq_len` is the
    sequence length; under context parallelism (`cp`, or the automatic candidates of `cp_candidates`) each rank
    holds seq_len / cp of its tokens."""
    if gpus < 1:
        raise K3ConfigError(f"plan: gpus must be >= 1, got {gpus}")
    table = param_table(cfg)
    E = cfg.num_experts
    cands = []
    for C in cp_candidates(gpus, seq_len, cp):
        for R in _divisors(gpus // C):
            S = gpus // (R * C)
            if R > 1 and S * C < min(gpus_per_node, gpus):
                continue
            for ep in _divisors(S * C):
                if ep > max_ep or (ep > 1 and (E <= 0 or E % ep)):
                    continue
                dims = ParallelDims(dp_replicate=R, dp_shard=S, cp=C, ep=ep, world_size=gpus,
                                    num_experts=E if E > 0 else None)
                cands.append(estimate(cfg, dims, seq_len, tokens_per_gpu, gpu_memory, reserve, table=table))
    fit = [c for c in cands if c.fits]
    rec = min(fit, key=lambda c: (c.ep, c.cp, -c.dp_replicate, c.total_bytes)) if fit else None
    return PlanReport(gpus, gpu_memory, seq_len, tokens_per_gpu or seq_len,
                      sum(math.prod(s) for _, s, _, _ in table), cands, rec)


def verify_with_fake_pg(cfg, dims: ParallelDims) -> dict:
    """Apply the real parallelisation (EP + FSDP2, `meta` device) over torch's fake process group of
    dims.world_size ranks in this process; returns rank 0's local element counts {"dense", "expert"}. Needs a
    process without an initialised default process group (it creates and destroys one)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from k3.parallel.expert import is_ep_param
    from k3.parallel.mesh import build_mesh
    from k3.parallel.parallelize import build_meta_model, parallelize_model, refresh_ep_flags
    if dist.is_initialized():
        raise K3ConfigError("verify_with_fake_pg: a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dims.world_size)
    try:
        model = build_meta_model(cfg)
        parallelize_model(model, build_mesh(dims, "cpu"))
        refresh_ep_flags(model)
        out = {"dense": 0, "expert": 0}
        for n, p in model.named_parameters():
            loc = p.to_local() if isinstance(p, DTensor) else p
            is_exp = is_ep_param(p) or n.endswith(("experts.gate_up_proj", "experts.down_proj"))
            out["expert" if is_exp else "dense"] += loc.numel()
        return out
    finally:
        dist.destroy_process_group()
