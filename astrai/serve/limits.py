"""Input limits applied before a request costs anything: body size, JSON nesting,
surrogates, prompt size.

The body limit is an ASGI middleware, so an oversized body is refused while it streams in
(by its Content-Length, or by counting the chunks of a chunked one) and is never held in
memory whole, parsed, or tokenized. The same middleware refuses a JSON body nested deeper
than `MAX_JSON_DEPTH` levels, on every route, before it is parsed: the request's walkers
(chat templates, the content shield, schema compilers) recurse, and nesting near Python's
recursion limit would end in a `RecursionError`. The string checks run on the parsed
request before the prompt is rendered: a lone surrogate cannot be tokenized or encoded
into a response, and the character limit bounds the tokenizer's work per request.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import numpy as np
from pydantic import BaseModel

from astrai.serve.errors import APIError, error_body

logger = logging.getLogger("astrai.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# How much of an oversized body is read (and thrown away) before answering, so that a
# client that sends its whole body before reading gets the 413 instead of a reset.
DRAIN_LIMIT = 256 * 1024 * 1024

# The deepest nesting of arrays and objects a JSON body may have, the body itself being
# level 1 (the default of Ruby's JSON; a JSON schema of 40 nested objects is ~85 levels
# deep inside a request). Far below the ~1000 where Python's recursion gives out.
MAX_JSON_DEPTH = 100


def too_large(limit: int) -> APIError:
    """The 413 for a body over `limit` bytes (shaped per protocol by `error_body`)."""
    return APIError(
        413,
        f"request body is too large: the limit is {limit} bytes",
        kind="too_large",
        code="request_too_large",
    )


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with a 413 in the protocol's error shape.

    The body is buffered up to the limit and replayed to the app, so the app never sees a
    partial body; the replayed `receive` still reports a later client disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _drain(receive, 0)
            await self._refuse(scope, send, too_large(self.max_bytes))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                first: Message | None = message
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive, size)
                await self._refuse(scope, send, too_large(self.max_bytes))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                too_deep = json_too_deep(first["body"], self.max_depth)
                if too_deep is not None:
                    await self._refuse(scope, send, too_deep)
                    return
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                assert first is not None
                return first
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, err: APIError) -> None:
        logger.warning("%s %s -> %d: %s", scope["method"], scope["path"], err.status, err)
        body = json.dumps(error_body(scope["path"], err)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Receive, seen: int) -> None:
    """Read and discard the rest of a refused body (bounded by `DRAIN_LIMIT`)."""
    while seen <= DRAIN_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


# --------------------------------------------------------------------------- JSON depth
# A JSON string (possessive: linear time, also on a string the body never closes).
_STRING = rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)'
_STRINGS = re.compile(_STRING, re.S)
# A string (group 1, then group 2 if it is an object key), a bracket or a comma.
_TOKENS = re.compile(rb"(" + _STRING + rb")\s*(:)?|[\[\]{},]", re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", bytes([1, 1, 255, 255]))  # int8: +1 in, -1 out


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> APIError | None:
    """The 400 for a JSON text nested deeper than `limit` levels, naming the top-level
    field it is in and the path down to the limit (None: within it, or not JSON).

    Measured on the raw bytes, without parsing: strings are cut out, the brackets left
    are counted in vectorized steps; only a refused body is walked again for the path."""
    if body.lstrip()[:1] not in (b"{", b"["):
        return None
    brackets = _STRINGS.sub(b"", body).translate(None, _NOT_BRACKETS)
    if len(brackets) <= limit:
        return None
    steps = np.frombuffer(brackets.translate(_STEPS), dtype=np.int8)
    if int(np.cumsum(steps, dtype=np.int64).max()) <= limit:
        return None
    path = _path_beyond(body, limit)
    field = path[0] if path else "body"
    shown = ".".join(path[:8]) + (". ..." if len(path) > 8 else "") or "the body"
    return APIError(
        400,
        f"{field}: nested deeper than the limit of {limit} JSON levels (at {shown})",
        param=field,
        code="json_too_deep",
    )


def _path_beyond(body: bytes, limit: int) -> list[str]:
    """Keys and indices down to the first array or object at level `limit + 1`."""
    stack: list[list[Any]] = []  # per open container: [is_array, key or index]
    for m in _TOKENS.finditer(body):
        token = m.group(0)[:1]
        if m.group(2):  # an object key
            if stack:
                stack[-1][1] = _key(m.group(1))
        elif token in (b"[", b"{"):
            stack.append([token == b"[", 0 if token == b"[" else None])
            if len(stack) > limit:
                return [str(k) for _, k in stack[:-1] if k is not None]
        elif token in (b"]", b"}"):
            if stack:
                stack.pop()
        elif token == b"," and stack and stack[-1][0]:
            stack[-1][1] += 1
    return []


def _key(raw: bytes) -> str:
    try:
        return str(json.loads(raw))
    except ValueError:
        return raw.decode("utf-8", "replace").strip('"')


# --------------------------------------------------------------------------- strings


def _walk(value: Any, path: str, keys: bool = True) -> Iterator[tuple[str, str]]:
    """(dotted path, string) for every string in `value`, in document order; dict keys too
    when `keys`. Iterative: any nesting depth is walked without recursion."""
    todo: list[tuple[str, Any, bool]] = [(path, value, False)]  # (path, value, is a key)
    while todo:
        at, item, is_key = todo.pop()
        if isinstance(item, str):
            yield at, item
        elif is_key:
            continue
        elif isinstance(item, dict):
            nested = []
            for k, v in item.items():
                sub = f"{at}.{k}" if at else str(k)
                if keys and isinstance(k, str):
                    nested.append((sub, k, True))
                nested.append((sub, v, False))
            todo.extend(reversed(nested))
        elif isinstance(item, (list, tuple)):
            subs = [(f"{at}.{i}" if at else str(i), v, False) for i, v in enumerate(item)]
            todo.extend(reversed(subs))


def _dump(body: Any) -> Any:
    return body.model_dump(exclude_unset=True) if isinstance(body, BaseModel) else body


def check_unicode(body: Any) -> None:
    """400 naming the first field that holds a lone surrogate (not valid Unicode text)."""
    for path, text in _walk(_dump(body), ""):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            path = path.encode("utf-8", "replace").decode()  # a key may be the culprit
            raise APIError(
                400, f"{path}: the string is not valid Unicode (lone surrogate)", param=path
            ) from None


def check_prompt_chars(body: Any, fields: tuple[str, ...], limit: int | None) -> None:
    """400 when the prompt's text (the strings under `fields`) exceeds `limit` characters;
    names the largest field. Checked before any tokenizing."""
    if limit is None:
        return
    data = _dump(body)
    sizes = {
        f: sum(len(s) for _, s in _walk(data.get(f), f, keys=False)) for f in fields if f in data
    }
    total = sum(sizes.values())
    if total > limit:
        field = max(sizes, key=lambda f: sizes[f])
        raise APIError(
            400,
            f"{field}: the prompt is too long: {total} characters, the limit is {limit}",
            param=field,
            code="context_length_exceeded",
        )
