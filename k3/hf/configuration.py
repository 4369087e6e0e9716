"""`K3HFConfig`: the exported `config.json` (container + `text_config`) as a transformers config."""
from __future__ import annotations

from transformers import PretrainedConfig

__all__ = ["K3HFConfig"]


class K3HFConfig(PretrainedConfig):
    """Holds the released config verbatim (`text_config` / `vision_config` as dicts); the text model's sizes are
    also exposed flat (`vocab_size`, `hidden_size`, ...) for transformers utilities. `to_k3()` builds the
    `k3.config.K3Config` the model is made from."""

    model_type = "kimi_k3"

    def __init__(self, text_config=None, vision_config=None, **kwargs):
        self.text_config = dict(text_config or {})
        self.vision_config = vision_config
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings"):
            if k in self.text_config:
                kwargs.setdefault(k, self.text_config[k])
        super().__init__(**kwargs)

    def get_text_config(self, *args, **kwargs):
        return self

    def to_k3(self):
        from k3.config import K3Config
        d = {"text_config": self.text_config}
        if self.vision_config is not None:
            d["vision_config"] = self.vision_config
        return K3Config.from_dict(d)
