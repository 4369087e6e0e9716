"""`k3 export --format release`: a k3 checkpoint -> the released K3 layout that other tools load (vLLM's K3 /
Kimi-Linear loader, transformers with `trust_remote_code`).

Output directory (docs/architecture.md §4):

* ``config.json``: the multimodal container (``KimiK3ForConditionalGeneration`` / ``kimi_k3``) with the text model
  in ``text_config`` (``KimiLinearForCausalLM`` / ``kimi_linear``, released keys only) and ``vision_config`` when
  the checkpoint has a vision tower; ``quantization_config`` (compressed-tensors MXFP4, as released) inside
  ``text_config`` with ``quantize="mxfp4"``; ``auto_map`` pointing at the transformers shims;
* weights: ``language_model.``-prefixed text tensors with per-expert ``w1``/``w2``/``w3`` (bf16, or MXFP4
  ``weight_packed`` + ``weight_scale``), ``vision_tower.*`` / ``mm_projector.*`` verbatim; one
  ``model.safetensors`` when it fits in ``max_shard_size``, else shards + ``model.safetensors.index.json``;
* ``tiktoken.model`` + ``tokenizer_config.json`` (K3's tokenizer format with every special slot named);
* ``generation_config.json``; ``preprocessor_config.json`` when there is a vision tower;
* ``configuration_k3.py`` / ``modeling_k3.py`` / ``tokenization_k3.py``: small shims delegating to the installed
  ``k3`` package (k3/hf), so ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` works.

A config that the released format cannot express (a KDA decay rank other than ``head_dim``, a non-default MLA
latent-norm eps) is refused with ``CheckpointError``: other tools would rebuild a different model.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional

import torch

from k3.errors import CheckpointError

__all__ = ["export_release", "release_config_dict", "check_release_plan", "SourceShards", "ReleaseTokenizerWriter",
           "RELEASE_TEXT_ARCH", "RELEASE_CONTAINER_ARCH"]

log = logging.getLogger("k3.export")

RELEASE_TEXT_ARCH = "KimiLinearForCausalLM"
RELEASE_CONTAINER_ARCH = "KimiK3ForConditionalGeneration"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
_K3_ONLY_TEXT_KEYS = ("a_log_storage_size", "auto_map", "mtp_loss_weight")


def release_config_dict(config, *, quantize: Optional[str] = None, dtype: str = "bfloat16",
                        vision_config: Optional[dict] = None, media_placeholder_token_id: Optional[int] = None,
                        auto_map: Optional[dict] = None) -> dict:
    """The released ``config.json`` (container + ``text_config``) for a ``K3Config``."""
    from k3.checkpoint.adapter import default_quantization_config
    problems = config.release_compatible_problems
    if problems:
        raise CheckpointError("this model cannot be exported in the released format (other tools derive these "
                              "from the released keys and would build a different model):\n  - "
                              + "\n  - ".join(problems))
    text = config.to_dict(text_only=True)
    for k in _K3_ONLY_TEXT_KEYS:
        text.pop(k, None)
    text.pop("torch_dtype", None)
    text.update(architectures=[RELEASE_TEXT_ARCH], model_type="kimi_linear", dtype=dtype)
    if quantize == "mxfp4":
        text["quantization_config"] = config.quantization_config or default_quantization_config()
        if config.num_nextn_predict_layers:   # MTP blocks' eh_proj / shared head stay 16-bit (not MXFP4)
            q = text["quantization_config"] = json.loads(json.dumps(text["quantization_config"]))
            ign = q.setdefault("ignore", [])
            ign.extend(x for x in ("re:.*eh_proj.*", "re:.*shared_head.*") if x not in ign)
    elif quantize is None:
        text.pop("quantization_config", None)
    else:
        raise CheckpointError(f"unknown quantization {quantize!r} (supported: mxfp4)")
    base = json.loads(json.dumps(config.container)) if config.container else {}
    base.pop("text_config", None)
    base.pop("vision_config", None)
    base.pop("torch_dtype", None)
    V = config.vocab_size
    out = dict(base)
    out.update(architectures=[RELEASE_CONTAINER_ARCH], model_type="kimi_k3", dtype=dtype,
               bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
               tie_word_embeddings=config.tie_word_embeddings, text_config=dict(sorted(text.items())))
    out.setdefault("ignore_index", -100)
    out.setdefault("image_placeholder", IMAGE_PLACEHOLDER)
    out["media_placeholder_token_id"] = (media_placeholder_token_id if media_placeholder_token_id is not None
                                         else base.get("media_placeholder_token_id", V - 256 + 21))
    if vision_config is not None:
        out["vision_config"] = vision_config
    if auto_map is not None:
        out["auto_map"] = auto_map
    else:
        out.pop("auto_map", None)
    return dict(sorted(out.items()))


_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "U8": "uint8",
              "I8": "int8", "I32": "int32", "I64": "int64", "BOOL": "bool"}


class SourceShards:
    """Memory-mapped handles on the source checkpoint's shards, opened once; tensors are read on demand."""

    def __init__(self, ckpt):
        import safetensors
        from k3.checkpoint.io import _shard_layout
        self.where, self.meta, self._handles = {}, {}, {}
        for path, keys in _shard_layout(ckpt).items():
            try:
                h = safetensors.safe_open(path, framework="pt", device="cpu")
            except Exception as e:
                raise CheckpointError(f"cannot read safetensors file {path}: {type(e).__name__}: {e}") from e
            self._handles[path] = h
            present = set(h.keys())
            for k in (keys if keys is not None else sorted(present)):
                if k not in present:
                    raise CheckpointError(f"checkpoint index maps {k} to {path}, but that file does not contain it")
                sl = h.get_slice(k)
                dt = sl.get_dtype()
                self.where[k] = path
                self.meta[k] = (tuple(sl.get_shape()), getattr(torch, _ST_DTYPES.get(dt, dt.lower())))

    def get(self, key):
        return self._handles[self.where[key]].get_tensor(key)


def _stream_plan(src: "SourceShards", cfg, quantize: bool, tdt) -> list:
    """Released entries made lazily from the source checkpoint's tensors (a k3 checkpoint is already in the
    released naming): floating tensors cast to ``tdt`` (fp32-kept ones stay fp32), routed experts re-encoded to
    MXFP4 / decoded to ``tdt`` as needed, one tensor at a time. Nothing is materialised up front."""
    from k3.checkpoint.adapter import ReleasedEntry, is_fp32_key
    from k3.checkpoint.mxfp4 import GROUP_SIZE, mxfp4_decode, mxfp4_encode
    ex_re = re.compile(r"^(?P<base>.*\.experts\.\d+\.w[123])\.(?P<kind>weight|weight_packed|weight_scale)$")
    plan, done = [], set()
    for k, (shape, dt) in src.meta.items():
        m = ex_re.match(k)
        if m is None:
            out_dt = torch.float32 if is_fp32_key(k) else (tdt if dt.is_floating_point else dt)
            plan.append(ReleasedEntry(k, shape, out_dt, lambda k=k, d=out_dt: src.get(k).to(d).contiguous()))
            continue
        base = m.group("base")
        if base in done:
            continue
        done.add(base)
        if f"{base}.weight" in src.meta:                      # dense expert weight in the source
            o, i = src.meta[f"{base}.weight"][0]
            if quantize:
                if i % GROUP_SIZE:
                    raise CheckpointError(f"{base}: MXFP4 needs the input dim ({i}) to be a multiple of 32")
                cache: dict = {}

                def q(part, base=base, cache=cache):
                    if part not in cache:
                        cache["p"], cache["s"] = mxfp4_encode(src.get(f"{base}.weight"))
                    return cache.pop(part)
                plan.append(ReleasedEntry(base + ".weight_packed", (o, i // 2), torch.uint8, lambda q=q: q("p")))
                plan.append(ReleasedEntry(base + ".weight_scale", (o, i // GROUP_SIZE), torch.uint8,
                                          lambda q=q: q("s")))
            else:
                plan.append(ReleasedEntry(base + ".weight", (o, i), tdt,
                                          lambda b=base: src.get(f"{b}.weight").to(tdt).contiguous()))
        else:                                                 # MXFP4 expert in the source
            pk, sc = f"{base}.weight_packed", f"{base}.weight_scale"
            if pk not in src.meta or sc not in src.meta:
                raise CheckpointError(f"{base}: MXFP4 expert needs both weight_packed and weight_scale")
            (o, h) = src.meta[pk][0]
            if quantize:
                plan.append(ReleasedEntry(pk, (o, h), torch.uint8, lambda pk=pk: src.get(pk)))
                plan.append(ReleasedEntry(sc, src.meta[sc][0], torch.uint8, lambda sc=sc: src.get(sc)))
            else:
                plan.append(ReleasedEntry(base + ".weight", (o, 2 * h), tdt,
                                          lambda pk=pk, sc=sc: mxfp4_decode(src.get(pk), src.get(sc), tdt)))
    return plan


def check_release_plan(plan, cfg, quantize: bool, ckpt: str) -> None:
    """Names and shapes of the text tensors = what the released format implies for ``cfg`` (A_log: >= H)."""
    from k3.checkpoint.adapter import PREFIX, format_key_report, released_key_shapes
    want = released_key_shapes(cfg, quantize_experts=quantize)
    if cfg.num_nextn_predict_layers:
        from k3.nn.mtp import mtp_released_key_shapes   # MTP blocks: model.layers.{L+i}.* (k3/nn/mtp.py)
        want.update(mtp_released_key_shapes(cfg, quantize, PREFIX))
    have = {e.key: e.shape for e in plan if e.key.startswith(PREFIX)}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    bad = []
    for k in set(want) & set(have):
        ws, hs = tuple(want[k][0]), tuple(have[k])
        if k.endswith(".A_log"):
            if len(hs) != 1 or hs[0] < cfg.lac.num_heads:
                bad.append(f"{k}: {hs}, need [>= {cfg.lac.num_heads}]")
        elif ws != hs:
            bad.append(f"{k}: checkpoint {hs} vs config {ws}")
    if missing or unexpected or bad:
        parts = [format_key_report("missing", missing), format_key_report("unexpected", unexpected),
                 format_key_report("mis-shaped", bad)]
        raise CheckpointError(f"export: checkpoint {ckpt} does not match its config.json:\n"
                              + "\n".join(p for p in parts if p))


class ReleaseTokenizerWriter:
    """`save(dir)` hook for save_pretrained: writes the tokenizer in K3's released format."""

    def __init__(self, tok, extra_config):
        self.tok, self.extra_config = tok, extra_config

    def save(self, directory):
        from k3.tokenizer.export import save_release_tokenizer
        save_release_tokenizer(self.tok, directory, extra_config=self.extra_config)


def export_release(ckpt: str, out: str, *, quantize: Optional[str] = None, dtype: str = "bfloat16",
                   max_shard_size="5GB", tokenizer=None, hf_shims: bool = True) -> str:
    """Export the k3 checkpoint directory ``ckpt`` to ``out`` in the released layout (module docstring).

    ``quantize``: None (bf16 / ``dtype`` experts) or ``"mxfp4"``; ``dtype``: of the non-fp32-kept tensors
    (release: bfloat16); ``tokenizer``: a k3 tokenizer or a path (default: the one in ``ckpt``). Writes
    atomically (like save_pretrained) and returns ``out``.

    Streaming: tensors are read one at a time from the memory-mapped source shards and written shard by shard
    (peak memory ~ one output shard), after the names and shapes were checked against ``config.json``."""
    from k3.checkpoint.adapter import torch_dtype
    from k3.checkpoint.io import load_config, save_pretrained
    from k3.tokenizer import check_tokenizer_matches, load_tokenizer

    if quantize not in (None, "mxfp4"):
        raise CheckpointError(f"--quantize: unknown format {quantize!r} (supported: mxfp4)")
    tdt = torch_dtype(dtype)
    dtype_name = str(tdt).replace("torch.", "")
    cfg = load_config(ckpt)
    if cfg.release_compatible_problems:  # fail before reading any weights
        release_config_dict(cfg)
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        src = os.fspath(tokenizer) if tokenizer is not None else ckpt
        try:
            tok = load_tokenizer(src)
        except Exception as e:
            raise CheckpointError(f"export: no usable tokenizer in {src} ({e}); pass --tokenizer PATH") from e
    else:
        tok = tokenizer
    check_tokenizer_matches(tok, cfg)

    src = SourceShards(ckpt)
    extras = {k for k in src.meta if k.startswith(("vision_tower.", "mm_projector."))}
    vision_config = None
    if extras:
        vc = (cfg.container or {}).get("vision_config")
        if not isinstance(vc, dict):
            raise CheckpointError(f"checkpoint {ckpt} has vision tensors ({next(iter(extras))}, ...) but its "
                                  f"config.json has no `vision_config`")
        vision_config = vc
    elif (cfg.container or {}).get("vision_config"):
        log.warning("export: config.json has a vision_config but the checkpoint holds no vision tensors; the "
                    "export is text-only")

    media_pad = tok.special_tokens.get("<|media_pad|>")
    auto_map = None
    files: dict = {}
    tok_extra = {"tokenizer_class": "TikTokenTokenizer", "model_max_length": cfg.max_position_embeddings}
    if hf_shims:
        from k3.hf.shims import AUTO_MAP, TOKENIZER_AUTO_MAP, shim_files
        auto_map = dict(AUTO_MAP)
        tok_extra["auto_map"] = dict(TOKENIZER_AUTO_MAP)
        files.update(shim_files())
    cdict = release_config_dict(cfg, quantize=quantize, dtype=dtype_name, vision_config=vision_config,
                                media_placeholder_token_id=media_pad, auto_map=auto_map)
    files["generation_config.json"] = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                                       "pad_token_id": cfg.pad_token_id}
    if vision_config is not None:
        pp = os.path.join(ckpt, "preprocessor_config.json")
        if os.path.isfile(pp):
            with open(pp) as f:
                files["preprocessor_config.json"] = json.load(f)
        else:
            from k3.vision.config import ImageProcessorConfig, VisionConfig
            files["preprocessor_config.json"] = {"media_proc_cfg": ImageProcessorConfig.from_vision_config(
                VisionConfig.from_dict(vision_config)).to_dict()}

    qcfg = cdict["text_config"].get("quantization_config")
    save_cfg = cfg.replace(quantization_config=qcfg, dtype=dtype_name)
    plan = _stream_plan(src, save_cfg, quantize == "mxfp4", tdt)
    check_release_plan(plan, save_cfg, quantize == "mxfp4", ckpt)
    path = save_pretrained(plan, out, max_shard_size=max_shard_size, quantize_experts=(quantize == "mxfp4"),
                           tokenizer=ReleaseTokenizerWriter(tok, tok_extra), extra_files=files, config=save_cfg,
                           dtype=tdt, single_file_if_fits=True, config_dict=cdict)
    log.info("exported %s -> %s (%s%s)", ckpt, path, dtype_name, ", MXFP4 experts" if quantize else "")
    return path
