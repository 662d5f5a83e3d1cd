"""Request body limits enforced before the body is read, so an oversized upload is refused at
once instead of being spooled to disk first."""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from offpeak.endpoints import anthropic_messages
from offpeak.wire import error_object

#: Multipart framing around the file part of an upload.
MULTIPART_SLACK = 64 * 1024
#: Every other body (batch create, cancel) is a small JSON object.
JSON_BODY_LIMIT = 1 << 20
#: A Message Batch carries its requests inline: Anthropic's limit, 256 MB.
MESSAGE_BATCH_BODY_LIMIT = 256 << 20


class BodyLimitMiddleware:
    """413 in OpenAI's (or Anthropic's) error shape for a body over its limit, whatever the
    method: from ``Content-Length`` when the client sends one, else by counting bytes as they
    arrive."""

    def __init__(self, app: ASGIApp, max_file_bytes: int) -> None:
        self.app = app
        self.max_file_bytes = max_file_bytes

    def _limit(self, scope: Scope) -> int:
        """The body limit of a request: uploads and Message Batch creates are the only large
        bodies; every other method and route takes a small JSON object at most."""
        path = scope["path"].rstrip("/")
        if scope["method"] == "POST" and path == "/v1/files":
            return self.max_file_bytes + MULTIPART_SLACK
        if scope["method"] == "POST" and path == "/v1/messages/batches":
            return MESSAGE_BATCH_BODY_LIMIT
        return JSON_BODY_LIMIT

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length in (b"", b"0") and b"transfer-encoding" not in headers:
            # No body framed (a poll): nothing to count, whatever the method.
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope)
        if length.isdigit() and int(length) > limit:
            await self._refuse(send, limit, scope["path"])
            return
        received = 0
        refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Answer now and tell the app the client left, so it stops reading; whatever
                    # it tries to send afterwards is dropped.
                    refused = True
                    await self._refuse(send, limit, scope["path"])
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    @staticmethod
    async def _refuse(send: Send, limit: int, path: str) -> None:
        message = f"The request body is larger than the limit of {limit} bytes."
        if anthropic_messages.on_surface(path):
            body = orjson.dumps(anthropic_messages.error_body(413, message))
        else:
            body = orjson.dumps(error_object(message, param=None, code="request_too_large"))
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
