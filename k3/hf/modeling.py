"""`K3HFForCausalLM`: a transformers `PreTrainedModel` around `k3.model.K3ForCausalLM`.

`from_pretrained(dir)` loads through `k3.checkpoint.from_pretrained` (the released layout: per-expert
w1/w2/w3, MXFP4 experts, A_log padding are k3's mapping, not transformers'); `forward` returns the logits of
the k3 model. No KV cache is exposed to `generate` (each step re-runs the prefix): for fast decoding use
`k3.generate`. Padded batches (an `attention_mask` with zeros) are refused: K3 packs documents instead.
"""
from __future__ import annotations

import os

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from k3.hf.configuration import K3HFConfig

__all__ = ["K3HFForCausalLM"]


class K3HFForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = K3HFConfig
    base_model_prefix = "k3_model"
    main_input_name = "input_ids"

    def __init__(self, config: K3HFConfig, k3_model=None):
        super().__init__(config)
        self.post_init()  # before the k3 model is attached: transformers' init must not touch its weights
        if k3_model is None:
            from k3.model import K3ForCausalLM
            k3_model = K3ForCausalLM(config.to_k3())
        self.k3_model = k3_model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, dtype=None,
                        torch_dtype=None, device_map=None, **kwargs):
        from k3.checkpoint import from_pretrained as k3_from_pretrained
        path = os.fspath(pretrained_model_name_or_path)
        if not os.path.isdir(path):
            raise OSError(f"{path}: K3HFForCausalLM loads local checkpoint directories only")
        if not isinstance(config, K3HFConfig):
            config = K3HFConfig.from_pretrained(path)
        dt = dtype if dtype is not None else torch_dtype
        if dt == "auto":
            dt = None
        device = "cpu"
        if isinstance(device_map, (str, torch.device)) and str(device_map) not in ("auto", "cpu"):
            device = device_map
        model = cls(config, k3_model=k3_from_pretrained(path, dtype=dt, device=device))
        model.eval()
        return model

    def get_input_embeddings(self):
        return self.k3_model.model.embed_tokens

    def get_output_embeddings(self):
        return self.k3_model.lm_head

    def forward(self, input_ids=None, attention_mask=None, labels=None, inputs_embeds=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("K3HFForCausalLM: padded batches (attention_mask with zeros) are not supported; "
                             "run sequences separately or use k3.generate")
        out = self.k3_model(input_ids=input_ids, inputs_embeds=inputs_embeds)
        logits = out.logits
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                     labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}
