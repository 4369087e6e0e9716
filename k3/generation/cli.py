"""`k3 generate` (stream a completion) and `k3 chat` (interactive multi-turn chat in the K3 chat format).

Both load a checkpoint directory (config.json + safetensors + tiktoken.model or tokenizer.json) with
k3.checkpoint.from_pretrained and k3.tokenizer.load_tokenizer, and check that the tokenizer fits the model.
Errors are k3 errors (CheckpointError / TokenizerError / ...) that `k3.cli.main` prints as one line.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import threading

from k3.errors import CheckpointError, K3Error


def load_for_inference(ckpt: str, device: str = "auto", dtype: str = None):
    """(model, tokenizer) from a checkpoint directory, on `device` ("auto": cuda if available). A multimodal
    checkpoint (config with `vision_config`) gives a K3ForConditionalGeneration (k3.multimodal)."""
    import torch
    from k3.checkpoint import from_pretrained
    from k3.checkpoint.multimodal import from_pretrained_multimodal
    from k3.checkpoint.io import load_config
    from k3.multimodal import is_multimodal_config
    from k3.tokenizer import check_tokenizer_matches, load_tokenizer
    if not ckpt or not os.path.isdir(ckpt):
        raise CheckpointError(f"checkpoint directory not found: {ckpt}")
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise CheckpointError(f"checkpoint {ckpt}: no config.json")
    tok = load_tokenizer(ckpt)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        config = load_config(ckpt)
        if is_multimodal_config(config):
            model = from_pretrained_multimodal(ckpt, device=device, dtype=dtype, config=config)
        else:
            model = from_pretrained(ckpt, device=device, dtype=dtype)
    except K3Error:
        raise
    except Exception as e:  # safetensors / json errors of a corrupt file
        raise CheckpointError(f"checkpoint {ckpt} could not be loaded: {type(e).__name__}: {e}") from None
    check_tokenizer_matches(tok, model.config)
    return model.eval(), tok


def _sampling(a) -> dict:
    do_sample = a.temperature > 0
    return dict(do_sample=do_sample, temperature=a.temperature if do_sample else 1.0, top_k=a.top_k,
                top_p=a.top_p, repetition_penalty=a.repetition_penalty)


def _int_at_least(name, lo):
    """argparse type: an integer >= lo (else a clear `k3 generate: error: argument ...`)."""
    def f(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{name} must be >= {lo}, got {v}")
        return v
    f.__name__ = name
    return f


def _number(name, lo, hi=math.inf, lo_open=False):
    """argparse type: a finite number in [lo, hi] ((lo, hi] with lo_open); nan / inf are refused."""
    def f(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            if hi == math.inf:
                rng = f"{'>' if lo_open else '>='} {lo:g}"
            else:
                rng = "in " + ("(" if lo_open else "[") + f"{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"{name} must be a finite number {rng}, got {text}")
        return v
    f.__name__ = name
    return f


def _add_common(s) -> None:
    s.add_argument("--ckpt", required=True, help="checkpoint directory (config.json, safetensors, tokenizer)")
    s.add_argument("--max-new-tokens", type=_int_at_least("max_new_tokens", 1), default=256)
    s.add_argument("--temperature", type=_number("temperature", 0.0), default=0.0, help="0 = greedy")
    s.add_argument("--top-k", type=_int_at_least("top_k", 0), default=0, help="0 = off")
    s.add_argument("--top-p", type=_number("top_p", 0.0, 1.0, lo_open=True), default=1.0, help="1 = off")
    s.add_argument("--repetition-penalty", type=_number("repetition_penalty", 0.0, lo_open=True), default=1.0,
                   help="1 = off")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--device", default="auto")
    s.add_argument("--dtype", default=None, help="override the checkpoint dtype (e.g. float32)")
    s.add_argument("--prefill-chunk", type=_int_at_least("prefill_chunk", 1), default=2048,
                   help="prompt tokens per forward during prefill")


def _is_multimodal(model) -> bool:
    from k3.multimodal import K3ForConditionalGeneration
    return isinstance(model, K3ForConditionalGeneration)


def _load_images(paths, model, ckpt: str) -> list:
    """Decoded, checked PIL images of `paths`; K3ImageError for a bad file, RequestError when the checkpoint
    has no vision tower."""
    from k3.errors import RequestError
    if not paths:
        return []
    if not _is_multimodal(model):
        raise RequestError(f"--image needs a multimodal checkpoint (config.json with `vision_config`); {ckpt} is "
                           f"a text-only checkpoint")
    from k3.vision.preprocess import load_image
    return [load_image(p, model.processor_config) for p in paths]


def _image_parts(images) -> list:
    return [{"type": "image", "width": im.size[0], "height": im.size[1]} for im in images]


def _stream_args(model, prompts: list, images: list) -> tuple:
    """(the model generate runs, prompts, extra keywords): the language model with image-filled prompt
    embeddings for a multimodal checkpoint, else the model and prompts as they are."""
    if not _is_multimodal(model):
        return model, prompts, {}
    from k3.multimodal import image_prompt_embeds
    expanded, embeds = image_prompt_embeds(model, prompts, images or None)
    return model.language_model, expanded, {"prompt_embeds": embeds}


def _cmd_generate(a) -> int:
    from k3.generation.generate import stream_generate
    model, tok = load_for_inference(a.ckpt, a.device, a.dtype)
    images = _load_images(a.image, model, a.ckpt)
    if a.chat or images:
        from k3.chat import K3ChatFormat
        content = _image_parts(images) + [{"type": "text", "text": a.prompt}] if images else a.prompt
        ids = K3ChatFormat(tok).render([{"role": "user", "content": content}], thinking=False)
    else:
        ids = tok.encode(a.prompt)
    if not ids:
        from k3.errors import RequestError
        raise RequestError("the prompt encodes to no tokens")
    runner, prompts, extra = _stream_args(model, [ids], images)
    cancel = threading.Event()
    out = sys.stdout
    try:
        for chunk in stream_generate(runner, prompts, a.max_new_tokens, tokenizer=tok, stop_strings=a.stop or None,
                                     seed=a.seed, prefill_chunk_size=a.prefill_chunk, cancel=cancel, output="text",
                                     **extra, **_sampling(a)):
            out.write(chunk)
            out.flush()
    except KeyboardInterrupt:
        cancel.set()
    out.write("\n")
    out.flush()
    return 0


def _cmd_chat(a) -> int:
    from k3.chat import parse_assistant
    from k3.generation.generate import stream_chat
    model, tok = load_for_inference(a.ckpt, a.device, a.dtype)
    history = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    print("k3 chat: empty line is ignored; `/image PATH` attaches an image to your next message; Ctrl-D or "
          "Ctrl-C to quit.", file=sys.stderr)
    images, pending = [], []   # every image of the conversation in order; those waiting for the next message
    import importlib
    G = importlib.import_module("k3.generation.generate")  # (the package attribute `generate` is the function)
    while True:
        try:
            user = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not user.strip():
            continue
        if user.strip().startswith("/image"):
            path = user.strip()[len("/image"):].strip()
            try:
                if not path:
                    from k3.errors import RequestError
                    raise RequestError("/image needs a path: /image PATH")
                pending += _load_images([path], model, a.ckpt)
            except K3Error as e:
                print(f"error: {e}", file=sys.stderr)
                continue
            print(f"(image {path} attached to your next message)", file=sys.stderr)
            continue
        if pending:
            history.append({"role": "user", "content": _image_parts(pending) + [{"type": "text", "text": user}]})
            images, pending = images + pending, []
        else:
            history.append({"role": "user", "content": user})
        state: dict = {}
        sys.stdout.write("k3> ")
        sys.stdout.flush()
        try:
            if _is_multimodal(model):
                ids = G._chat_ids(tok, history, a.thinking)
                runner, prompts, extra = _stream_args(model, [ids], images)
                chunks = G.stream_generate(runner, prompts, a.max_new_tokens, tokenizer=tok, output="text",
                                           _state=state, stop_token_ids=[tok.eos_id], stop_strings=a.stop or None,
                                           seed=a.seed, prefill_chunk_size=a.prefill_chunk, **extra,
                                           **_sampling(a))
            else:
                chunks = stream_chat(model, tok, history, a.max_new_tokens, thinking=a.thinking,
                                     stop_strings=a.stop or None, seed=a.seed, prefill_chunk_size=a.prefill_chunk,
                                     _state=state, **_sampling(a))
            for chunk in chunks:
                sys.stdout.write(chunk)
                sys.stdout.flush()
        except KeyboardInterrupt:
            print()
            return 0
        print()
        new = state.get("new_tokens", [[]])[0]
        try:
            msg = parse_assistant(new, tokenizer=tok, thinking=a.thinking)
            turn = {"role": "assistant", "content": msg.get("content") or ""}
            if msg.get("reasoning_content") is not None:
                turn["reasoning_content"] = msg["reasoning_content"]
            if msg.get("tool_calls"):
                turn["tool_calls"] = msg["tool_calls"]
        except Exception:  # unparsable output of an untrained model: keep the raw text
            turn = {"role": "assistant", "content": tok.decode([i for i in new if i < tok.vocab_size],
                                                                 skip_special=True)}
        history.append(turn)


def add_parser(sub) -> None:
    s = sub.add_parser("generate", help="stream a completion of --prompt from a checkpoint")
    _add_common(s)
    s.add_argument("--prompt", required=True)
    s.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat format")
    s.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for a multimodal checkpoint (repeatable; the prompt becomes one user turn with "
                        "the images before the text)")
    s.set_defaults(fn=_cmd_generate)
    s = sub.add_parser("chat", help="interactive multi-turn chat with a checkpoint")
    _add_common(s)
    s.add_argument("--system", default=None, help="system message")
    s.add_argument("--thinking", action="store_true", help="thinking mode (the model writes a think block)")
    s.set_defaults(fn=_cmd_chat, max_new_tokens=512)
