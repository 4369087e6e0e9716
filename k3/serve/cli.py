"""`k3 serve`: an OpenAI-compatible HTTP server for a checkpoint directory (FastAPI + uvicorn)."""
from __future__ import annotations

import ipaddress
import os
import sys


def _positive(name):
    def f(s):
        v = int(s)
        if v < 1:
            raise ValueError(f"{name} must be >= 1")
        return v
    f.__name__ = name
    return f


def _nonneg(s):
    v = int(s)
    if v < 0:
        raise ValueError("must be >= 0")
    return v


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
    key = a.api_key if a.api_key is not None else os.environ.get("K3_API_KEY") or None
    cfg = ServeConfig(model_name=name, api_key=key, max_batch=a.max_batch, max_queue=a.max_queue,
                      max_context=max_context, default_max_tokens=a.default_max_tokens,
                      prefill_chunk=a.prefill_chunk)
    return create_app(model, tok, cfg), cfg


def _cmd_serve(a) -> int:
    import uvicorn
    if not _is_loopback(a.host) and not (a.api_key or os.environ.get("K3_API_KEY")):
        print(f"k3 serve: warning: listening on {a.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    app, cfg = build_server(a)
    print(f"k3 serve: model '{cfg.model_name}' on http://{a.host}:{a.port}/v1 (max batch {cfg.max_batch}, "
          f"queue {cfg.max_queue}, context {cfg.max_context}, api key {'on' if cfg.api_key else 'off'})",
          file=sys.stderr)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=5)
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, streaming, batching)")
    s.add_argument("--ckpt", required=True, help="checkpoint directory (config.json, safetensors, tokenizer)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $K3_API_KEY, else off)")
    s.add_argument("--max-batch", type=_positive("max_batch"), default=8,
                   help="streams decoded together (cache rows)")
    s.add_argument("--max-queue", type=_nonneg, default=64,
                   help="requests that may wait for a free stream; beyond that the server answers 429")
    s.add_argument("--max-context", type=_positive("max_context"), default=None,
                   help="prompt + completion tokens per request (default min(4096, max_position_embeddings))")
    s.add_argument("--default-max-tokens", type=_positive("default_max_tokens"), default=None,
                   help="chat completion length when a request gives none (default: the rest of the context)")
    s.add_argument("--served-model-name", default=None, help="model id of the API (default: checkpoint dir name)")
    s.add_argument("--prefill-chunk", type=_positive("prefill_chunk"), default=512,
                   help="prompt tokens prefilled per scheduler step (bounds the stall of running streams)")
    s.add_argument("--device", default="auto")
    s.add_argument("--dtype", default=None, help="override the checkpoint dtype (e.g. float32)")
    s.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(fn=_cmd_serve)
