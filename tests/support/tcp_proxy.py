"""A TCP proxy a test can cut and restore: the server behind it looks dead to its clients (resets,
then refused connections) and comes back at once, without the cost of killing and restarting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")

#: Bytes one read moves from one side to the other.
CHUNK = 65536


def reset(writer: asyncio.StreamWriter) -> None:
    """Close the connection with an RST, as the kernel does for a killed process's socket with
    unread data (linger 0: nothing queued is sent)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copy ``source`` to ``sink`` until EOF, then pass the EOF on (a half-close)."""
    while data := await source.read(CHUNK):
        sink.write(data)
        await sink.drain()
    if sink.can_write_eof() and not sink.is_closing():
        sink.write_eof()


class TcpProxy:
    """Forwards ``host``:``port`` (0: a free port, kept across restarts) to ``target_host``:
    ``target_port``, from an event loop on a daemon thread. ``stop`` closes the listening socket
    and resets every open connection on both sides; ``start`` listens again on the same port."""

    def __init__(
        self, target_host: str, target_port: int, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.target_host, self.target_port = target_host, target_port
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cuts = 0  # how many times stop() cut the connections
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name=f"tcp-proxy-{target_port}"
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """The proxy's HTTP base URL."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Listen (again) on ``port``; harmless when already listening."""
        self._call(self._listen())

    def stop(self) -> None:
        """Refuse new connections and reset the open ones; harmless when stopped."""
        self._call(self._cut())

    def close(self) -> None:
        """``stop``, then end the loop and its thread."""
        if self._loop.is_closed():
            return
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> TcpProxy:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(
                self._handle, self.host, self.port, reuse_address=True
            )
            self.port = self._server.sockets[0].getsockname()[1]

    async def _cut(self) -> None:
        self._cuts += 1
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            reset(writer)
        # Each connection's task ends on its own once both sides are reset (cancelling it
        # instead makes Python 3.11's asyncio.streams log a spurious error).
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cuts = self._cuts
        if self._server is None:  # accepted just before a cut
            reset(writer)
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            up_reader, upstream = await asyncio.open_connection(self.target_host, self.target_port)
            self._writers.add(upstream)
            if cuts != self._cuts:  # cut while connecting
                reset(writer)
                reset(upstream)
                return
            pumps = {
                asyncio.create_task(pump(reader, upstream)),
                asyncio.create_task(pump(up_reader, writer)),
            }
            done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            if any(p.exception() is not None for p in done):
                # One side reset the connection: the other sees a reset too.
                reset(writer)
                reset(upstream)
                await asyncio.gather(*pending, return_exceptions=True)  # they end at the reset
            else:
                writer.close()
                upstream.close()
        except OSError:  # the target refused the connection
            reset(writer)
        finally:
            self._writers.discard(writer)
            if upstream is not None:
                self._writers.discard(upstream)
            self._tasks.discard(task)
