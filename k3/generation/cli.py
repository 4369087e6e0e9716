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
    """(model, tokenizer) from a checkpoint directory, on `device` ("auto": cuda if available)."""
    import torch
    from k3.checkpoint import from_pretrained
    from k3.tokenizer import check_tokenizer_matches, load_tokenizer
    if not ckpt or not os.path.isdir(ckpt):
        raise CheckpointError(f"checkpoint directory not found: {ckpt}")
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise CheckpointError(f"checkpoint {ckpt}: no config.json")
    tok = load_tokenizer(ckpt)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
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


def _cmd_generate(a) -> int:
    from k3.generation.generate import stream_generate
    model, tok = load_for_inference(a.ckpt, a.device, a.dtype)
    if a.chat:
        from k3.chat import K3ChatFormat
        ids = K3ChatFormat(tok).render([{"role": "user", "content": a.prompt}], thinking=False)
    else:
        ids = tok.encode(a.prompt)
    if not ids:
        from k3.errors import RequestError
        raise RequestError("the prompt encodes to no tokens")
    cancel = threading.Event()
    out = sys.stdout
    try:
        for chunk in stream_generate(model, [ids], a.max_new_tokens, tokenizer=tok, stop_strings=a.stop or None,
                                     seed=a.seed, prefill_chunk_size=a.prefill_chunk, cancel=cancel, output="text",
                                     **_sampling(a)):
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
    print("k3 chat: empty line is ignored; Ctrl-D or Ctrl-C to quit.", file=sys.stderr)
    while True:
        try:
            user = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not user.strip():
            continue
        history.append({"role": "user", "content": user})
        state: dict = {}
        sys.stdout.write("k3> ")
        sys.stdout.flush()
        try:
            for chunk in stream_chat(model, tok, history, a.max_new_tokens, thinking=a.thinking,
                                     stop_strings=a.stop or None, seed=a.seed, prefill_chunk_size=a.prefill_chunk,
                                     _state=state, **_sampling(a)):
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
    s.set_defaults(fn=_cmd_generate)
    s = sub.add_parser("chat", help="interactive multi-turn chat with a checkpoint")
    _add_common(s)
    s.add_argument("--system", default=None, help="system message")
    s.add_argument("--thinking", action="store_true", help="thinking mode (the model writes a think block)")
    s.set_defaults(fn=_cmd_chat, max_new_tokens=512)
