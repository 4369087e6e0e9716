"""`k3 serve`: an OpenAI-compatible HTTP server for a checkpoint directory (FastAPI + uvicorn).

Every flag is checked by argparse before the model loads (a `k3 serve: error: argument ...` line, exit 2); a
missing fastapi / uvicorn is a one-line `k3: error:` hint; the command exits 1 if the scheduler stops for good."""
from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys

from k3 import knobs


def _int_in(name, lo, hi=None):
    """argparse type: an integer in [lo, hi] (a clear `k3 serve: error: argument ...` otherwise)."""
    def f(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"{name} must be {rng}, got {v}")
        return v
    f.__name__ = name
    return f


def _positive(name):
    return _int_in(name, 1)


def _nonneg(name):
    return _int_in(name, 0)


def _seconds(name):
    def f(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a finite number > 0, got {text}")
        return v
    f.__name__ = name
    return f


def _need_serving_deps() -> None:
    """A one-line K3Error (not a traceback) when fastapi / uvicorn are missing."""
    import importlib.util
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        from k3.errors import K3Error
        raise K3Error(f"k3 serve needs {' and '.join(missing)}: pip install fastapi uvicorn "
                      f"(or reinstall k3: pip install -e .)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_server(a):
    """(app, ServeConfig) from parsed `k3 serve` arguments (loads the checkpoint)."""
    import torch
    from k3.errors import K3Error
    from k3.generation.cli import load_for_inference
    from k3.serve.app import ServeConfig, create_app
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_for_inference(a.ckpt, a.device, a.dtype)
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 4096
    max_context = a.max_context or min(limit, 4096)
    if max_context < 2:
        raise K3Error(f"--max-context must be >= 2, got {max_context}")
    name = a.served_model_name or os.path.basename(os.path.normpath(a.ckpt)) or "k3"
    key = a.api_key if a.api_key is not None else knobs.get("K3_API_KEY")
    default_max_tokens = a.default_max_tokens or None          # 0: the rest of the context
    cfg = ServeConfig(model_name=name, api_key=key, max_batch=a.max_batch, max_queue=a.max_queue,
                      max_context=max_context, default_max_tokens=default_max_tokens,
                      prefill_chunk=a.prefill_chunk, read_timeout=a.read_timeout,
                      request_timeout=a.request_timeout, max_connections=a.max_connections,
                      max_images=a.max_images, max_image_bytes=a.max_image_bytes)
    from k3.multimodal import K3ForConditionalGeneration
    if isinstance(model, K3ForConditionalGeneration):   # base64 is 4/3 of the bytes, plus the rest of the body
        cfg.max_body_bytes = max(cfg.max_body_bytes, a.max_image_bytes * 4 // 3 + (1 << 20))
    return create_app(model, tok, cfg), cfg


def _cmd_serve(a) -> int:
    _need_serving_deps()                      # before loading the model: the flags are checked by argparse
    from k3.serve.app import run_server
    if not _is_loopback(a.host) and not (a.api_key or knobs.get("K3_API_KEY")):
        print(f"k3 serve: warning: listening on {a.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    app, cfg = build_server(a)
    print(f"k3 serve: model '{cfg.model_name}' on http://{a.host}:{a.port}/v1 (max batch {cfg.max_batch}, "
          f"queue {cfg.max_queue}, context {cfg.max_context}, api key {'on' if cfg.api_key else 'off'})",
          file=sys.stderr)
    rc = run_server(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=5)
    if rc:
        print("k3 serve: error: the generation scheduler stopped (see the log above); exiting", file=sys.stderr)
    return rc


DEFAULT_MAX_TOKENS = 256   # = k3.serve.engine.DEFAULT_MAX_TOKENS (not imported here: fastapi is optional)


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, streaming, batching)")
    s.add_argument("--ckpt", required=True, help="checkpoint directory (config.json, safetensors, tokenizer)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_int_in("port", 1, 65535), default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $K3_API_KEY, else off)")
    s.add_argument("--max-batch", type=_positive("max_batch"), default=8,
                   help="streams decoded together (cache rows)")
    s.add_argument("--max-queue", type=_nonneg("max_queue"), default=64,
                   help="requests that may wait for a free stream; beyond that the server answers 429")
    s.add_argument("--max-context", type=_positive("max_context"), default=None,
                   help="prompt + completion tokens per request (default min(4096, max_position_embeddings))")
    s.add_argument("--default-max-tokens", type=_nonneg("default_max_tokens"), default=DEFAULT_MAX_TOKENS,
                   help=f"chat completion length when a request gives no max_tokens (default {DEFAULT_MAX_TOKENS}; "
                        "0: the rest of the context)")
    s.add_argument("--served-model-name", default=None, help="model id of the API (default: checkpoint dir name)")
    s.add_argument("--prefill-chunk", type=_positive("prefill_chunk"), default=512,
                   help="prompt tokens prefilled per scheduler step (bounds the stall of running streams)")
    s.add_argument("--device", default="auto")
    s.add_argument("--dtype", default=None, help="override the checkpoint dtype (e.g. float32)")
    s.add_argument("--threads", type=_nonneg("threads"), default=0,
                   help="torch intra-op threads (0: torch's default)")
    s.add_argument("--read-timeout", type=_seconds("read_timeout"), default=30.0,
                   help="seconds a request body may take to arrive (else 408)")
    s.add_argument("--request-timeout", type=_seconds("request_timeout"), default=600.0,
                   help="seconds a non-streaming request may wait for its answer (else 504)")
    s.add_argument("--max-connections", type=_positive("max_connections"), default=256,
                   help="concurrent connections; beyond that the server answers 503")
    s.add_argument("--max-images", type=_nonneg("max_images"), default=8,
                   help="images per request (multimodal checkpoints; more: 400)")
    s.add_argument("--max-image-bytes", type=_positive("max_image_bytes"), default=8 * 1024 * 1024,
                   help="decoded image bytes per request, all images together (more: 413); for a multimodal "
                        "checkpoint the request body limit grows to fit them as base64")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(fn=_cmd_serve)
