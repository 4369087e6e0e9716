"""Native vision input for K3: MoonViT-V2 tower, patchmergerv2 projector, and the released image preprocessing.

    from k3.vision import preprocess, VisionConfig, VisionModel
    pixel_values, grid_thw = preprocess([img1, "cat.png", png_bytes])        # release preprocessing
    vm = VisionModel(VisionConfig.preset("tiny"))
    embeds, counts = vm(pixel_values, grid_thw)   # [sum(counts), text_hidden_size], tokens per image

Needs Pillow for `preprocess` (imported lazily; the tower itself does not).
"""
from k3.vision.config import VISION_PRESETS, ImageProcessorConfig, VisionConfig
from k3.vision.errors import K3ImageError
from k3.vision.preprocess import (SUPPORTED_MODES, ResizePlan, load_image, num_image_tokens, preprocess,
                                  preprocess_image, resize_plan)
from k3.vision.projector import PatchMergerV2, VisionModel, encode_images
from k3.vision.tower import MoonViT, VisionRMSNorm, image_token_counts, merge_sd2_tpool

__all__ = ["VisionConfig", "ImageProcessorConfig", "VISION_PRESETS", "K3ImageError", "preprocess",
           "preprocess_image", "load_image", "resize_plan", "num_image_tokens", "ResizePlan", "SUPPORTED_MODES",
           "MoonViT", "PatchMergerV2", "VisionModel", "VisionRMSNorm", "encode_images", "merge_sd2_tpool",
           "image_token_counts"]
