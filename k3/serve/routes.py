"""The routes of `k3 serve`, one function per group: errors (always OpenAI's format), health + models, text
completions, chat completions. Each adds its handlers to a FastAPI app around an Engine."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.serve.engine import Engine
from k3.serve.http import error_response
from k3.serve.protocol import APIError, bad, parse_chat, parse_completion

__all__ = ["add_error_handlers", "add_model_routes", "add_completion_routes", "add_chat_routes"]

log = logging.getLogger("k3.serve")


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        msg = f"{request.method} {request.url.path}: {e.detail}"
        return error_response(APIError(e.status_code, msg, "invalid_request_error", None, kind,
                                       headers=dict(e.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return error_response(bad(f"invalid request: {e.errors()}"[:500], None, "invalid_request"))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("unhandled error")
        return error_response(APIError(500, "internal server error (details are in the server log)",
                                       "server_error", None, "internal_error"))


def add_model_routes(app: FastAPI, engine: Engine) -> None:
    """GET /health (no key: 200 while the scheduler runs, else 503), GET /v1/models, GET /v1/models/{id}."""
    name = engine.cfg.model_name

    @app.get("/health")
    async def health():
        snap = engine.scheduler.snapshot()
        ok = snap["scheduler_alive"]
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": name, **snap},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        engine.check_key(request)
        return {"object": "list", "data": [engine.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str, request: Request):
        engine.check_key(request)
        if model_id != name:
            raise APIError(404, f"The model '{model_id[:200]}' does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return engine.model_card()


def _choice(field: str, value, reason) -> dict:
    """One entry of `choices`: `field` is "text" (completions), "message" (chat) or "delta" (chat chunks)."""
    return {"index": 0, field: value, "logprobs": None, "finish_reason": reason}


def _chunk(cid, obj: str, created, model: str, choice: dict) -> dict:
    return {"id": cid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": [choice]}


async def _generate(engine: Engine, request: Request, parse, chunk, obj: str, whole_obj: str, field: str, value_of):
    """A generation request: SSE events built by `chunk` when it streams, else one `whole_obj` response whose choice
    holds `value_of(text)` under `field`."""
    p, req, q = await engine.prepare(request, parse)
    if p.stream:
        return engine.stream(p, req, q, chunk, obj)
    text, ev = await engine.collect(request, req, q)
    return engine.whole(req, whole_obj, _choice(field, value_of(text), ev[1]), ev)


def add_completion_routes(app: FastAPI, engine: Engine) -> None:
    """POST /v1/completions (text or token-id prompt; SSE with stream=true)."""
    name, obj = engine.cfg.model_name, "text_completion"

    def chunk(cid, created, text, reason, first=False):
        if first:
            return None
        return _chunk(cid, obj, created, name, _choice("text", text or "", reason))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(engine, request, parse_completion, chunk, obj, obj, "text", lambda text: text)


def add_chat_routes(app: FastAPI, engine: Engine) -> None:
    """POST /v1/chat/completions (K3 chat format, non-thinking; SSE with stream=true)."""
    name, obj = engine.cfg.model_name, "chat.completion.chunk"

    def chunk(cid, created, text, reason, first=False):
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return _chunk(cid, obj, created, name, _choice("delta", delta, reason))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(engine, request, parse_chat, chunk, obj, "chat.completion", "message",
                               lambda text: {"role": "assistant", "content": text})
