"""HTTP plumbing of `k3 serve`: bounded body reading, OpenAI-format error responses, server-sent events."""
from __future__ import annotations

import asyncio
import json

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from k3.serve.protocol import APIError, bad

__all__ = ["read_body", "error_response", "sse", "SSEResponse"]


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _too_large(n: str, limit: int) -> APIError:
    return APIError(413, f"request body is {n} bytes; the limit is {limit}", param=None, code="request_too_large")


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes (a Content-Length over
    the limit is refused before reading any of it; a chunked body when the running total passes it), 408 when it
    does not arrive within `timeout` seconds. Never holds more than `limit` + one chunk in memory."""
    cl = request.headers.get("content-length")
    if cl is not None:
        if not cl.strip().isdigit():
            raise bad(f"invalid Content-Length header: {cl[:40]!r}", None, "invalid_header")
        if int(cl) > limit:
            raise _too_large(cl.strip(), limit)
    buf = bytearray()

    async def read():
        async for chunk in request.stream():
            buf.extend(chunk)
            if len(buf) > limit:
                raise _too_large(f"more than {limit}", limit)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", param=None,
                       code="request_timeout") from None
    return bytes(buf)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
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
