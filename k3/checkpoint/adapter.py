"""Map between the in-memory state dict of ``K3ForCausalLM`` (docs/CONTRACTS.md) and the released checkpoint
layout (spec §4.2–4.3).

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
    "model_key_shapes", "released_key_shapes", "to_released", "from_released", "released_plan",
    "ReleasedAssembler", "ReleasedEntry", "default_quantization_config", "format_key_report", "model_key_of",
]

log = logging.getLogger("k3.checkpoint")

PREFIX = "language_model."
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.")
# Tensors stored (and kept in memory) in fp32 regardless of the model dtype (spec §2).
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
    """The released ``quantization_config`` (spec §4.3)."""
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
class ReleasedAssembler:
    """Streams released tensors into in-memory tensors.

    ``targets``: ``{model_key: tensor}`` to copy into (e.g. a live model's ``state_dict()``); keys absent from it
    are *unexpected*. With ``targets=None`` the assembler builds a fresh state dict (direct tensors are kept as-is
    after the dtype cast; stacked experts are allocated from the config) and nothing is unexpected except keys
    that match no naming rule.

    Call :meth:`add` for every tensor, then :meth:`finish` (returns the state dict, raises CheckpointError on
    problems when ``strict``).
    """

    def __init__(self, config, targets: Optional[dict] = None, dtype=None, strict: bool = True,
                 expected: Optional[dict] = None, experts: Optional[tuple] = None):
        self.config = config
        # routed experts kept (start, stop): expert e lands at index e - start of the stacked tensors; experts
        # outside the range are skipped (an expert-parallel rank loads its own slice)
        self.expert_range = tuple(experts) if experts is not None else None
        self.targets = targets
        self.dtype = torch_dtype(dtype) if dtype is not None else None
        self.strict = strict
        self.expected = expected  # {model_key: (shape, dtype)} for shape checks in fresh mode
        self.out: dict = {} if targets is None else targets
        self.filled: set = set()
        self.expert_filled: dict = {}   # stacked model key -> set of (e, w)
        self.pending: dict = {}         # (base, e, w) -> {"weight_packed": t} waiting for its partner
        self.ignored: dict = {}
        self.unexpected: list = []
        self.misshaped: list = []
        self.bad: set = set()            # model keys / (stacked key, e, w) reported as mis-shaped
        self.errors: list = []
        self.sources: dict = {}         # released key -> source (file) for messages
        self._seen: set = set()

    # -- helpers
    def _float_dtype(self, key: str, src: torch.Tensor) -> torch.dtype:
        if is_fp32_key(key):
            return torch.float32
        if self.targets is not None and key in self.targets:
            return self.targets[key].dtype
        if self.dtype is not None:
            return self.dtype
        return src.dtype if src.is_floating_point() else torch_dtype(self.config.dtype)

    def _where(self, rkey: str) -> str:
        src = self.sources.get(rkey)
        return f" (in {src})" if src else ""

    def _stacked_target(self, skey: str, which: str) -> Optional[torch.Tensor]:
        if skey in self.out:
            return self.out[skey]
        if self.targets is not None:
            return None
        E, l, M = self.config.num_experts, self.config.routed_expert_hidden_size, self.config.moe_intermediate_size
        if self.expert_range is not None:
            E = self.expert_range[1] - self.expert_range[0]
        shape = (E, l, 2 * M) if which == "gate_up_proj" else (E, M, l)
        dt = self.dtype if self.dtype is not None else torch_dtype(self.config.dtype)
        t = torch.zeros(shape, dtype=dt)
        self.out[skey] = t
        return t

    # -- main entry
    def add(self, key: str, tensor: torch.Tensor, source: Optional[str] = None) -> None:
        if source:
            self.sources[key] = source
        if key in self._seen:
            self.errors.append(f"duplicate tensor {key}{self._where(key)}")
            return
        self._seen.add(key)
        if key.startswith(IGNORED_PREFIXES):
            self.ignored[key] = tensor
            return
        k = _strip(key, PREFIX)
        m = _EXPERT_RE.match(k)
        if m:
            self._add_expert(key, m, tensor)
            return
        if _A_LOG_RE.search(k) and tensor.dim() == 1:
            H = self._a_log_heads(k)
            if H is not None and tensor.shape[0] > H:
                tail = tensor[H:]
                if bool((tail != 0).any()):
                    self.errors.append(f"{key}{self._where(key)}: A_log has {tensor.shape[0]} entries, the model uses "
                                       f"{H}; padding entries {H}..{tensor.shape[0] - 1} must be zero, got "
                                       f"{tail.float().abs().max().item():.4g} max |value|")
                    return
                tensor = tensor[:H]
        self._add_direct(key, k, tensor)

    def _a_log_heads(self, k: str) -> Optional[int]:
        if self.targets is not None:
            t = self.targets.get(k)
            return t.shape[0] if t is not None and t.dim() == 1 else None
        return self.config.lac.num_heads

    def _add_direct(self, key: str, k: str, tensor: torch.Tensor) -> None:
        if self.targets is not None:
            tgt = self.targets.get(k)
            if tgt is None:
                self.unexpected.append(key)
                return
            if tuple(tgt.shape) != tuple(tensor.shape):
                self.misshaped.append(f"{key}{self._where(key)}: checkpoint {tuple(tensor.shape)} vs model "
                                      f"{tuple(tgt.shape)}")
                self.bad.add(k)
                return
            with torch.no_grad():
                tgt.copy_(tensor)
            self.filled.add(k)
            return
        if self.expected is not None:
            exp = self.expected.get(k)
            if exp is None:
                self.unexpected.append(key)
                return
            if tuple(exp[0]) != tuple(tensor.shape):
                self.misshaped.append(f"{key}{self._where(key)}: checkpoint {tuple(tensor.shape)} vs expected "
                                      f"{tuple(exp[0])}")
                self.bad.add(k)
                return
        dt = self._float_dtype(k, tensor) if tensor.is_floating_point() else tensor.dtype
        self.out[k] = tensor.to(dt)
        self.filled.add(k)

    def _add_expert(self, key: str, m: re.Match, tensor: torch.Tensor) -> None:
        base, e, w, kind = m.group("base"), int(m.group("e")), m.group("w"), m.group("kind")
        if self.expert_range is not None:
            if not (self.expert_range[0] <= e < self.expert_range[1]):
                return  # another rank's expert
            e -= self.expert_range[0]
        which = "down" if w == "w2" else "gate_up"
        if self.targets is not None and f"{base}.{which}_packed" in self.targets:
            self._add_packed_expert(key, base, e, w, kind, tensor)
            return
        if kind != "weight":
            slot = self.pending.setdefault((base, e, w), {})
            slot[kind] = (key, tensor)
            if len(slot) < 2:
                return
            del self.pending[(base, e, w)]
            (pkey, packed), (skey_, scale) = slot["weight_packed"], slot["weight_scale"]
            try:
                tensor = mxfp4_decode(packed, scale, dtype=torch.float32)
            except ValueError as ex:
                self.misshaped.append(f"{pkey}{self._where(pkey)} / {skey_}: cannot MXFP4-decode: {ex}")
                self.bad.add((f"{base}.{'down_proj' if w == 'w2' else 'gate_up_proj'}", e, w))
                return
            key = pkey
        self._place_expert(key, base, e, w, tensor)

    def _add_packed_expert(self, key: str, base: str, e: int, w: str, kind: str, tensor: torch.Tensor) -> None:
        """Into a model with PackedMXFP4Experts: MXFP4 pairs are copied as bytes (no decode); a dense expert
        weight is MXFP4-encoded (lossy unless it lies on the grid)."""
        if kind == "weight":
            try:
                packed, scale = mxfp4_encode(tensor)
            except ValueError as ex:
                self.misshaped.append(f"{key}{self._where(key)}: cannot MXFP4-encode for packed experts: {ex}")
                return
            if not getattr(self, "_warned_encode", False):
                log.info("packed experts: MXFP4-encoding dense expert weights of the checkpoint (%s, ...)", key)
                self._warned_encode = True
        else:
            slot = self.pending.setdefault((base, e, w), {})
            slot[kind] = (key, tensor)
            if len(slot) < 2:
                return
            del self.pending[(base, e, w)]
            (key, packed), (_, scale) = slot["weight_packed"], slot["weight_scale"]
        which = "down" if w == "w2" else "gate_up"
        tp, ts = self.targets[f"{base}.{which}_packed"], self.targets.get(f"{base}.{which}_scale")
        skey = f"{base}.{which}_proj"
        E, rows, _ = tp.shape
        if not (0 <= e < E):
            self.unexpected.append(f"{key}: expert index {e} out of range (model has {E} experts)")
            return
        sl = slice(None) if which == "down" else (slice(0, rows // 2) if w == "w1" else slice(rows // 2, rows))
        want_p, want_s = tuple(tp[e, sl].shape), tuple(ts[e, sl].shape)
        if tuple(packed.shape) != want_p or tuple(scale.shape) != want_s:
            self.misshaped.append(f"{key}{self._where(key)}: packed {tuple(packed.shape)} / scale "
                                  f"{tuple(scale.shape)} vs model {want_p} / {want_s}")
            self.bad.add((skey, e, w))
            return
        done = self.expert_filled.setdefault(skey, set())
        if (e, w) in done:
            self.errors.append(f"expert {e} {w} of {skey} given twice (dense and MXFP4?){self._where(key)}")
            return
        with torch.no_grad():
            tp[e, sl].copy_(packed)
            ts[e, sl].copy_(scale)
        done.add((e, w))

    def _place_expert(self, key: str, base: str, e: int, w: str, W: torch.Tensor) -> None:
        which = "down_proj" if w == "w2" else "gate_up_proj"
        skey = f"{base}.{which}"
        tgt = self._stacked_target(skey, which)
        if tgt is None:
            self.unexpected.append(key)
            return
        E, l_in, last = tgt.shape
        if not (0 <= e < E):
            self.unexpected.append(f"{key}: expert index {e} out of range (model has {E} experts)")
            return
        if which == "gate_up_proj":
            M = last // 2
            sl = slice(0, M) if w == "w1" else slice(M, 2 * M)
            want = (M, l_in)
        else:
            sl = slice(None)
            want = (last, l_in)
        if tuple(W.shape) != want:
            self.misshaped.append(f"{key}{self._where(key)}: checkpoint {tuple(W.shape)} vs model {want} "
                                  f"(from {skey} {tuple(tgt.shape)})")
            self.bad.add((skey, e, w))
            return
        done = self.expert_filled.setdefault(skey, set())
        if (e, w) in done:
            self.errors.append(f"expert {e} {w} of {skey} given twice (dense and MXFP4?){self._where(key)}")
            return
        with torch.no_grad():
            tgt[e, :, sl].copy_(W.t())
        done.add((e, w))

    # -- results
    def missing(self, prefix: str = PREFIX) -> list:
        """Missing tensors, named as released keys (per expert for stacked experts)."""
        if self.targets is not None:
            keys = list(self.targets.keys())
        elif self.expected is not None:
            keys = list(self.expected.keys())
        else:
            keys = list(self.expert_filled.keys())
        miss = []
        for k in keys:
            pm = _PACKED_RE.match(k)
            if pm:  # PackedMXFP4Experts buffers: complete when every expert's parts were copied in
                if pm.group("part") == "scale":
                    continue
                skey = f"{pm.group('base')}.{pm.group('which')}_proj"
                have = self.expert_filled.get(skey, set())
                ws = ("w1", "w3") if pm.group("which") == "gate_up" else ("w2",)
                for e in range(self.out[k].shape[0]):
                    for w in ws:
                        if (e, w) not in have and (skey, e, w) not in self.bad:
                            miss.append(f"{prefix}{pm.group('base')}.{e}.{w}.weight_packed/.weight_scale")
                continue
            m = _STACKED_RE.match(k)
            if m:
                if k in self.filled:  # given already stacked
                    continue
                have = self.expert_filled.get(k, set())
                E = self.out[k].shape[0] if k in self.out else self.expected[k][0][0]
                ws = ("w1", "w3") if m.group("which") == "gate_up_proj" else ("w2",)
                if len(have) == E * len(ws):
                    continue
                for e in range(E):
                    for w in ws:
                        if (e, w) not in have and (k, e, w) not in self.bad:
                            miss.append(f"{prefix}{m.group('base')}.{e}.{w}.weight (or .weight_packed/.weight_scale)")
                continue
            if k not in self.filled and k not in self.bad:
                if k == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
                    continue
                miss.append(prefix + k)
        return miss

    def problems(self) -> list:
        errs = list(self.errors)
        for (base, e, w), slot in self.pending.items():
            have = next(iter(slot))
            other = "weight_scale" if have == "weight_packed" else "weight_packed"
            errs.append(f"{slot[have][0]}: MXFP4 partner `{PREFIX}{base}.{e}.{w}.{other}` is missing")
        return errs

    def report(self) -> str:
        parts = [format_key_report("missing keys", self.missing()),
                 format_key_report("unexpected keys", self.unexpected),
                 format_key_report("mis-shaped keys", self.misshaped),
                 format_key_report("other errors", self.problems())]
        return "\n".join(p for p in parts if p)

    def finish(self, what: str = "checkpoint") -> dict:
        if self.ignored:
            log.info("ignored %d vision/projector tensors (%s, ...): the text model does not use them",
                     len(self.ignored), next(iter(self.ignored)))
        if getattr(self.config, "tie_word_embeddings", False) and "lm_head.weight" not in self.filled \
                and "model.embed_tokens.weight" in self.filled:
            if self.targets is not None:
                if "lm_head.weight" in self.targets and \
                        self.targets["lm_head.weight"].data_ptr() != self.targets["model.embed_tokens.weight"].data_ptr():
                    with torch.no_grad():
                        self.targets["lm_head.weight"].copy_(self.targets["model.embed_tokens.weight"])
            else:
                self.out["lm_head.weight"] = self.out["model.embed_tokens.weight"]
            self.filled.add("lm_head.weight")
        missing = self.missing()
        # an incomplete expert stack is always an error: the result would hold silent zeros
        incomplete = self.targets is None and self.expected is None and missing
        bad = bool(self.misshaped or self.problems() or incomplete)
        if self.strict:
            bad = bad or bool(self.unexpected) or bool(missing)
        if bad:
            raise CheckpointError(f"{what} does not match the model:\n{self.report()}")
        if self.unexpected or missing:
            log.warning("%s: non-strict load:\n%s", what, self.report())
        return self.out


def from_released(tensors: Mapping[str, torch.Tensor], config, *, dtype=None, strict: bool = False,
                  return_extras: bool = False):
    """Released tensors -> in-memory state dict.

    Accepts keys with or without ``language_model.``; ``vision_tower.*`` / ``mm_projector.*`` are set aside (logged,
    and returned as the second element when ``return_extras=True``); per-expert dense or MXFP4 weights are stacked
    (already-stacked ``experts.gate_up_proj`` / ``down_proj`` keys are accepted as well); ``A_log`` is trimmed to
    ``linear_attn_config.num_heads`` (non-zero padding raises). fp32-kept tensors come back fp32; others keep their
    checkpoint dtype unless ``dtype`` is given; decoded experts use ``dtype`` or ``config.dtype``.

    ``strict=True`` also checks the key set and every shape against :func:`model_key_shapes`; the default only
    checks what the mapping itself needs (expert shapes, A_log padding, MXFP4 pairs, complete expert sets)."""
    asm = ReleasedAssembler(config, targets=None, dtype=dtype, strict=strict,
                            expected=model_key_shapes(config) if strict else None)
    for k, t in tensors.items():
        asm.add(k, t)
    sd = asm.finish("released tensors")
    return (sd, dict(asm.ignored)) if return_extras else sd
