"""Checkpoint I/O: the released safetensors layout (architecture.md §4), MXFP4 experts, atomic save, streaming load."""
from k3.checkpoint.mxfp4 import mxfp4_decode, mxfp4_encode
from k3.checkpoint.adapter import (PREFIX, is_fp32_key, model_key_shapes, released_key_shapes,
                                   to_released)
from k3.checkpoint.assemble import from_released
from k3.checkpoint.io import cast_to_storage_dtype, from_pretrained, load_config, load_state_dict, save_pretrained

__all__ = ["mxfp4_decode", "mxfp4_encode", "PREFIX", "from_released", "to_released", "released_key_shapes",
           "model_key_shapes", "is_fp32_key", "save_pretrained", "load_state_dict", "from_pretrained",
           "load_config", "cast_to_storage_dtype"]
