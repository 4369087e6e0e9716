"""K3ForConditionalGeneration: the MoonViT-V2 tower + patchmergerv2 projector + K3ForCausalLM, as released (spec §5.5).

    from k3.multimodal import K3ForConditionalGeneration, multimodal_config
    from k3.vision import preprocess
    model = K3ForConditionalGeneration(multimodal_config("tiny"))
    pixel_values, grid_thw = preprocess(["cat.png"], model.vision_config)
    out = model(input_ids, pixel_values=pixel_values, grid_thw=grid_thw, labels=labels)

Placement (what the release does, HF/NeMo style):
- `input_ids` hold exactly ONE `media_placeholder_token_id` (`<|media_pad|>`, 163605 at release) per image, in image
  order (row-major over the batch). Inside the model each placeholder is expanded to that image's N_i merged tokens
  ((h/2)(w/2) of its patch grid), so the sequence gets longer by sum_i (N_i - 1); the N_i positions hold the
  projector outputs, in order. Mismatched counts are errors (`K3ImageError`).
- Labels are k3's *aligned targets* (labels[t] = what position t predicts). Expansion keeps them consistent with the
  release's unshifted-label expansion: the first N_i - 1 image positions get -100, the last one inherits the
  placeholder's target (it predicts the token after the image, e.g. `<|media_end|>`), and a target equal to the
  placeholder id becomes -100 (no position is trained to predict an image).
- `cu_seqlens` (packed documents, batch 1) is given in the *unexpanded* coordinates; every boundary moves right by
  the expansion of the placeholders before it.
- Rows of a batch expand by different amounts; shorter rows are right-padded with `pad_token_id` (labels -100).
- Embeddings at `[PAD]` (`pad_token_id`) positions are zeroed, as NeMo's release code does for padded batches.
  Text-only input without `[PAD]` tokens therefore gives exactly `K3ForCausalLM`'s output.
- `always_run_tower=True` runs the tower on a dummy image when a batch has none and adds 0 * its output, so every
  vision parameter takes part in forward and backward on every step: needed under FSDP/DDP, where a rank with
  images and one without must take the same collective path (TorchTitan notes a deadlock); the dummy runs before
  the embedding lookup, where a rank with images runs its tower. Off by default; `k3.parallel.vision`'s
  `parallelize_multimodal` turns it on.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import nn

from k3.config import K3Config
from k3.errors import K3ConfigError
from k3.model import K3ForCausalLM, K3Output
from k3.ops.loss import IGNORE_INDEX
from k3.vision.config import ImageProcessorConfig, VisionConfig
from k3.vision.errors import K3ImageError
from k3.vision.projector import PatchMergerV2, encode_images
from k3.vision.tower import MoonViT

__all__ = ["K3ForConditionalGeneration", "K3MultimodalOutput", "ExpandedInputs", "multimodal_config",
           "vision_config_of", "media_placeholder_id", "expand_placeholders", "is_multimodal_config",
           "MULTIMODAL_PRESETS", "generate", "image_prompt_embeds"]

MEDIA_PAD_OFFSET = 21  # `<|media_pad|>` slot among the 256 specials at [V-256, V) (spec §6): 163605 at release
MULTIMODAL_PRESETS = ("tiny", "kimi-k3")


# ---------------------------------------------------------------------------------------------------- config
def is_multimodal_config(config: K3Config) -> bool:
    return isinstance(config.container, dict) and isinstance(config.container.get("vision_config"), dict)


def vision_config_of(config: K3Config) -> VisionConfig:
    """The `VisionConfig` of a container config; K3ConfigError when it has none or the widths disagree."""
    if not isinstance(config, K3Config):
        raise TypeError(f"expected a K3Config, got {type(config).__name__}")
    if not is_multimodal_config(config):
        raise K3ConfigError("config has no `vision_config` (a text-only config): build K3ForCausalLM, or make a "
                            "multimodal config with k3.multimodal.multimodal_config(text, vision)")
    vc = VisionConfig.from_dict(config.container["vision_config"])
    if vc.text_hidden_size != config.hidden_size:
        raise K3ConfigError(f"vision_config.text_hidden_size ({vc.text_hidden_size}) must equal "
                            f"text_config.hidden_size ({config.hidden_size}): the projector writes text embeddings")
    return vc


def media_placeholder_id(config: K3Config) -> int:
    """`media_placeholder_token_id` of the container (default: the `<|media_pad|>` slot, V - 256 + 21)."""
    c = config.container or {}
    pid = c.get("media_placeholder_token_id", config.vocab_size - 256 + MEDIA_PAD_OFFSET)
    if not isinstance(pid, int) or isinstance(pid, bool) or not (0 <= pid < config.vocab_size):
        raise K3ConfigError(f"media_placeholder_token_id must be an id in [0, {config.vocab_size}), got {pid!r}")
    if pid == config.pad_token_id:
        raise K3ConfigError(f"media_placeholder_token_id ({pid}) must differ from pad_token_id")
    return pid


def multimodal_config(text: Union[str, K3Config] = "tiny", vision: Union[str, VisionConfig, dict, None] = None,
                      media_placeholder_token_id: Optional[int] = None, **text_overrides) -> K3Config:
    """A container config (text + vision) in the released layout.

    `text`: a K3Config or a text preset name; `vision`: a VisionConfig, a `vision_config` dict or a vision preset
    name (default: the preset of the same name as `text` when there is one, else "tiny"). `text_hidden_size` of the
    vision config is set to the text width. The container keys follow the release (`model_type="kimi_k3"`,
    `architectures=["KimiK3ForConditionalGeneration"]`, special ids, `media_placeholder_token_id`).
    "kimi-k3" gives the released container as shipped."""
    if isinstance(text, str):
        name = text
        text = K3Config.from_preset(text, **text_overrides)
        if vision is None:
            vision = name if name in MULTIMODAL_PRESETS else "tiny"
    elif text_overrides:
        text = text.replace(**text_overrides)
    if vision is None:
        vision = "tiny"
    if isinstance(vision, str):
        vc = VisionConfig.preset(vision)
    elif isinstance(vision, dict):
        vc = VisionConfig.from_dict(vision)
    elif isinstance(vision, VisionConfig):
        vc = copy.deepcopy(vision)
    else:
        raise TypeError(f"vision: expected a preset name, a VisionConfig or a dict, got {type(vision).__name__}")
    if vc.text_hidden_size != text.hidden_size:
        vc = VisionConfig.from_dict(dict(vc.to_dict(), text_hidden_size=text.hidden_size))
    container = copy.deepcopy(text.container) if is_multimodal_config(text) else {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "ignore_index": IGNORE_INDEX,
        "image_placeholder": "<|kimi_image_placeholder|>",
    }
    container.update(bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id,
                     dtype=text.dtype, tie_word_embeddings=text.tie_word_embeddings, vision_config=vc.to_dict())
    if media_placeholder_token_id is not None:
        container["media_placeholder_token_id"] = int(media_placeholder_token_id)
    elif "media_placeholder_token_id" not in container or container.get("media_placeholder_token_id", 0) >= \
            text.vocab_size:
        container["media_placeholder_token_id"] = text.vocab_size - 256 + MEDIA_PAD_OFFSET
    cfg = text.replace()
    cfg.container = dict(sorted(container.items()))
    media_placeholder_id(cfg)  # validate
    vision_config_of(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------------- expansion
@dataclass
class ExpandedInputs:
    input_ids: torch.Tensor                 # [B, T'] placeholders repeated N_i times, rows right-padded with [PAD]
    image_mask: torch.Tensor                # [B, T'] bool: positions that take image features
    labels: Optional[torch.Tensor] = None   # [B, T'] aligned targets
    cu_seqlens: Optional[torch.Tensor] = None
    lengths: Optional[list] = None          # expanded length of each row (before the batch padding)


def _check_ids(input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype in (
            torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise ValueError(f"input_ids must be an integer tensor [batch, seq], got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}"
                         f"{' ' + str(input_ids.dtype) if isinstance(input_ids, torch.Tensor) else ''}")


def expand_placeholders(input_ids: torch.Tensor, counts: Sequence[int], placeholder_id: int, pad_id: int,
                        labels: Optional[torch.Tensor] = None,
                        cu_seqlens: Optional[torch.Tensor] = None) -> ExpandedInputs:
    """Expand each `placeholder_id` in `input_ids` [B, T] to `counts[i]` positions (images in row-major order);
    labels and cu_seqlens follow (see the module docstring). Raises K3ImageError on count mismatches."""
    _check_ids(input_ids)
    B, T = input_ids.shape
    dev = input_ids.device
    is_ph = input_ids == placeholder_id
    per_row = is_ph.sum(1).tolist()
    n_ph, n_img = sum(per_row), len(counts)
    if n_ph != n_img:
        raise K3ImageError(f"input_ids hold {n_ph} media placeholder(s) (id {placeholder_id}, one per image) but "
                           f"{n_img} image(s) were given (grid_thw rows)")
    if any(int(c) < 1 for c in counts):
        raise K3ImageError(f"every image needs at least one token, got counts {list(counts)}")
    if labels is not None and tuple(labels.shape) != (B, T):
        raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {(B, T)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens (packed sequences) needs batch size 1, got {B}")
    cnt = torch.as_tensor([int(c) for c in counts], dtype=torch.long, device=dev)
    reps = torch.ones(B, T, dtype=torch.long, device=dev)
    reps[is_ph] = cnt  # boolean-mask assignment runs in row-major order = image order
    ends = reps.cumsum(1)                     # [B, T]: one past the last new position of each old position
    lengths = ends[:, -1].tolist() if T else [0] * B
    Tn = max(lengths) if lengths else 0
    new_ids = torch.full((B, Tn), pad_id, dtype=input_ids.dtype, device=dev)
    new_labels = None if labels is None else torch.full((B, Tn), IGNORE_INDEX, dtype=labels.dtype, device=dev)
    for b in range(B):
        new_ids[b, :lengths[b]] = torch.repeat_interleave(input_ids[b], reps[b])
        if labels is not None:
            new_labels[b, ends[b] - 1] = labels[b]
    if new_labels is not None:
        new_labels[new_labels == placeholder_id] = IGNORE_INDEX
    new_cu = None
    if cu_seqlens is not None:
        starts = torch.cat([ends.new_zeros(1), ends[0]])    # new position of old position c (c = T -> end)
        cu = cu_seqlens.to(device=dev, dtype=torch.long)
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must rise from 0 to the sequence length {T}, got {cu.tolist()[:8]}...")
        new_cu = starts[cu].to(cu_seqlens.dtype)
    return ExpandedInputs(new_ids, new_ids == placeholder_id, new_labels, new_cu, lengths)


def _check_images(pixel_values, grid_thw, patch: int) -> None:
    if pixel_values is None or grid_thw is None:
        raise K3ImageError("pass pixel_values and grid_thw together (both or neither)")
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise K3ImageError(f"grid_thw: expected an integer tensor [n_images, 3] (t, h, w patches), got "
                           f"{getattr(grid_thw, 'shape', type(grid_thw).__name__)}")
    if grid_thw.dtype.is_floating_point or grid_thw.dtype.is_complex or grid_thw.dtype == torch.bool:
        raise K3ImageError(f"grid_thw: expected an integer dtype (int64), got {grid_thw.dtype}")
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4 or \
            tuple(pixel_values.shape[1:]) != (3, patch, patch):
        raise K3ImageError(f"pixel_values: expected a tensor [L, 3, {patch}, {patch}], got "
                           f"{getattr(pixel_values, 'shape', type(pixel_values).__name__)}")
    if not pixel_values.dtype.is_floating_point:
        raise K3ImageError(f"pixel_values: expected a floating dtype, got {pixel_values.dtype}")
    rows = int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum()) if grid_thw.numel() else 0
    if rows != pixel_values.shape[0]:
        raise K3ImageError(f"pixel_values has {pixel_values.shape[0]} patch rows but grid_thw describes {rows} "
                           f"(sum of t*h*w over {grid_thw.shape[0]} images)")


# ---------------------------------------------------------------------------------------------------- model
@dataclass
class K3MultimodalOutput(K3Output):
    input_ids: Optional[torch.Tensor] = None    # the expanded ids the language model saw
    labels: Optional[torch.Tensor] = None       # expanded labels
    cu_seqlens: Optional[torch.Tensor] = None   # expanded document boundaries
    image_mask: Optional[torch.Tensor] = None


class K3ForConditionalGeneration(nn.Module):
    """`vision_tower` (MoonViT) + `mm_projector` (PatchMergerV2) + `language_model` (K3ForCausalLM); the released
    checkpoint keys are exactly `state_dict()`'s (`language_model.*` modulo the expert layout, see k3.checkpoint)."""

    def __init__(self, config: K3Config, init: bool = True, language_model: Optional[K3ForCausalLM] = None):
        super().__init__()
        if not isinstance(config, K3Config):
            raise TypeError(f"K3ForConditionalGeneration needs a K3Config, got {type(config).__name__}")
        self.config = config
        self.vision_config = vision_config_of(config)
        self.media_placeholder_token_id = media_placeholder_id(config)
        self.vision_tower = MoonViT(self.vision_config)
        self.mm_projector = PatchMergerV2(self.vision_config)
        self.language_model = language_model if language_model is not None else K3ForCausalLM(config, init=init)
        self.zero_pad_embeddings = True
        self.always_run_tower = False

    # ---------------------------------------------------------------- helpers
    @property
    def device(self) -> torch.device:
        return self.language_model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.dtype

    @property
    def processor_config(self) -> ImageProcessorConfig:
        """Release preprocessing with this tower's patch and merge sizes (for k3.vision.preprocess)."""
        return ImageProcessorConfig.from_vision_config(self.vision_config)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise in place as the constructor does (the language model's init; the vision linears / conv
        torch's defaults, norms 1, the position table U(+-0.02*sqrt(3))); works on FSDP shards (DTensors)."""
        from k3.vision.tower import PosEmb, VisionRMSNorm
        self.language_model.reset_parameters()
        for mod in (self.vision_tower, self.mm_projector):
            for m in mod.modules():
                if isinstance(m, (nn.Linear, nn.Conv2d)):
                    m.reset_parameters()
                elif isinstance(m, VisionRMSNorm):
                    nn.init.ones_(m.weight)
                elif isinstance(m, PosEmb):
                    b = 0.02 * 3 ** 0.5
                    nn.init.uniform_(m.weight, -b, b)

    def set_gradient_checkpointing(self, on: bool = True) -> None:
        """Activation checkpointing of the language model's layers (the tower is small next to it)."""
        self.language_model.set_gradient_checkpointing(on)

    def image_token_counts(self, grid_thw: torch.Tensor) -> list:
        kh, kw = self.vision_config.merge_kernel_size
        return [(int(h) // kh) * (int(w) // kw) for _, h, w in grid_thw.tolist()]

    @classmethod
    def from_pretrained(cls, path: str, **kw) -> "K3ForConditionalGeneration":
        from k3.checkpoint.multimodal import from_pretrained_multimodal
        return from_pretrained_multimodal(path, **kw)

    def save_pretrained(self, path: str, **kw) -> str:
        from k3.checkpoint.multimodal import save_pretrained_multimodal
        return save_pretrained_multimodal(self, path, **kw)

    # ---------------------------------------------------------------- embedding
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple:
        """(projected image tokens [sum N_i, hidden] in the text dtype, [N_i])."""
        _check_images(pixel_values, grid_thw, self.vision_config.patch_size)
        feats, counts = encode_images(self.vision_tower, self.mm_projector, pixel_values,
                                      grid_thw.to(torch.long))
        return feats.to(self.language_model.model.embed_tokens.weight.dtype), counts

    def _dummy_tower_output(self) -> torch.Tensor:
        """0 * (tower + projector on a 2x2-patch blank image): keeps every vision parameter in the graph."""
        p = self.vision_config.patch_size
        kh, kw = self.vision_config.merge_kernel_size
        w = self.vision_tower.patch_embed.proj.weight
        pv = torch.zeros(kh * kw, 3, p, p, device=w.device, dtype=torch.float32)
        grid = torch.tensor([[1, kh, kw]], dtype=torch.long)
        feats, _ = encode_images(self.vision_tower, self.mm_projector, pv, grid)
        return feats.sum() * 0.0

    def embed(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor] = None,
              grid_thw: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
              cu_seqlens: Optional[torch.Tensor] = None, image_embeds: Optional[torch.Tensor] = None,
              image_counts: Optional[Sequence[int]] = None) -> tuple:
        """(inputs_embeds [B, T', hidden], ExpandedInputs): placeholders expanded and filled with image tokens,
        [PAD] embeddings zeroed. `image_embeds` + `image_counts` (from `encode_images`) skip the tower."""
        _check_ids(input_ids)
        pid = self.media_placeholder_token_id
        dummy = None
        if image_embeds is None:
            if pixel_values is None and grid_thw is None:
                image_counts = []
                if self.always_run_tower:
                    # before the embedding lookup, as a rank with images runs its tower: under FSDP every rank
                    # must gather the tower, projector and embedding units in the same order
                    dummy = self._dummy_tower_output()
            else:
                image_embeds, image_counts = self.encode_images(pixel_values, grid_thw)
        elif image_counts is None or sum(image_counts) != image_embeds.shape[0]:
            raise K3ImageError(f"image_embeds has {image_embeds.shape[0]} rows; image_counts {image_counts} "
                               f"must sum to that")
        V = self.config.vocab_size
        if input_ids.numel() and input_ids.device.type == "cpu":
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= V:
                raise ValueError(f"input_ids out of range [0, {V}): min {lo}, max {hi}")
        exp = expand_placeholders(input_ids, image_counts, pid, self.config.pad_token_id, labels, cu_seqlens)
        emb = self.language_model.model.embed_tokens(exp.input_ids)
        if image_embeds is not None and image_embeds.shape[0]:
            emb = emb.masked_scatter(exp.image_mask.unsqueeze(-1), image_embeds.to(emb.dtype))
        elif self.always_run_tower:
            emb = emb + (dummy if dummy is not None else self._dummy_tower_output()).to(emb.dtype)
        if self.zero_pad_embeddings:
            pad = exp.input_ids == self.config.pad_token_id
            if input_ids.device.type != "cpu" or bool(pad.any()):
                emb = emb.masked_fill(pad.unsqueeze(-1), 0.0)
        return emb, exp

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor] = None,
                grid_thw: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, cache=None, logits_to_keep: int = 0,
                return_logits: Optional[bool] = None, image_embeds: Optional[torch.Tensor] = None,
                image_counts: Optional[Sequence[int]] = None) -> K3MultimodalOutput:
        """`input_ids` [B, T] with one placeholder per image; `pixel_values` [L, 3, p, p] and `grid_thw` [n, 3]
        from `k3.vision.preprocess` (images of all rows, row-major). Returns the language model's output (on the
        expanded sequence) plus the expanded ids / labels / cu_seqlens."""
        emb, exp = self.embed(input_ids, pixel_values, grid_thw, labels, cu_seqlens, image_embeds, image_counts)
        out = self.language_model(inputs_embeds=emb, labels=exp.labels, cu_seqlens=exp.cu_seqlens, cache=cache,
                                  logits_to_keep=logits_to_keep, return_logits=return_logits)
        return K3MultimodalOutput(loss=out.loss, logits=out.logits, hidden_states=out.hidden_states,
                                  num_tokens=out.num_tokens, main_loss=out.main_loss, mtp_losses=out.mtp_losses,
                                  input_ids=exp.input_ids, labels=exp.labels, cu_seqlens=exp.cu_seqlens,
                                  image_mask=exp.image_mask)


# ---------------------------------------------------------------------------------------------------- generation
def image_prompt_embeds(model: K3ForConditionalGeneration, prompts, images=None, *,
                        pixel_values: Optional[torch.Tensor] = None, grid_thw: Optional[torch.Tensor] = None) -> tuple:
    """(expanded prompts, their input embeddings): for `k3.generate(model.language_model, expanded,
    prompt_embeds=embeds)`. `prompts`: lists of ids, each with one placeholder per image; `images` (PIL / path /
    bytes, all prompts' images in order) or `pixel_values` + `grid_thw`. Each placeholder is repeated N_i times
    and those positions hold the image's projected tokens, exactly as `forward` places them."""
    if images is not None and not isinstance(images, (str, bytes)) and hasattr(images, "__len__") and \
            len(images) == 0:
        images = None   # no images: text prompts
    if images is not None:
        if pixel_values is not None or grid_thw is not None:
            raise K3ImageError("pass images or pixel_values/grid_thw, not both")
        from k3.vision.preprocess import preprocess
        pixel_values, grid_thw = preprocess(images, model.processor_config)
    pid = model.media_placeholder_token_id
    with torch.inference_mode():
        feats, counts = (model.encode_images(pixel_values.to(model.device), grid_thw)
                         if pixel_values is not None or grid_thw is not None else (None, []))
        n_ph = sum(t == pid for p in prompts for t in p)
        if n_ph != len(counts):
            raise K3ImageError(f"the prompts hold {n_ph} media placeholder(s) (id {pid}, one per image) but "
                               f"{len(counts)} image(s) were given")
        expanded, embeds, k, r = [], [], 0, 0
        for p in prompts:
            n = sum(t == pid for t in p)
            c = list(counts[k:k + n])
            rows = sum(c)
            emb, exp = model.embed(torch.tensor([p], dtype=torch.long, device=model.device),
                                   image_embeds=feats[r:r + rows] if n else None, image_counts=c if n else None)
            expanded.append(exp.input_ids[0].tolist())
            embeds.append(emb[0])
            k, r = k + n, r + rows
    return expanded, embeds


def generate(model: K3ForConditionalGeneration, input_ids, images=None, max_new_tokens: int = 64, *,
             pixel_values: Optional[torch.Tensor] = None, grid_thw: Optional[torch.Tensor] = None,
             return_dict: bool = False, **kw):
    """`k3.generate` with images. `input_ids`: one prompt (list of ids or [T] / [1, T] tensor) or a list of
    prompts, each holding one placeholder per image (e.g. built with `k3.chat.image_placeholder_tokens`); images
    (PIL / path / bytes, all prompts' images in order) or precomputed `pixel_values` + `grid_thw`.

    The prompts are pre-expanded (each placeholder repeated N_i times, vLLM style) and their embeddings (image
    tokens scattered in, as `forward` does; `image_prompt_embeds`) are prefilled through
    `k3.generate(prompt_embeds=...)`; decoding is unchanged (KV/recurrent cache, sampling, stop rules: every
    keyword of `k3.generate`; use_cache=False runs the full-forward reference path). Returns the *unexpanded*
    prompt + new tokens like `k3.generate` (a GenerationOutput with return_dict=True, whose prompt_lengths are the
    unexpanded ones)."""
    from k3.generation import generate as _generate
    from k3.generation.generate import _as_prompts
    prompts = _as_prompts(input_ids)
    was_training = model.training
    model.eval()
    try:
        expanded, embeds = image_prompt_embeds(model, prompts, images, pixel_values=pixel_values, grid_thw=grid_thw)
        kw.setdefault("static", False)
        out = _generate(model.language_model, expanded, max_new_tokens, return_dict=True, prompt_embeds=embeds,
                        **kw)
    finally:
        model.train(was_training)
    pad = model.config.pad_token_id if kw.get("pad_token_id") is None else int(kw["pad_token_id"])
    full = [p + n for p, n in zip(prompts, out.new_tokens)]
    L = max(len(s) for s in full)
    seq = torch.full((len(full), L), pad, dtype=torch.long)
    for i, s in enumerate(full):
        seq[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    seq = seq.to(model.device)
    if not return_dict:
        return seq
    out.sequences, out.prompt_lengths = seq, [len(p) for p in prompts]
    return out
