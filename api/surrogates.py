"""Refuse JSON bodies that hold a lone UTF-16 surrogate, before the app reads them.

JSON may spell one (``"\\ud800"``), and Python's ``json`` decodes it, and raw surrogate bytes, into
a ``str`` that cannot be encoded as UTF-8: the database driver, or the answer that echoes the
value, then fails deep inside a route. Checking the body once here covers every field of every
route; query strings, paths, form fields and headers are decoded with replacement characters by
Starlette, so no surrogate arrives through them.
"""

from __future__ import annotations

import json
from email.message import Message as MimeMessage
from typing import Any

import anyio.to_thread
import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from offpeak.endpoints import anthropic_messages
from offpeak.wire import error_object

#: Bodies above this size are parsed on a worker thread rather than on the event loop.
PARSE_ON_LOOP_BYTES = 64 * 1024
#: ``lone_surrogate_path``'s answer for a body nested deeper than the parser's recursion limit.
TOO_DEEP = "\x00too-deep"

#: A lone surrogate can only come from a ``\u`` escape or from the UTF-8-style bytes of one
#: (``ED A0..BF xx``, which ``json.loads`` accepts from bytes): without either, skip the parse.
_MARKERS = (b"\\u", b"\xed")


class LoneSurrogateMiddleware:
    """400 in OpenAI's error shape (``param``: the path of the offending string) for a JSON body
    that holds a lone surrogate. Bodies FastAPI does not read as JSON pass untouched and
    unbuffered (file uploads); JSON bodies are small (``api.body_limits.JSON_BODY_LIMIT``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _read_as_json(scope):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        if len(body) > PARSE_ON_LOOP_BYTES:
            # A large body's parse would stall every other request of the process meanwhile.
            param = await anyio.to_thread.run_sync(lone_surrogate_path, body)
        else:
            param = lone_surrogate_path(body)
        if param is TOO_DEEP:
            await _refuse(send, _too_deep_message(), scope["path"], param=None)
            return
        if param is not None:
            await _refuse(send, _surrogate_message(param), scope["path"], param=_shown(param))
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _read_as_json(scope: Scope) -> bool:
    """Whether FastAPI parses this request's body as JSON: no ``Content-Type`` at all, or
    ``application/json`` / ``application/*+json`` (``fastapi.routing``'s rule)."""
    if scope["method"] in ("GET", "HEAD", "OPTIONS"):
        return False
    raw = dict(scope["headers"]).get(b"content-type")
    if not raw:
        return True
    mime = MimeMessage()
    mime["content-type"] = raw.decode("latin-1")
    subtype = mime.get_content_subtype()
    return mime.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def lone_surrogate_path(body: bytes) -> str | None:
    """The dotted path (``"metadata.team"``, ``"items.0"``; ``""`` for the body itself) of the
    first string or key in the JSON ``body`` that holds a lone surrogate; ``None`` when there
    is none or the body is not JSON (the app reports that); ``TOO_DEEP`` when the body nests
    deeper than the parser's recursion limit (which would raise in the app too)."""
    if not any(marker in body for marker in _MARKERS):
        return None
    try:
        document = json.loads(body)  # as Starlette's Request.json() reads it
        return _find(document, [])
    except ValueError:
        return None
    except RecursionError:
        return TOO_DEEP


def _find(value: Any, path: list[str]) -> str | None:
    if isinstance(value, str):
        return None if _encodable(value) else ".".join(path)
    if isinstance(value, dict):
        for key, item in value.items():
            if not _encodable(key):
                return ".".join([*path, key])
            found = _find(item, [*path, key])
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _find(item, [*path, str(index)])
            if found is not None:
                return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _shown(param: str) -> str | None:
    # The path may itself hold the surrogate (a key): spell it with escapes.
    return param.encode("utf-8", "backslashreplace").decode() or None


def _surrogate_message(param: str) -> str:
    shown = _shown(param)
    return (
        f"Invalid value for '{shown}': " if shown else "Invalid request body: "
    ) + "the string holds a lone UTF-16 surrogate (U+D800 to U+DFFF), which is not valid Unicode."


def _too_deep_message() -> str:
    return "Invalid request body: the JSON is nested too deeply to be read."


async def _refuse(send: Send, message: str, path: str, param: str | None) -> None:
    if anthropic_messages.on_surface(path):
        body = orjson.dumps(anthropic_messages.error_body(400, message))
    else:
        body = orjson.dumps(error_object(message, param=param, code="invalid_value"))
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
