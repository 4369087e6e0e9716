"""Map between the in-memory state dict of ``K3ForCausalLM`` (docs/CONTRACTS.md) and the released checkpoint
layout (architecture.md §4.2–4.3).

In-memory                                              released (prefix ``language_model.``)
``...block_sparse_moe.experts.gate_up_proj [E, l, 2M]`` ``...experts.{e}.w1.weight [M, l]`` (cols 0..M-1, transposed)
                                                        ``...experts.{e}.w3.weight [M, l]`` (cols M..2M-1, transposed)
``...block_sparse_moe.experts.down_proj [E, M, l]``     ``...experts.{e}.w2.weight [l, M]`` (transposed)
  (or, MXFP4, ``.weight_packed`` uint8 [out, in/2] + ``.weight_scale`` uint8 [out, in/32] instead of ``.weight``)
``...self_attn.A_log [H]``                              ``...self_attn.A_log [a_log_storage_size]`` zero padded
everything else                                         same name with the prefix

The mapping is pattern based, so it works on any state dict that follows the naming contract; the config is only
used for sizes (experts, A_log padding) and for :func:`model_key_shapes` / :func:`released_key_shapes`.

The core is streaming: :class:`ReleasedAssembler` accepts released tensors one at a time and writes them into
target tensors (fresh ones, or the parameters of a live model), so a checkpoint can be loaded shard by shard
without a second full copy in memory. :func:`released_plan` is the inverse: a list of lazily produced released
tensors, so a save can materialize one shard at a time.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from k3.errors import CheckpointError
from k3.checkpoint.mxfp4 import GROUP_SIZE, mxfp4_decode, mxfp4_encode

__all__ = [
    "PREFIX", "FP32_KEY_PATTERNS", "IGNORED_PREFIXES", "is_fp32_key", "torch_dtype",
    "model_key_shapes", "released_key_shapes", "to_released", "released_plan",
    "ReleasedEntry", "default_quantization_config", "format_key_report", "model_key_of",
]

log = logging.getLogger("k3.checkpoint")

PREFIX = "language_model."
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.")
# Tensors stored (and kept in memory) in fp32 regardless of the model dtype (architecture.md §2).
FP32_KEY_PATTERNS = (
    re.compile(r"(^|\.)A_log$"),
    re.compile(r"(^|\.)dt_bias$"),
    re.compile(r"(^|\.)[qkv]_conv1d\.weight$"),
    re.compile(r"(^|\.)self_attn\.o_norm\.weight$"),
    re.compile(r"(^|\.)e_score_correction_bias$"),
)
_STACKED_RE = re.compile(r"^(?P<base>.*\.experts)\.(?P<which>gate_up_proj|down_proj)$")
_EXPERT_RE = re.compile(r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<w>w1|w2|w3)\.(?P<kind>weight|weight_packed|weight_scale)$")
_PACKED_RE = re.compile(r"^(?P<base>.*\.experts)\.(?P<which>gate_up|down)_(?P<part>packed|scale)$")
_A_LOG_RE = re.compile(r"(^|\.)A_log$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float": torch.float32, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def is_fp32_key(key: str) -> bool:
    return any(p.search(key) for p in FP32_KEY_PATTERNS)


def torch_dtype(d) -> torch.dtype:
    """``torch.dtype`` from a dtype, a config string (``"bfloat16"``) or ``"torch.bfloat16"``."""
    if isinstance(d, torch.dtype):
        return d
    if isinstance(d, str):
        name = d.replace("torch.", "")
        if name in _DTYPES:
            return _DTYPES[name]
    raise CheckpointError(f"unsupported dtype {d!r}; use one of {sorted(_DTYPES)}")


def _strip(key: str, prefix: str) -> str:
    return key[len(prefix):] if prefix and key.startswith(prefix) else key


def model_key_of(released_key: str, prefix: str = PREFIX) -> str:
    """The in-memory name a released tensor lands in: the prefix stripped, per-expert ``experts.{e}.w1|w3`` ->
    ``experts.gate_up_proj`` and ``experts.{e}.w2`` -> ``experts.down_proj`` (dense or MXFP4 parts alike)."""
    k = _strip(released_key, prefix)
    m = _EXPERT_RE.match(k)
    if m:
        return f"{m.group('base')}.{'down_proj' if m.group('w') == 'w2' else 'gate_up_proj'}"
    return k


def format_key_report(title: str, items: list, limit: int = 20) -> str:
    if not items:
        return ""
    shown = "\n".join(f"    {x}" for x in items[:limit])
    more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"  {title} ({len(items)}):\n{shown}{more}"


# ----------------------------------------------------------------------------------------------- schemas
def model_key_shapes(config) -> dict:
    """Expected in-memory state dict ``{name: (shape, dtype)}`` per docs/CONTRACTS.md, with the float dtype of
    ``config.dtype`` (fp32 for the fp32-kept keys). Computed on paper: nothing is allocated."""
    c = config
    lac = c.lac
    dt = torch_dtype(c.dtype)
    d, V = c.hidden_size, c.vocab_size
    out: dict = {}

    def add(name, shape):
        out[name] = (tuple(int(s) for s in shape), torch.float32 if is_fp32_key(name) else dt)

    add("model.embed_tokens.weight", (V, d))
    add("lm_head.weight", (V, d))
    add("model.norm.weight", (d,))
    add("model.output_attn_res_norm.weight", (d,))
    add("model.output_attn_res_proj.weight", (1, d))
    H, K, r, ck = lac.num_heads, lac.head_dim, c.kda_gate_low_rank, lac.short_conv_kernel_size
    nh, qk, vd = c.num_attention_heads, c.qk_head_dim, c.v_head_dim
    E, l, M = c.num_experts, c.routed_expert_hidden_size, c.moe_intermediate_size
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            add(p + n + ".weight", (d,))
        add(p + "self_attention_res_proj.weight", (1, d))
        add(p + "mlp_res_proj.weight", (1, d))
        a = p + "self_attn."
        if kind == "kda":
            for n in "qkvg":
                add(a + f"{n}_proj.weight", (H * K, d))
            add(a + "o_proj.weight", (d, H * K))
            add(a + "f_a_proj.weight", (r, d))
            add(a + "f_b_proj.weight", (H * K, r))
            add(a + "b_proj.weight", (H, d))
            for n in "qkv":
                add(a + f"{n}_conv1d.weight", (H * K, 1, ck))
            add(a + "A_log", (H,))
            add(a + "dt_bias", (H * K,))
            add(a + "o_norm.weight", (K,))
        else:
            if c.q_lora_rank > 0:
                add(a + "q_a_proj.weight", (c.q_lora_rank, d))
                add(a + "q_a_layernorm.weight", (c.q_lora_rank,))
                add(a + "q_b_proj.weight", (nh * qk, c.q_lora_rank))
            else:
                add(a + "q_proj.weight", (nh * qk, d))
            add(a + "kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, d))
            add(a + "kv_a_layernorm.weight", (c.kv_lora_rank,))
            add(a + "kv_b_proj.weight", (nh * (c.qk_nope_head_dim + vd), c.kv_lora_rank))
            if c.mla_use_output_gate:
                add(a + "g_proj.weight", (nh * vd, d))
            add(a + "o_proj.weight", (d, nh * vd))
        if c.is_moe_layer(i):
            m = p + "block_sparse_moe."
            add(m + "gate.weight", (E, d))
            add(m + "gate.e_score_correction_bias", (E,))
            add(m + "routed_expert_down_proj.weight", (l, d))
            if c.latent_moe_use_norm:
                add(m + "routed_expert_norm.weight", (l,))
            add(m + "routed_expert_up_proj.weight", (d, l))
            if c.num_shared_experts > 0:
                S = c.shared_intermediate_size
                add(m + "shared_experts.gate_proj.weight", (S, d))
                add(m + "shared_experts.up_proj.weight", (S, d))
                add(m + "shared_experts.down_proj.weight", (d, S))
            add(m + "experts.gate_up_proj", (E, l, 2 * M))
            add(m + "experts.down_proj", (E, M, l))
        else:
            I = c.intermediate_size
            add(p + "mlp.gate_proj.weight", (I, d))
            add(p + "mlp.up_proj.weight", (I, d))
            add(p + "mlp.down_proj.weight", (d, I))
    return out


def _expert_weight_shapes(config) -> dict:
    """``{'w1'|'w3'|'w2': [out, in]}`` of one routed expert."""
    l, M = config.routed_expert_hidden_size, config.moe_intermediate_size
    return {"w1": (M, l), "w3": (M, l), "w2": (l, M)}


def _a_log_released_size(config, H: int) -> int:
    S = getattr(config, "a_log_storage_size", H) or H
    return S if H <= S else H


def released_key_shapes(config, quantize_experts: Optional[bool] = None, prefix: str = PREFIX) -> dict:
    """Expected released layout ``{name: (shape, dtype)}`` (text model only). ``quantize_experts=None`` means
    "MXFP4 iff ``config.quantization_config`` is set" (as in the release). Nothing is allocated."""
    if quantize_experts is None:
        quantize_experts = bool(getattr(config, "quantization_config", None))
    out: dict = {}
    ew = _expert_weight_shapes(config)
    for k, (shape, dt) in model_key_shapes(config).items():
        m = _STACKED_RE.match(k)
        if m:
            which = ("w1", "w3") if m.group("which") == "gate_up_proj" else ("w2",)
            for e in range(config.num_experts):
                for w in which:
                    o, i = ew[w]
                    base = f"{prefix}{m.group('base')}.{e}.{w}"
                    if quantize_experts:
                        out[base + ".weight_packed"] = ((o, i // 2), torch.uint8)
                        out[base + ".weight_scale"] = ((o, i // GROUP_SIZE), torch.uint8)
                    else:
                        out[base + ".weight"] = ((o, i), dt)
            continue
        if k == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        if _A_LOG_RE.search(k):
            shape = (_a_log_released_size(config, shape[0]),)
        out[prefix + k] = (shape, dt)
    return out


def default_quantization_config() -> dict:
    """The released ``quantization_config`` (architecture.md §4.3)."""
    return {
        "config_groups": {"group_0": {
            "format": "mxfp4-pack-quantized", "targets": ["Linear"],
            "weights": {"dynamic": False, "group_size": 32, "num_bits": 4, "observer": "minmax",
                        "scale_dtype": "torch.uint8", "strategy": "group", "symmetric": True, "type": "float"}}},
        "format": "mxfp4-pack-quantized",
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


# ----------------------------------------------------------------------------------------------- to_released
@dataclass
class ReleasedEntry:
    """One released tensor, produced lazily (``make()``) so a save can materialize a shard at a time."""
    key: str
    shape: tuple
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def _cast(t: torch.Tensor, key: str, dtype: Optional[torch.dtype]) -> torch.Tensor:
    if is_fp32_key(key):
        return t.to(torch.float32)
    if dtype is not None and t.is_floating_point():
        return t.to(dtype)
    return t


def released_plan(state_dict: Mapping[str, torch.Tensor], config, quantize_experts: bool = False,
                  prefix: str = PREFIX, dtype=None) -> list:
    """Lazy version of :func:`to_released`: a list of :class:`ReleasedEntry` in state-dict order (experts of one
    layer in expert order)."""
    dtype = torch_dtype(dtype) if dtype is not None else None
    plan: list = []
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for k, t in state_dict.items():
        if tied and k == "lm_head.weight":
            continue  # tied to embed_tokens: not stored (HF convention)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"state dict entry {k!r} is a {type(t).__name__}, not a tensor")
        m = _STACKED_RE.match(k)
        if m:
            plan.extend(_expert_entries(k, m, t, config, quantize_experts, prefix, dtype))
            continue
        pm = _PACKED_RE.match(k)
        if pm:
            if pm.group("part") == "packed":
                scale = state_dict.get(f"{pm.group('base')}.{pm.group('which')}_scale")
                if scale is None:
                    raise CheckpointError(f"{k}: packed experts without their `{pm.group('which')}_scale`")
                plan.extend(_packed_entries(pm, t, scale, quantize_experts, prefix,
                                            dtype or torch_dtype(config.dtype)))
            continue
        shape, out_dtype = tuple(t.shape), (torch.float32 if is_fp32_key(k) else
                                            (dtype if (dtype is not None and t.is_floating_point()) else t.dtype))
        if _A_LOG_RE.search(k):
            if t.dim() != 1:
                raise CheckpointError(f"{k}: A_log must be 1-D [H], got shape {shape}")
            H = shape[0]
            S = _a_log_released_size(config, H)

            def make(t=t, H=H, S=S):
                z = torch.zeros(S, dtype=torch.float32)
                z[:H] = t.detach().to("cpu", torch.float32)
                return z
            plan.append(ReleasedEntry(prefix + k, (S,), torch.float32, make))
            continue
        plan.append(ReleasedEntry(prefix + k, shape, out_dtype,
                                  lambda t=t, k=k: _cast(t.detach(), k, dtype).to("cpu").contiguous()))
    return plan


def _expert_entries(k, m, t, config, quantize, prefix, dtype):
    E = t.shape[0] if t.dim() == 3 else None
    M = config.moe_intermediate_size
    if t.dim() != 3:
        raise CheckpointError(f"{k}: stacked expert tensor must be 3-D, got shape {tuple(t.shape)}")
    which = m.group("which")
    if which == "gate_up_proj":
        if t.shape[2] != 2 * M:
            raise CheckpointError(f"{k}: expected last dim 2*moe_intermediate_size = {2 * M}, got shape "
                                  f"{tuple(t.shape)}")
        parts = (("w1", slice(0, M)), ("w3", slice(M, 2 * M)))
    else:
        parts = (("w2", slice(None)),)
    out_dtype = dtype if dtype is not None else t.dtype
    entries = []
    for e in range(E):
        for w, sl in parts:
            base = f"{prefix}{m.group('base')}.{e}.{w}"

            def view(t=t, e=e, sl=sl):  # [in, out] slice -> W [out, in]
                return t.detach()[e, :, sl].t()
            o, i = tuple(view().shape)
            if quantize:
                if i % GROUP_SIZE:
                    raise CheckpointError(f"{base}: MXFP4 needs the input dim ({i}) to be a multiple of {GROUP_SIZE}")
                cache: dict = {}

                def q(part, view=view, cache=cache, base=base):
                    if part not in cache:
                        try:
                            cache["p"], cache["s"] = mxfp4_encode(view().to("cpu"))
                        except ValueError as ex:
                            raise CheckpointError(f"{base}: cannot MXFP4-encode: {ex}") from None
                    return cache.pop(part)  # each part is requested once; drop it after
                entries.append(ReleasedEntry(base + ".weight_packed", (o, i // 2), torch.uint8,
                                             lambda q=q: q("p")))
                entries.append(ReleasedEntry(base + ".weight_scale", (o, i // GROUP_SIZE), torch.uint8,
                                             lambda q=q: q("s")))
            else:
                entries.append(ReleasedEntry(base + ".weight", (o, i), out_dtype,
                                             lambda view=view: view().to("cpu", out_dtype).contiguous()))
    return entries


def _packed_entries(pm, packed, scale, quantize, prefix, dtype):
    """Per-expert released entries of PackedMXFP4Experts buffers: the bytes as they are (MXFP4 export) or decoded."""
    E, rows, _ = packed.shape
    parts = (("w2", slice(None)),) if pm.group("which") == "down" else \
        (("w1", slice(0, rows // 2)), ("w3", slice(rows // 2, rows)))
    out = []
    for e in range(E):
        for w, sl in parts:
            base = f"{prefix}{pm.group('base')}.{e}.{w}"
            p, s = packed[e, sl], scale[e, sl]
            if quantize:
                out.append(ReleasedEntry(base + ".weight_packed", tuple(p.shape), torch.uint8,
                                         lambda p=p: p.to("cpu").contiguous()))
                out.append(ReleasedEntry(base + ".weight_scale", tuple(s.shape), torch.uint8,
                                         lambda s=s: s.to("cpu").contiguous()))
            else:
                o, i = p.shape[0], p.shape[1] * 2
                out.append(ReleasedEntry(base + ".weight", (o, i), dtype,
                                         lambda p=p, s=s: mxfp4_decode(p.to("cpu"), s.to("cpu"), dtype)))
    return out


def to_released(state_dict: Mapping[str, torch.Tensor], config, quantize_experts: bool = False,
                prefix: str = PREFIX, dtype=None) -> dict:
    """In-memory state dict -> released tensors (``{name: tensor}``, CPU, contiguous).

    Stacked experts are split per expert (``w1``/``w3``/``w2`` ``.weight``, or MXFP4 ``weight_packed`` /
    ``weight_scale`` when ``quantize_experts``), ``A_log [H]`` is zero padded to ``config.a_log_storage_size`` (when
    ``H <=`` it), every key gets ``prefix``. fp32-kept tensors are written in fp32; ``dtype`` (optional) casts the
    other floating tensors (default: keep their dtype)."""
    return {e.key: e.make() for e in released_plan(state_dict, config, quantize_experts, prefix, dtype)}


# ----------------------------------------------------------------------------------------------- from_released
