"""K3 XTML chat format (spec §6) and the image placeholder block (spec §5.5).

Layout, rendered in Python (no Jinja). Only ``<|open|>``, ``<|close|>``, ``<|sep|>`` and
``<|end_of_msg|>`` are emitted as special ids (plus the media specials of an image block); tag
names, attributes and every message text are ordinary BPE, encoded with special-token
recognition disabled, so a user typing ``<|open|>`` gets plain text tokens. No BOS is prepended.

    message  := <|open|>message role="R"[ name="N"]<|sep|> CONTENT <|close|>message<|sep|><|end_of_msg|>
    assistant CONTENT := [thinking mode: <|open|>think<|sep|> REASONING <|close|>think<|sep|>]
                         <|open|>response<|sep|> TEXT <|close|>response<|sep|>
                         [<|open|>tools<|sep|> CALL... <|close|>tools<|sep|>]
    CALL     := <|open|>call tool="NAME" index="i"<|sep|> ARG... <|close|>call<|sep|>     (i from 1)
    ARG      := <|open|>argument key="K" type="T"<|sep|> VALUE <|close|>argument<|sep|>
                (T in string/number/boolean/null/object/array; strings raw, others compact JSON)
              | <|open|>json type="object"<|sep|> RAW <|close|>json<|sep|>   (unparsable arguments)
    tool result := message with role="tool" tool="NAME" index="i" (i = position of its tool_call_id
                   in the preceding assistant's tool_calls; results are re-sorted into that order)
    preamble := [system type="tool-declare": compact key-sorted JSON of tools]
                [thinking mode: system type="thinking-effort"]
    trailer  := [system type="tool-choice"] [system type="response-format"]   (after the conversation)
    generation prompt := <|open|>message role="assistant"<|sep|><|open|>think<|sep|>   (thinking)
                       | <|open|>message role="assistant"<|sep|><|open|>response<|sep|> (non-thinking)

Attribute values escape ``&`` -> ``&amp;`` and ``"`` -> ``&quot;`` and are written `` key="value"``.

Token parity: the bodies of the generated system messages (tool-declare, thinking-effort, tool-choice,
response-format) are those of the released ``encoding_k3.py`` as two independent public re-implementations of it
reproduce them (a Python and a Rust renderer that agree string for string, read 2026-11-30); the released file
itself is not available here, so they are unverified against it. The named-function tool_choice body is ours (the
re-implementations reject a named tool_choice). The tool-choice/response-format messages come after the
conversation, before the generation prompt, as in those renderers.
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from k3.errors import RequestError, TokenizerError
from k3.tokenizer.base import (CLOSE, END_OF_MSG, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, OPEN,
                               SEP)


class ChatFormatError(TokenizerError, RequestError):
    """A conversation that cannot be rendered in the K3 chat format (bad role, missing field ...)."""


# ------------------------------------------------------------------------------------------------
# The one table of generated system-message bodies (see the module docstring for where they come from).
THINKING_EFFORTS = ("low", "medium", "high", "max")
_EFFORT_BODY = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                "Now the system is invoked with `thinking_effort={effort}`.")
_RAW_JSON = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
             "formatting.")
CHAT_BODY_STRINGS: Dict[str, Any] = {
    # str.format fields: {tools_json} = compact (separators=(",", ":")), key-sorted JSON of `tools`
    "tool_declare": "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools_json}\n```",
    "thinking_effort": {e: _EFFORT_BODY.format(effort=e) for e in THINKING_EFFORTS},
    "tool_choice": {
        "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
        "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        # ours (no reference body): a named tool
        "function": "The system is invoked with `tool_choice={name}`.\nYou MUST call the tool `{name}` in the "
                    "next message.",
    },
    "response_format": {
        "json_object": "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON,
        # {schema_json}: compact, key-sorted JSON of the schema (json_schema["schema"] when present)
        "json_schema": "The system is invoked with `response_format=json_schema`.\n" + _RAW_JSON
                       + "\nThe JSON data must match the following schema:\n```json\n{schema_json}\n```",
    },
}

ROLES = ("system", "user", "assistant", "tool")
IMAGE_PART_TYPES = ("image", "image_url", "input_image")
STRUCTURAL = (OPEN, CLOSE, SEP, END_OF_MSG)

Segment = Tuple[str, str]  # ("special", name) | ("text", text)


def escape_attr(value: Any) -> str:
    """Attribute value escaping: ``&`` -> ``&amp;`` then ``"`` -> ``&quot;``."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _compact_json(obj: Any, sort_keys: bool = False) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys)


# ------------------------------------------------------------------------------------------------
# Segment builder

class _Segs:
    def __init__(self) -> None:
        self.segs: List[Segment] = []
        self.train: List[bool] = []  # per segment: part of an assistant turn's output
        self.training = False

    def sp(self, name: str) -> None:
        self.segs.append(("special", name))
        self.train.append(self.training)

    def text(self, s: str) -> None:
        if not s:
            return
        if self.segs and self.segs[-1][0] == "text" and self.train[-1] == self.training:
            self.segs[-1] = ("text", self.segs[-1][1] + s)  # adjacent text is encoded as one string
        else:
            self.segs.append(("text", s))
            self.train.append(self.training)

    def open(self, tag: str, attrs: Sequence[Tuple[str, Any]] = ()) -> None:
        self.sp(OPEN)
        self.text(tag + "".join(f' {k}="{escape_attr(v)}"' for k, v in attrs))
        self.sp(SEP)

    def close(self, tag: str) -> None:
        self.sp(CLOSE)
        self.text(tag)
        self.sp(SEP)


def image_placeholder_text(width: int, height: int) -> str:
    """Text form of the per-image block (spec §5.5)."""
    w, h = int(width), int(height)
    if w <= 0 or h <= 0:
        raise ChatFormatError(f"image size must be positive, got {width}x{height}")
    return f"{MEDIA_BEGIN}image {w}x{h}{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"


def _image_segs(b: _Segs, width: Any, height: Any) -> None:
    try:
        w, h = int(width), int(height)
    except (TypeError, ValueError):
        raise ChatFormatError(f"image part needs integer width and height (original pixel size), got "
                              f"{width!r}x{height!r}") from None
    if w <= 0 or h <= 0:
        raise ChatFormatError(f"image size must be positive, got {w}x{h}")
    b.sp(MEDIA_BEGIN)
    b.text(f"image {w}x{h}")
    b.sp(MEDIA_CONTENT)
    b.sp(MEDIA_PAD)
    b.sp(MEDIA_END)


def image_placeholder_tokens(width: int, height: int, tokenizer) -> List[int]:
    """Ids of ``<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>``; the single
    ``<|media_pad|>`` is later expanded to the image's N_img feature positions."""
    b = _Segs()
    _image_segs(b, width, height)
    return segments_to_ids(b.segs, tokenizer)


def _content_segs(b: _Segs, content: Any, where: str, allow_images: bool) -> None:
    """Message content: str, None, or a list of OpenAI-style parts ({"type": "text", "text"} and
    image parts {"type": "image"|"image_url"|"input_image", "width", "height", ...})."""
    if content is None:
        return
    if isinstance(content, str):
        b.text(content)
        return
    if not isinstance(content, (list, tuple)):
        raise ChatFormatError(f"{where}: content must be a string, null or a list of parts, "
                              f"got {type(content).__name__}")
    for j, part in enumerate(content):
        if isinstance(part, str):
            b.text(part)
            continue
        if not isinstance(part, dict):
            raise ChatFormatError(f"{where}.content[{j}]: part must be an object")
        ptype = part.get("type", "text")
        if ptype == "text":
            t = part.get("text")
            if not isinstance(t, str):
                raise ChatFormatError(f"{where}.content[{j}]: text part needs a string 'text'")
            b.text(t)
        elif ptype in IMAGE_PART_TYPES:
            if not allow_images:
                raise ChatFormatError(f"{where}.content[{j}]: images are not allowed in this message")
            inner = part.get(ptype) if isinstance(part.get(ptype), dict) else {}
            w = part.get("width", inner.get("width"))
            h = part.get("height", inner.get("height"))
            _image_segs(b, w, h)
        else:
            raise ChatFormatError(f"{where}.content[{j}]: unsupported part type {ptype!r}")


def _argument_type(v: Any) -> str:
    if isinstance(v, str):
        return "string"
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, dict):
        return "object"
    if isinstance(v, list):
        return "array"
    raise ChatFormatError(f"argument value of type {type(v).__name__} is not JSON")


def _tool_call_segs(b: _Segs, calls: Sequence[Any], where: str) -> None:
    b.open("tools")
    for i, call in enumerate(calls, start=1):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatFormatError(f"{where}.tool_calls[{i - 1}]: needs function.name")
        b.open("call", [("tool", fn["name"]), ("index", i)])
        args = fn.get("arguments", "")
        parsed: Any
        if isinstance(args, dict):
            parsed = args
        elif args is None or (isinstance(args, str) and not args.strip()):
            parsed = {}
        elif isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
        else:
            raise ChatFormatError(f"{where}.tool_calls[{i - 1}]: arguments must be a JSON string or object")
        if isinstance(parsed, dict):
            for k, v in parsed.items():
                t = _argument_type(v)
                b.open("argument", [("key", k), ("type", t)])
                b.text(v if t == "string" else _compact_json(v))
                b.close("argument")
        else:  # unparsable (or non-object) argument string: carried raw
            b.open("json", [("type", "object")])
            b.text(args)
            b.close("json")
        b.close("call")
    b.close("tools")


def _system_msg(b: _Segs, mtype: str, body: str) -> None:
    b.open("message", [("role", "system"), ("type", mtype)])
    b.text(body)
    b.close("message")
    b.sp(END_OF_MSG)


def _tool_choice_body(tool_choice: Any) -> Optional[str]:
    table = CHAT_BODY_STRINGS["tool_choice"]
    if tool_choice is None or tool_choice == "auto":
        return None  # the default behaviour: no message
    if tool_choice in ("none", "required"):
        return table[tool_choice]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if isinstance(name, str) and name:
            return table["function"].format(name=name)
    raise ChatFormatError(f"tool_choice must be 'auto', 'none', 'required' or "
                          f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")


def _response_format_body(fmt: Any) -> Optional[str]:
    table = CHAT_BODY_STRINGS["response_format"]
    if fmt is None:
        return None
    ftype = fmt.get("type") if isinstance(fmt, dict) else fmt
    if ftype == "text":
        return None
    if ftype == "json_object":
        return table["json_object"]
    if ftype == "json_schema" and isinstance(fmt, dict):
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise ChatFormatError("response_format json_schema needs a 'json_schema' object")
        schema = js.get("schema", js)
        return table["json_schema"].format(schema_json=_compact_json(schema, sort_keys=True))
    raise ChatFormatError(f"response_format type must be text, json_object or json_schema, got {ftype!r}")


def build_segments(messages: Sequence[Dict[str, Any]], tools: Optional[Sequence[Any]] = None,
                   thinking: bool = True, thinking_effort: str = "max", add_generation_prompt: bool = True,
                   tool_choice: Any = None, response_format: Any = None) -> _Segs:
    if not isinstance(messages, (list, tuple)):
        raise ChatFormatError("messages must be a list of message objects")
    b = _Segs()
    # ---- preamble
    if tools:
        if not isinstance(tools, (list, tuple)):
            raise ChatFormatError("tools must be a list")
        tools_json = _compact_json(list(tools), sort_keys=True)
        _system_msg(b, "tool-declare", CHAT_BODY_STRINGS["tool_declare"].format(tools_json=tools_json))
    if thinking:
        if thinking_effort not in THINKING_EFFORTS:
            raise ChatFormatError(f"thinking_effort must be one of {THINKING_EFFORTS}, got {thinking_effort!r}")
        _system_msg(b, "thinking-effort", CHAT_BODY_STRINGS["thinking_effort"][thinking_effort])
    # ---- conversation
    last_calls: Dict[Any, Tuple[int, str]] = {}  # tool_call_id -> (index from 1, tool name); key 0 -> names
    i, n = 0, len(messages)
    while i < n:
        m = messages[i]
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatFormatError(f"{where}: must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"{where}: unknown role {role!r} (expected one of {ROLES})")
        if role == "tool":
            j = i
            while j < n and isinstance(messages[j], dict) and messages[j].get("role") == "tool":
                j += 1
            _tool_results(b, messages, i, j, last_calls)
            i = j
            continue
        attrs: List[Tuple[str, Any]] = [("role", role)]
        if m.get("name") is not None:
            attrs.append(("name", m["name"]))
        if role == "assistant":
            b.open("message", attrs)
            b.training = True
            if thinking:
                b.open("think")
                rc = m.get("reasoning_content")
                if rc is not None and not isinstance(rc, str):
                    raise ChatFormatError(f"{where}: reasoning_content must be a string")
                b.text(rc or "")
                b.close("think")
            b.open("response")
            _content_segs(b, m.get("content"), where, allow_images=False)
            b.close("response")
            calls = m.get("tool_calls") or []
            last_calls = {}
            if calls:
                _tool_call_segs(b, calls, where)
                for k, c in enumerate(calls, start=1):
                    cid = c.get("id")
                    if cid is not None:
                        last_calls[str(cid)] = (k, c["function"]["name"])
                last_calls[0] = tuple(c["function"]["name"] for c in calls)
            b.close("message")
            b.sp(END_OF_MSG)
            b.training = False
        else:
            b.open("message", attrs)
            _content_segs(b, m.get("content"), where, allow_images=True)
            b.close("message")
            b.sp(END_OF_MSG)
        i += 1
    # ---- trailing system messages
    body = _tool_choice_body(tool_choice)
    if body is not None:
        _system_msg(b, "tool-choice", body)
    body = _response_format_body(response_format)
    if body is not None:
        _system_msg(b, "response-format", body)
    # ---- generation prompt
    if add_generation_prompt:
        b.open("message", [("role", "assistant")])
        b.open("think" if thinking else "response")
    return b


def _tool_results(b: _Segs, messages, start: int, stop: int, calls: Dict[Any, Any]) -> None:
    """Render tool messages[start:stop], re-sorted into the order of the preceding assistant's calls."""
    names = calls.get(0, ())
    ids = sorted(k for k in calls if isinstance(k, str))
    items = []
    for k in range(start, stop):
        m = messages[k]
        where = f"messages[{k}]"
        cid = m.get("tool_call_id")
        if cid is not None and str(cid) in calls:
            idx, name = calls[str(cid)]
            name = m.get("name") or name
        elif cid is not None and ids:
            raise ChatFormatError(f"{where}: tool_call_id {cid!r} matches no call of the preceding assistant "
                                  f"message (ids: {ids})")
        else:  # no id (or the calls had none): position within the run of tool messages
            idx = k - start + 1
            name = m.get("name") or (names[idx - 1] if idx <= len(names) else None)
            if not name:
                raise ChatFormatError(f"{where}: tool message needs a tool_call_id of the preceding assistant's "
                                      f"tool_calls or a 'name'")
        items.append((idx, k, name, m, where))
    items.sort(key=lambda t: (t[0], t[1]))
    for idx, _, name, m, where in items:
        b.open("message", [("role", "tool"), ("tool", name), ("index", idx)])
        _content_segs(b, m.get("content"), where, allow_images=True)
        b.close("message")
        b.sp(END_OF_MSG)


def segments_to_ids(segs: Sequence[Segment], tokenizer) -> List[int]:
    out: List[int] = []
    for kind, s in segs:
        if kind == "special":
            out.append(tokenizer.token_to_id(s))
        else:
            out.extend(tokenizer.encode(s, allow_special=False))
    return out


def segments_to_text(segs: Sequence[Segment]) -> str:
    return "".join(s for _, s in segs)


def render_messages(messages, tools=None, thinking: bool = True, thinking_effort: str = "max",
                    add_generation_prompt: bool = True, tool_choice=None, response_format=None, *,
                    tokenizer) -> List[int]:
    """Render an OpenAI-style conversation to K3 token ids (see module docstring).

    messages: [{"role": system|user|assistant|tool, "content": str | None | [parts], "name"?,
    "reasoning_content"? (assistant thinking), "tool_calls"? [{"id", "function": {"name",
    "arguments": JSON str}}], "tool_call_id"? (tool)}]. Images in content parts need
    "width"/"height" (original pixels) and render as the §5.5 block.
    """
    b = build_segments(messages, tools, thinking, thinking_effort, add_generation_prompt, tool_choice,
                       response_format)
    return segments_to_ids(b.segs, tokenizer)


def render_messages_text(messages, tools=None, thinking: bool = True, thinking_effort: str = "max",
                         add_generation_prompt: bool = True, tool_choice=None, response_format=None) -> str:
    """The same rendering as a string with special-token names inline (for debugging/tests;
    re-encoding it with allow_special=True is NOT equivalent for text containing special names)."""
    b = build_segments(messages, tools, thinking, thinking_effort, add_generation_prompt, tool_choice,
                       response_format)
    return segments_to_text(b.segs)


def render_messages_with_mask(messages, tools=None, thinking: bool = True, thinking_effort: str = "max",
                              add_generation_prompt: bool = False, tool_choice=None, response_format=None, *,
                              tokenizer) -> Tuple[List[int], List[bool]]:
    """(ids, mask) for SFT: mask is True on assistant-turn output tokens (everything after each
    ``<|open|>message role="assistant"<|sep|>`` header up to and including its ``<|end_of_msg|>``)."""
    b = build_segments(messages, tools, thinking, thinking_effort, add_generation_prompt, tool_choice,
                       response_format)
    ids: List[int] = []
    mask: List[bool] = []
    for (kind, s), t in zip(b.segs, b.train):
        part = [tokenizer.token_to_id(s)] if kind == "special" else tokenizer.encode(s, allow_special=False)
        ids.extend(part)
        mask.extend([t] * len(part))
    return ids, mask


# ------------------------------------------------------------------------------------------------
# Parsing a generated assistant turn

_HEADER_RE = re.compile(r'\s*([A-Za-z_][\w\-]*)((?:\s+[\w\-]+="[^"]*")*)\s*\Z')
_ATTR_RE = re.compile(r'([\w\-]+)="([^"]*)"')
_STRUCT_TEXT_RE = re.compile("|".join(re.escape(s) for s in sorted(STRUCTURAL, key=len, reverse=True)))


def _segments_from_text(text: str) -> List[Segment]:
    segs: List[Segment] = []
    pos = 0
    for m in _STRUCT_TEXT_RE.finditer(text):
        if m.start() > pos:
            segs.append(("text", text[pos:m.start()]))
        segs.append(("special", m.group()))
        pos = m.end()
    if pos < len(text):
        segs.append(("text", text[pos:]))
    return segs


def _segments_from_ids(ids: Iterable[int], tokenizer) -> List[Segment]:
    struct = {tokenizer.token_to_id(s): s for s in STRUCTURAL}
    segs: List[Segment] = []
    run: List[int] = []
    for i in ids:
        i = int(i)
        s = struct.get(i)
        if s is None:
            run.append(i)
            continue
        if run:
            segs.append(("text", tokenizer.decode(run)))
            run = []
        segs.append(("special", s))
    if run:
        segs.append(("text", tokenizer.decode(run)))
    return segs


def _parse_header(text: str) -> Tuple[str, Dict[str, str]]:
    m = _HEADER_RE.match(text)
    if not m:
        return text.strip(), {}
    return m.group(1), {k: unescape_attr(v) for k, v in _ATTR_RE.findall(m.group(2))}


def _decode_argument(raw: str, typ: str) -> Any:
    if typ == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # partial or malformed value: keep the text


def assistant_turn_problem(ids: Sequence[int], tokenizer, thinking: bool = True) -> Optional[str]:
    """Why a generated assistant turn (token ids after the generation prompt, ending at <|end_of_msg|>) is not a
    well-formed message, or None when it is. The prompt left `message` and `think` (thinking) or `response` open;
    every block must close with its own name (`<|close|>NAME<|sep|>`) in order, no text may stand outside a block
    but whitespace, and <|end_of_msg|> must come right after the message closed. `parse_assistant` is lenient
    (it parses unterminated output as far as it goes); rewards must not be (an answer followed by a tools block
    that never closes is not an answer)."""
    segs = _segments_from_ids(ids, tokenizer)
    stack = ["message", "think" if thinking else "response"]
    k, n = 0, len(segs)
    while k < n:
        kind, val = segs[k]
        if kind == "text":
            if len(stack) <= 1 and val.strip():
                return f"text outside a block: {val.strip()[:40]!r}"
            k += 1
            continue
        if val in (OPEN, CLOSE):
            head = segs[k + 1][1] if k + 1 < n and segs[k + 1][0] == "text" else ""
            if not (k + 2 < n and segs[k + 2] == ("special", SEP)):
                return f"{val} without its <|sep|>"
            name = head.strip().split(" ", 1)[0] if head.strip() else ""
            if val == OPEN:
                if not stack:
                    return f"a {name!r} block after the message closed"
                stack.append(name)
            else:
                if not stack or stack[-1] != name:
                    return f"<|close|>{name} while {stack[-1] if stack else 'nothing'!r} is open"
                stack.pop()
            k += 3
            continue
        if val == END_OF_MSG:
            if stack:
                return f"<|end_of_msg|> with {stack[-1]!r} still open"
            return None if k == n - 1 else "tokens after <|end_of_msg|>"
        return f"a stray {val}"
    return f"the turn ended with {stack[-1]!r} still open" if stack else "no <|end_of_msg|>"


def parse_assistant(output: Union[str, Sequence[int]], tokenizer=None, thinking: bool = True) -> Dict[str, Any]:
    """Parse a generated assistant turn back into {"reasoning_content", "content", "tool_calls"}.

    ``output`` is token ids (needs ``tokenizer``) or the text form. It may be a whole rendered
    assistant message (starting ``<|open|>message ...``) or the model's continuation after the
    generation prompt, in which case ``thinking`` says which block the prompt left open (think or
    response). Partial/unterminated output is parsed as far as it goes. reasoning_content is None
    when no think block was seen; tool_calls are [{"id": "call_<i>", "type": "function",
    "function": {"name", "arguments": JSON str}}].
    """
    if isinstance(output, str):
        segs = _segments_from_text(output)
    else:
        if tokenizer is None:
            raise ChatFormatError("parse_assistant needs a tokenizer to parse token ids")
        segs = _segments_from_ids(output, tokenizer)
    # skip leading whitespace-only text, then decide whether we start inside the prompt's open block
    k = 0
    while k < len(segs) and segs[k][0] == "text" and not segs[k][1].strip():
        k += 1
    segs = segs[k:]
    if not segs or segs[0] != ("special", OPEN):
        segs = [("special", OPEN), ("text", "think" if thinking else "response"), ("special", SEP)] + segs

    reasoning: Optional[str] = None
    content_parts: List[str] = []
    calls: List[Dict[str, Any]] = []
    stack: List[str] = []
    cur_call: Optional[Dict[str, Any]] = None
    cur_arg: Optional[Dict[str, Any]] = None  # {"key", "type", "buf"} or {"json": True, "buf"}

    def finish_arg() -> None:
        nonlocal cur_arg
        if cur_arg is None or cur_call is None:
            cur_arg = None
            return
        raw = "".join(cur_arg["buf"])
        if cur_arg.get("json"):
            cur_call["raw"] = raw
        else:
            cur_call["args"][cur_arg["key"]] = _decode_argument(raw, cur_arg["type"])
        cur_arg = None

    def finish_call() -> None:
        nonlocal cur_call
        finish_arg()
        if cur_call is not None:
            if cur_call["raw"] is not None and not cur_call["args"]:
                arguments = cur_call["raw"]
            else:
                arguments = json.dumps(cur_call["args"], ensure_ascii=False)
            calls.append({"id": f"call_{cur_call['index']}", "type": "function",
                          "function": {"name": cur_call["name"], "arguments": arguments}})
        cur_call = None

    i, n = 0, len(segs)
    while i < n:
        kind, s = segs[i]
        if kind == "special" and s in (OPEN, CLOSE):
            # a tag: OPEN/CLOSE, header text, SEP. Unterminated tag at the end: stop.
            header = segs[i + 1][1] if i + 1 < n and segs[i + 1][0] == "text" else ""
            j = i + 2 if header else i + 1
            if j >= n or segs[j] != ("special", SEP):
                if j >= n:
                    break
                i = j  # malformed tag: drop it and continue
                continue
            i = j + 1
            name, attrs = _parse_header(header)
            if s == OPEN:
                stack.append(name)
                if name == "think":
                    reasoning = reasoning or ""
                elif name == "call":
                    finish_call()
                    try:
                        idx = int(attrs.get("index", len(calls) + 1))
                    except ValueError:
                        idx = len(calls) + 1
                    cur_call = {"name": attrs.get("tool", ""), "index": idx, "args": {}, "raw": None}
                elif name == "argument":
                    finish_arg()
                    cur_arg = {"key": attrs.get("key", ""), "type": attrs.get("type", "string"), "buf": []}
                elif name == "json":
                    finish_arg()
                    cur_arg = {"json": True, "buf": []}
            else:
                if name in stack:
                    while stack and stack[-1] != name:
                        stack.pop()
                    stack.pop()
                if name in ("argument", "json"):
                    finish_arg()
                elif name == "call":
                    finish_call()
                elif name == "message":
                    break
            continue
        if kind == "special":
            if s == END_OF_MSG:
                break
            i += 1  # stray <|sep|>
            continue
        # text
        top = stack[-1] if stack else None
        if top == "think":
            reasoning = (reasoning or "") + s
        elif top == "response":
            content_parts.append(s)
        elif top in ("argument", "json") and cur_arg is not None:
            cur_arg["buf"].append(s)
        elif top is None or (top == "message" and s.strip()):
            content_parts.append(s)  # text outside any block: treat as response text
        i += 1
    finish_call()
    return {"reasoning_content": reasoning, "content": "".join(content_parts), "tool_calls": calls}


# ------------------------------------------------------------------------------------------------

class K3ChatFormat:
    """Binds the chat functions to one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        for s in STRUCTURAL:
            tokenizer.token_to_id(s)  # raises TokenizerError if the vocabulary lacks it

    @property
    def stop_id(self) -> int:
        return self.tokenizer.token_to_id(END_OF_MSG)

    def render(self, messages, **kw) -> List[int]:
        return render_messages(messages, tokenizer=self.tokenizer, **kw)

    def render_text(self, messages, **kw) -> str:
        return render_messages_text(messages, **kw)

    def render_with_mask(self, messages, **kw) -> Tuple[List[int], List[bool]]:
        return render_messages_with_mask(messages, tokenizer=self.tokenizer, **kw)

    def parse(self, output, thinking: bool = True) -> Dict[str, Any]:
        return parse_assistant(output, tokenizer=self.tokenizer, thinking=thinking)

    def image_placeholder_tokens(self, width: int, height: int) -> List[int]:
        return image_placeholder_tokens(width, height, self.tokenizer)
