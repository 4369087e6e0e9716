"""The request side of `k3 serve`: API key and model checks, prompt tokenising / chat rendering, the context and
max_tokens rules, submitting to the Scheduler and turning its events into a whole answer or an SSE stream."""
from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from k3.generation.sampling import SamplingParams
from k3.serve.http import SSEResponse, read_body, sse
from k3.serve.protocol import MAX_BODY_BYTES, APIError, ParsedRequest, bad, parse_json_body
from k3.serve.scheduler import GenRequest, QueueFull, Scheduler

__all__ = ["ServeConfig", "Engine"]

DEFAULT_MAX_TOKENS = 256


@dataclass
class ServeConfig:
    model_name: str = "k3"
    api_key: Optional[str] = None
    max_batch: int = 8
    max_queue: int = 64
    max_context: int = 4096
    default_max_tokens: Optional[int] = DEFAULT_MAX_TOKENS  # chat requests without max_tokens (None: the rest of
    #                                                         the context, capped by max_context)
    prefill_chunk: int = 512
    max_body_bytes: int = MAX_BODY_BYTES   # request bodies over this are refused (413) while being read
    read_timeout: float = 30.0             # seconds for a request body to arrive (else 408)
    request_timeout: float = 600.0         # seconds a non-streaming request may wait for its answer (else 504)
    max_connections: Optional[int] = 256   # concurrent connections (uvicorn limit_concurrency; over it: 503)
    max_images: int = 8                    # images per request (multimodal checkpoints; over it: 400)
    max_image_bytes: int = 8 * 1024 * 1024  # decoded image bytes per request, all images together (over it: 413)


def _unavailable(msg: str = "the generation scheduler is not running") -> APIError:
    return APIError(503, msg, "server_error", None, "unavailable")


def _usage(ev) -> dict:
    return {"prompt_tokens": ev[2], "completion_tokens": ev[3], "total_tokens": ev[2] + ev[3]}


class Engine:
    def __init__(self, model, tokenizer, cfg: ServeConfig):
        from k3.chat import K3ChatFormat
        from k3.multimodal import K3ForConditionalGeneration
        self.model, self.tok, self.cfg = model, tokenizer, cfg
        self.chat_format = K3ChatFormat(tokenizer)
        # a multimodal model: the scheduler runs its language model; images become prompt embeddings here
        self.mm = model if isinstance(model, K3ForConditionalGeneration) else None
        lm = model.language_model if self.mm is not None else model
        self.scheduler = Scheduler(lm, tokenizer, cfg.max_batch, cfg.max_queue, cfg.max_context,
                                   cfg.prefill_chunk)
        self.created = int(time.time())
        # ids the model may emit that the tokenizer cannot decode are skipped; prompts must fit both
        self.max_id = min(model.config.vocab_size, tokenizer.vocab_size)

    # ------------------------------------------------------------------ checks
    def check_key(self, request: Request) -> None:
        key = self.cfg.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "replace"),
                                                                 key.encode("utf-8")):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", None, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, model_id: str) -> None:
        if model_id != self.cfg.model_name:
            raise APIError(404, f"The model '{model_id[:200]}' does not exist; this server serves "
                                f"'{self.cfg.model_name}'", "invalid_request_error", "model", "model_not_found")

    def check_room(self) -> None:
        if not self.scheduler.alive or self.scheduler.fatal is not None:
            raise _unavailable()
        try:
            self.scheduler.check_room()
        except QueueFull as e:
            raise APIError(429, f"{e}; retry later", "rate_limit_error", None, "queue_full",
                           headers={"Retry-After": "1"}) from None

    def model_card(self) -> dict:
        return {"id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "k3",
                "max_context": self.cfg.max_context}

    # ------------------------------------------------------------------ request -> GenRequest
    def _images(self, p: ParsedRequest) -> tuple:
        """(messages with each image part as {"type": "image", "width", "height"}, decoded PIL images in order).
        Limits: `max_images` per request (400), `max_image_bytes` decoded bytes per request (413); an image that
        cannot be opened is a 400 naming its part."""
        from k3.serve.protocol import ImagePart
        found = [(i, j, x) for i, m in enumerate(p.messages) if isinstance(m["content"], list)
                 for j, x in enumerate(m["content"]) if isinstance(x, ImagePart)]
        if not found:
            return p.messages, []
        first = found[0][2].param
        if self.mm is None:
            raise bad(f"'{first}': this model takes no images (a text-only checkpoint)", first, "unsupported_value")
        if len(found) > self.cfg.max_images:
            over = found[self.cfg.max_images][2].param
            raise bad(f"'messages' holds {len(found)} images; this server takes at most {self.cfg.max_images} per "
                      f"request", over, "too_many_images")
        total = sum(len(x.data) for _, _, x in found)
        if total > self.cfg.max_image_bytes:
            raise APIError(413, f"the request's images hold {total} bytes (decoded); this server takes at most "
                                f"{self.cfg.max_image_bytes} bytes of images per request", "invalid_request_error",
                           "messages", "images_too_large")
        from k3.vision import K3ImageError
        from k3.vision.preprocess import load_image
        cfg = self.mm.processor_config
        msgs = [dict(m, content=list(m["content"])) if isinstance(m["content"], list) else m for m in p.messages]
        images = []
        for i, j, x in found:
            try:
                img = load_image(x.data, cfg)
            except K3ImageError as e:
                raise bad(f"'{x.param}': the image cannot be used: {e}"[:500], x.param, "invalid_image") from None
            msgs[i]["content"][j] = {"type": "image", "width": img.size[0], "height": img.size[1]}
            images.append(img)
        return msgs, images

    def tokenize(self, p: ParsedRequest):
        """(prompt ids, error param name[, prompt embeddings]). Runs in a worker thread (tokenising, image
        decoding and the vision tower can take a while). With images the ids are the expanded prompt (each
        placeholder repeated per image token) and the embeddings hold the image tokens."""
        if p.kind == "chat":
            from k3.chat import ChatFormatError
            messages, images = self._images(p)
            try:
                ids = self.chat_format.render(messages, thinking=False, add_generation_prompt=True)
            except ChatFormatError as e:
                raise bad(f"'messages' cannot be rendered: {e}", "messages") from None
            if images:
                from k3.multimodal import image_prompt_embeds
                from k3.vision import K3ImageError
                try:
                    expanded, embeds = image_prompt_embeds(self.mm, [ids], images)
                except K3ImageError as e:
                    raise bad(f"'messages': the images cannot be used: {e}"[:500], "messages",
                              "invalid_image") from None
                return expanded[0], "messages", embeds[0]
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

    def _max_tokens(self, p: ParsedRequest, n: int, where: str) -> int:
        C = self.cfg.max_context
        if n >= C:
            raise bad(f"This model's maximum context length is {C} tokens. However, your {where} resulted in "
                      f"{n} tokens (at least 1 token must be left for the completion).", where,
                      "context_length_exceeded")
        room = C - n
        if p.max_tokens is None:
            return room if self.cfg.default_max_tokens is None else min(room, self.cfg.default_max_tokens)
        if p.max_tokens > room:
            raise bad(f"This model's maximum context length is {C} tokens. However, you requested "
                      f"{n + p.max_tokens} tokens ({n} in the {where}, {p.max_tokens} in the completion). Please "
                      f"reduce the {where} or the completion length ('max_tokens').", "max_tokens",
                      "context_length_exceeded")
        return p.max_tokens

    def build(self, p: ParsedRequest, ids, where: str, sink, embeds=None) -> GenRequest:
        max_tokens = self._max_tokens(p, len(ids), where)
        do_sample = p.temperature > 0 and p.top_p > 0
        params = SamplingParams(do_sample=do_sample, temperature=p.temperature if do_sample else 1.0,
                                top_k=p.top_k, top_p=p.top_p if do_sample else 1.0,
                                repetition_penalty=p.repetition_penalty)
        stop_ids = frozenset(self.tok.stop_ids) if p.kind == "completion" else frozenset([self.tok.eos_id])
        if p.ignore_eos:
            stop_ids = frozenset()
        return GenRequest(prompt=list(ids), max_tokens=max_tokens, sink=sink, params=params, seed=p.seed,
                          stop_ids=stop_ids, stop_strings=list(p.stop), text_ends_at_special=p.kind == "chat",
                          embeds=embeds,
                          id=("chatcmpl-" if p.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24])

    async def prepare(self, request: Request, parse):
        """Check, parse, tokenise and submit a request: (parsed, GenRequest, event queue). The cheap checks (key,
        body size while reading, fields, model, queue room) come before any tokenising or rendering."""
        self.check_key(request)
        body = parse_json_body(await read_body(request, self.cfg.max_body_bytes, self.cfg.read_timeout),
                               self.cfg.max_body_bytes)
        p = parse(body)
        self.check_model(p.model)
        self.check_room()
        ids, where, *embeds = await run_in_threadpool(self.tokenize, p)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink(ev, _loop=loop, _q=q):
            _loop.call_soon_threadsafe(_q.put_nowait, ev)

        req = self.build(p, ids, where, sink, embeds[0] if embeds else None)
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            raise APIError(429, f"{e}; retry later", "rate_limit_error", None, "queue_full",
                           headers={"Retry-After": "1"}) from None
        except RuntimeError:
            raise _unavailable() from None
        return p, req, q

    def _cancel(self, req: GenRequest) -> None:
        if not req.cancel.is_set():
            req.cancel.set()
            self.scheduler.wake()

    # ------------------------------------------------------------------ answers
    async def collect(self, request: Request, req: GenRequest, q: asyncio.Queue):
        """(text, done event) of the whole generation; a client that disconnects meanwhile cancels it (499), one
        that waits longer than request_timeout gets 504."""
        async def gone():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(gone())
        deadline = time.monotonic() + self.cfg.request_timeout
        parts = []
        try:
            while True:
                getter = asyncio.ensure_future(q.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED,
                                             timeout=max(0.0, deadline - time.monotonic()))
                if getter not in done:
                    getter.cancel()
                    self._cancel(req)
                    if watcher in done:
                        raise APIError(499, "client closed the request", "invalid_request_error", None,
                                       "cancelled")
                    raise APIError(504, f"the generation did not finish within {self.cfg.request_timeout:g} s",
                                   "server_error", None, "timeout")
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

    def stream(self, p: ParsedRequest, req: GenRequest, q: asyncio.Queue, make_chunk, obj: str) -> SSEResponse:
        """SSE answer: `make_chunk(id, created, text, finish_reason, first=...)` events, an error event if the
        generation fails (or the server shuts down), then `data: [DONE]`."""
        name = self.cfg.model_name

        async def gen():
            created = int(time.time())
            first = make_chunk(req.id, created, None, None, first=True)
            if first is not None:
                yield sse(first)
            while True:
                ev = await q.get()
                if ev[0] == "text":
                    yield sse(make_chunk(req.id, created, ev[1], None))
                elif ev[0] == "done":
                    if ev[1] != "cancelled":
                        yield sse(make_chunk(req.id, created, None, ev[1] if ev[1] in ("stop", "length") else "stop"))
                        if p.include_usage:
                            yield sse({"id": req.id, "object": obj, "created": created, "model": name,
                                       "choices": [], "usage": _usage(ev)})
                    break
                else:
                    yield sse(APIError(500, ev[1], "server_error", None, "generation_failed").body())
                    break
            yield "data: [DONE]\n\n"

        return SSEResponse(gen(), lambda: self._cancel(req),
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def whole(self, req: GenRequest, obj: str, choice: dict, ev) -> dict:
        return {"id": req.id, "object": obj, "created": int(time.time()), "model": self.cfg.model_name,
                "system_fingerprint": None, "choices": [choice], "usage": _usage(ev)}
