"""Strict parsing of OpenAI-style request bodies. Every problem is an APIError (4xx) that names the field.

Nothing here touches the model: `parse_json_body` turns raw bytes into a dict (UTF-8, JSON, object),
`parse_chat` / `parse_completion` check every field and return a ParsedRequest with the prompt still as
messages / text (tokenising and the context check happen in app.py, which knows the tokenizer and limits).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

__all__ = ["APIError", "ParsedRequest", "ImagePart", "parse_json_body", "parse_chat", "parse_completion", "MAX_BODY_BYTES",
           "MAX_STOP", "MAX_STOP_CHARS"]

MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_STOP = 4                 # stop strings per request (as OpenAI)
MAX_STOP_CHARS = 256         # characters per stop string (bounds the per-token stop scan)
MAX_TOKENS_LIMIT = 1 << 31
IMAGE_MIME_TYPES = ("image/png", "image/jpeg", "image/webp")


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = "invalid_value", status: int = 400):
    return APIError(status, message, "invalid_request_error", param, code)


@dataclass
class ParsedRequest:
    kind: str                                  # "chat" | "completion"
    model: str
    messages: Optional[List[dict]] = None      # chat
    prompt: Union[str, List[int], None] = None  # completion: text or token ids
    max_tokens: Optional[int] = None           # None: the rest of the context (or the server default)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop: List[str] = field(default_factory=list)
    seed: Optional[int] = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False                   # extension (as in vLLM): do not stop at the end-of-turn token
    user: Optional[str] = None


# ---------------------------------------------------------------------------------------------------- body
def _no_constants(name):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes, limit: int = MAX_BODY_BYTES) -> Dict[str, Any]:
    if len(raw) > limit:
        raise APIError(413, f"request body is {len(raw)} bytes; the limit is {limit}",
                       param=None, code="request_too_large")
    if not raw.strip():
        raise bad("request body is empty; expected a JSON object", None, "invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"request body is not valid UTF-8 (invalid byte at offset {e.start})", None,
                  "invalid_utf8") from None
    try:
        obj = json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise bad("request body JSON is nested too deeply", None, "invalid_json") from None
    except ValueError as e:
        raise bad(f"request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(obj, dict):
        raise bad(f"request body must be a JSON object, got {_tname(obj)}", None, "invalid_type")
    return obj


# JSON type names, most specific Python type first (bool is an int)
_JSON_TYPES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def _tname(v) -> str:
    return next((name for t, name in _JSON_TYPES if isinstance(v, t)), type(v).__name__)


def _check_str(v: str, name: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"'{name}' is not valid Unicode (it contains a lone surrogate)", name, "invalid_utf8") from None
    return v


# ---------------------------------------------------------------------------------------------------- fields
class _Fields:
    def __init__(self, body: dict, allowed):
        self.body = body
        for k in body:
            if k not in allowed:
                raise bad(f"Unrecognized request argument supplied: {k}", k, "unknown_parameter")

    def has(self, name) -> bool:
        return self.body.get(name) is not None

    def string(self, name, required=False, default=None) -> Optional[str]:
        v = self.body.get(name)
        if v is None:
            if required:
                raise bad(f"'{name}' is required", name, "missing_required_parameter")
            return default
        if not isinstance(v, str):
            raise bad(f"'{name}' must be a string, got {_tname(v)}", name, "invalid_type")
        return _check_str(v, name)

    def boolean(self, name, default=False) -> bool:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad(f"'{name}' must be a boolean, got {_tname(v)}", name, "invalid_type")
        return v

    def number(self, name, lo, hi, default, lo_open=False) -> float:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad(f"'{name}' must be a number, got {_tname(v)}", name, "invalid_type")
        v = float(v) if not isinstance(v, float) else v
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise bad(f"'{name}' must be in {rng}, got {v}", name, "invalid_value")
        return v

    def integer(self, name, lo, hi, default) -> Optional[int]:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and math.isfinite(v) and v == int(v):
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad(f"'{name}' must be an integer, got {_tname(v)}", name, "invalid_type")
        if v < lo or v > hi:
            raise bad(f"'{name}' must be in [{lo}, {hi}], got {v}", name, "invalid_value")
        return v

    def unsupported(self, name, ok) -> None:
        """A known OpenAI field this server does not implement: only its neutral value(s) are accepted."""
        v = self.body.get(name)
        if v is None:
            return
        try:
            fine = ok(v)
        except Exception:
            fine = False
        if not fine:
            raise bad(f"'{name}' is not supported by this server (got {json.dumps(v)[:80]})", name,
                      "unsupported_parameter")


COMMON = ("model", "temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "stop", "seed", "n",
          "stream", "stream_options", "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
          "ignore_eos")
CHAT_KEYS = set(COMMON) | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                           "parallel_tool_calls", "response_format", "functions", "function_call"}
COMPLETION_KEYS = set(COMMON) | {"prompt", "echo", "best_of", "suffix"}


def _common(f: _Fields, p: ParsedRequest) -> None:
    p.temperature = f.number("temperature", 0.0, 2.0, 1.0)
    p.top_p = f.number("top_p", 0.0, 1.0, 1.0)
    p.top_k = f.integer("top_k", 0, 1 << 30, 0)
    p.repetition_penalty = f.number("repetition_penalty", 0.0, 100.0, 1.0, lo_open=True)
    p.seed = f.integer("seed", -(1 << 63), (1 << 64) - 1, None)
    n = f.integer("n", 1, 1 << 30, 1)
    if n != 1:
        raise bad(f"'n' must be 1 (this server returns one choice per request), got {n}", "n", "unsupported_value")
    p.stream = f.boolean("stream")
    p.ignore_eos = f.boolean("ignore_eos")
    so = f.body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad(f"'stream_options' must be an object, got {_tname(so)}", "stream_options", "invalid_type")
        if not p.stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        for k in so:
            if k != "include_usage":
                raise bad(f"Unrecognized argument 'stream_options.{k}'", f"stream_options.{k}",
                          "unknown_parameter")
        v = so.get("include_usage")
        if v is not None and not isinstance(v, bool):
            raise bad(f"'stream_options.include_usage' must be a boolean, got {_tname(v)}",
                      "stream_options.include_usage", "invalid_type")
        p.include_usage = bool(v)
    stop = f.body.get("stop")
    if stop is None:
        p.stop = []
    elif isinstance(stop, str):
        p.stop = [_stop_str(stop, "stop")] if stop else []
    elif isinstance(stop, list):
        if len(stop) > MAX_STOP:
            raise bad(f"'stop' may hold at most {MAX_STOP} strings, got {len(stop)}", "stop")
        for j, s in enumerate(stop):
            if not isinstance(s, str):
                raise bad(f"'stop[{j}]' must be a string, got {_tname(s)}", f"stop[{j}]", "invalid_type")
            _stop_str(s, f"stop[{j}]")
        p.stop = [s for s in stop if s]
    else:
        raise bad(f"'stop' must be a string or an array of strings, got {_tname(stop)}", "stop", "invalid_type")
    p.user = f.string("user")
    f.unsupported("presence_penalty", lambda v: not isinstance(v, bool) and float(v) == 0)
    f.unsupported("frequency_penalty", lambda v: not isinstance(v, bool) and float(v) == 0)
    f.unsupported("logit_bias", lambda v: isinstance(v, dict) and not v)


def _stop_str(s: str, name: str) -> str:
    if len(s) > MAX_STOP_CHARS:
        raise bad(f"'{name}' is {len(s)} characters long; a stop string may have at most {MAX_STOP_CHARS}", name)
    return _check_str(s, name)


def _max_tokens(f: _Fields, *names) -> Optional[int]:
    out = None
    for name in names:
        v = f.integer(name, 1, MAX_TOKENS_LIMIT, None)
        if v is not None:
            out = v if out is None else min(out, v)
    return out


ROLES = {"system", "developer", "user", "assistant", "tool"}


def _messages(f: _Fields) -> List[dict]:
    msgs = f.body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise bad(f"'messages' must be an array, got {_tname(msgs)}", "messages", "invalid_type")
    if not msgs:
        raise bad("'messages' must contain at least one message", "messages", "empty_array")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object, got {_tname(m)}", where, "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"'{where}.role' is required and must be a string", f"{where}.role",
                      "missing_required_parameter" if role is None else "invalid_type")
        if role not in ROLES:
            raise bad(f"'{where}.role' must be one of system, developer, user, assistant, tool; got {role!r}"[:300],
                      f"{where}.role")
        if role == "tool":
            raise bad(f"'{where}': tool messages are not supported by this server (no tool calling)",
                      f"{where}.role", "unsupported_value")
        if m.get("tool_calls"):
            raise bad(f"'{where}.tool_calls' is not supported by this server", f"{where}.tool_calls",
                      "unsupported_parameter")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise bad(f"'{where}.content' is required for role {role}", f"{where}.content",
                          "missing_required_parameter")
            text = ""
        elif isinstance(content, str):
            text = _check_str(content, f"{where}.content")
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                pw = f"{where}.content[{j}]"
                if not isinstance(part, dict):
                    raise bad(f"'{pw}' must be an object, got {_tname(part)}", pw, "invalid_type")
                if part.get("type") == "image_url" and role == "user":
                    parts.append(_image_part(part, pw))
                    continue
                if part.get("type") != "text":
                    what = "'text' or (in user messages) 'image_url'" if role == "user" else "'text'"
                    raise bad(f"'{pw}.type' must be {what}, got {json.dumps(part.get('type'))[:40]}",
                              f"{pw}.type", "unsupported_value")
                t = part.get("text")
                if not isinstance(t, str):
                    raise bad(f"'{pw}.text' must be a string, got {_tname(t)}", f"{pw}.text", "invalid_type")
                parts.append(_check_str(t, f"{pw}.text"))
            if any(isinstance(x, ImagePart) for x in parts):   # images: keep the parts in order
                text = [{"type": "text", "text": x} if isinstance(x, str) else x for x in parts]
            else:
                text = "".join(parts)
        else:
            raise bad(f"'{where}.content' must be a string or an array of content parts, got {_tname(content)}",
                      f"{where}.content", "invalid_type")
        msg = {"role": "system" if role == "developer" else role, "content": text}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad(f"'{where}.name' must be a string, got {_tname(name)}", f"{where}.name", "invalid_type")
            msg["name"] = _check_str(name, f"{where}.name")
        out.append(msg)
    return out


@dataclass
class ImagePart:
    """An `image_url` content part whose `data:` URI was decoded (not yet opened: engine.py does that)."""
    data: bytes
    mime: str
    param: str                       # the field that named it, e.g. "messages[0].content[1].image_url.url"
    detail: Optional[str] = None


def _image_part(part: dict, pw: str) -> ImagePart:
    """An OpenAI `image_url` part with a base64 `data:` URI (PNG / JPEG / WebP). Remote URLs are refused: the
    server never fetches anything."""
    iu = part.get("image_url")
    where = f"{pw}.image_url"
    if isinstance(iu, str):
        url, detail = iu, None
    elif isinstance(iu, dict):
        url, detail = iu.get("url"), iu.get("detail")
        where += ".url"
        if detail is not None and detail not in ("auto", "low", "high"):
            raise bad(f"'{pw}.image_url.detail' must be 'auto', 'low' or 'high', got {json.dumps(detail)[:40]}",
                      f"{pw}.image_url.detail")
    else:
        raise bad(f"'{pw}.image_url' is required and must be an object {{\"url\": ...}}, got {_tname(iu)}", where,
                  "missing_required_parameter" if iu is None else "invalid_type")
    if not isinstance(url, str):
        raise bad(f"'{where}' must be a string, got {_tname(url)}", where, "invalid_type")
    head = url[:16].lower()
    if head.startswith(("http://", "https://")):
        raise bad(f"'{where}': remote image URLs are not fetched by this server; send the image inline as a "
                  f"base64 data URI (data:image/png;base64,...)", where, "unsupported_value")
    if not head.startswith("data:"):
        raise bad(f"'{where}' must be a base64 data URI (data:image/png|jpeg|webp;base64,...), got "
                  f"{json.dumps(url[:30])}...", where)
    meta, sep, payload = url[5:].partition(",")
    if not sep:
        raise bad(f"'{where}': malformed data URI (no ',' before the data)", where)
    bits = [b.strip().lower() for b in meta.split(";")]
    mime = bits[0]
    if mime == "image/jpg":
        mime = "image/jpeg"
    if mime not in IMAGE_MIME_TYPES:
        raise bad(f"'{where}': unsupported image type {json.dumps(bits[0][:40])}; expected one of "
                  f"{', '.join(IMAGE_MIME_TYPES)}", where, "unsupported_value")
    if "base64" not in bits[1:]:
        raise bad(f"'{where}': the data URI must be base64 encoded (';base64,')", where)
    import base64
    import binascii
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"'{where}': the data URI's base64 payload is not valid base64", where) from None
    if not data:
        raise bad(f"'{where}': the image is empty (no bytes)", where)
    return ImagePart(data, mime, where, detail)


def parse_chat(body: dict) -> ParsedRequest:
    f = _Fields(body, CHAT_KEYS)
    p = ParsedRequest("chat", f.string("model", required=True))
    p.messages = _messages(f)
    _common(f, p)
    p.max_tokens = _max_tokens(f, "max_tokens", "max_completion_tokens")
    f.unsupported("logprobs", lambda v: v is False)
    f.unsupported("top_logprobs", lambda v: False)
    f.unsupported("tools", lambda v: isinstance(v, list) and not v)
    f.unsupported("functions", lambda v: isinstance(v, list) and not v)
    f.unsupported("tool_choice", lambda v: v == "none")
    f.unsupported("function_call", lambda v: v == "none")
    f.unsupported("parallel_tool_calls", lambda v: isinstance(v, bool))
    f.unsupported("response_format", lambda v: isinstance(v, dict) and v.get("type") == "text" and len(v) == 1)
    return p


def parse_completion(body: dict) -> ParsedRequest:
    f = _Fields(body, COMPLETION_KEYS)
    p = ParsedRequest("completion", f.string("model", required=True))
    pr = body.get("prompt")
    if pr is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(pr, list) and len(pr) == 1 and isinstance(pr[0], (str, list)):
        pr = pr[0]                                   # a batch of one prompt
    if isinstance(pr, str):
        if not pr:
            raise bad("'prompt' must not be empty", "prompt", "empty_prompt")
        p.prompt = _check_str(pr, "prompt")
    elif isinstance(pr, list):
        if not pr:
            raise bad("'prompt' must not be empty", "prompt", "empty_prompt")
        if all(isinstance(x, int) and not isinstance(x, bool) for x in pr):
            p.prompt = list(pr)
        elif all(isinstance(x, (str, list)) for x in pr):
            raise bad(f"'prompt' holds {len(pr)} prompts; this server takes one prompt per request", "prompt",
                      "unsupported_value")
        else:
            raise bad("'prompt' must be a string, an array of token ids, or an array of one string / token-id "
                      "array", "prompt", "invalid_type")
    else:
        raise bad(f"'prompt' must be a string or an array of token ids, got {_tname(pr)}", "prompt", "invalid_type")
    _common(f, p)
    p.max_tokens = _max_tokens(f, "max_tokens")
    if p.max_tokens is None:
        p.max_tokens = 16                                # OpenAI's default for /v1/completions
    f.unsupported("echo", lambda v: v is False)
    f.unsupported("best_of", lambda v: not isinstance(v, bool) and v == 1)
    f.unsupported("suffix", lambda v: v == "")
    f.unsupported("logprobs", lambda v: not isinstance(v, bool) and v == 0)
    return p
