"""The `k3 serve` HTTP application (FastAPI): OpenAI-compatible routes over the continuous-batching Scheduler.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (both with SSE
streaming: `data: {chunk}` events ending in `data: [DONE]`), GET /health (no API key needed).

Every error is answered as {"error": {"message", "type", "param", "code"}}: bad input is a 4xx naming the field
(protocol.py), a full queue 429, a missing/wrong API key 401, unknown routes 404/405; anything unexpected is a
500 in the same format with a generic message (the detail is logged) and the server keeps running. Bodies are
read as raw bytes and checked by hand (UTF-8, JSON, field types and ranges) so no framework error format leaks out.

Chat: messages are rendered in the K3 chat format in non-thinking mode (K3ChatFormat.render(thinking=False));
generation stops at <|end_of_msg|>; the reply `content` is the plain text of the response block, i.e. the
generated text up to the first special token (<|close|>). No tools / logprobs (rejected with a 400 naming the
field). Images (multimodal checkpoints): user-message `image_url` parts with base64 `data:` URIs (PNG / JPEG /
WebP) are decoded, checked (k3.vision.load_image), encoded by the vision tower in the request's worker thread and
placed as prompt embeddings; such a prompt prefills alone with them. Remote http(s) URLs are refused (the server
never fetches), so are more than `max_images` images (400) or more than `max_image_bytes` decoded bytes (413) per
request; an image that cannot be opened fails its request alone (400 naming the part). Completions: the prompt is text (no special-token recognition) or token ids; generation stops
at the tokenizer's stop ids. Greedy when temperature (or top_p) is 0; `seed` makes sampling reproducible (the
same tokens k3.generate gives with that seed); extensions: `top_k`, `repetition_penalty`, `ignore_eos`.

Bounded work per request: the body is refused (413) while being read once it passes `max_body_bytes`, a body that
does not arrive within `read_timeout` is a 408, the queue's room is checked before tokenising, at most 4 stop
strings of at most MAX_STOP_CHARS characters, text work per token is O(1) (scheduler.py), non-streaming answers
wait at most `request_timeout` (504), and `max_connections` bounds concurrent connections (run_server).
One request's failure fails it alone; if the scheduler stops for good every open request gets an error at once,
/health answers 503 and run_server returns 1 (`k3 serve` exits non-zero). On shutdown (Ctrl-C / SIGTERM) open
streams get a final error event and `data: [DONE]` before the server closes.

Layout: protocol.py (request fields), engine.py (ServeConfig, Engine: checks, tokenising, submit, answers),
routes.py (one function per route group), http.py (body reading, SSE), scheduler.py (continuous batching).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI

from k3.serve.engine import DEFAULT_MAX_TOKENS, Engine, ServeConfig
from k3.serve.routes import add_chat_routes, add_completion_routes, add_error_handlers, add_model_routes

__all__ = ["ServeConfig", "create_app", "make_server", "run_server", "DEFAULT_MAX_TOKENS"]

log = logging.getLogger("k3.serve")


def create_app(model, tokenizer, config: Optional[ServeConfig] = None) -> FastAPI:
    """The FastAPI app serving `model` (K3ForCausalLM, eval mode) with `tokenizer`. The scheduler thread starts
    with the app's lifespan (uvicorn startup) and stops at shutdown; `app.state.engine` exposes it."""
    engine = Engine(model, tokenizer, config or ServeConfig())

    @asynccontextmanager
    async def lifespan(app):
        engine.scheduler.start()
        try:
            yield
        finally:
            engine.scheduler.stop()

    app = FastAPI(title="k3 serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    add_error_handlers(app)
    add_model_routes(app, engine)
    add_completion_routes(app, engine)
    add_chat_routes(app, engine)
    return app


def _uvicorn():
    try:
        import uvicorn
    except ModuleNotFoundError:
        from k3.errors import K3Error
        raise K3Error("k3 serve needs uvicorn and fastapi: pip install fastapi uvicorn") from None
    return uvicorn


def _server_class():
    uvicorn = _uvicorn()

    class _K3Server(uvicorn.Server):
        """uvicorn.Server that, when it starts shutting down, first stops the scheduler: every open stream gets
        a final error event and `data: [DONE]`, every waiting request an answer, before connections close."""

        def __init__(self, config, engine: Engine):
            super().__init__(config)
            self.engine = engine

        def on_fatal(self, reason: str) -> None:   # scheduler thread: the loop cannot continue
            log.critical("generation scheduler stopped (%s): shutting down the server", reason)
            self.should_exit = True

        async def shutdown(self, sockets=None):
            await asyncio.get_running_loop().run_in_executor(None, self.engine.scheduler.stop)  # ends its step
            await super().shutdown(sockets)

    return _K3Server


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                timeout_graceful_shutdown: float = 5, **uvicorn_kw):
    """A uvicorn server for `app` (create_app) with the serving limits of its ServeConfig (max_connections ->
    limit_concurrency) that stops itself when the scheduler dies."""
    uvicorn = _uvicorn()
    engine: Engine = app.state.engine
    n = engine.cfg.max_connections        # uvicorn counts the arriving connection too: +1 allows exactly n
    uvicorn_kw.setdefault("limit_concurrency", None if n is None else n + 1)
    uvicorn_kw.setdefault("timeout_keep_alive", 5)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=timeout_graceful_shutdown, **uvicorn_kw)
    server = _server_class()(config, engine)
    engine.scheduler.on_fatal = server.on_fatal
    return server


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               sockets=None, **kw) -> int:
    """Serve `app` until shutdown; 0 after a normal shutdown, 1 if the generation scheduler stopped for good
    (so that a supervisor restarts the process)."""
    server = make_server(app, host, port, log_level, **kw)
    server.run(sockets=sockets)
    return 1 if app.state.engine.scheduler.fatal is not None else 0
