"""The `k3 serve` HTTP application (FastAPI): OpenAI-compatible routes over the continuous-batching Scheduler.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (both with SSE
streaming: `data: {chunk}` events ending in `data: [DONE]`), GET /health (no API key needed).

Every error is answered as {"error": {"message", "type", "param", "code"}}: bad input is a 4xx naming the field
(protocol.py), a full queue 429, a missing/wrong API key 401, unknown routes 404/405; anything unexpected is a
500 in the same format and the server keeps running. Bodies are read as raw bytes and checked by hand (UTF-8,
JSON, field types and ranges) so no framework error format leaks out.

Chat: messages are rendered in the K3 chat format in non-thinking mode (K3ChatFormat.render(thinking=False));
generation stops at <|end_of_msg|>; the reply `content` is the plain text of the response block, i.e. the
generated text up to the first special token (<|close|>). No tools / images / logprobs (rejected with a 400
naming the field). Completions: the prompt is text (no special-token recognition) or token ids; generation stops
at the tokenizer's stop ids. Greedy when temperature (or top_p) is 0; `seed` makes sampling reproducible (the
same tokens k3.generate gives with that seed); extensions: `top_k`, `repetition_penalty`, `ignore_eos`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.concurrency import run_in_threadpool

from k3.generation.sampling import SamplingParams
from k3.serve.protocol import APIError, ParsedRequest, bad, parse_chat, parse_completion, parse_json_body
from k3.serve.scheduler import GenRequest, QueueFull, Scheduler

__all__ = ["ServeConfig", "create_app"]

log = logging.getLogger("k3.serve")


@dataclass
class ServeConfig:
    model_name: str = "k3"
    api_key: Optional[str] = None
    max_batch: int = 8
    max_queue: int = 64
    max_context: int = 4096
    default_max_tokens: Optional[int] = None   # chat requests without max_tokens: None = the rest of the context
    prefill_chunk: int = 512


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _Engine:
    def __init__(self, model, tokenizer, cfg: ServeConfig):
        from k3.chat import K3ChatFormat
        self.model, self.tok, self.cfg = model, tokenizer, cfg
        self.chat_format = K3ChatFormat(tokenizer)
        self.scheduler = Scheduler(model, tokenizer, cfg.max_batch, cfg.max_queue, cfg.max_context,
                                   cfg.prefill_chunk)
        self.created = int(time.time())
        # ids the model may emit that the tokenizer cannot decode are skipped; prompts must fit both
        self.max_id = min(model.config.vocab_size, tokenizer.vocab_size)

    # ------------------------------------------------------------------ request -> GenRequest
    def tokenize(self, p: ParsedRequest):
        """(prompt ids, error param name). Runs in a worker thread (tokenising can take a while)."""
        if p.kind == "chat":
            from k3.chat import ChatFormatError
            try:
                ids = self.chat_format.render(p.messages, thinking=False, add_generation_prompt=True)
            except ChatFormatError as e:
                raise bad(f"'messages' cannot be rendered: {e}", "messages") from None
            return ids, "messages"
        if isinstance(p.prompt, str):
            ids = self.tok.encode(p.prompt)
            if not ids:
                raise bad("'prompt' encodes to no tokens", "prompt", "empty_prompt")
            return ids, "prompt"
        for j, t in enumerate(p.prompt):
            if not 0 <= t < self.max_id:
                raise bad(f"'prompt[{j}]' token id {t} is out of range [0, {self.max_id})", f"prompt[{j}]")
        return list(p.prompt), "prompt"

    def build(self, p: ParsedRequest, ids, where: str, sink) -> GenRequest:
        C = self.cfg.max_context
        n = len(ids)
        if n >= C:
            raise bad(f"This model's maximum context length is {C} tokens. However, your {where} resulted in "
                      f"{n} tokens (at least 1 token must be left for the completion).", where,
                      "context_length_exceeded")
        room = C - n
        max_tokens = p.max_tokens
        if max_tokens is None:
            max_tokens = room if self.cfg.default_max_tokens is None else min(room, self.cfg.default_max_tokens)
        elif max_tokens > room:
            name = "max_tokens"
            raise bad(f"This model's maximum context length is {C} tokens. However, you requested {n + max_tokens} "
                      f"tokens ({n} in the {where}, {max_tokens} in the completion). Please reduce the "
                      f"{where} or the completion length ('{name}').", name, "context_length_exceeded")
        do_sample = p.temperature > 0 and p.top_p > 0
        params = SamplingParams(do_sample=do_sample, temperature=p.temperature if do_sample else 1.0,
                                top_k=p.top_k, top_p=p.top_p if do_sample else 1.0,
                                repetition_penalty=p.repetition_penalty)
        stop_ids = frozenset(self.tok.stop_ids) if p.kind == "completion" else frozenset([self.tok.eos_id])
        if p.ignore_eos:
            stop_ids = frozenset()
        return GenRequest(prompt=list(ids), max_tokens=max_tokens, sink=sink, params=params, seed=p.seed,
                          stop_ids=stop_ids, stop_strings=list(p.stop), text_ends_at_special=p.kind == "chat",
                          id=("chatcmpl-" if p.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24])


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always listens for the client's disconnect (any ASGI spec version), stops the
    stream when it comes, and calls `on_close` however the stream ends (the slot is freed at once)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, media_type="text/event-stream", **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        async def listen():
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    self.on_close()
                    break

        try:
            async with anyio.create_task_group() as tg:
                async def run(fn):
                    try:
                        await fn()
                    except OSError:     # the client went away mid-write
                        self.on_close()
                    tg.cancel_scope.cancel()

                tg.start_soon(run, lambda: self.stream_response(send))
                await run(listen)
        finally:
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await aclose()
                    except Exception:
                        pass


def create_app(model, tokenizer, config: Optional[ServeConfig] = None) -> FastAPI:
    """The FastAPI app serving `model` (K3ForCausalLM, eval mode) with `tokenizer`. The scheduler thread starts
    with the app's lifespan (uvicorn startup) and stops at shutdown; `app.state.engine` exposes it."""
    cfg = config or ServeConfig()
    engine = _Engine(model, tokenizer, cfg)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        engine.scheduler.start()
        try:
            yield
        finally:
            engine.scheduler.stop()

    app = FastAPI(title="k3 serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine

    # ------------------------------------------------------------------ errors: always OpenAI's format
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        msg = f"{request.method} {request.url.path}: {e.detail}"
        return _error_response(APIError(e.status_code, msg, "invalid_request_error", None, kind,
                                        headers=dict(e.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return _error_response(bad(f"invalid request: {e.errors()}"[:500], None, "invalid_request"))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("unhandled error")
        return _error_response(APIError(500, f"internal server error: {type(e).__name__}", "server_error", None,
                                        "internal_error"))

    # ------------------------------------------------------------------ helpers
    def check_key(request: Request) -> None:
        if not cfg.api_key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "replace"),
                                                                 cfg.api_key.encode("utf-8")):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", None, "invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_model(p: ParsedRequest) -> None:
        if p.model != cfg.model_name:
            raise APIError(404, f"The model '{p.model[:200]}' does not exist; this server serves "
                                f"'{cfg.model_name}'", "invalid_request_error", "model", "model_not_found")

    def model_card() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": engine.created, "owned_by": "k3",
                "max_context": cfg.max_context}

    async def prepare(request: Request, parse):
        check_key(request)
        body = parse_json_body(await request.body())
        p = parse(body)
        check_model(p)
        ids, where = await run_in_threadpool(engine.tokenize, p)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink(ev, _loop=loop, _q=q):
            _loop.call_soon_threadsafe(_q.put_nowait, ev)

        req = engine.build(p, ids, where, sink)
        if not engine.scheduler.alive:
            raise APIError(503, "the generation scheduler is not running", "server_error", None, "unavailable")
        try:
            engine.scheduler.submit(req)
        except QueueFull as e:
            raise APIError(429, f"{e}; retry later", "rate_limit_error", None, "queue_full",
                           headers={"Retry-After": "1"}) from None
        return p, req, q

    def usage(ev) -> dict:
        return {"prompt_tokens": ev[2], "completion_tokens": ev[3], "total_tokens": ev[2] + ev[3]}

    async def collect(request: Request, req: GenRequest, q: asyncio.Queue):
        """Wait for the whole generation; a client that disconnects meanwhile cancels it."""
        async def gone():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(gone())
        parts = []
        try:
            while True:
                getter = asyncio.ensure_future(q.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    req.cancel.set()
                    engine.scheduler.wake()
                    raise APIError(499, "client closed the request", "invalid_request_error", None, "cancelled")
                ev = getter.result()
                if ev[0] == "text":
                    parts.append(ev[1])
                elif ev[0] == "done":
                    return "".join(parts), ev
                else:
                    raise APIError(500, ev[1], "server_error", None, "generation_failed")
        finally:
            watcher.cancel()
            req.cancel.set()

    def stream(p: ParsedRequest, req: GenRequest, q: asyncio.Queue, make_chunk):
        async def gen():
            created = int(time.time())
            first = make_chunk(req.id, created, None, None, first=True)
            if first is not None:
                yield _sse(first)
            while True:
                ev = await q.get()
                if ev[0] == "text":
                    yield _sse(make_chunk(req.id, created, ev[1], None))
                elif ev[0] == "done":
                    reason = ev[1] if ev[1] in ("stop", "length") else "stop"
                    if ev[1] != "cancelled":
                        yield _sse(make_chunk(req.id, created, None, reason))
                        if p.include_usage:
                            yield _sse({"id": req.id, "object": make_chunk.object, "created": created,
                                        "model": cfg.model_name, "choices": [], "usage": usage(ev)})
                    break
                else:
                    yield _sse(APIError(500, ev[1], "server_error", None, "generation_failed").body())
                    break
            yield "data: [DONE]\n\n"

        def on_close():
            if not req.cancel.is_set():
                req.cancel.set()
                engine.scheduler.wake()

        return _SSEResponse(gen(), on_close, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        snap = engine.scheduler.snapshot()
        ok = snap["scheduler_alive"]
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": cfg.model_name, **snap},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str, request: Request):
        check_key(request)
        if model_id != cfg.model_name:
            raise APIError(404, f"The model '{model_id[:200]}' does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        p, req, q = await prepare(request, parse_chat)

        def chunk(cid, created, text, reason, first=False):
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": cfg.model_name,
                    "system_fingerprint": None,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        chunk.object = "chat.completion.chunk"

        if p.stream:
            return stream(p, req, q, chunk)
        text, ev = await collect(request, req, q)
        return {"id": req.id, "object": "chat.completion", "created": int(time.time()), "model": cfg.model_name,
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": ev[1]}],
                "usage": usage(ev)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        p, req, q = await prepare(request, parse_completion)

        def chunk(cid, created, text, reason, first=False):
            if first:
                return None
            return {"id": cid, "object": "text_completion", "created": created, "model": cfg.model_name,
                    "system_fingerprint": None,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]}
        chunk.object = "text_completion"

        if p.stream:
            return stream(p, req, q, chunk)
        text, ev = await collect(request, req, q)
        return {"id": req.id, "object": "text_completion", "created": int(time.time()), "model": cfg.model_name,
                "system_fingerprint": None,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": ev[1]}],
                "usage": usage(ev)}

    return app
