"""The HTTP server's own limits, so the API holds without a reverse proxy in front of it.

uvicorn bounds neither a request's headers (their size, or how long they may take to arrive)
nor the pauses within a body: a client that opens connections and dribbles bytes holds sockets
and memory for as long as it likes. Nor does httptools: it keeps a header's name and value until
the next header starts, growing it by copying, so one header line that never ends costs memory
and CPU without bound. ``BoundedHttpProtocol`` is uvicorn's httptools protocol with those bounds
(uvicorn's ``h11_max_incomplete_event_size`` bounds only its slower h11 protocol, and neither
has a deadline for headers); the concurrency cap and keep-alive are uvicorn's own settings
(``server_options``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from offpeak.settings import Settings, get_settings


def _status(code: int, reason: str, message: str) -> bytes:
    body = message.encode()
    return (
        f"HTTP/1.1 {code} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class BoundedHttpProtocol(HttpToolsProtocol):
    """A connection whose request line and headers exceed ``api_max_header_bytes`` is answered
    431 and closed; one whose headers are not complete ``api_header_timeout_seconds`` after the
    request's first byte (or the connection's opening), or whose body pauses longer than
    ``api_body_timeout_seconds``, is closed (408 when nothing was answered yet).

    The limits come from the process's settings (``get_settings``): uvicorn builds the protocol
    itself, in each of its worker processes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self.max_header_bytes = settings.api_max_header_bytes
        self.header_timeout = settings.api_header_timeout_seconds
        self.body_timeout = settings.api_body_timeout_seconds

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_bytes = 0
        self._head_received = 0
        self._refused = False
        self._in_body = False
        self._timer: asyncio.TimerHandle | None = None
        self._arm(self.header_timeout, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_body:
            self._arm(self.body_timeout, self._body_late)
        elif self._timer is None:
            # The first byte of a request on a kept-alive connection starts its header clock.
            self._arm(self.header_timeout, self._headers_late)
        in_head = not self._in_body
        if in_head:
            # The bytes as they arrive, not as parsed: the parser reports a header only once
            # the next one starts, so an unfinished one would never be counted.
            self._head_received += len(data)
        super().data_received(data)
        if in_head and not self._in_body and self._head_received > self.max_header_bytes:
            self._too_large()

    def on_message_begin(self) -> None:
        self._header_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self._count(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._count(len(name) + len(value) + 4):
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._disarm()
        self._in_body = True
        self._head_received = 0
        self._arm(self.body_timeout, self._body_late)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._in_body = False
        self._disarm()
        super().on_message_complete()

    def _count(self, size: int) -> bool:
        if self._refused:
            return False
        self._header_bytes += size
        if self._header_bytes > self.max_header_bytes:
            self._too_large()
            return False
        return True

    def _too_large(self) -> None:
        if not self._refused:
            message = f"The request's headers are larger than {self.max_header_bytes} bytes."
            self._refuse(_status(431, "Request Header Fields Too Large", message))

    def _refuse(self, answer: bytes | None) -> None:
        self._refused = True
        self._disarm()
        if not self.transport.is_closing():
            if answer is not None:
                self.transport.write(answer)
            self.transport.close()

    def _arm(self, seconds: float, handler: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, handler)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if self.cycle is None or self.cycle.response_complete:
            self._refuse(_status(408, "Request Timeout", "The request's headers came too slowly."))

    def _body_late(self) -> None:
        self._timer = None
        if not self._in_body:
            return
        if self.flow.read_paused:
            # We stopped reading (the app has not taken what came): not the client's pause.
            self._arm(self.body_timeout, self._body_late)
            return
        answered = self.cycle is not None and self.cycle.response_started
        self._refuse(
            None if answered else _status(408, "Request Timeout", "The request's body stalled.")
        )
        if self.cycle is not None:
            # The app's next receive() sees the client gone and stops reading.
            self.cycle.disconnected = True
            self.cycle.message_event.set()


def server_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run``/``uvicorn.Config`` that bound a public listener:
    the protocol above, a concurrency cap past which requests are answered 503, and the
    seconds an idle kept-alive connection stays open."""
    return {
        "http": BoundedHttpProtocol,
        "limit_concurrency": settings.api_max_concurrency,
        "timeout_keep_alive": settings.api_keep_alive_seconds,
    }
