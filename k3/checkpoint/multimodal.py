"""Save / load `K3ForConditionalGeneration` in the released multimodal layout (architecture.md §4-5).

One checkpoint directory: the container `config.json` (`text_config` + `vision_config` + `media_placeholder_token_id`),
sharded safetensors holding `language_model.*` (the text model, mapped exactly as `k3.checkpoint.io` maps it:
per-expert / MXFP4 experts, padded A_log), `vision_tower.*` and `mm_projector.*` (1:1 with the module names,
never quantised), and one `model.safetensors.index.json` over all of them. io.py writes it all
(`save_pretrained` with `extra_tensors=` and `container=`) and loads the text part; the vision part is loaded
here with the same strictness rules.
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional

import safetensors
import torch

from k3.checkpoint.adapter import IGNORED_PREFIXES, format_key_report, torch_dtype
from k3.checkpoint.io import CONFIG_NAME, _shard_layout, load_config, save_pretrained
from k3.checkpoint.io import from_pretrained as _text_from_pretrained
from k3.errors import CheckpointError, K3ConfigError

__all__ = ["save_pretrained_multimodal", "from_pretrained_multimodal", "load_vision_state_dict", "VISION_PREFIXES"]

log = logging.getLogger("k3.checkpoint")

VISION_PREFIXES = IGNORED_PREFIXES  # ("vision_tower.", "mm_projector.")


def save_pretrained_multimodal(model, save_directory: str, max_shard_size="2GB", quantize_experts: bool = False,
                               tokenizer=None, extra_files: Optional[Mapping] = None, *, dtype=None) -> str:
    """Write a `K3ForConditionalGeneration` to `save_directory` (atomically, by `k3.checkpoint.save_pretrained`):
    container config.json with the model's `vision_config`, shards with text and vision tensors, the index.
    `quantize_experts` MXFP4-encodes routed experts only (vision weights stay unquantised, as released)."""
    from k3.multimodal import K3ForConditionalGeneration
    if not isinstance(model, K3ForConditionalGeneration):
        raise CheckpointError(f"save_pretrained_multimodal: expected a K3ForConditionalGeneration, got "
                              f"{type(model).__name__}")
    vision = {prefix + k: t for prefix in VISION_PREFIXES for k, t in getattr(model, prefix[:-1]).state_dict().items()}
    return save_pretrained(model.language_model, save_directory, max_shard_size, quantize_experts, tokenizer,
                           extra_files, config=model.config, dtype=dtype, extra_tensors=vision,
                           container={"vision_config": model.vision_config.to_dict(),
                                      "media_placeholder_token_id": model.media_placeholder_token_id})


def load_vision_state_dict(directory: str) -> dict:
    """`{vision_tower.* / mm_projector.*: tensor}` of a checkpoint, reading only those tensors."""
    out = {}
    for path, keys in _shard_layout(directory).items():
        if keys is not None:
            keys = [k for k in keys if k.startswith(VISION_PREFIXES)]
            if not keys:
                continue
        try:
            with safetensors.safe_open(path, framework="pt", device="cpu") as f:
                present = set(f.keys())
                for k in (keys if keys is not None else [k for k in f.keys() if k.startswith(VISION_PREFIXES)]):
                    if k not in present:
                        raise CheckpointError(f"checkpoint index maps {k} to {path}, but that file does not contain it")
                    out[k] = f.get_tensor(k)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read safetensors file {path} (corrupt or truncated?): "
                                  f"{type(e).__name__}: {e}") from e
    return out


def from_pretrained_multimodal(directory: str, device="cpu", dtype=None, strict: bool = True, config=None):
    """Build `K3ForConditionalGeneration` from a multimodal checkpoint directory. The text model is loaded by
    `k3.checkpoint.from_pretrained` (same dtype / strict rules); the vision tensors are checked against the tower
    and projector built from `vision_config`: with `strict=True` a missing, unexpected or mis-shaped vision key
    raises CheckpointError listing them; `strict=False` warns and keeps the initial values. Returns eval mode."""
    from k3.multimodal import K3ForConditionalGeneration, is_multimodal_config
    if config is None:
        config = load_config(directory)
    if not is_multimodal_config(config):
        raise CheckpointError(f"checkpoint {directory}: {CONFIG_NAME} has no `vision_config` (a text-only "
                              f"checkpoint): load it with K3ForCausalLM.from_pretrained")
    td = torch_dtype(dtype) if dtype is not None else torch_dtype(config.dtype)
    lm = _text_from_pretrained(directory, device=device, dtype=td, strict=strict, config=config)
    try:
        model = K3ForConditionalGeneration(config, language_model=lm)
    except K3ConfigError as e:
        raise CheckpointError(f"checkpoint {directory}: invalid multimodal {CONFIG_NAME}: {e}") from e
    model.vision_tower.to(device=device, dtype=td)
    model.mm_projector.to(device=device, dtype=td)
    want = {k: v for k, v in model.state_dict().items() if k.startswith(VISION_PREFIXES)}
    got = load_vision_state_dict(directory)
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    misshaped = [f"{k}: checkpoint {tuple(got[k].shape)}, model {tuple(want[k].shape)}"
                 for k in sorted(set(want) & set(got)) if tuple(got[k].shape) != tuple(want[k].shape)]
    report = "\n".join(p for p in (format_key_report("missing keys", missing),
                                   format_key_report("unexpected keys", unexpected),
                                   format_key_report("mis-shaped keys", misshaped)) if p)
    if misshaped or (strict and (missing or unexpected)):
        raise CheckpointError(f"checkpoint {directory}: vision weights do not match the model:\n{report}")
    if missing or unexpected:
        log.warning("checkpoint %s: non-strict vision load:\n%s", directory, report)
    with torch.no_grad():
        for k, t in got.items():
            if k in want:
                want[k].copy_(t.to(want[k].dtype))
    model.eval()
    return model
