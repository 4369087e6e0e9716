"""Inference: hybrid KDA/MLA cache, exact incremental decoding, sampling, generation API (architecture.md §7).

    from k3.generation import K3Cache, cache_memory, generate, stream_generate
    out = generate(model, input_ids, max_new_tokens=32)                  # greedy, prompt + new tokens
    for tok in stream_generate(model, ids, 32, do_sample=True, top_p=0.9, seed=0): ...
"""
from k3.generation.cache import K3Cache, K3CacheView, KDALayerCache, MLALayerCache, cache_memory
from k3.generation.generate import (GenerationEvent, GenerationOutput, TextStreamer, chat, generate,
                                    generate_text, prefill, stream_chat, stream_generate, stream_text)
from k3.generation.static import StaticDecoder
from k3.generation.sampling import (SamplingParams, apply_repetition_penalty, process_logits, select_next,
                                    top_k_mask, top_p_mask)

__all__ = ["K3Cache", "K3CacheView", "KDALayerCache", "MLALayerCache", "cache_memory", "generate",
           "stream_generate", "prefill", "generate_text", "stream_text", "chat", "stream_chat", "GenerationOutput",
           "GenerationEvent", "TextStreamer", "SamplingParams", "apply_repetition_penalty", "process_logits",
           "select_next", "top_k_mask", "top_p_mask", "StaticDecoder"]
