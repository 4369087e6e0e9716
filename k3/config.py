"""K3Config: one dataclass tree for the K3 text model, read from / written to the released HF `config.json`.

The field names are the released `text_config` keys, so a config maps 1:1. Keys this class does not model are
kept in `extra` (text level) and `container` (the top-level multimodal wrapper incl. `vision_config`), so a
load → save round trip loses nothing.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Optional

from k3.errors import K3ConfigError

__all__ = ["K3Config", "LinearAttnConfig", "PRESETS"]

_PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")


@dataclass
class LinearAttnConfig:
    """KDA part (`text_config.linear_attn_config`). Layer lists are **1-indexed** as in the release."""

    num_heads: int = 96
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = True
    # log-decay floor of the bounded gate g = lb * sigmoid(exp(A_log) (f + dt_bias)), in [-10, 0) (see validate);
    # None = the unbounded Kimi-Linear gate g = -exp(A_log) * softplus(f + dt_bias)
    gate_lower_bound: Optional[float] = -5.0
    full_attn_layers: list = field(default_factory=list)
    kda_layers: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "LinearAttnConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kw = {k: v for k, v in d.items() if k in names}
        return cls(**kw, extra={k: v for k, v in d.items() if k not in names})

    def to_dict(self) -> dict:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"}
        d.update(copy.deepcopy(self.extra))
        return d


# Fields of K3Config that are *not* released keys: written only when they differ from what the released format
# implies (so a config that matches the release is written with released keys only). `kda_gate_low_rank` is
# implicit in the release: it equals `linear_attn_config.head_dim` (f_a_proj [head_dim, d], f_b_proj [P, head_dim]).
# `mtp_loss_weight` (training only: lambda of the MTP loss) never changes the weights' layout, so a release export
# simply drops it (k3.export).
_K3_ONLY_DEFAULTS = {"a_log_storage_size": 128, "mla_latent_norm_eps": 1e-6, "attn_res_mode": "block",
                     "mtp_loss_weight": 0.3}
ATTN_RES_MODES = ("block", "none")
# Released-format aliases read on load: older HF configs spell `dtype` as `torch_dtype`.
_ALIASES = {"torch_dtype": "dtype"}


@dataclass
class K3Config:
    # --- sizes
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    # --- MLA
    num_attention_heads: int = 96
    num_key_value_heads: Optional[int] = None  # None (key absent) = num_attention_heads: MLA has no GQA
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # --- KDA
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    # --- MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    intermediate_size: int = 33792
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    # --- activation / norms / AttnRes
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    attn_res_block_size: int = 12
    rms_norm_eps: float = 1e-5
    # --- misc released keys
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    use_cache: bool = True
    dtype: str = "bfloat16"
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    model_type: str = "kimi_linear"
    architectures: list = field(default_factory=lambda: ["KimiLinearForCausalLM"])
    quantization_config: Optional[dict] = None
    # --- k3-only (not in the release; implicit there)
    # rank of the KDA decay gate (f_a_proj rows / f_b_proj columns). None = the released rule, i.e.
    # linear_attn_config.head_dim (resolved in __post_init__; written to config.json only when it differs)
    kda_gate_low_rank: Optional[int] = None
    a_log_storage_size: int = 128
    mla_latent_norm_eps: float = 1e-6
    # "block": Block Attention Residuals (the release); "none": a standard pre-norm residual stream
    # h += attn(norm(h)); h += ffn(norm(h)), without the AttnRes norms / pseudo-queries (ablations only)
    attn_res_mode: str = "block"
    # weight lambda of the multi-token-prediction loss: loss = main + lambda * mean over the
    # num_nextn_predict_layers MTP depths (k3/nn/mtp.py; no effect without MTP blocks)
    mtp_loss_weight: float = 0.3
    # --- round-trip storage
    extra: dict = field(default_factory=dict)
    container: Optional[dict] = None  # top-level wrapper (incl. vision_config) when loaded from one

    def __post_init__(self):
        if isinstance(self.linear_attn_config, dict):
            self.linear_attn_config = LinearAttnConfig.from_dict(self.linear_attn_config)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.kda_gate_low_rank is None:
            self.kda_gate_low_rank = self.linear_attn_config.head_dim
        self.validate()

    @property
    def release_compatible_problems(self) -> list[str]:
        """Why a checkpoint of this config cannot be written in the released layout so that other tools (vLLM,
        HF remote code) rebuild the same model from `config.json` alone: k3-only fields that differ from what the
        released format implies. Empty = representable."""
        out = []
        if self.kda_gate_low_rank != self.lac.head_dim:
            out.append(f"kda_gate_low_rank = {self.kda_gate_low_rank} differs from linear_attn_config.head_dim = "
                       f"{self.lac.head_dim} (the released format derives the KDA decay rank from head_dim)")
        if self.mla_latent_norm_eps != _K3_ONLY_DEFAULTS["mla_latent_norm_eps"]:
            out.append(f"mla_latent_norm_eps = {self.mla_latent_norm_eps} (the released format implies 1e-6)")
        if self.attn_res_mode != "block":
            out.append(f"attn_res_mode = {self.attn_res_mode!r} (the released format implies Block AttnRes, 'block')")
        return out

    # ------------------------------------------------------------------ derived
    @property
    def lac(self) -> LinearAttnConfig:
        return self.linear_attn_config

    @property
    def layer_types(self) -> list[str]:
        """'kda' or 'mla' per 0-based layer index."""
        mla = set(self.lac.full_attn_layers)
        return ["mla" if (i + 1) in mla else "kda" for i in range(self.num_hidden_layers)]

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and (i % self.moe_layer_freq == 0)

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def bad(key, msg):
            raise K3ConfigError(f"config key `{key}`: {msg}")

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "v_head_dim", "attn_res_block_size", "kda_gate_low_rank"):
            v = getattr(self, key)
            if not isinstance(v, int) or v <= 0:
                bad(key, f"must be a positive integer, got {v!r}")
        for key in ("qk_nope_head_dim", "qk_rope_head_dim", "q_lora_rank", "num_shared_experts", "num_experts",
                    "first_k_dense_replace"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 0:
                bad(key, f"must be a non-negative integer, got {v!r}")
        if self.qk_head_dim <= 0:
            bad("qk_nope_head_dim", "qk_nope_head_dim + qk_rope_head_dim must be > 0")
        if self.num_key_value_heads != self.num_attention_heads:
            bad("num_key_value_heads", f"MLA has no GQA: must equal num_attention_heads "
                f"({self.num_attention_heads}), got {self.num_key_value_heads}")
        lac = self.lac
        for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
            v = getattr(lac, key)
            if not isinstance(v, int) or v <= 0:
                bad(f"linear_attn_config.{key}", f"must be a positive integer, got {v!r}")
        if lac.use_full_rank_gate is not True:
            bad("linear_attn_config.use_full_rank_gate", f"only the full-rank KDA output gate (g_proj d -> P) is "
                f"implemented, got {lac.use_full_rank_gate!r}")
        if self.mla_use_nope is not True:
            bad("mla_use_nope", f"only NoPE MLA (no rotary embedding; the 'rope' dims stay unrotated) is implemented, "
                f"got {self.mla_use_nope!r}")
        lb = lac.gate_lower_bound
        if lb is not None:
            from k3.ops.kda import MIN_LOWER_BOUND, lower_bound_problem
            why = lower_bound_problem(lb)
            if why is not None:
                bad("linear_attn_config.gate_lower_bound", f"{why}; null selects the unbounded softplus gate "
                    f"(safe limit {MIN_LOWER_BOUND})")
        if self.attn_res_mode not in ATTN_RES_MODES:
            bad("attn_res_mode", f"must be one of {', '.join(map(repr, ATTN_RES_MODES))}, got {self.attn_res_mode!r}")
        L = self.num_hidden_layers
        mla, kda = list(lac.full_attn_layers), list(lac.kda_layers)
        for name, lst in (("full_attn_layers", mla), ("kda_layers", kda)):
            for x in lst:
                if not isinstance(x, int) or not (1 <= x <= L):
                    bad(f"linear_attn_config.{name}", f"entries are 1-indexed layer numbers in 1..{L}, got {x!r}")
            if len(set(lst)) != len(lst):
                bad(f"linear_attn_config.{name}", "has duplicate entries")
        both = sorted(set(mla) & set(kda))
        if both:
            bad("linear_attn_config.kda_layers", f"layers {both} are in both kda_layers and full_attn_layers")
        if kda or mla:
            missing = sorted(set(range(1, L + 1)) - set(mla) - set(kda))
            if kda and missing:
                bad("linear_attn_config.kda_layers", f"layers {missing} are in neither kda_layers nor full_attn_layers")
        if self.num_experts > 0:
            if not (1 <= self.num_experts_per_token <= self.num_experts):
                bad("num_experts_per_token", f"top-k must be in 1..num_experts ({self.num_experts}), "
                    f"got {self.num_experts_per_token}")
            for key in ("moe_intermediate_size", "routed_expert_hidden_size", "moe_layer_freq", "num_expert_group"):
                if getattr(self, key) <= 0:
                    bad(key, f"must be positive, got {getattr(self, key)}")
            if self.num_experts % self.num_expert_group:
                bad("num_expert_group", f"must divide num_experts ({self.num_experts})")
            if not (1 <= self.topk_group <= self.num_expert_group):
                bad("topk_group", f"must be in 1..num_expert_group ({self.num_expert_group})")
            G = self.num_expert_group
            if G > 1 and self.topk_group * (self.num_experts // G) < self.num_experts_per_token:
                bad("topk_group", f"the {self.topk_group} kept group(s) of {self.num_experts // G} experts hold fewer "
                    f"than num_experts_per_token ({self.num_experts_per_token}) experts")
            if G > 1 and not self.use_grouped_topk:
                bad("use_grouped_topk", f"must be true when num_expert_group > 1 (got num_expert_group = {G}); "
                    f"ungrouped selection is num_expert_group = 1")
            if self.topk_method != "noaux_tc":
                bad("topk_method", f"only 'noaux_tc' (top-k of sigmoid scores + correction bias, optionally grouped) "
                    f"is implemented, got {self.topk_method!r}")
            if self.moe_router_activation_func != "sigmoid":
                bad("moe_router_activation_func", f"only 'sigmoid' is implemented, got {self.moe_router_activation_func!r}")
        if self.first_k_dense_replace > 0 and self.intermediate_size <= 0:
            bad("intermediate_size", "must be positive when first_k_dense_replace > 0")
        if self.hidden_act not in ("situ", "silu", "swiglu"):
            bad("hidden_act", f"must be 'situ' (SiTU-GLU), 'silu' or 'swiglu' (both SwiGLU), got {self.hidden_act!r}")
        if self.activation_situ_beta <= 0 or self.activation_situ_linear_beta <= 0:
            bad("activation_situ_beta", "SiTU betas must be > 0")
        n = self.num_nextn_predict_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            bad("num_nextn_predict_layers", f"must be a non-negative integer (MTP blocks; 0 = none, as released), "
                f"got {n!r}")
        if n and self.num_experts == 0 and self.intermediate_size <= 0:
            bad("intermediate_size", "must be positive for the dense FFN of the MTP blocks (num_experts = 0)")
        w = self.mtp_loss_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0 <= w < float("inf")):
            bad("mtp_loss_weight", f"must be a finite number >= 0, got {w!r}")
        if not (0 <= self.bos_token_id < self.vocab_size and 0 <= self.eos_token_id < self.vocab_size
                and 0 <= self.pad_token_id < self.vocab_size):
            bad("eos_token_id", f"bos/eos/pad ids must be < vocab_size ({self.vocab_size})")

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_dict(cls, d: dict) -> "K3Config":
        if not isinstance(d, dict):
            raise K3ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        container = None
        if "text_config" in d:
            container = {k: copy.deepcopy(v) for k, v in d.items() if k != "text_config"}
            d = d["text_config"]
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "container"}
        kw = {k: copy.deepcopy(v) for k, v in d.items() if k in names}
        for alias, name in _ALIASES.items():  # `torch_dtype` (older HF spelling) when `dtype` is absent
            if name not in kw and isinstance(d.get(alias), str):
                kw[name] = d[alias].replace("torch.", "")
        extra = {k: copy.deepcopy(v) for k, v in d.items() if k not in names}
        if "linear_attn_config" in kw:
            kw["linear_attn_config"] = LinearAttnConfig.from_dict(kw["linear_attn_config"])
        try:
            return cls(**kw, extra=extra, container=container)
        except TypeError as e:  # pragma: no cover - defensive
            raise K3ConfigError(str(e)) from e

    def to_dict(self, text_only: bool = False) -> dict:
        """The HF layout: the container with `text_config` when this config came from one (or always for
        `text_only=False` with a container), else the bare text config."""
        d = {}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "container"):
                continue
            v = getattr(self, f.name)
            if f.name in _K3_ONLY_DEFAULTS and v == _K3_ONLY_DEFAULTS[f.name]:
                continue
            if f.name == "kda_gate_low_rank" and v == self.lac.head_dim:
                continue  # the released rule: implied by head_dim
            if f.name == "quantization_config" and v is None:
                continue
            d[f.name] = v.to_dict() if isinstance(v, LinearAttnConfig) else copy.deepcopy(v)
        d.update(copy.deepcopy(self.extra))
        d = dict(sorted(d.items()))
        if self.container is not None and not text_only:
            out = copy.deepcopy(self.container)
            out["text_config"] = d
            return dict(sorted(out.items()))
        return d

    @classmethod
    def from_json(cls, path: str) -> "K3Config":
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise K3ConfigError(f"config file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise K3ConfigError(f"config file {path} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def save_json(self, path: str, text_only: bool = False) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(text_only=text_only), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "K3Config":
        path = os.path.join(_PRESET_DIR, f"{name}.json")
        if not os.path.exists(path):
            raise K3ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
        cfg = cls.from_json(path)
        return cfg.replace(**overrides) if overrides else cfg

    @classmethod
    def load(cls, spec: str) -> "K3Config":
        """A preset name, a config.json path, or a directory holding config.json."""
        if os.path.isdir(spec):
            return cls.from_json(os.path.join(spec, "config.json"))
        if os.path.exists(spec) or spec.endswith(".json"):
            return cls.from_json(spec)
        return cls.from_preset(spec)

    def replace(self, **overrides) -> "K3Config":
        d = self.to_dict(text_only=True)
        for k, v in overrides.items():
            if "." in k:  # linear_attn_config.num_heads=...
                a, b = k.split(".", 1)
                d[a][b] = v
            elif dataclasses.is_dataclass(v) and not isinstance(v, type):
                d[k] = dataclasses.asdict(v)
            else:
                d[k] = v
        new = K3Config.from_dict(d)
        new.container = copy.deepcopy(self.container)
        return new


PRESETS = sorted(os.path.splitext(f)[0] for f in os.listdir(_PRESET_DIR) if f.endswith(".json")) \
    if os.path.isdir(_PRESET_DIR) else []
